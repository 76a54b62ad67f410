"""Formats told from content, not names; files that lie about themselves and pickles that run code refused."""

from __future__ import annotations

import json
import warnings
import zipfile

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import vitkit
from convert_reference import assert_noted, assert_same_logits, load_noting, randomize_
from vitkit.checkpoint import CheckpointError
from vitkit.convert.detect import NPZ, SAFETENSORS, TORCH, sniff_file


def tiny_state():
    return randomize_(vitkit.create_model("ViT-Ti/16", image_size=32, patch_size=8, dim=64, depth=1,
                                          num_heads=1, mlp_dim=96, num_classes=3)).state_dict()


class RunsCode:
    """Unpickling this calls os.makedirs(marker): what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.makedirs, (self.marker,)


def test_sniffing_reads_content(tmp_path):
    state = tiny_state()
    save_file(state, str(tmp_path / "a"))
    torch.save(state, tmp_path / "b")
    np.savez(tmp_path / "c", x=np.zeros(3))
    torch.save(state, tmp_path / "d", _use_new_zipfile_serialization=False)
    assert [sniff_file(tmp_path / n) for n in ("a", "b", "c.npz", "d")] == [SAFETENSORS, TORCH, NPZ, TORCH]
    # the extension is irrelevant to loading when it does not lie
    assert vitkit.load(tmp_path / "a").cfg.dim == 64 and vitkit.load(tmp_path / "d").cfg.dim == 64


@pytest.mark.parametrize("name, writer, claims, holds", [
    ("w.npz", "safetensors", "npz", "safetensors"),
    ("w.safetensors", "torch", "safetensors", "torch"),
    ("w.pth", "npz", "torch", "npz"),
])
def test_a_file_that_is_not_what_its_name_claims_is_refused(tmp_path, name, writer, claims, holds):
    path = tmp_path / name
    state = tiny_state()
    if writer == "safetensors":
        save_file(state, str(path))
    elif writer == "torch":
        torch.save(state, path)
    else:
        with open(path, "wb") as f:
            np.savez(f, x=np.zeros(3))
    with pytest.raises(CheckpointError,
                       match=rf"{name}: named \.{name.split('.')[1]} \(a {claims} file\) but its "
                             rf"content is a {holds} file"):
        vitkit.load(path)


def test_a_pickle_that_would_run_code_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"patch_embed.proj.weight": torch.zeros(1), "payload": RunsCode(str(marker))},
               tmp_path / "evil.pth")
    with pytest.raises(CheckpointError,
                       match=r"evil.pth: refused: this pickle holds more than tensors and would "
                             r"run code"):
        vitkit.load(tmp_path / "evil.pth")
    assert not marker.exists()


def test_state_dict_wrappers_and_ddp_prefix(tmp_path):
    state = tiny_state()
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 7},
               tmp_path / "ckpt.pth")
    model = vitkit.load(tmp_path / "ckpt.pth")
    assert torch.equal(model.blocks[0].attn.qkv.weight, state["blocks.0.attn.qkv.weight"])
    torch.save({"epoch": 7, "weights": [1, 2]}, tmp_path / "odd.pth")
    with pytest.raises(CheckpointError, match=r"odd.pth: a dict whose entries are not all tensors"):
        vitkit.load(tmp_path / "odd.pth")


def test_unknown_files_and_state_dicts(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"notes.txt: not a vitkit checkpoint, nor a checkpoint file"):
        vitkit.load(tmp_path / "notes.txt")
    with zipfile.ZipFile(tmp_path / "x.zip", "w") as z:
        z.writestr("readme.md", "hi")
    with pytest.raises(CheckpointError,
                       match=r"x.zip: a zip file that is neither an .npz nor a PyTorch file"):
        vitkit.load(tmp_path / "x.zip")
    save_file({"conv1.weight": torch.zeros(2, 3, 7, 7), "fc.weight": torch.zeros(2, 4)},
              str(tmp_path / "r.safetensors"))
    with pytest.raises(CheckpointError,
                       match=r"not a ViT state dict vitkit recognises .* \['conv1.weight', "):
        vitkit.load(tmp_path / "r.safetensors")


def test_a_config_without_weights_and_a_sharded_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=1,
                                 intermediate_size=96, image_size=32, patch_size=8, num_labels=3)
    ref = randomize_(transformers.ViTForImageClassification(cfg)).eval()
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vitkit.load(tmp_path / "sharded")(x), ref(x).logits, rtol=0, atol=1e-5)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(CheckpointError,
                       match=r"config.json: not a vitkit checkpoint config but a Hugging Face one, "
                             r"and .*empty holds no weights"):
        vitkit.load(tmp_path / "empty")


def test_a_refused_pickle_names_the_global_in_one_plain_line(tmp_path):
    """torch's message has ANSI bold codes and advice over many lines; ours names what the pickle imports
    (a training checkpoint's argparse.Namespace, or a function that would run)."""
    import argparse

    torch.save({"patch_embed.proj.weight": torch.zeros(1), "payload": RunsCode(str(tmp_path / "m"))},
               tmp_path / "evil.pth")
    torch.save({"model": {"patch_embed.proj.weight": torch.zeros(1)}, "args": argparse.Namespace(lr=0.1)},
               tmp_path / "train.pth")
    for name, refused in (("evil.pth", "os.makedirs"), ("train.pth", "argparse.Namespace")):
        with pytest.raises(CheckpointError) as err:
            vitkit.load(tmp_path / name)
        message = str(err.value)
        assert f"it imports {refused}, which torch.load(weights_only=True) does not allow" in message, message
        assert "\x1b" not in message and "\n" not in message, repr(message)


def test_sharded_pytorch_model_bin_folder(tmp_path):
    """pytorch_model.bin.index.json and pytorch_model-0000i-of-0000N.bin shards (transformers' layout with
    safe_serialization=False), each shard read through torch.load(weights_only=True)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=1,
                                 intermediate_size=96, image_size=32, patch_size=8, num_labels=3)
    ref = randomize_(transformers.ViTForImageClassification(cfg)).eval()
    folder = tmp_path / "sharded"
    ref.save_pretrained(folder, max_shard_size="50KB")  # transformers 5 writes safetensors shards only:
    index = json.loads((folder / "model.safetensors.index.json").read_text())  # made into .bin shards here
    shards = sorted(set(index["weight_map"].values()))
    renamed = {s: s.replace("model-", "pytorch_model-").replace(".safetensors", ".bin") for s in shards}
    for s in shards:
        torch.save(load_file(str(folder / s)), folder / renamed[s])
        (folder / s).unlink()
    (folder / "model.safetensors.index.json").unlink()
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert len(shards) > 1
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vitkit.load(folder)(x), ref(x).logits, rtol=0, atol=1e-5)
    # a shard that would run code is refused like a single .bin file
    torch.save({"payload": RunsCode(str(tmp_path / "code-ran"))}, folder / renamed[shards[0]])
    with pytest.raises(CheckpointError, match=r"pytorch_model-00001-of-.*\.bin: refused: this pickle"):
        vitkit.load(folder)
    assert not (tmp_path / "code-ran").exists()
    # an index that points outside its folder is refused
    index["weight_map"]["classifier.bias"] = "../elsewhere.bin"
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError,
                       match=r"shards must be files next to the index, not \['../elsewhere.bin'\]"):
        vitkit.load(folder)


# --- what a bare state dict leaves open: assumed with a warning that names the argument, never silently -----
def vitkit_model(**kw):
    args = dict(image_size=32, patch_size=8, dim=64, depth=2, num_heads=4, mlp_dim=128, num_classes=10)
    args.update(kw)
    return randomize_(vitkit.create_model(vitkit.ViTConfig(**args))).eval()





def test_a_bare_file_says_it_assumed_the_heads(tmp_path):
    """4 heads of 16 in a 64-wide model: q;k;v are fused, so the file cannot tell; vitkit assumes one head of
    64 (the 64-wide convention) and says so, naming num_heads=, which gives the source model."""
    ref = vitkit_model()
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    model, notes = load_noting(tmp_path / "w.pth")
    assert model.cfg.num_heads == 1
    assert_noted(notes,
                 r"w\.pth holds no config that gives its number of heads: assumed 1 head of 64 \(the 64-wide "
                 r"convention\); pass num_heads= if the model has another count")
    model, notes = load_noting(tmp_path / "w.pth", num_heads=4)
    assert model.cfg.num_heads == 4 and not [n for n in notes if "gives its number of heads" in n], notes
    assert_same_logits(model, ref, (32, 32))


def test_a_bare_file_says_it_assumed_token_pooling(tmp_path):
    """GAP with the class token kept: the tensors are those of a token-pooling model; pool= tells them
    apart."""
    ref = vitkit_model(num_heads=1, pool="gap", class_token=True)
    save_file(ref.state_dict(), str(tmp_path / "gap.safetensors"))
    model, notes = load_noting(tmp_path / "gap.safetensors")
    assert model.cfg.pool == "token"
    assert_noted(notes,
                 r"gap\.safetensors holds no config that gives its pooling: assumed pool='token' .*pass "
                 r"pool='gap'")
    model, notes = load_noting(tmp_path / "gap.safetensors", pool="gap")
    assert model.cfg.pool == "gap" and not [n for n in notes if "gives its pooling" in n], notes
    assert_same_logits(model, ref, (32, 32))
    with pytest.raises(ValueError, match=r"pool='mean': choose from token, gap"):
        vitkit.load(tmp_path / "gap.safetensors", pool="mean")


def test_a_bare_file_says_it_assumed_a_square_grid(tmp_path):
    """A 4x16 grid (32x128 images) has the 64 position rows of an 8x8 one: assumed square, said, and
    image_size= gives the source model."""
    ref = vitkit_model(image_size=(32, 128), num_heads=1)
    save_file(ref.state_dict(), str(tmp_path / "wide.safetensors"))
    model, notes = load_noting(tmp_path / "wide.safetensors")
    assert model.cfg.image_size == (64, 64)
    assert_noted(notes,
                 r"wide\.safetensors holds no config that gives its image size: assumed a square 8x8 grid of "
                 r"8-pixel patches \(64x64 images\) .*pass image_size=\(H, W\)")
    model, notes = load_noting(tmp_path / "wide.safetensors", image_size=(32, 128))
    assert model.cfg.image_size == (32, 128) and not [n for n in notes if "gives its image size" in n], notes
    assert_same_logits(model, ref, (32, 128))


def test_nothing_is_said_when_nothing_is_assumed(tmp_path):
    """A vitkit folder holds its config, and arguments given for a bare file are not assumptions: no
    warning."""
    ref = vitkit_model(image_size=(32, 128), pool="gap", class_token=True)
    vitkit.save(ref, tmp_path / "folder")
    save_file(ref.state_dict(), str(tmp_path / "bare.safetensors"))
    for path, kw in ((tmp_path / "folder", {}), (tmp_path / "folder" / "model.safetensors", {}),
                     (tmp_path / "bare.safetensors", dict(num_heads=4, pool="gap", image_size=(32, 128)))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model = vitkit.load(path, **kw)
        assert model.cfg.num_heads == 4 and model.cfg.pool == "gap", path
        assert_same_logits(model, ref, (32, 128))


def test_a_shard_index_that_disagrees_with_its_shards_is_an_error(tmp_path):
    """A tensor the index names but no shard holds would be missing; one two shards hold is ambiguous (the
    later shard's copy would silently win): both named, with the index."""
    from safetensors.torch import load_file

    state = tiny_state()
    names = sorted(state)
    folder = tmp_path / "sharded"
    folder.mkdir()
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(folder / shard))
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = vitkit.load(folder, num_heads=1, image_size=32)
    assert all(torch.equal(model.state_dict()[k], state[k]) for k in names)
    first = folder / "model-00001-of-00002.safetensors"
    save_file({**load_file(str(first)), names[-1]: torch.zeros_like(state[names[-1]])}, str(first))
    with pytest.raises(CheckpointError,
                       match=rf"model\.safetensors\.index\.json: tensors more than one shard holds: "
                             rf"{names[-1]} \(in model-00001-of-00002\.safetensors, "
                             rf"model-00002-of-00002\.safetensors\)$"):
        vitkit.load(folder, num_heads=1, image_size=32)
    save_file({k: state[k] for k in halves[first.name][1:]}, str(first))
    with pytest.raises(CheckpointError,
                       match=rf"model\.safetensors\.index\.json: tensors it names that no shard holds "
                             rf"\['{names[0]}'\]"):
        vitkit.load(folder, num_heads=1, image_size=32)
