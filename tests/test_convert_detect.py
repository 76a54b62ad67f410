"""Formats told from content, not names; files that lie about themselves and pickles that run code refused."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import vitkit
from convert_reference import randomize_
from vitkit.checkpoint import CheckpointError
from vitkit.convert.detect import NPZ, SAFETENSORS, TORCH, sniff_file


def tiny_state():
    return randomize_(vitkit.create_model("ViT-Ti/16", image_size=32, patch_size=8, dim=64, depth=1, num_heads=1,
                                          mlp_dim=96, num_classes=3)).state_dict()


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
    with pytest.raises(CheckpointError, match=rf"{name}: named \.{name.split('.')[1]} \(a {claims} file\) but its "
                                              rf"content is a {holds} file"):
        vitkit.load(path)


def test_a_pickle_that_would_run_code_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"patch_embed.proj.weight": torch.zeros(1), "payload": RunsCode(str(marker))}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError, match=r"evil.pth: refused: this pickle holds more than tensors and would "
                                              r"run code"):
        vitkit.load(tmp_path / "evil.pth")
    assert not marker.exists()


def test_state_dict_wrappers_and_ddp_prefix(tmp_path):
    state = tiny_state()
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 7}, tmp_path / "ckpt.pth")
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
    with pytest.raises(CheckpointError, match=r"x.zip: a zip file that is neither an .npz nor a PyTorch file"):
        vitkit.load(tmp_path / "x.zip")
    save_file({"conv1.weight": torch.zeros(2, 3, 7, 7), "fc.weight": torch.zeros(2, 4)}, str(tmp_path / "r.safetensors"))
    with pytest.raises(CheckpointError, match=r"not a ViT state dict vitkit recognises .* \['conv1.weight', "):
        vitkit.load(tmp_path / "r.safetensors")


def test_a_config_without_weights_and_a_sharded_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=1, intermediate_size=96,
                                 image_size=32, patch_size=8, num_labels=3)
    ref = randomize_(transformers.ViTForImageClassification(cfg)).eval()
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vitkit.load(tmp_path / "sharded")(x), ref(x).logits, rtol=0, atol=1e-5)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(CheckpointError, match=r"config.json: not a vitkit checkpoint config but a Hugging Face one, "
                                              r"and .*empty holds no weights"):
        vitkit.load(tmp_path / "empty")
