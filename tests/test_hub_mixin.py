"""The Hub's conventions on VisionTransformer, through huggingface_hub's ModelHubMixin: save_pretrained writes
vitkit's folder and a model card, from_pretrained and vitkit.load read it, timm loads its weights, and
push_to_hub hands that folder to huggingface_hub's upload."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from huggingface_hub import HfApi, ModelHubMixin

import vitkit
from vitkit import ViTConfig
from vitkit.model import VisionTransformer

CFG = ViTConfig(image_size=32, patch_size=8, dim=32, depth=2, num_heads=2, mlp_dim=64, num_classes=3,
                name="tiny-test")
RECORD = {"step": 120, "seconds": 12.5, "split": "holdout", "top1": 0.875, "loss": 0.4,
          "test": {"split": "test", "top1": 0.8625, "count": 800}}


def trained_model(tmp_path) -> VisionTransformer:
    """A model as `vitkit.load` gives it from a training run's last/ folder: class names and record."""
    torch.manual_seed(0)
    model = VisionTransformer(CFG)
    torch.nn.init.normal_(model.head.weight, std=0.1)
    vitkit.save(model, tmp_path / "last", class_names=["cat", "dog", "fox"], extra={"train": RECORD})
    return vitkit.load(tmp_path / "last")


def test_save_pretrained_writes_a_folder_vitkit_timm_and_from_pretrained_read(tmp_path):
    model = trained_model(tmp_path)
    assert isinstance(model, ModelHubMixin)
    model.save_pretrained(tmp_path / "hub")
    assert sorted(p.name for p in (tmp_path / "hub").iterdir()) == ["README.md", "config.json",
                                                                    "model.safetensors"]
    meta = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert meta["format"] == "vitkit" and meta["class_names"] == ["cat", "dog", "fox"]
    assert meta["train"] == RECORD
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
        again = VisionTransformer.from_pretrained(tmp_path / "hub")
        assert not again.training and again.class_names == ["cat", "dog", "fox"]
        torch.testing.assert_close(again(x), want, rtol=0, atol=0)
        torch.testing.assert_close(vitkit.load(tmp_path / "hub")(x), want, rtol=0, atol=0)
        weights = str(tmp_path / "hub" / "model.safetensors")
        theirs = timm.create_model("vit_tiny_patch16_224", pretrained=True, img_size=32, patch_size=8,
                                   embed_dim=32, depth=2, num_heads=2, mlp_ratio=2, num_classes=3,
                                   pretrained_cfg_overlay={"file": weights, "num_classes": 3})
        torch.testing.assert_close(theirs.eval()(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="from_pretrained takes no model arguments \\(num_classes\\)"):
        VisionTransformer.from_pretrained(tmp_path / "hub", num_classes=5)
    with pytest.raises(ValueError, match="save_pretrained the model you passed to vitkit.optimize"):
        vitkit.optimize(model).save_pretrained(tmp_path / "optimized")


def test_the_model_card_says_what_the_model_is_how_to_feed_it_and_how_it_was_trained(tmp_path):
    trained_model(tmp_path).save_pretrained(tmp_path / "hub")
    card = (tmp_path / "hub" / "README.md").read_text()
    header = card.split("---")[1]
    assert "library_name: vitkit" in header and "pipeline_tag: image-classification" in header
    for text in ("# tiny-test", "| depth | 2 |", "| patch_size | 8 |", "| mean | [0.5, 0.5, 0.5] |",
                 "cat, dog, fox", "| top1 on the holdout split | 0.875 |",
                 "| test top1 (800 images) | 0.8625 |",
                 "VisionTransformer.from_pretrained"):
        assert text in card, text
    # a model built in Python has no record: no training section
    VisionTransformer(CFG).save_pretrained(tmp_path / "fresh")
    assert "## Training" not in (tmp_path / "fresh" / "README.md").read_text()


def test_push_to_hub_uploads_the_saved_folder_through_huggingface_hub(tmp_path, monkeypatch):
    """The upload is huggingface_hub's: its create_repo and upload_folder get the repository and a folder
    holding what save_pretrained writes (recorded here instead of sent)."""
    sent = {}

    class Repo:
        repo_id = "someone/tiny-vit"

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: Repo())

    def upload_folder(self, repo_id, folder_path, **kw):
        sent["repo"] = repo_id
        sent["files"] = {p.name: p.read_bytes() for p in __import__("pathlib").Path(folder_path).iterdir()}
        return "https://huggingface.co/someone/tiny-vit"

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    trained_model(tmp_path).push_to_hub("someone/tiny-vit", token="not-a-token")
    assert sent["repo"] == "someone/tiny-vit"
    assert sorted(sent["files"]) == ["README.md", "config.json", "model.safetensors"]
    assert json.loads(sent["files"]["config.json"])["format"] == "vitkit"


def test_from_pretrained_of_a_repository_goes_through_the_hub_cache(tmp_path, monkeypatch):
    """A repository id is fetched by huggingface_hub's snapshot_download (here answered from a local copy,
    as the hub cannot be reached from the tests) and loaded from the folder it returns."""
    trained_model(tmp_path).save_pretrained(tmp_path / "snapshot")
    asked = {}

    def snapshot_download(repo_id, **kw):
        asked.update(kw, repo_id=repo_id)
        return str(tmp_path / "snapshot")

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    monkeypatch.setattr("huggingface_hub.hub_mixin.hf_hub_download",
                        lambda **kw: str(tmp_path / "snapshot" / "config.json"))
    model = VisionTransformer.from_pretrained("someone/tiny-vit", revision="v1")
    assert asked["repo_id"] == "someone/tiny-vit" and asked["revision"] == "v1"
    assert model.class_names == ["cat", "dog", "fox"]
