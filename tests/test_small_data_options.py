"""What every one of Lee et al.'s small-dataset options (vitkit.spt, vitkit.lsa, and the two together) must
keep: its function through save and load and through ONNX Runtime, its name where timm, transformers and
`vitkit info` meet it, and a training run that learns with it and saves it."""

import csv

import pytest
import torch

import vitkit
from train_helpers import synthetic_dataset
from vitkit.config import ViTConfig
from vitkit.train import get_recipe, train

BASE = ViTConfig(image_size=(12, 16), patch_size=4, in_chans=2, dim=32, depth=2, num_heads=2, mlp_dim=64,
                 num_classes=5)
NAMES = {"spt": "shifted patch tokenization (spt)", "lsa": "locality self-attention (lsa)"}
OPTIONS = [("spt",), ("lsa",), ("spt", "lsa")]


def config(options):
    return BASE.replace(**{o: True for o in options})


def trained_a_little(model):
    """The model with its zero classifier and the options' own parameters moved off their start."""
    torch.manual_seed(1)
    with torch.no_grad():
        model.head.weight.normal_(std=0.2)
        for name, p in model.named_parameters():
            if name.endswith(("head_scale", "patch_embed.norm.weight")):
                p.mul_(torch.empty_like(p).uniform_(0.5, 2.0))
    return model


@pytest.mark.parametrize("options", OPTIONS, ids="+".join)
def test_saved_and_loaded_with_the_same_function(tmp_path, options):
    model = trained_a_little(vitkit.create_model(config(options))).eval()
    again = vitkit.load(vitkit.save(model, tmp_path / "m"))
    assert all(getattr(again.cfg, o) is True for o in options)
    x = torch.randn(2, 2, 12, 16)
    with torch.inference_mode():
        torch.testing.assert_close(again(x), model(x))


@pytest.mark.parametrize("options", OPTIONS, ids="+".join)
def test_a_bare_file_of_its_tensors_is_refused_by_name(tmp_path, options):
    """Its tensors saved without the config read as timm's names, which have no such tensors: the refusal
    names the option and the folder to load instead."""
    from safetensors.torch import save_file

    from vitkit.checkpoint import CheckpointError

    model = vitkit.create_model(config(options))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "bare.safetensors")
    with pytest.raises(CheckpointError, match="load the folder vitkit.save wrote") as refused:
        vitkit.load(tmp_path / "bare.safetensors")
    assert all(NAMES[o] in str(refused.value) for o in options), str(refused.value)


@pytest.mark.parametrize("options", OPTIONS, ids="+".join)
def test_timm_and_transformers_writers_refuse_it_by_name(options):
    from vitkit.convert.hf import to_hf
    from vitkit.convert.timm import to_timm

    model = vitkit.create_model(config(options))
    for write in (to_timm, to_hf):
        with pytest.raises(ValueError) as refused:
            write(model)
        assert all(NAMES[o] in str(refused.value) for o in options), str(refused.value)


@pytest.mark.parametrize("options", OPTIONS, ids="+".join)
def test_onnx_export_runs_it_in_onnxruntime(tmp_path, options):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from vitkit.export import check_onnx, export_onnx

    model = trained_a_little(vitkit.create_model(config(options))).eval()
    assert check_onnx(model, export_onnx(model, tmp_path / "m.onnx")).ok


@pytest.mark.parametrize("options", OPTIONS, ids="+".join)
def test_training_with_it_learns_and_saves_it(tmp_path, options):
    data = synthetic_dataset(32, seed=0)
    cfg = get_recipe("demo-tiny", [f"model.{o}=true" for o in options] + [
        "augment.crop=none", "augment.hflip=0", "augment.random_erasing=0", "threads=1", "batch_size=32",
        "steps=25", "optim.schedule=constant", "optim.warmup_epochs=0", "optim.lr=0.003",
        "optim.label_smoothing=0", "log_every=1", "ckpt_every=100"])
    train(cfg, tmp_path / "run", train_set=data, val_set=data, progress=False)
    with (tmp_path / "run" / "metrics.csv").open() as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "train"]
    assert losses[-1] < 0.5 * losses[0], losses
    last = vitkit.load(tmp_path / "run" / "last")
    assert all(getattr(last.cfg, o) is True for o in options)
    if "lsa" in options:
        attn = last.blocks[0].attn
        assert not torch.equal(attn.head_scale, torch.full_like(attn.head_scale, attn.scale)), "not trained"


@pytest.mark.parametrize("options", OPTIONS, ids="+".join)
def test_info_names_it(tmp_path, capsys, options):
    from vitkit.cli.main import main

    vitkit.save(vitkit.create_model(config(options)), tmp_path / "m")
    with pytest.raises(SystemExit) as done:
        main(["info", str(tmp_path / "m")])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert all(NAMES[o] in out for o in options), out
