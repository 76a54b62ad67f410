"""MixUp and CutMix over pairs fixed by their place in the global batch (vitkit.data.mixing): what each does
to the images and labels, and that a micro-batch mixes the same whether alone or inside a larger one."""

from __future__ import annotations

import torch

from vitkit.data.augment import AugmentConfig
from vitkit.data.mixing import mix_pairs, partners
from vitkit.streams import image_streams


def batch(n: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 12, 10, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_partners_pair_global_positions_two_by_two():
    assert partners(0, 6).tolist() == [1, 0, 3, 2, 5, 4]
    assert partners(0, 5).tolist() == [1, 0, 3, 2, 4]  # the last image's partner is in the next micro-batch
    assert partners(3, 4).tolist() == [0, 2, 1, 3]  # positions 3..6: 3 and 6 have no partner here


def test_mixup_mixes_each_pair_both_ways_with_one_lambda():
    x, y = batch()
    streams = image_streams(0, 0, 0, torch.arange(16))
    mixed, soft = mix_pairs(x, y, streams, 0, AugmentConfig(mixup=0.8), 10)
    torch.testing.assert_close(soft.sum(dim=1), torch.ones(16))
    lams = []
    for k in range(0, 16, 2):
        a, b = k, k + 1
        lam = float(soft[a, y[a]]) if y[a] != y[b] else None
        if lam is None:
            continue
        lams.append(lam)
        torch.testing.assert_close(soft[b, y[b]], soft[a, y[a]])  # the same lambda for both partners
        torch.testing.assert_close(mixed[a], lam * x[a] + (1 - lam) * x[b])
        torch.testing.assert_close(mixed[b], lam * x[b] + (1 - lam) * x[a])
    assert len(set(round(v, 6) for v in lams)) == len(lams) > 3  # each pair draws its own


def test_cutmix_pastes_one_box_each_way_and_labels_by_area():
    x, y = batch()
    streams = image_streams(0, 0, 5, torch.arange(16))
    mixed, soft = mix_pairs(x, y, streams, 0, AugmentConfig(cutmix=1.0), 10)
    for k in range(0, 16, 2):
        a, b = k, k + 1
        from_partner = (mixed[a] == x[b]).all(dim=0) & (mixed[a] != x[a]).any(dim=0)
        own = (mixed[a] == x[a]).all(dim=0)
        assert bool((from_partner | own).all())  # every pixel is its own or its partner's
        assert torch.equal((mixed[b] == x[a]).all(dim=0) & ~own, from_partner)  # the same box, the other way
        if y[a] != y[b]:
            torch.testing.assert_close(soft[a, y[b]], from_partner.float().mean())  # lambda = area kept


def test_a_micro_batch_mixes_alike_alone_or_inside_the_global_batch():
    x, y = batch(16)
    streams = image_streams(4, 1, 9, torch.arange(16))
    aug = AugmentConfig(mixup=0.8, cutmix=1.0)
    whole = mix_pairs(x, y, streams, 0, aug, 10)
    halves = [mix_pairs(x[i:i + 8], y[i:i + 8], streams[i:i + 8], i, aug, 10) for i in (0, 8)]
    for k in range(2):
        torch.testing.assert_close(whole[k], torch.cat([h[k] for h in halves]), rtol=0, atol=0)
    cut = (whole[0] != x).any(dim=1).any(dim=(1, 2)) & ~(whole[0] != x).all(dim=(1, 2, 3))
    assert bool(cut.any()) and bool((~cut).any())  # both kinds occur with both on


def test_with_both_off_the_batch_is_left_alone():
    x, y = batch(4)
    out = mix_pairs(x, y, image_streams(0, 0, 0, torch.arange(4)), 0, AugmentConfig(), 10)
    assert out[0] is x and out[1] is y
