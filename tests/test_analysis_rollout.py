"""Attention rollout and single-layer attention maps, on cases with a known answer."""

import numpy as np
import pytest
import torch

from vitkit import ViTConfig, create_model
from vitkit.analysis.rollout import (
    attention_rollout,
    discard_lowest,
    fuse_heads,
    layer_attention,
    rollout_matrix,
)


def _stochastic(B, H, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, H, T, T, generator=g, dtype=torch.float64).softmax(-1)


def test_identity_attention_gives_identity_rollout():
    T = 5
    eye = torch.eye(T, dtype=torch.float64).expand(2, 3, T, T)
    r = rollout_matrix([eye, eye, eye])
    torch.testing.assert_close(r, torch.eye(T, dtype=torch.float64).expand(2, T, T))
    # The class token keeps everything to itself: nothing flows from the patches ...
    torch.testing.assert_close(attention_rollout([eye, eye], num_prefix_tokens=1), torch.zeros(2, T - 1,
                                                                                                 dtype=torch.float64))
    # ... and with no class token (GAP), the mean patch row is uniform over the patches.
    torch.testing.assert_close(attention_rollout([eye], num_prefix_tokens=0),
                               torch.full((2, T), 1.0 / T, dtype=torch.float64))


def test_hand_computed_two_layers():
    # Three tokens (class token + 2 patches), one head. Layer 1 sends each token to the next one (a cyclic
    # permutation), layer 2 attends uniformly.
    perm = torch.tensor([[0, 1, 0], [0, 0, 1], [1, 0, 0]], dtype=torch.float64)
    uniform = torch.full((3, 3), 1 / 3, dtype=torch.float64)
    # With the identity added and rows re-normalised: A1 = (P + I) / 2, A2 = (U + I) / 2, so
    # A2 A1 row 0 = 2/3 [1/2, 1/2, 0] + 1/6 [0, 1/2, 1/2] + 1/6 [1/2, 0, 1/2] = [5/12, 5/12, 1/6].
    r = rollout_matrix([perm[None, None], uniform[None, None]])
    torch.testing.assert_close(r[0, 0], torch.tensor([5 / 12, 5 / 12, 1 / 6], dtype=torch.float64))
    torch.testing.assert_close(attention_rollout([perm[None, None], uniform[None, None]], 1)[0],
                               torch.tensor([5 / 12, 1 / 6], dtype=torch.float64))
    # The heads are averaged before the identity is added: heads P and I give (P + I) / 2, then
    # ((P + I) / 2 + I) / 2 = (P + 3 I) / 4.
    heads = torch.stack([perm, torch.eye(3, dtype=torch.float64)])[None]
    torch.testing.assert_close(rollout_matrix([heads])[0], (perm + 3 * torch.eye(3, dtype=torch.float64)) / 4)


def test_rollout_equals_a_loop_over_layers_in_numpy():
    attns = [_stochastic(2, 4, 6, seed=s) for s in range(3)]
    expected = []
    for b in range(2):
        r = np.eye(6)
        for a in attns:
            m = a[b].numpy().mean(axis=0) + np.eye(6)
            m = m / m.sum(axis=1, keepdims=True)
            r = m @ r
        expected.append(r)
    got = rollout_matrix(attns).numpy()
    np.testing.assert_allclose(got, np.stack(expected), rtol=1e-12, atol=1e-12)
    # Every row of the rollout is a distribution over the input tokens.
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-12)


def test_fusion_and_discard():
    a = _stochastic(1, 3, 4)
    torch.testing.assert_close(fuse_heads(a, "max"), a.amax(1))
    torch.testing.assert_close(fuse_heads(a, "min"), a.amin(1))
    with pytest.raises(ValueError, match="head fusion"):
        fuse_heads(a, "median")
    m = fuse_heads(a)
    d = discard_lowest(m, 0.5)  # two of four entries per row go, never the diagonal
    assert ((d == 0).sum(-1) == 2).all()
    torch.testing.assert_close(torch.diagonal(d, dim1=-2, dim2=-1), torch.diagonal(m, dim1=-2, dim2=-1))
    kept = d[d > 0]
    assert torch.isin(kept, m).all()
    with pytest.raises(ValueError, match="discard ratio"):
        discard_lowest(m, 1.0)


@pytest.mark.parametrize("pool", ["token", "gap"])
def test_on_a_model_layer_attention_picks_the_right_rows(pool):
    model = create_model("ViT-Ti/16", image_size=32, patch_size=8, dim=32, depth=2, num_heads=2, mlp_dim=64,
                         num_classes=3, pool=pool).eval()
    p = model.cfg.num_prefix_tokens
    with torch.no_grad():
        _, attns = model.forward_features(torch.randn(2, 3, 32, 32), return_attention=True)
    one = layer_attention(attns, -1, p, head=1)
    expected = attns[-1][:, 1, 0, p:] if p else attns[-1][:, 1, :, :].mean(1)
    torch.testing.assert_close(one, expected.double())
    mean = layer_attention(attns, 0, p)
    expected = attns[0].mean(1)[:, 0, p:] if p else attns[0].mean(1).mean(1)
    torch.testing.assert_close(mean, expected.double())
    roll = attention_rollout(attns, p)
    assert roll.shape == (2, model.cfg.num_patches)
    assert (roll >= 0).all() and (roll.sum(-1) <= 1 + 1e-9).all()
    with pytest.raises(ValueError, match="out of range"):
        layer_attention(attns, 2, p)
    with pytest.raises(ValueError, match="out of range"):
        layer_attention(attns, 0, p, head=2)


def test_a_gap_model_with_a_class_token_is_read_from_its_patch_rows():
    # timm's global_pool="avg" keeps the class token: the representation is still the mean of the patch
    # tokens.
    cfg = ViTConfig(image_size=32, patch_size=8, dim=32, depth=2, num_heads=2, mlp_dim=64, num_classes=3,
                    pool="gap", class_token=True)
    model = create_model(cfg).eval()
    with torch.no_grad():
        _, attns = model.forward_features(torch.randn(2, 3, 32, 32), return_attention=True)
    one = layer_attention(attns, 0, 1, pool="gap")
    torch.testing.assert_close(one, attns[0].mean(1)[:, 1:, 1:].mean(1).double())
    roll = attention_rollout(attns, 1, pool="gap")
    torch.testing.assert_close(roll, rollout_matrix(attns)[:, 1:, 1:].mean(1))
    assert not torch.allclose(roll, attention_rollout(attns, 1))  # the class token's row differs
    with pytest.raises(ValueError, match="needs a class token"):
        layer_attention(attns, 0, 0, pool="token")
