"""timm state dicts and hub folders, against timm's VisionTransformer with the same random weights."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import vitkit
from convert_reference import assert_noted, assert_same, assert_same_logits, load_noting, randomize_
from vitkit.checkpoint import CheckpointError
from vitkit.convert import write

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer as TimmViT  # noqa: E402


def tiny_timm(seed: int = 1, **kw) -> TimmViT:
    args = dict(img_size=32, patch_size=8, embed_dim=128, depth=2, num_heads=2, num_classes=10)
    args.update(kw)
    return randomize_(TimmViT(**args), seed).eval()


def timm_folder(folder, model: TimmViT, architecture: str, model_args: dict, **extra) -> str:
    """A timm hub folder as timm's push_to_hf_hub writes it."""
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    h, w = model.patch_embed.img_size
    config = {"architecture": architecture, "num_classes": model.num_classes,
              "num_features": model.num_features, "global_pool": model.global_pool, "model_args": model_args,
              "pretrained_cfg": {"tag": "test", "input_size": [3, h, w], "interpolation": "bicubic",
                                 "crop_pct": 0.9, "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5],
                                 "num_classes": model.num_classes}}
    config.update(extra)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth", ".bin"])
def test_state_dict_files(tmp_path, suffix):
    """A bare state dict: heads by the 64-wide convention (128 / 64 = 2), the size from the position table."""
    ref = tiny_timm()
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        save_file(ref.state_dict(), str(path))
    else:
        torch.save(ref.state_dict(), path)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = vitkit.load(path)
        assert_same(ours(x), ref(x), f"timm {suffix} state dict vs timm")
    assert ((ours.cfg.num_heads, ours.cfg.image_size, ours.cfg.ln_eps, ours.cfg.gelu)
            == (2, (32, 32), 1e-6, "exact"))
    assert ours.cfg.mean == (0.5, 0.5, 0.5)  # timm's ViTs (Google's weights): pixels in [-1, 1]


def test_deit_release_file(tmp_path):
    """DeiT's released .pth: {"model": state_dict} with timm's names; ImageNet mean/std; the name's width."""
    ref = tiny_timm(img_size=32, embed_dim=192, num_heads=3, mlp_ratio=4)
    torch.save({"model": ref.state_dict()}, tmp_path / "deit_tiny_patch16_224-a1311bcf.pth")
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        ours = vitkit.load(tmp_path / "deit_tiny_patch16_224-a1311bcf.pth")
        assert_same(ours(x), ref(x), "DeiT release file vs timm")
    assert ours.cfg.num_heads == 3 and ours.cfg.mean == (0.485, 0.456, 0.406)


def test_hub_folder_non_square_with_heads_and_labels(tmp_path):
    """config.json gives what shapes cannot: 4 heads of 32, a 32x48 image, the preprocessing, label names."""
    ref = tiny_timm(img_size=(32, 48), num_heads=4, num_classes=3)
    folder = timm_folder(tmp_path / "t", ref, "vit_base_patch16_224",
                         {"img_size": [32, 48], "patch_size": 8, "embed_dim": 128, "depth": 2,
                          "num_heads": 4},
                         label_names=["cat", "dog", "cow"])
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        ours = vitkit.load(folder)
        assert_same(ours(x), ref(x), "timm hub folder (non-square, config heads) vs timm")
    assert ours.class_names == ["cat", "dog", "cow"]
    assert (ours.cfg.crop_pct, ours.cfg.name) == (0.9, "vit_base_patch16_224.test")


def test_gap_without_fc_norm_and_no_embed_class(tmp_path):
    x = torch.randn(2, 3, 32, 32)
    gap = tiny_timm(class_token=False, global_pool="avg", fc_norm=False)
    save_file(gap.state_dict(), str(tmp_path / "gap.safetensors"))
    nec = tiny_timm(no_embed_class=True)  # class token without a position row (DeiT III style)
    save_file(nec.state_dict(), str(tmp_path / "nec.safetensors"))
    with torch.no_grad():
        ours = vitkit.load(tmp_path / "gap.safetensors")
        assert ours.cfg.pool == "gap"
        assert_same(ours(x), gap(x), "timm GAP vs timm")
        assert_same(vitkit.load(tmp_path / "nec.safetensors")(x), nec(x), "timm no_embed_class vs timm")


def test_hybrid_state_dict(tmp_path):
    ref = randomize_(timm.create_model("vit_small_r26_s32_224", img_size=64, embed_dim=64, depth=1,
                                       num_heads=1, num_classes=4)).eval()
    save_file(ref.state_dict(), str(tmp_path / "r26.safetensors"))
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        ours = vitkit.load(tmp_path / "r26.safetensors")
        assert_same(ours(x), ref(x), "timm R26 hybrid state dict vs timm")
    assert ours.cfg.hybrid_layers == (2, 2, 2, 2)


def test_what_vitkit_cannot_represent_is_listed(tmp_path):
    """timm's fc_norm (GAP then LayerNorm) and layer scale are not vitkit's: named, never dropped."""
    model = tiny_timm(class_token=False, global_pool="avg", init_values=1e-5)  # fc_norm on by default
    save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError) as err:
        vitkit.load(tmp_path / "m.safetensors")
    message = str(err.value)
    assert ("unexpected keys" in message and "'fc_norm.weight'" in message
            and "'blocks.0.ls1.gamma'" in message)


def test_misfit_tensors_are_all_named(tmp_path):
    state = tiny_timm().state_dict()
    del state["blocks.1.mlp.fc2.bias"]
    state["blocks.0.norm2.weight"] = torch.ones(7)
    save_file(state, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError) as err:
        vitkit.load(tmp_path / "m.safetensors")
    message = str(err.value)
    assert "(timm format): tensors do not fit the config" in message
    assert "missing keys ['blocks.1.mlp.fc2.bias']" in message
    assert "blocks.0.norm2.weight: file (7,) vs model (128,)" in message


def test_write_timm_round_trip_and_timm_reads_it(tmp_path):
    """vitkit -> timm folder -> vitkit is exact, and timm builds the same function from the folder, also for
    an MLP width that mlp_dim / dim gives timm one short (int(56 * (61 / 56)) = 60)."""
    ours = randomize_(vitkit.create_model("ViT-S/16", image_size=(32, 48), patch_size=8, dim=56, depth=2,
                                          num_heads=4, mlp_dim=61, num_classes=3, gelu="tanh"))
    assert int(56 * (61 / 56)) == 60
    folder = write(ours.eval(), tmp_path / "out", to="timm", class_names=["a", "b", "c"])
    back = vitkit.load(folder)
    assert back.cfg == ours.cfg and back.class_names == ["a", "b", "c"]
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    config = json.loads((folder / "config.json").read_text())
    ref = timm.create_model(config["architecture"], num_classes=config["num_classes"], **config["model_args"])
    ref.load_state_dict(load_file(str(folder / "model.safetensors")))
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        assert_same(ours(x), ref.eval()(x), "vitkit written as timm, read by timm")
        # timm's own loader of a local folder, as docs/checkpoints.md shows it
        local = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
        assert_same(ours(x), local(x), "vitkit written as timm, read by timm's local-dir:")


def test_timms_fields_win_over_a_stale_vitkit_config(tmp_path):
    """Someone edits a vitkit-written timm folder's config.json: the fields timm computes with (model_args'
    heads and activation, pretrained_cfg's mean, std and crop) win over the vitkit_config entry left as it
    was, which still gives what timm cannot say (LayerNorm eps)."""
    ours = randomize_(vitkit.create_model("ViT-S/16", image_size=32, patch_size=8, dim=64, depth=1,
                                          num_heads=4, mlp_dim=96, num_classes=3, gelu="tanh", ln_eps=1e-12))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that timm computes with eps 1e-6
        folder = write(ours.eval(), tmp_path / "out", to="timm")
    config = json.loads((folder / "config.json").read_text())
    config["model_args"].update(num_heads=2, act_layer="gelu")
    config["pretrained_cfg"].update(mean=[0.1, 0.2, 0.3], std=[0.4, 0.5, 0.6], crop_pct=0.75)
    assert config["vitkit_config"]["num_heads"] == 4
    (folder / "config.json").write_text(json.dumps(config))
    back = vitkit.load(folder)
    assert (back.cfg.num_heads, back.cfg.gelu, back.cfg.mean, back.cfg.std, back.cfg.crop_pct) == \
        (2, "exact", (0.1, 0.2, 0.3), (0.4, 0.5, 0.6), 0.75)
    assert back.cfg.ln_eps == 1e-12


def test_the_timm_names_vitkit_says_timm_has_are_those_it_has():
    from vitkit.config import PRESETS, TIMM_ARCHITECTURES

    have = set(timm.list_models())
    assert {p.timm_name for p in PRESETS.values()} & have == TIMM_ARCHITECTURES
    assert not PRESETS["ViT-H/16"].in_timm and PRESETS["ViT-H/14"].in_timm


@pytest.mark.parametrize("preset", ["ViT-Ti/32", "ViT-H/16@384", "ViT-B/16"])
def test_a_preset_timm_lacks_is_written_under_an_architecture_it_has(tmp_path, preset):
    """ViT-Ti/32 has a timm-style name timm's registry lacks: the folder names timm's plain ViT, whose
    model_args make the same model; timm builds it by name from the folder and computes the same function."""
    from vitkit.config import TIMM_ARCHITECTURES

    ours = randomize_(vitkit.create_model(preset, image_size=32, dim=48, depth=1, num_heads=3, mlp_dim=96,
                                          num_classes=4))
    folder = write(ours.eval(), tmp_path / "out", to="timm")
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] in TIMM_ARCHITECTURES
    ref = timm.create_model(config["architecture"], num_classes=config["num_classes"], **config["model_args"])
    ref.load_state_dict(load_file(str(folder / "model.safetensors")))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_same(ours(x), ref.eval()(x), f"{preset} written as timm, read by timm")


def test_write_timm_refuses_a_larger_layer_norm_eps_and_notes_a_smaller_one(tmp_path):
    """timm's LayerNorm eps is 1e-6 whatever model_args say: a larger one would change what timm computes;
    a smaller one (Hugging Face's 1e-12) changes it by float noise and is written with a warning."""
    kwargs = dict(image_size=32, patch_size=8, dim=64, depth=1, num_heads=4, mlp_dim=96, num_classes=3)
    with pytest.raises(ValueError,
                       match=r"timm: timm's VisionTransformer normalises with LayerNorm eps 1e-06, "
                             r"this model with 1e-05"):
        write(vitkit.create_model("ViT-S/16", ln_eps=1e-5, **kwargs), tmp_path / "big", to="timm")
    assert not (tmp_path / "big").exists()
    with pytest.warns(UserWarning, match="timm normalises with LayerNorm eps 1e-06, this model with 1e-12"):
        write(vitkit.create_model("ViT-S/16", ln_eps=1e-12, **kwargs), tmp_path / "small", to="timm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write(vitkit.create_model("ViT-S/16", **kwargs), tmp_path / "same", to="timm")


def test_no_embed_class_with_a_non_square_size_from_config(tmp_path):
    """With a size in config.json, a table of one row per patch means the class token has no position."""
    ref = tiny_timm(img_size=(32, 48), no_embed_class=True)
    folder = timm_folder(tmp_path / "t", ref, "vit_base_patch16_224",
                         {"img_size": [32, 48], "patch_size": 8, "embed_dim": 128, "depth": 2,
                          "num_heads": 2})
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        assert_same(vitkit.load(folder)(x), ref(x), "timm no_embed_class, non-square, vs timm")


def test_write_timm_refuses_a_pre_logits_layer(tmp_path):
    """timm has no pre-logits layer: its checkpoint filter drops pre_logits.fc.*, so timm would compute
    another function. Refused, like --to hf, and nothing is written."""
    for num_classes in (3, 0):
        # a classifier behind the pre-logits, or the pre-logits output itself (ViTModel)
        model = vitkit.create_model("ViT-S/16", image_size=32, patch_size=8, dim=64, depth=1, num_heads=4,
                                    mlp_dim=96, num_classes=num_classes, representation_size=64)
        with pytest.raises(ValueError, match=r"cannot write this model for timm: .*no pre-logits layer"):
            write(model, tmp_path / "out", to="timm")
        assert not (tmp_path / "out").exists()


def test_crop_mode_is_read_and_written(tmp_path):
    """timm's pretrained_cfg crop_mode: "squash" (resize to the size, aspect not kept) and "center" both ways;
    timm's eval transform of the written folder is vitkit's."""
    import numpy as np
    from PIL import Image

    from vitkit.data.transforms import build_eval_transform

    ref = tiny_timm()
    folder = timm_folder(tmp_path / "t", ref, "vit_base_patch16_224",
                         {"img_size": 32, "patch_size": 8, "embed_dim": 128, "depth": 2, "num_heads": 2})
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    config["pretrained_cfg"].update(crop_mode="squash", crop_pct=1.0)
    (tmp_path / "t" / "config.json").write_text(json.dumps(config))
    ours = vitkit.load(folder)
    assert (ours.cfg.crop_mode, ours.cfg.crop_pct) == ("squash", 1.0)
    out = write(ours, tmp_path / "out", to="timm")
    pcfg = json.loads((out / "config.json").read_text())["pretrained_cfg"]
    assert (pcfg["crop_mode"], pcfg["crop_pct"]) == ("squash", 1.0)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 90, 3), dtype=np.uint8))
    data_cfg = timm.data.resolve_data_config(pretrained_cfg=pcfg)
    theirs = timm.data.create_transform(**data_cfg)(image)
    # one uint8 level apart at most (bicubic on a tensor vs PIL's); centre-cropping instead differs by ~1
    torch.testing.assert_close(build_eval_transform(ours.cfg)(image), theirs, rtol=0, atol=2 / 255 + 1e-6)
    centre = randomize_(vitkit.create_model("ViT-S/16", image_size=32, patch_size=8, dim=64, depth=1,
                                            num_heads=4, mlp_dim=96, num_classes=3, crop_pct=0.9))
    out = write(centre, tmp_path / "centre", to="timm")
    assert json.loads((out / "config.json").read_text())["pretrained_cfg"]["crop_mode"] == "center"


# --- what a bare timm state dict leaves open: assumed with a warning naming the argument --------------------



@pytest.mark.parametrize("dim, heads, assumed", [
    (64, 4, r"assumed 1 head of 64 \(the 64-wide convention\)"),
    # a vit_tiny with 6 heads
    (192, 6, r"assumed 3 heads of 64 as ViT-Ti of width 192 and MLP 768 \(Table 1\)"),
])
def test_a_bare_timm_file_says_which_heads_it_assumed(tmp_path, dim, heads, assumed):
    ref = tiny_timm(embed_dim=dim, num_heads=heads, depth=1)
    save_file(ref.state_dict(), str(tmp_path / "w.safetensors"))
    model, notes = load_noting(tmp_path / "w.safetensors")
    assert model.cfg.num_heads != heads
    assert_noted(notes, r"w\.safetensors holds no config that gives its number of heads: " + assumed
                 + r"; pass num_heads= if the model has another count")
    model, notes = load_noting(tmp_path / "w.safetensors", num_heads=heads)
    assert model.cfg.num_heads == heads and not [n for n in notes if "gives its number of heads" in n], notes
    assert_same_logits(model, ref, (32, 32))


def test_a_bare_timm_file_of_gap_with_the_class_token_says_it_assumed_token_pooling(tmp_path):
    """global_pool='avg', fc_norm=False keeps the class token: the same tensors as a token-pooling model."""
    ref = tiny_timm(embed_dim=64, num_heads=1, depth=1, global_pool="avg", fc_norm=False)
    torch.save(ref.state_dict(), tmp_path / "gap.pth")
    model, notes = load_noting(tmp_path / "gap.pth")
    assert model.cfg.pool == "token"
    assert_noted(notes,
                 r"gap\.pth holds no config that gives its pooling: assumed pool='token' .*pass pool='gap'")
    model, notes = load_noting(tmp_path / "gap.pth", pool="gap")
    assert model.cfg.pool == "gap" and not [n for n in notes if "gives its pooling" in n], notes
    assert_same_logits(model, ref, (32, 32))


def test_a_bare_timm_file_says_it_assumed_a_square_grid(tmp_path):
    """A 4x16 grid (32x128 images) has the 64 rows of an 8x8 one (64x64)."""
    ref = tiny_timm(img_size=(32, 128), embed_dim=64, num_heads=1, depth=1)
    save_file(ref.state_dict(), str(tmp_path / "wide.safetensors"))
    model, notes = load_noting(tmp_path / "wide.safetensors")
    assert model.cfg.image_size == (64, 64)
    assert_noted(notes,
                 r"wide\.safetensors holds no config that gives its image size: assumed a square 8x8 grid "
                 r"of 8-pixel patches \(64x64 images\) for its 64 position rows; pass image_size=\(H, W\)")
    model, notes = load_noting(tmp_path / "wide.safetensors", image_size=(32, 128))
    assert model.cfg.image_size == (32, 128) and not [n for n in notes if "gives its image size" in n], notes
    assert_same_logits(model, ref, (32, 128))


def test_a_timm_file_with_its_config_says_nothing(tmp_path):
    """timm's own writer (save_for_hf, as push_to_hf_hub) records heads, size and pooling: nothing assumed,
    for the folder and for its weights file; nor when model_args lack global_pool but config.json's top level
    (which timm always writes) has it."""
    from timm.models._hub import save_for_hf

    args = dict(img_size=(32, 128), patch_size=8, embed_dim=64, depth=1, num_heads=4, global_pool="avg",
                fc_norm=False)
    ref = randomize_(timm.create_model("vit_base_patch16_224", num_classes=10, **args)).eval()
    save_for_hf(ref, str(tmp_path / "t"), model_args=args, safe_serialization=True)
    del args["global_pool"], args["fc_norm"]
    timm_folder(tmp_path / "top", ref, "vit_base_patch16_224", args)
    for path in (tmp_path / "t", tmp_path / "t" / "model.safetensors", tmp_path / "top"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model = vitkit.load(path)
        assert (model.cfg.num_heads, model.cfg.pool, model.cfg.image_size) == (4, "gap", (32, 128)), path
        assert_same_logits(model, ref, (32, 128))


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "vit_small_patch16_384"])
def test_a_bare_timm_file_takes_timms_crop(tmp_path, name):
    """Without a config, the evaluation crop is timm's default for its ViTs (0.9 at 224 px, 1.0 at 384), not
    vitkit's own 0.875."""
    ref = timm.create_model(name, depth=1, num_classes=3)
    save_file(ref.state_dict(), str(tmp_path / f"{name}.safetensors"))
    model = vitkit.load(tmp_path / f"{name}.safetensors")
    assert model.cfg.crop_pct == ref.pretrained_cfg["crop_pct"]


def test_writing_a_flax_hybrid_for_timm_notes_timms_constants(tmp_path):
    model = vitkit.create_model("R26+ViT-S/32", image_size=32, dim=32, depth=1, num_heads=2, mlp_dim=64,
                                num_classes=3, hybrid_norm="flax")
    with pytest.warns(UserWarning, match=r"timm's hybrid ResNet standardises .* \(flax\)"):
        write(model, tmp_path / "out", to="timm")


def test_a_hub_folder_without_model_args_takes_its_heads_from_timms_builder(tmp_path):
    """The hub serves timm's folders without model_args: vit_base_patch16_gap_224 is 768 wide with 16 heads of
    48 (not ViT-B's 12, nor 64-wide ones), which timm's builder of the architecture says, built on the meta
    device."""
    ref = randomize_(timm.create_model("vit_base_patch16_gap_224", img_size=32, patch_size=8, depth=1,
                                       mlp_ratio=1.0, num_classes=3)).eval()
    assert ref.blocks[0].attn.num_heads == 16
    folder = timm_folder(tmp_path / "t", ref, "vit_base_patch16_gap_224", {})
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    del config["model_args"]
    (tmp_path / "t" / "config.json").write_text(json.dumps(config))
    model, notes = load_noting(folder)
    assert not [n for n in notes if "number of heads" in n], notes
    assert (model.cfg.num_heads, model.cfg.pool) == (16, "gap")
    with torch.no_grad():
        x = torch.randn(2, 3, 32, 32)
        assert_same(model(x), ref(x), "timm hub folder without model_args vs timm")
    config["architecture"] = "no_such_architecture"  # timm cannot say: still the warned guess
    (tmp_path / "t" / "config.json").write_text(json.dumps(config))
    model, notes = load_noting(folder)
    assert model.cfg.num_heads == 12
    assert_noted(notes, r"holds no config that gives its number of heads: assumed 12 heads")


def test_a_bare_timm_file_says_it_guessed_the_class_tokens_position_row(tmp_path):
    """A 6x8 grid and the class token's row have 49 rows, those of a 7x7 grid with no_embed_class: read as the
    latter with a warning naming image_size=, which then reads it right."""
    ref = tiny_timm(img_size=(48, 64), embed_dim=64, num_heads=1, depth=1)
    save_file(ref.state_dict(), str(tmp_path / "w.safetensors"))
    model, notes = load_noting(tmp_path / "w.safetensors")
    assert model.cfg.image_size == (56, 56)
    assert_noted(notes,
                 r"w\.safetensors holds no config that gives its class token's position row: assumed none "
                 r"\(timm's no_embed_class=True\): its 49 position rows a 7x7 grid of patches, not 48 "
                 r"patches and the class token's row; pass image_size=\(H, W\)")
    model, notes = load_noting(tmp_path / "w.safetensors", image_size=(48, 64))
    assert not [n for n in notes if "position row" in n], notes
    assert_same_logits(model, ref, (48, 64))


def test_a_non_square_no_embed_class_table_is_counted_right(tmp_path):
    """A 6x10 grid without the class token's row: 60 rows, which the error counts both ways."""
    ref = tiny_timm(img_size=(48, 80), embed_dim=64, num_heads=1, depth=1, no_embed_class=True)
    save_file(ref.state_dict(), str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError,
                       match=r"w\.safetensors: the position table has 60 rows, not a square grid "
                             r"of patches with the class token's row \(59 patches\) or without it "
                             r"\(60, timm's no_embed_class\); give the image size"):
        vitkit.load(tmp_path / "w.safetensors")
    model, _ = load_noting(tmp_path / "w.safetensors", image_size=(48, 80))
    assert_same_logits(model, ref, (48, 80))


def test_a_model_without_position_embedding_is_written_for_timm(tmp_path):
    """timm's pos_embed='none': read from timm, written back, and timm builds the same function from the
    folder."""
    ref = tiny_timm(pos_embed="none", depth=1)
    save_file(ref.state_dict(), str(tmp_path / "w.safetensors"))
    ours, _ = load_noting(tmp_path / "w.safetensors", image_size=32)
    assert ours.cfg.pos_embed == "none"
    assert_same_logits(ours, ref, (32, 32))
    folder = write(ours, tmp_path / "out", to="timm")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_args"]["pos_embed"] == "none"
    theirs = timm.create_model(config["architecture"], num_classes=config["num_classes"],
                               **config["model_args"])
    theirs.load_state_dict(load_file(str(folder / "model.safetensors")))
    assert_same_logits(theirs.eval(), ref, (32, 32))
    assert vitkit.load(folder).cfg == ours.cfg


def test_a_transformers_timm_wrapper_folder(tmp_path):
    """transformers' TimmWrapperForImageClassification saves timm's names under `timm_model.`, with timm's
    architecture and model_args (here without num_heads, which timm's builder then gives) in config.json."""
    transformers = pytest.importorskip("transformers")
    config = transformers.TimmWrapperConfig(architecture="vit_base_patch16_gap_224", num_labels=3,
                                            model_args={"depth": 1, "img_size": 32, "patch_size": 8,
                                                        "mlp_ratio": 1.0})
    ref = randomize_(transformers.TimmWrapperForImageClassification(config)).eval()
    ref.save_pretrained(tmp_path / "w")
    assert json.loads((tmp_path / "w" / "config.json").read_text())["model_type"] == "timm_wrapper"
    model, notes = load_noting(tmp_path / "w")
    assert (model.cfg.num_heads, model.class_names) == (16, None)
    assert not [n for n in notes if "number of heads" in n], notes
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_same(model(x), ref(pixel_values=x).logits, "transformers TimmWrapper folder vs transformers")


@pytest.mark.parametrize("overrides, architecture", [
    ({}, "vit_small_patch16_224"),
    ({"image_size": 384}, "vit_small_patch16_384"),
    ({"image_size": 64}, "vit_small_patch16_224"),
    ({"patch_size": 8}, "vit_small_patch8_224"),
    ({"dim": 768, "num_heads": 12, "mlp_dim": 3072}, "vit_base_patch16_224"),
    ({"dim": 128, "depth": 4, "num_heads": 4, "mlp_dim": 512, "patch_size": 4, "image_size": 28},
     "vit_base_patch16_224"),
])
def test_the_timm_config_names_the_registered_model_of_the_same_shape(overrides, architecture):
    """A model whose shape timm registers is named by it, whatever preset it was built from (a ViT-S/16
    widened to 768 is ViT-B/16); one timm has no shape of names timm's plain ViT, which model_args turn into
    it, and the description says the real shape."""
    from vitkit.convert.timm import to_timm

    cfg = vitkit.get_config("ViT-S/16", num_classes=10, **overrides)
    _, config = to_timm(vitkit.VisionTransformer(cfg))
    assert config["architecture"] == architecture
    d = cfg.image_size
    assert config["architecture_description"] == (
        f"ViT: {cfg.depth} layers, width {cfg.dim}, {cfg.num_heads} heads, MLP {cfg.mlp_dim}, "
        f"patch {cfg.patch_size}, {d[0]}x{d[1]} input")
    assert timm.create_model(config["architecture"], num_classes=10, **config["model_args"]).pos_embed.shape \
        == vitkit.VisionTransformer(cfg).pos_embed.shape
