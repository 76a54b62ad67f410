"""vitkit.streams: the hash against its plain definition, streams that depend only on the image's place,
uniform and Beta draws against their distributions, and Draws independent of the batch around an image."""

from __future__ import annotations

import random

import pytest
import torch

from vitkit.streams import (
    M32,
    Draws,
    beta,
    bits,
    fold_in,
    gamma,
    image_streams,
    mix32,
    open_uniform,
    uniform,
)


def lowbias32(x: int) -> int:
    """The hash as published, with Python's exact integers."""
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def test_mix32_is_lowbias32_on_ints_and_int64_tensors():
    rng = random.Random(0)
    values = [0, 1, M32, 0x80000000, *(rng.getrandbits(32) for _ in range(1000))]
    expected = [lowbias32(v) for v in values]
    assert [mix32(v) for v in values] == expected
    assert mix32(torch.tensor(values, dtype=torch.int64)).tolist() == expected
    assert mix32(2**40 + 5) == lowbias32(5)  # only the low 32 bits count
    # A bijection: 2^16 distinct inputs give 2^16 distinct outputs.
    assert len(set(mix32(torch.arange(2**16) * 65_537).tolist())) == 2**16


def test_an_images_stream_depends_on_its_place_not_on_the_batch():
    whole = image_streams(7, 2, 11, torch.arange(32))
    torch.testing.assert_close(image_streams(7, 2, 11, torch.arange(16, 32)), whole[16:], rtol=0, atol=0)
    assert len({tuple(r) for r in whole.tolist()}) == 32  # no two images share a stream
    for other in (image_streams(8, 2, 11, torch.arange(32)), image_streams(7, 3, 11, torch.arange(32)),
                  image_streams(7, 2, 12, torch.arange(32))):
        assert not (other == whole).all(dim=1).any()  # seed, epoch and step each change every stream
    assert not torch.equal(fold_in(whole, 1), fold_in(whole, 2))
    values = bits(whole, 64)
    assert values.shape == (32, 64) and int(values.min()) >= 0 and int(values.max()) <= M32
    torch.testing.assert_close(bits(whole[3:4], 64), values[3:4], rtol=0, atol=0)


def test_uniform_draws_are_uniform_and_independent_across_images_and_indices():
    u = uniform(image_streams(0, 0, 0, torch.arange(4096)), 16)
    assert u.dtype == torch.float32 and float(u.min()) >= 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    corr = torch.corrcoef(u.T)  # the 16 draws of an image, across images
    assert float((corr - torch.eye(16)).abs().max()) < 0.06
    assert abs(float(torch.corrcoef(torch.stack([u[:-1, 0], u[1:, 0]]))[0, 1])) < 0.06  # neighbours
    o = open_uniform(image_streams(0, 0, 0, torch.arange(64)), 4)
    assert o.dtype == torch.float64 and float(o.min()) > 0 and float(o.max()) < 1


@pytest.mark.parametrize("a", [0.2, 0.8, 1.0, 2.5])
def test_beta_and_gamma_draws_follow_their_distributions(a):
    stats = pytest.importorskip("scipy.stats")
    streams = image_streams(1, 0, 0, torch.arange(20_000))
    assert stats.kstest(beta(streams, a, a).numpy(), stats.beta(a, a).cdf).pvalue > 1e-3
    assert stats.kstest(gamma(streams, a).numpy(), stats.gamma(a).cdf).pvalue > 1e-3
    with pytest.raises(ValueError, match="gamma shape=0"):
        gamma(streams, 0.0)


def test_draws_give_each_image_its_stream_in_order_whatever_the_batch():
    streams = image_streams(0, 0, 0, torch.arange(8))
    whole, part = Draws(streams), Draws(streams[5:])
    shapes = ((), (3,), (2, 2), (Draws.CHUNK + 5,), (Draws.CHUNK - 4,), (1,))  # across several chunks
    got = []
    for shape in shapes:
        a, b = whole.rand(*shape), part.rand(*shape)
        assert a.shape == (8, *shape) and len(whole) == 8
        torch.testing.assert_close(a[5:], b, rtol=0, atol=0)
        got.append(a.reshape(8, -1))
    total = sum(g.shape[1] for g in got)
    torch.testing.assert_close(torch.cat(got, dim=1), uniform(streams, total), rtol=0, atol=0)
