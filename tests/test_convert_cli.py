"""`vitkit convert SRC DST --to vitkit|timm|hf`: every hop reproduces the tensors and the config exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitkit
from convert_reference import randomize_, timm_to_npz_arrays
from vitkit.cli.main import main


def run(*args: str) -> None:
    """The command as the shell runs it; typer exits with SystemExit(0) on success."""
    try:
        main(["convert", *map(str, args)])
    except SystemExit as e:
        if e.code not in (0, None):
            raise


def assert_identical(a, b) -> None:
    assert a.cfg == b.cfg
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_round_trips_are_exact(tmp_path, capsys):
    """vitkit -> timm -> hf -> vitkit, and timm -> vitkit -> timm, with a non-square, tanh-GELU, eps-1e-12
    model (Hugging Face's eps, which timm's folder keeps for vitkit in its vitkit_config)."""
    src = randomize_(vitkit.create_model("ViT-S/16", image_size=(32, 48), patch_size=8, dim=64, depth=2,
                                         num_heads=4, mlp_dim=96, num_classes=3, gelu="tanh", ln_eps=1e-12,
                                         crop_pct=0.9)).eval()
    vitkit.save(src, tmp_path / "src", class_names=["x", "y", "z"])
    run(tmp_path / "src", tmp_path / "timm", "--to", "timm")
    run(tmp_path / "timm", tmp_path / "hf", "--to", "hf")
    run(tmp_path / "hf", tmp_path / "back")
    run(tmp_path / "back", tmp_path / "timm2", "--to", "timm")
    assert ("-> " + str(tmp_path / "hf") + " (hf): 64 wide, 2 layers, 4 heads, 32x48 px, 3 classes"
            in capsys.readouterr().out)
    for folder in ("timm", "hf", "back", "timm2"):
        model = vitkit.load(tmp_path / folder)
        assert_identical(model, src)
        assert model.class_names == ["x", "y", "z"]
    assert ((tmp_path / "timm" / "model.safetensors").read_bytes()
            == (tmp_path / "timm2" / "model.safetensors").read_bytes())


def test_npz_and_torchvision_sources(tmp_path):
    timm = pytest.importorskip("timm")
    ref = randomize_(timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=64,
                                                                       depth=1, num_heads=4, num_classes=5))
    np.savez(tmp_path / "g.npz", **timm_to_npz_arrays(ref))
    run(tmp_path / "g.npz", tmp_path / "g", "--to", "hf")
    assert_identical(vitkit.load(tmp_path / "g"), vitkit.load(tmp_path / "g.npz"))  # gelu tanh kept
    tv = pytest.importorskip("torchvision.models.vision_transformer")
    model = randomize_(tv.VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2,
                                            hidden_dim=128, mlp_dim=96, num_classes=1000))
    torch.save(model.state_dict(), tmp_path / "vit.pth")
    run(tmp_path / "vit.pth", tmp_path / "tv", "--to", "timm")
    back = vitkit.load(tmp_path / "tv")
    assert_identical(back, vitkit.load(tmp_path / "vit.pth"))  # ImageNet mean/std, bilinear, names kept
    assert back.class_names[1] == "goldfish"


def test_errors_are_one_line_with_a_hint(tmp_path, capsys):
    gap = vitkit.create_model("ViT-S/16", image_size=32, patch_size=8, dim=64, depth=1, num_heads=4,
                              mlp_dim=96, pool="gap")
    vitkit.save(gap, tmp_path / "gap")
    cases = [
        ((tmp_path / "gap", tmp_path / "o1", "--to", "onnx"), "unknown format --to 'onnx'"),
        ((tmp_path / "gap", tmp_path / "o2", "--to", "hf"), "classifies from the class token"),
        ((tmp_path / "gap", tmp_path / "gap", "--to", "timm"), "folder is not empty"),
        ((tmp_path / "none", tmp_path / "o3"), "none: no such file or folder"),
        ((tmp_path / "gap", tmp_path / "o4", "--image-size", "3x4x5"), "is not N or HxW"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            run(*args)
        assert exit_info.value.code != 0
        err = capsys.readouterr().err
        assert message in err and "hint:" in err and "Traceback" not in err, err


def test_to_timm_refuses_pre_logits_and_writes_nothing(tmp_path, capsys):
    """A Google .npz with pre_logits (here a vitkit folder with the same layer) cannot become a timm
    folder."""
    model = vitkit.create_model("ViT-S/16", image_size=32, patch_size=8, dim=64, depth=1, num_heads=4,
                                mlp_dim=96, num_classes=3, representation_size=32)
    vitkit.save(model, tmp_path / "src")
    with pytest.raises(SystemExit) as exit_info:
        run(tmp_path / "src", tmp_path / "out", "--to", "timm")
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert ("error: cannot write this model for timm: timm's VisionTransformer has no pre-logits layer"
            in err), err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_convert_prints_what_the_target_will_compute_differently(tmp_path, capsys):
    """A Hugging Face model (LayerNorm eps 1e-12) written for timm (eps 1e-6): written, with a note."""
    model = vitkit.create_model("ViT-S/16", image_size=32, patch_size=8, dim=64, depth=1, num_heads=4,
                                mlp_dim=96, num_classes=3, ln_eps=1e-12)
    vitkit.save(model, tmp_path / "src")
    run(tmp_path / "src", tmp_path / "out", "--to", "timm")
    err = capsys.readouterr().err
    assert "note: timm normalises with LayerNorm eps 1e-06, this model with 1e-12" in err, err
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_bare_file_is_described_once_by_the_options_its_warnings_name(tmp_path, capsys):
    """A bare state dict of a 4-head, GAP-with-class-token, 16x64 model: loading it guesses all three and the
    warnings name the convert options; convert with --num-heads, --pool and --image-size writes the model
    itself."""
    from safetensors.torch import save_file

    source = randomize_(vitkit.create_model(vitkit.ViTConfig(
        image_size=(16, 64), patch_size=8, dim=64, depth=1, num_heads=4, mlp_dim=128, num_classes=3,
        pool="gap", class_token=True)))
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "bare.safetensors")
    with pytest.warns(UserWarning, match="vitkit convert FILE FOLDER --num-heads N") as seen:
        vitkit.load(tmp_path / "bare.safetensors")
    assert len(seen) == 3
    run(tmp_path / "bare.safetensors", tmp_path / "out", "--num-heads", "4", "--pool", "gap", "--image-size",
        "16x64")
    written = vitkit.load(tmp_path / "out")
    # The file's name becomes the model's; a bare file with timm's names takes timm's evaluation crop.
    assert written.cfg == source.cfg.replace(name="bare", crop_pct=0.9)
    for k, v in source.state_dict().items():
        assert torch.equal(written.state_dict()[k], v), k


def test_the_checkpoint_hint_points_to_info_except_from_info(tmp_path, capsys):
    """A checkpoint error's hint suggests `vitkit info PATH`, but not to `vitkit info` itself (it just
    failed)."""
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint at all")
    for command, suggests in ((["convert", tmp_path / "junk.safetensors", tmp_path / "out"], True),
                              (["info", tmp_path / "junk.safetensors"], False)):
        with pytest.raises(SystemExit) as exit_info:
            main([*map(str, command)])
        assert exit_info.value.code != 0
        err = capsys.readouterr().err
        assert "junk.safetensors" in err and "hint: vitkit loads its own folders" in err, err
        assert ("`vitkit info PATH` tells what one holds" in err) == suggests, err
