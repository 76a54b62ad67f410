"""The frozen config dataclass, its typed validation, and preset name resolution."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vitkit import ViTConfig, get_config, list_models
from vitkit.config import PRESETS, get_preset


# --- validation ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(pool="max"), "pool='max' (choose from token, gap)"),
        (dict(pos_embed="relative"),
         "pos_embed='relative' (choose from learned, learned-2d, sincos-2d, none)"),
        (dict(gelu="relu"), "gelu='relu' (choose from exact, tanh)"),
        (dict(dim=100, num_heads=3), "dim=100 is not divisible by num_heads=3"),
        (dict(pool="token", class_token=False), "pool='token' needs class_token=True"),
        (dict(pos_embed="sincos-2d", dim=66, num_heads=3),
         "pos_embed='sincos-2d' needs dim divisible by 4, got 66"),
        (dict(pos_embed="learned-2d", dim=33, num_heads=3),
         "pos_embed='learned-2d' needs an even dim, got 33"),
        (dict(image_size=(224, 200)), "image_size=(224, 200) is not a multiple of the patch stride 16"),
        (dict(mean=(0.1, 0.2)), "mean=(0.1, 0.2) must have in_chans=3 entries"),
        (dict(depth=0), "depth=0 must be a positive integer"),
        (dict(num_heads=0), "num_heads=0 must be a positive integer"),
        (dict(num_classes=-1), "num_classes=-1 must be >= 0"),
        (dict(dropout=1.0), "dropout=1.0 must be in [0, 1)"),
        (dict(drop_path=-0.1), "drop_path=-0.1 must be in [0, 1)"),
        (dict(ln_eps=0.0), "ln_eps=0.0 must be positive"),
        (dict(representation_size=0), "representation_size=0 must be positive or None"),
        # Wrong types are named too, before any arithmetic trips over them (a hand-edited config.json).
        (dict(depth=2.0), "depth=2.0 must be an integer"),
        (dict(num_classes=2.5), "num_classes=2.5 must be an integer"),
        (dict(depth=True), "depth=True must be an integer"),
        (dict(dim="192"), "dim='192' must be an integer"),
        (dict(num_classes=None), "num_classes=None must be an integer"),
        (dict(patch_size=16.0), "patch_size=16.0 must be an integer"),
        (dict(dropout="0.1"), "dropout='0.1' must be a finite number"),
        (dict(ln_eps=float("nan")), "ln_eps=nan must be a finite number"),
        (dict(qkv_bias="no"), "qkv_bias='no' must be true or false"),
        (dict(image_size=224.0), "image_size=224.0 must be an int or a (height, width) pair of ints"),
        (dict(image_size="224"), "image_size='224' must be an int or a (height, width) pair of ints"),
        (dict(image_size=(32, 32, 3)), "image_size=(32, 32, 3) must be an int or a (height, width) pair"),
        (dict(mean="abc"), "mean='abc' must be a list of finite numbers, one per channel"),
        (dict(hybrid_layers="3,4"), "hybrid_layers='3,4' must be a list of unit counts per stage, or None"),
        # and values no model can have
        (dict(image_size=0), "image_size=(0, 0) must be positive"),
        (dict(image_size=-32), "image_size=(-32, -32) must be positive"),
        (dict(hybrid_layers=()), "hybrid_layers=() must be one or more positive unit counts per stage"),
        (dict(hybrid_layers=(0, 0), patch_size=1), "hybrid_layers=(0, 0) must be one or more positive unit"),
        (dict(hybrid_width=0), "hybrid_width=0 must be a positive multiple of the 32 GroupNorm groups"),
        (dict(hybrid_width=48), "hybrid_width=48 must be a positive multiple of the 32 GroupNorm groups"),
        (dict(std=(0, 0, 0)), "std=(0.0, 0.0, 0.0) must be positive"),
        (dict(crop_pct=-1), "crop_pct=-1.0 must be in (0, 1]"),
        (dict(interpolation="foo"), "interpolation='foo' (choose from bicubic, bilinear, nearest)"),
    ],
)
def test_invalid_configs_name_the_bad_value(overrides, message):
    with pytest.raises(ValueError) as err:
        ViTConfig(**overrides)
    assert str(err.value).startswith("invalid ViTConfig: ")
    assert message in str(err.value)


def test_all_errors_are_reported_at_once():
    with pytest.raises(ValueError, match=r"pool='max'.*gelu='relu'"):
        ViTConfig(pool="max", gelu="relu")


def test_config_is_frozen_and_normalises_its_types():
    cfg = ViTConfig(image_size=32, patch_size=8, mean=[0.5], std=[0.25], in_chans=1)
    assert cfg.image_size == (32, 32) and cfg.mean == (0.5,) and cfg.std == (0.25,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 12
    # A constant per-channel value fits any channel count.
    assert ViTConfig(in_chans=1).mean == (0.5,)
    assert ViTConfig(in_chans=4, mean=(0.2,), std=(0.3,)).std == (0.3,) * 4


def test_types_that_lose_nothing_are_converted():
    np = pytest.importorskip("numpy")
    cfg = ViTConfig(depth=np.int64(3), image_size=[np.int64(32), 64], patch_size=16, dropout=0,
                    mean=np.array([0.1, 0.2, 0.3]), hybrid_layers=None)
    assert type(cfg.depth) is int and cfg.depth == 3
    assert cfg.image_size == (32, 64) and all(type(v) is int for v in cfg.image_size)
    assert type(cfg.dropout) is float and cfg.mean == (0.1, 0.2, 0.3)


def test_interpolations_are_the_ones_the_transforms_know():
    from vitkit.config import INTERPOLATIONS
    from vitkit.data.transforms import interpolation_mode

    for name in INTERPOLATIONS:
        interpolation_mode(name)


def test_derived_sizes():
    cfg = ViTConfig(image_size=(224, 160), patch_size=16, dim=192, num_heads=3)
    assert cfg.grid_size == (14, 10)
    assert cfg.num_patches == 140 and cfg.num_tokens == 141 and cfg.head_dim == 64
    gap = cfg.replace(pool="gap", class_token=False)
    assert gap.num_prefix_tokens == 0 and gap.num_tokens == 140


def test_dict_round_trip_through_json():
    cfg = ViTConfig(image_size=(32, 48), patch_size=8, dim=64, num_heads=4, mlp_dim=96, pool="gap",
                    class_token=False, pos_embed="learned-2d", gelu="tanh", representation_size=32,
                    in_chans=1, mean=(0.2,), std=(0.3,), name="custom")
    back = ViTConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg
    hybrid = get_config("R50+ViT-B/16")
    assert ViTConfig.from_dict(json.loads(json.dumps(hybrid.to_dict()))) == hybrid


def test_unknown_keys_are_rejected_with_the_valid_ones_listed():
    with pytest.raises(ValueError, match=r"unknown ViTConfig keys \['heads'\]; valid keys: .*'num_heads'"):
        ViTConfig().replace(heads=4)
    with pytest.raises(ValueError, match=r"unknown ViTConfig keys \['width'\]"):
        ViTConfig.from_dict({"width": 4})
    with pytest.raises(ValueError, match=r"unknown ViTConfig keys \['hidden'\]"):
        get_config("ViT-B/16", hidden=3)


# --- presets and names --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, canonical",
    [
        ("ViT-B/16", "ViT-B/16"),
        ("B/16", "ViT-B/16"),
        ("vit-b/16", "ViT-B/16"),
        (" ViT-B/16 ", "ViT-B/16"),
        ("ViT-B/16@224", "ViT-B/16"),
        ("ViT-B/16@384", "ViT-B/16@384"),
        ("vit_base_patch16_224", "ViT-B/16"),
        ("vit_base_patch16_384", "ViT-B/16@384"),
        ("vit_base_patch16_224.augreg2_in21k_ft_in1k", "ViT-B/16"),
        ("vit_huge_patch14_518", "ViT-H/14@518"),
        ("Ti/16", "ViT-Ti/16"),
        ("vit_tiny_patch16_224", "ViT-Ti/16"),
        ("ViT-S/32@384", "ViT-S/32@384"),
        ("R50+ViT-B/16", "R50+ViT-B/16"),
        ("vit_base_r50_s16_384", "R50+ViT-B/16@384"),
        ("R50+B/16", "R50+ViT-B/16"),  # the hybrids' short names, as for the plain models
        ("r26+s/32@384", "R26+ViT-S/32@384"),
        ("r26+vit-s/32@384", "R26+ViT-S/32@384"),
    ],
)
def test_preset_names_resolve(name, canonical):
    assert get_preset(name).name == canonical


@pytest.mark.parametrize(
    "name", ["ViT-X/16", "ViT-B/15", "ViT-B/16@300", "vit_base_patch15_224", "", "resnet50"]
)
def test_unknown_names_raise_keyerror_with_a_hint(name):
    with pytest.raises(KeyError) as err:
        get_preset(name)
    message = err.value.args[0]
    assert repr(name) in message and "`vitkit models`" in message and "'ViT-B/16'" in message


@pytest.mark.parametrize("name", [16, None, ("ViT-B/16",)])
def test_a_name_that_is_not_a_string_is_a_type_error_naming_it(name):
    with pytest.raises(TypeError, match=r"a model name must be a string such as 'ViT-B/16', got "):
        get_preset(name)


def test_changes_from_preset_name_the_overridden_architecture_fields():
    from vitkit.config import changes_from_preset

    assert changes_from_preset(get_config("ViT-B/16", num_classes=10, dropout=0.1)) == []
    assert changes_from_preset(get_config("ViT-B/16", image_size=384, depth=6)) == ["image_size=(384, 384)",
                                                                                     "depth=6"]
    assert changes_from_preset(ViTConfig(name="my-own-vit")) == []


def test_list_models_and_timm_names_are_unique_and_consistent():
    names = list_models()
    assert names == list(PRESETS) and len(set(names)) == len(names)
    timm_names = [p.timm_name for p in PRESETS.values()]
    assert len(set(timm_names)) == len(timm_names)
    for p in PRESETS.values():
        assert get_preset(p.timm_name) is p
        assert p.config.name == p.timm_name


def test_paper_table_1_sizes():
    for name, dims in {"ViT-B/16": (768, 12, 12, 3072), "ViT-L/16": (1024, 24, 16, 4096),
                       "ViT-H/14": (1280, 32, 16, 5120), "ViT-Ti/16": (192, 12, 3, 768),
                       "ViT-S/16": (384, 12, 6, 1536)}.items():
        cfg = get_config(name)
        assert (cfg.dim, cfg.depth, cfg.num_heads, cfg.mlp_dim) == dims
        assert (cfg.ln_eps, cfg.pool, cfg.pos_embed, cfg.class_token) == (1e-6, "token", "learned", True)


def test_get_config_applies_overrides_and_leaves_the_preset_alone():
    cfg = get_config("ViT-S/16", num_classes=10, image_size=384)
    assert cfg.num_classes == 10 and cfg.image_size == (384, 384) and cfg.grid_size == (24, 24)
    assert get_config("ViT-S/16").num_classes == 1000
    assert get_config("ViT-S/16", pool="gap").class_token is False
    assert get_config("ViT-S/16", pool="gap", class_token=True).class_token is True
