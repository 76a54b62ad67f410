"""The ResNet + ViT hybrid (Sec. 3.1) against timm's `vit_*_r*_s*` models, with the same random weights."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from typer.testing import CliRunner

from vitkit import count_parameters, create_model, get_config
from vitkit.hybrid import pad_same, same_padding, standardize_weight

timm = pytest.importorskip("timm")


def randomize_(module: torch.nn.Module) -> None:
    """Random values in every parameter, GroupNorm/LayerNorm affines included, so nothing is trivially 1 or
    0."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "norm3.weight")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def assert_same_logits(ours: torch.Tensor, ref: torch.Tensor) -> float:
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"largest logit difference {rel:.2e} relative to the largest logit"
    return rel


def test_same_padding_matches_tensorflow():
    # TF 'SAME': output ceil(n / s); the odd padding pixel goes after.
    assert same_padding(64, 7, 2) == (2, 3)
    assert same_padding(32, 3, 2) == (0, 1)
    assert same_padding(33, 3, 2) == (1, 1)
    assert same_padding(16, 1, 2) == (0, 0)
    assert same_padding(16, 3, 1) == (1, 1)
    x = torch.ones(1, 1, 4, 4)
    assert pad_same(x, 3, 2, value=-1.0)[0, 0, -1].eq(-1).all()  # padded at the bottom only
    assert pad_same(x, 3, 2, value=-1.0)[0, 0, 0, :4].eq(1).all()  # and at the right only


def test_standardize_weight():
    w = torch.randn(8, 4, 3, 3) * 3 + 2
    s = standardize_weight(w).reshape(8, -1)
    torch.testing.assert_close(s.mean(1), torch.zeros(8), atol=1e-5, rtol=0)
    torch.testing.assert_close(s.var(1, unbiased=False), torch.ones(8), atol=1e-4, rtol=0)
    # Flax's (vit_jax/models_resnet.py): (w - mean) / (std + 1e-5), written out for kernels of std 0.01
    small = (torch.randn(8, 4, 3, 3, dtype=torch.float64) * 0.01).float()
    flat = small.double().reshape(8, -1)
    centred = flat - flat.mean(1, keepdim=True)
    expected = centred / (centred.pow(2).mean(1, keepdim=True).sqrt() + 1e-5)
    torch.testing.assert_close(standardize_weight(small, "flax").reshape(8, -1).double(), expected, rtol=1e-5,
                               atol=1e-6)
    assert (standardize_weight(small, "flax") - standardize_weight(small)).abs().max() > 1e-4


def test_hybrid_norm_sets_the_groupnorm_eps_and_is_checked():
    cfg = get_config("R26+ViT-S/32", image_size=32, dim=32, depth=1, num_heads=2, mlp_dim=64)
    eps = {m.eps for m in create_model(cfg.replace(hybrid_norm="flax")).modules()
           if isinstance(m, torch.nn.GroupNorm)}
    assert eps == {1e-6} and cfg.hybrid_norm == "timm"
    with pytest.raises(ValueError, match="hybrid_norm='jax'"):
        cfg.replace(hybrid_norm="jax")


@pytest.mark.parametrize(
    "timm_name, preset",
    [("vit_small_r26_s32_224", "R26+ViT-S/32"), ("vit_base_r50_s16_224", "R50+ViT-B/16")],
)
def test_hybrid_equals_timm(timm_name, preset):
    """timm's own constructor (full-width ResNet), a tiny transformer, a 64-px image."""
    size, dim, classes = 64, 64, 7
    ref = timm.create_model(timm_name, img_size=size, embed_dim=dim, depth=1, num_heads=2,
                            num_classes=classes).eval()
    randomize_(ref)
    cfg = get_config(preset, image_size=size, dim=dim, depth=1, num_heads=2, mlp_dim=4 * dim,
                     num_classes=classes)
    ours = create_model(cfg).eval()
    state = ref.state_dict()
    assert set(state) == set(ours.state_dict())  # timm's names: an identity mapping
    ours.load_state_dict(state)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        print(f"largest relative logit difference: {assert_same_logits(ours(x), ref(x)):.2e}")


def test_narrow_hybrid_equals_timm_resnetv2():
    """hybrid_width scales every stage as BiT's width factor does; a non-square image."""
    from timm.layers import HybridEmbed as TimmHybridEmbed
    from timm.layers import StdConv2dSame
    from timm.models.resnetv2 import ResNetV2
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    size, layers, width = (32, 64), (1, 2), 32
    backbone = ResNetV2(layers=layers, channels=tuple(4 * width * 2**i for i in range(len(layers))),
                        stem_chs=width, num_classes=0, global_pool="", preact=False, stem_type="same",
                        conv_layer=partial(StdConv2dSame, eps=1e-8))
    ref = TimmViT(img_size=size, patch_size=1, embed_dim=32, depth=1, num_heads=2, num_classes=5,
                  embed_layer=partial(TimmHybridEmbed, backbone=backbone)).eval()
    randomize_(ref)
    cfg = get_config("R50+ViT-B/16", image_size=size, hybrid_layers=layers, hybrid_width=width, dim=32,
                     depth=1, num_heads=2, mlp_dim=128, num_classes=5)
    ours = create_model(cfg).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        print(f"largest relative logit difference: {assert_same_logits(ours(x), ref(x)):.2e}")


def test_each_bottleneck_starts_as_its_shortcut_as_timm_and_the_official_code():
    """The last GroupNorm of every unit starts at zero scale (models_resnet.py's gn3 with zeros scale_init,
    timm's zero_init_last), the others at one; the unit's residual branch then adds nothing."""
    cfg = get_config("R26+ViT-S/32", image_size=32, dim=32, depth=1, num_heads=2, mlp_dim=64, num_classes=3)
    ours = create_model(cfg).patch_embed.backbone
    ref = timm.create_model("vit_small_r26_s32_224", img_size=32, embed_dim=32, depth=1, num_heads=2,
                            num_classes=3).patch_embed.backbone
    ours_norms = {k: v for k, v in ours.state_dict().items() if "norm" in k and k.endswith("weight")}
    ref_norms = {k: v for k, v in ref.state_dict().items() if "norm" in k and k.endswith("weight")}
    assert len(ours_norms) == len(ref_norms) > 0
    zeros = {k for k, v in ours_norms.items() if not v.any()}
    assert zeros == {k for k in ours_norms if ".norm3." in k} != set()
    assert (sorted(bool(v.any()) for v in ours_norms.values())
            == sorted(bool(v.any()) for v in ref_norms.values()))
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in ours_norms.items() if k not in zeros)


@pytest.mark.parametrize("preset, timm_name", [("R26+ViT-S/32", "vit_small_r26_s32_224"),
                                               ("R50+ViT-B/16@384", "vit_base_r50_s16_384")])
def test_parameter_count_equals_timm(preset, timm_name):
    with torch.device("meta"):
        ref = timm.create_model(timm_name)
    assert count_parameters(get_config(preset)) == sum(p.numel() for p in ref.parameters())


def test_models_command_lists_the_hybrids():
    from vitkit.cli.main import app

    result = CliRunner().invoke(app, ["models", "+ViT"])
    assert result.exit_code == 0, result.output
    for preset in ("R50+ViT-B/16", "R26+ViT-S/32"):
        assert preset in result.output
        assert f"{count_parameters(get_config(preset)):,}" in result.output
    assert "98,950,952" in result.output  # timm's vit_base_r50_s16_384 (checked above against timm)


def test_hybrid_width_must_fit_groupnorm():
    with pytest.raises(ValueError, match="hybrid_width"):
        create_model("R26+ViT-S/32", hybrid_width=48, image_size=64, dim=32, depth=1, num_heads=2, mlp_dim=64)
