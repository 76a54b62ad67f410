"""The model API a timm user reaches for on `VisionTransformer`: activation checkpointing per block,
dynamic_img_size, forward_intermediates / get_intermediate_layers and reset_classifier, against timm's."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import timm.models.vision_transformer as timm_vit
import torch
import torch.nn.functional as F

import vitkit
from vitkit import ViTConfig
from vitkit.cpu import accelerate, autotune
from vitkit.model import VisionTransformer
from vitkit.shortcut import with_class_token_shortcut
from vitkit.streams import image_streams


def tiny(**overrides) -> ViTConfig:
    base = dict(image_size=32, patch_size=8, dim=32, depth=4, num_heads=4, mlp_dim=64, num_classes=10)
    base.update(overrides)
    return ViTConfig(**base)


def saved_bytes_and_grads(model: VisionTransformer, x, y, streams, seed: int):
    """The bytes autograd keeps for the backward pass (outside checkpointed regions: those keep their own),
    and every parameter's gradient, of one training step's loss."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout's draws
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x, streams=streams), y)
    loss.backward()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fast", [False, True], ids=["plain", "accelerated"])
def test_grad_checkpointing_gives_the_same_gradients_and_keeps_only_the_blocks_inputs(fast):
    """Every stochastic part on (drop-path and PatchDropout from the streams, dropout from torch's generator):
    the recomputed blocks draw the same masks, so the gradients equal those of the plain backward pass."""
    torch.manual_seed(0)
    model = VisionTransformer(tiny(drop_path=0.3, patch_dropout=0.25, dropout=0.1, attn_dropout=0.1))
    torch.nn.init.normal_(model.head.weight, std=0.1)  # the zero classifier would block every gradient
    if fast:
        accelerate(model)
    model.train()
    x, y = torch.randn(6, 3, 32, 32), torch.randint(0, 10, (6,))
    streams = image_streams(0, 0, 0, torch.arange(6))
    saved_bytes_and_grads(model, x, y, streams, seed=1)  # the kernels' first calls time their candidates
    kept, plain = saved_bytes_and_grads(model, x, y, streams, seed=1)
    model.set_grad_checkpointing()
    assert model.grad_checkpointing
    kept_ckpt, ckpt = saved_bytes_and_grads(model, x, y, streams, seed=1)
    for name, g in plain.items():
        torch.testing.assert_close(ckpt[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert kept_ckpt < kept / 4  # here a block keeps about ten tensors of its input's size
    # without autograd nothing is checkpointed; with it off again, the plain backward pass
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), model.forward_head(model.forward_features(x)))
    model.train().set_grad_checkpointing(False)
    assert saved_bytes_and_grads(model, x, y, streams, seed=1)[0] == kept


def test_kernels_tuned_inside_a_checkpointed_block_leave_it_alone(monkeypatch, tmp_path):
    """vitkit's kernels time their candidates on their first call, with autograd: inside a checkpointed
    block (that first call with checkpointing on) their saved tensors are not the block's."""
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path))  # nothing tuned yet
    monkeypatch.setenv(autotune.ENV, "1")
    autotune.forget()
    monkeypatch.setattr(autotune, "MIN_ROUNDS", 1)
    monkeypatch.setattr(autotune, "MAX_ROUNDS", 1)
    torch.manual_seed(0)
    model = VisionTransformer(tiny(image_size=48, dropout=0.1))  # shapes no other test tunes
    torch.nn.init.normal_(model.head.weight, std=0.1)
    plain = with_class_token_shortcut(copy.deepcopy(model))  # as accelerate: dropout draws alike
    accelerate(model).set_grad_checkpointing()
    x, y = torch.randn(3, 3, 48, 48), torch.randint(0, 10, (3,))
    streams = image_streams(0, 0, 0, torch.arange(3))
    _, tuned = saved_bytes_and_grads(model, x, y, streams, seed=2)
    assert autotune._memo  # the kernels did tune in there
    _, reference = saved_bytes_and_grads(plain, x, y, streams, seed=2)
    for name, g in reference.items():
        torch.testing.assert_close(tuned[name], g, rtol=1e-4, atol=1e-5, msg=name)
    autotune.forget()


# --- dynamic_img_size, forward_intermediates, get_intermediate_layers, reset_classifier against timm -------
def timm_twin(cfg: ViTConfig, **extra) -> torch.nn.Module:
    """timm's VisionTransformer of the same architecture (exact GELU, LayerNorm eps as vitkit's)."""
    return timm_vit.VisionTransformer(
        img_size=cfg.image_size, patch_size=cfg.patch_size, in_chans=cfg.in_chans,
        num_classes=cfg.num_classes, embed_dim=cfg.dim, depth=cfg.depth, num_heads=cfg.num_heads,
        mlp_ratio=cfg.mlp_dim / cfg.dim,
        class_token=cfg.class_token, global_pool="token" if cfg.pool == "token" else "avg", fc_norm=False,
        norm_layer=partial(torch.nn.LayerNorm, eps=cfg.ln_eps), **extra).eval()


def twins(**overrides) -> tuple[VisionTransformer, torch.nn.Module]:
    torch.manual_seed(0)
    ours = VisionTransformer(tiny(**overrides)).eval()
    torch.nn.init.normal_(ours.head.weight, std=0.1)
    theirs = timm_twin(ours.cfg, dynamic_img_size=ours.cfg.dynamic_img_size)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("overrides", [{}, dict(pool="gap", class_token=False)], ids=["token", "gap"])
def test_dynamic_img_size_takes_any_multiple_of_the_patch_as_timm_does(overrides):
    ours, theirs = twins(dynamic_img_size=True, **overrides)
    with torch.no_grad():
        for size in [(32, 32), (48, 24), (64, 64), (8, 16)]:
            x = torch.randn(2, 3, *size)
            torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5, msg=str(size))
            # and its speed layers take the same sizes
            torch.testing.assert_close(vitkit.optimize(ours)(x), ours(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="multiples of the patch stride 8"):
        ours(torch.randn(1, 3, 36, 32))
    fixed = VisionTransformer(tiny(**overrides))
    with pytest.raises(ValueError, match="dynamic_img_size=True"):
        fixed(torch.randn(1, 3, 48, 32))


def test_dynamic_sincos_positions_are_made_for_the_grid_and_gradients_reach_the_learned_table():
    """The fixed sin-cos table is computed for the new grid (a model built at that size has the same one);
    a learned table is resampled differentiably, so training at several sizes updates it."""
    torch.manual_seed(0)
    dynamic = VisionTransformer(tiny(pos_embed="sincos-2d", dynamic_img_size=True)).eval()
    at_48 = VisionTransformer(tiny(pos_embed="sincos-2d", image_size=(48, 40))).eval()
    at_48.load_state_dict(dynamic.state_dict())
    x = torch.randn(2, 3, 48, 40)
    with torch.no_grad():
        torch.testing.assert_close(dynamic.forward_features(x), at_48.forward_features(x))
    learned = VisionTransformer(tiny(dynamic_img_size=True, pos_embed="learned-2d"))
    learned.forward_features(torch.randn(2, 3, 48, 40)).square().sum().backward()
    assert learned.pos_embed_row.grad.abs().sum() > 0 and learned.pos_embed_col.grad.abs().sum() > 0


def test_forward_intermediates_and_get_intermediate_layers_equal_timms():
    ours, theirs = twins()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        for kw in [dict(indices=[0, -1], return_prefix_tokens=True, norm=True),
                   dict(indices=2, output_fmt="NLC"), dict(indices=None, stop_early=True)]:
            final, mine = ours.forward_intermediates(x, **kw)
            final_t, timms = theirs.forward_intermediates(x, **kw)
            torch.testing.assert_close(final, final_t, rtol=1e-5, atol=1e-5)
            assert len(mine) == len(timms)
            for a, b in zip(mine, timms, strict=True):
                for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,),
                                strict=True):
                    assert u.shape == v.shape
                    torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)
        full, maps = ours.forward_intermediates(x)
        torch.testing.assert_close(full, ours.forward_features(x))
        assert [m.shape for m in maps] == [(2, 32, 4, 4)] * 4
        only = ours.forward_intermediates(x, indices=[1], intermediates_only=True)
        torch.testing.assert_close(only[0], maps[1])
        for kw in [dict(n=2), dict(n=[0, 3], reshape=True, norm=True), dict(n=1, return_prefix_tokens=True)]:
            mine, timms = ours.get_intermediate_layers(x, **kw), theirs.get_intermediate_layers(x, **kw)
            assert len(mine) == len(timms)
            for a, b in zip(mine, timms, strict=True):
                for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,),
                                strict=True):
                    torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block 4 does not exist"):
        ours.forward_intermediates(x, indices=[4])
    with pytest.raises(ValueError, match="output_fmt='NHWC'"):
        ours.forward_intermediates(x, output_fmt="NHWC")
    dropping = VisionTransformer(tiny(patch_dropout=0.5)).train()
    with pytest.raises(ValueError, match="PatchDropout"):
        dropping.forward_intermediates(x)
    assert dropping.forward_intermediates(x, output_fmt="NLC", intermediates_only=True)[0].shape == (2, 8, 32)


def test_reset_classifier_gives_a_zero_head_for_the_new_classes():
    ours, _ = twins()
    x = torch.randn(2, 3, 32, 32)
    ours.reset_classifier(5)
    assert ours.cfg.num_classes == 5 and ours(x).shape == (2, 5) and not ours(x).any()
    ours.reset_classifier(0, global_pool="avg")
    assert ours.cfg.pool == "gap" and isinstance(ours.head, torch.nn.Identity)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ours.forward_features(x)[:, 1:].mean(1))
    gap = VisionTransformer(tiny(pool="gap", class_token=False))
    with pytest.raises(ValueError, match="pool='token' needs class_token=True"):
        gap.reset_classifier(3, global_pool="token")
    assert gap.cfg.num_classes == 10  # unchanged when refused
