"""vitkit's own checkpoints: a folder with model.safetensors and config.json, round trips and bad files."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import vitkit
from vitkit import ViTConfig
from vitkit.checkpoint import CONFIG_NAME, WEIGHTS_NAME, CheckpointError
from vitkit.model import VisionTransformer


def tiny(**overrides) -> ViTConfig:
    base = dict(image_size=32, patch_size=8, dim=32, depth=2, num_heads=4, mlp_dim=64, num_classes=5)
    base.update(overrides)
    return ViTConfig(**base)


def trained_looking(cfg: ViTConfig) -> VisionTransformer:
    """A model with every tensor random, so that a round trip that drops or mixes one would show."""
    model = VisionTransformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.eval()


@pytest.fixture()
def checkpoint(tmp_path):
    model = trained_looking(tiny())
    return vitkit.save(model, tmp_path / "ckpt", class_names=list("abcde")), model


# --- round trips --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        dict(pos_embed="learned"),
        dict(pos_embed="learned-2d", image_size=(24, 40)),
        dict(pos_embed="sincos-2d", image_size=(40, 24)),
        dict(pos_embed="none"),
        dict(pool="gap", class_token=False, pos_embed="learned-2d"),
        dict(representation_size=16, gelu="tanh", ln_eps=1e-5, qkv_bias=False),
        dict(in_chans=1, mean=(0.286,), std=(0.353,), interpolation="bilinear", crop_pct=1.0),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_round_trip_gives_identical_outputs(tmp_path, overrides):
    cfg = tiny(**overrides)
    model = trained_looking(cfg)
    folder = vitkit.save(model, tmp_path / "ckpt")
    assert sorted(p.name for p in folder.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]  # no temp files left
    loaded = vitkit.load(folder)
    assert loaded.cfg == cfg
    assert not loaded.training
    x = torch.randn(2, cfg.in_chans, *cfg.image_size)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
        assert torch.equal(loaded.forward_features(x), model.forward_features(x))
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)


def test_config_json_records_model_classes_and_preprocessing(checkpoint):
    folder, model = checkpoint
    meta = json.loads((folder / CONFIG_NAME).read_text())
    assert meta["format"] == "vitkit" and meta["format_version"] == 1
    assert ViTConfig.from_dict(meta["model"]) == model.cfg
    assert meta["class_names"] == list("abcde")
    assert meta["preprocessing"] == {
        "input_size": [3, 32, 32], "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5],
        "interpolation": "bicubic", "crop_pct": 0.875, "crop_mode": "center",
    }
    assert vitkit.load(folder).class_names == list("abcde")


def test_weights_are_plain_safetensors(checkpoint):
    folder, model = checkpoint
    with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as f:
        assert f.metadata() == {"format": "vitkit"}
        assert set(f.keys()) == set(model.state_dict())


def test_load_accepts_the_weights_file_and_a_string_path(checkpoint):
    folder, model = checkpoint
    x = torch.randn(1, 3, 32, 32)
    for path in (folder / WEIGHTS_NAME, str(folder)):
        with torch.no_grad():
            assert torch.equal(vitkit.load(path)(x), model(x))


def test_save_rejects_class_names_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="3 class names for a model with 5 classes"):
        vitkit.save(VisionTransformer(tiny()), tmp_path / "c", class_names=["a", "b", "c"])
    assert not (tmp_path / "c" / WEIGHTS_NAME).exists()


def test_saving_again_overwrites_in_place(checkpoint):
    folder, _ = checkpoint
    other = trained_looking(tiny(num_classes=2))
    vitkit.save(other, folder)
    assert vitkit.load(folder).cfg.num_classes == 2
    assert sorted(p.name for p in folder.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]


# --- bad files ----------------------------------------------------------------------------------------
def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nope" / "there"
    with pytest.raises(CheckpointError, match=re.escape(f"{missing}: no such file or folder")):
        vitkit.load(missing)


def test_a_folder_without_config_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    message = f"{tmp_path}: not a vitkit checkpoint (no config.json)"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        vitkit.load(tmp_path)
    with pytest.raises(CheckpointError, match="not a vitkit checkpoint"):
        vitkit.load(tmp_path / "notes.txt")


def test_a_foreign_config_json_is_not_a_checkpoint(tmp_path):
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"model_type": "vit", "hidden_size": 768}))
    message = f"{tmp_path / CONFIG_NAME}: not a vitkit checkpoint config"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        vitkit.load(tmp_path)
    (tmp_path / CONFIG_NAME).write_text("{ not json")
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / CONFIG_NAME}: not valid JSON")):
        vitkit.load(tmp_path)


def test_a_bad_model_config_is_named(checkpoint):
    folder, _ = checkpoint
    meta = json.loads((folder / CONFIG_NAME).read_text())
    meta["model"]["heads"] = 4
    (folder / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=re.escape(f"{folder / CONFIG_NAME}: bad model config")
                       + r".*unknown ViTConfig keys \['heads'\]"):
        vitkit.load(folder)
    meta["model"].pop("heads")
    meta["model"]["pool"] = "max"
    (folder / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"bad model config .*pool='max'"):
        vitkit.load(folder)


def test_missing_weights_file_is_named(checkpoint):
    folder, _ = checkpoint
    (folder / WEIGHTS_NAME).unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"{folder / WEIGHTS_NAME}: no such file")):
        vitkit.load(folder)


@pytest.mark.parametrize("keep", [0.5, 0.99, 20])
def test_truncated_weights_file_is_named(checkpoint, keep):
    folder, _ = checkpoint
    path = folder / WEIGHTS_NAME
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: not a readable safetensors file")):
        vitkit.load(folder)


def test_a_pickle_in_place_of_the_weights_is_refused(checkpoint):
    folder, model = checkpoint
    torch.save(model.state_dict(), folder / WEIGHTS_NAME)  # a pickle under the safetensors name
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        vitkit.load(folder)


def _rewrite_weights(folder, change) -> None:
    state = load_file(str(folder / WEIGHTS_NAME))
    change(state)
    save_file(state, str(folder / WEIGHTS_NAME))


def test_tensors_that_do_not_fit_the_config_are_all_named(checkpoint, monkeypatch):
    folder, _ = checkpoint

    def change(state):
        state["pos_embed"] = torch.zeros(1, 50, 32)  # misshapen
        del state["blocks.1.mlp.fc2.bias"]  # missing
        state["blocks.2.norm1.weight"] = torch.ones(32)  # unexpected

    _rewrite_weights(folder, change)
    copied = []

    def record_load(self, *args, **kwargs):
        copied.append(self)
        raise AssertionError("weights were copied into a model before the check")

    monkeypatch.setattr(VisionTransformer, "load_state_dict", record_load)
    with pytest.raises(CheckpointError) as err:
        vitkit.load(folder)
    message = str(err.value)
    assert message.startswith(f"{folder / WEIGHTS_NAME}: tensors do not fit the config")
    assert "missing keys ['blocks.1.mlp.fc2.bias']" in message
    assert "unexpected keys ['blocks.2.norm1.weight']" in message
    assert "pos_embed: file (1, 50, 32) vs model (1, 17, 32)" in message
    assert copied == []  # checked before any weight was copied: nothing is half-loaded


def test_weights_of_another_architecture_are_refused(tmp_path):
    """config.json says 4 heads of width 32; the tensors come from a wider model."""
    vitkit.save(trained_looking(tiny(dim=64, mlp_dim=128)), tmp_path / "wide")
    vitkit.save(trained_looking(tiny()), tmp_path / "narrow")
    (tmp_path / "narrow" / WEIGHTS_NAME).write_bytes((tmp_path / "wide" / WEIGHTS_NAME).read_bytes())
    with pytest.raises(CheckpointError, match=r"misshapen \[.*'blocks.0.attn.qkv.weight: file \(192, 64\) "
                                              r"vs model \(96, 32\)'"):
        vitkit.load(tmp_path / "narrow")


def test_checkpoint_errors_are_value_errors():
    assert issubclass(CheckpointError, ValueError)


def test_save_writes_a_compiled_model_as_the_model_it_wraps(tmp_path):
    model = VisionTransformer(ViTConfig(image_size=16, patch_size=8, dim=16, depth=1, num_heads=2, mlp_dim=32,
                                        num_classes=2))
    vitkit.save(torch.compile(model), tmp_path / "ckpt")  # compiles nothing until called
    back = vitkit.load(tmp_path / "ckpt")
    assert back.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_save_refuses_what_it_could_not_load_again(tmp_path):
    with pytest.raises(TypeError, match="vitkit.save takes a vitkit VisionTransformer, got Linear"):
        vitkit.save(torch.nn.Linear(2, 2), tmp_path / "a")
    model = VisionTransformer(ViTConfig(image_size=16, patch_size=8, dim=16, depth=1, num_heads=2, mlp_dim=32,
                                        num_classes=2))
    model.extra = torch.nn.Linear(2, 2)  # a tensor the config does not describe
    with pytest.raises(CheckpointError, match=r"unexpected keys \['extra.bias', 'extra.weight'\]"):
        vitkit.save(model, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_files_and_folders_get_the_mode_of_an_ordinary_file(tmp_path):
    # mkstemp's private 0600 would leave a checkpoint in a shared folder unreadable to everyone else.
    import os
    import stat

    from vitkit.analysis.features import extract_features
    from vitkit.data import TensorImageDataset
    from vitkit.train.checkpoints import save_model_atomically, save_train_state

    old = os.umask(0o022)
    try:
        model = VisionTransformer(ViTConfig(image_size=16, patch_size=8, dim=16, depth=1, num_heads=2,
                                            mlp_dim=32, num_classes=2))
        vitkit.save(model, tmp_path / "ckpt")
        save_model_atomically(model, tmp_path / "run" / "last", None)
        # A run's training state (optimizer, EMA, generators) and a feature cache: safetensors files, which
        # safetensors itself creates private.
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(1, 3, 16, 16)).sum().backward()
        optimizer.step()
        state = save_train_state(tmp_path / "run", 1, model, optimizer, {}, None, model.state_dict())
        data = TensorImageDataset(torch.zeros(4, 3, 16, 16, dtype=torch.uint8),
                                  torch.zeros(4, dtype=torch.long), ["a", "b"])
        extract_features(model.eval(), data, cache=tmp_path / "features.safetensors", progress=False,
                         transform=lambda x: x.float())
    finally:
        os.umask(old)
    last = tmp_path / "run" / "last"
    written = [tmp_path / "ckpt" / WEIGHTS_NAME, tmp_path / "ckpt" / CONFIG_NAME, last / WEIGHTS_NAME,
               tmp_path / "features.safetensors", *(p for p in state.rglob("*") if p.is_file())]
    assert {p.name for p in written} >= {"optimizer.safetensors", "ema.safetensors", "rng.safetensors"}
    for f in written:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
    assert stat.S_IMODE((tmp_path / "run" / "last").stat().st_mode) == 0o755


@pytest.mark.parametrize("names", [["a", "b"], "abc"])
def test_class_names_that_do_not_fit_the_head_are_refused_at_load(checkpoint, names):
    folder, _ = checkpoint
    meta = json.loads((folder / CONFIG_NAME).read_text())
    meta["class_names"] = names  # the model has five classes
    (folder / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"config.json: .* for a model with 5 classes"):
        vitkit.load(folder)


def test_loading_to_a_gpu_the_machine_lacks_says_so(tmp_path, monkeypatch):
    import torch

    import vitkit

    vitkit.save(vitkit.create_model("ViT-Ti/16", image_size=32, patch_size=8, dim=32, depth=1, num_heads=2,
                                    mlp_dim=64, num_classes=2), tmp_path / "m")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="map_location='cuda': torch finds no CUDA device"):
        vitkit.load(tmp_path / "m", map_location="cuda")


@pytest.mark.parametrize("pos_embed", ["learned", "sincos-2d"])
def test_loading_builds_on_meta_and_takes_the_files_tensors_without_a_random_init(tmp_path, pos_embed,
                                                                                 monkeypatch):
    """vitkit.load builds on the meta device and assigns the file's tensors: init_weights never runs on real
    tensors, the logits are the saved model's, and a sin-cos table (in no state dict) is made."""
    from vitkit.model import VisionTransformer

    cfg = ViTConfig(image_size=16, patch_size=8, dim=32, depth=2, num_heads=2, mlp_dim=64, num_classes=3,
                    pos_embed=pos_embed)
    torch.manual_seed(0)
    saved = VisionTransformer(cfg).eval()
    torch.nn.init.normal_(saved.head.weight)
    vitkit.save(saved, tmp_path / "m")
    with_values = []
    init_weights = VisionTransformer.init_weights
    monkeypatch.setattr(VisionTransformer, "init_weights",
                        lambda self: (with_values.append(not self.norm.weight.is_meta), init_weights(self)))
    loaded = vitkit.load(tmp_path / "m")
    assert not any(with_values)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), saved(x), rtol=0, atol=0)
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])
    assert all(p.requires_grad for p in loaded.parameters())


def test_tensors_that_share_memory_are_copied_so_that_the_model_saves(tmp_path):
    """A converter may hand views of one array (q, k and v cut from a fused one): each parameter gets its own
    storage, as safetensors requires, and a tensor of its own is taken as it is."""
    from vitkit.checkpoint import model_from_state
    from vitkit.model import VisionTransformer

    cfg = ViTConfig(image_size=16, patch_size=8, dim=32, depth=1, num_heads=2, mlp_dim=64, num_classes=3)
    state = VisionTransformer(cfg).state_dict()
    both = torch.randn(2, *state["norm.weight"].shape)
    state["norm.weight"], state["norm.bias"] = both[0], both[1]  # one storage
    model = model_from_state(VisionTransformer, cfg, state)
    assert model.norm.weight.untyped_storage().data_ptr() != model.norm.bias.untyped_storage().data_ptr()
    assert model.head.weight.data_ptr() == state["head.weight"].data_ptr()  # its own: taken, not copied
    torch.testing.assert_close(model.norm.bias.detach(), both[1])
    vitkit.save(model, tmp_path / "m")
