"""Hugging Face transformers folders (ViTModel, ViTForImageClassification) against transformers itself."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import vitkit
from convert_reference import assert_same, randomize_
from vitkit.checkpoint import CheckpointError
from vitkit.convert import write

transformers = pytest.importorskip("transformers")


def hf_config(**kw):
    args = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                image_size=32, patch_size=8, layer_norm_eps=1e-12)
    args.update(kw)
    return transformers.ViTConfig(**args)


def test_image_classification_folder(tmp_path):
    labels = {0: "tench", 1: "goldfish", 2: "shark"}
    ref = randomize_(transformers.ViTForImageClassification(
        hf_config(id2label=labels, label2id={v: k for k, v in labels.items()}))).eval()
    ref.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "size": {"height": 32}}))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = vitkit.load(tmp_path / "hf")
        assert_same(ours(x), ref(x).logits, "HF ViTForImageClassification vs transformers")
    assert ours.class_names == ["tench", "goldfish", "shark"]
    assert ((ours.cfg.num_heads, ours.cfg.ln_eps, ours.cfg.interpolation, ours.cfg.crop_pct)
            == (4, 1e-12, "bilinear", 1.0))


def test_vit_model_with_pooler_tanh_gelu_and_bin_weights(tmp_path):
    """ViTModel: the pooler is the pre-logits layer, the output is pooler_output; pytorch_model.bin weights;
    a non-square image given in config.json."""
    ref = randomize_(transformers.ViTModel(hf_config(hidden_act="gelu_pytorch_tanh",
                                                     image_size=[32, 48]))).eval()
    ref.save_pretrained(tmp_path / "hf")
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save(weights, tmp_path / "hf" / "pytorch_model.bin")
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        out = ref(x)
        ours = vitkit.load(tmp_path / "hf")
        assert (ours.cfg.gelu, ours.cfg.num_classes, ours.cfg.representation_size) == ("tanh", 0, 64)
        assert_same(ours(x), out.pooler_output, "HF ViTModel pooler_output vs transformers")
        assert_same(ours.forward_features(x), out.last_hidden_state, "HF ViTModel last_hidden_state")


def test_in_memory_names_of_transformers_5(tmp_path):
    """transformers 5 names modules `layers.{i}.attention.q_proj`...; a state dict saved from memory loads."""
    ref = randomize_(transformers.ViTForImageClassification(hf_config(num_labels=5))).eval()
    torch.save(ref.state_dict(), tmp_path / "sd.pth")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        # No config.json: HF's default eps 1e-12; heads from the caller (64 / 4 are not the 64-wide
        # convention).
        ours = vitkit.load(tmp_path / "sd.pth", num_heads=4)
        assert ours.cfg.ln_eps == 1e-12
        assert_same(ours(x), ref(x).logits, "HF state dict without config vs transformers")


def test_write_hf_round_trip_and_transformers_reads_it(tmp_path):
    ours = randomize_(vitkit.create_model("ViT-S/16", image_size=32, patch_size=8, dim=64, depth=2,
                                          num_heads=4, mlp_dim=96, num_classes=3)).eval()
    with pytest.warns(UserWarning, match="no centre crop"):  # a square input: the same pixels here
        folder = write(ours, tmp_path / "out", to="hf", class_names=["a", "b", "c"])
    back = vitkit.load(folder)
    assert back.cfg == ours.cfg and back.class_names == ["a", "b", "c"]
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    ref = transformers.ViTForImageClassification.from_pretrained(folder).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_same(ours(x), ref(x).logits, "vitkit written as HF, read by transformers")
    assert ref.config.id2label[2] == "c"


def test_write_hf_warns_of_what_transformers_will_do_differently(tmp_path):
    """A headless model without pre-logits gives ViTModel a pooler without weights (transformers makes it up);
    a centre-cropping model gets ViTImageProcessor's squash. Both are said; a squash model with pre-logits is
    written without a word, and its pooler is the pre-logits."""
    kwargs = dict(image_size=32, patch_size=8, dim=64, depth=1, num_heads=4, mlp_dim=96, num_classes=0)
    headless = randomize_(vitkit.create_model("ViT-S/16", **kwargs)).eval()
    with pytest.warns(UserWarning) as notes:
        folder = write(headless, tmp_path / "headless", to="hf")
    said = " ".join(str(n.message) for n in notes)
    assert "no pre-logits layer, so ViTModel's pooler gets no weights" in said and "no centre crop" in said
    ref = transformers.ViTModel.from_pretrained(folder, add_pooling_layer=False).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_same(headless.forward_head(headless.forward_features(x)), ref(x).last_hidden_state[:, 0],
                    "the class token's representation")
    pooled = randomize_(vitkit.create_model("ViT-S/16", representation_size=64, crop_mode="squash", **kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        folder = write(pooled.eval(), tmp_path / "pooled", to="hf")
    with torch.no_grad():
        assert_same(pooled(x), transformers.ViTModel.from_pretrained(folder).eval()(x).pooler_output,
                    "pooler")


def test_write_hf_refuses_what_transformers_cannot_hold(tmp_path):
    gap = vitkit.create_model("ViT-S/16", image_size=32, patch_size=8, dim=64, depth=1, num_heads=4,
                              mlp_dim=96, pool="gap")
    with pytest.raises(ValueError, match="classifies from the class token"):
        write(gap, tmp_path / "x", to="hf")


def test_a_non_vit_config_is_refused(tmp_path):
    ref = transformers.ViTModel(hf_config())
    ref.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["model_type"] = "swin"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="a Hugging Face 'swin' model, not a plain ViT"):
        vitkit.load(tmp_path / "hf")


def test_preprocessing_is_vit_image_processors_squash(tmp_path):
    """ViTImageProcessor resizes straight to the model's size (no aspect kept, no crop): crop_mode="squash",
    and vitkit's eval transform then gives its inputs on a non-square image."""
    import numpy as np
    from PIL import Image

    from vitkit.data.transforms import build_eval_transform

    ref = transformers.ViTForImageClassification(hf_config(num_labels=3))
    ref.save_pretrained(tmp_path / "hf")
    processor = transformers.ViTImageProcessor(size={"height": 32, "width": 32}, resample=2,
                                               image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor.save_pretrained(tmp_path / "hf")
    cfg = vitkit.load(tmp_path / "hf").cfg
    assert (cfg.crop_mode, cfg.crop_pct, cfg.interpolation) == ("squash", 1.0, "bilinear")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 90, 3), dtype=np.uint8))
    theirs = transformers.ViTImageProcessor.from_pretrained(tmp_path / "hf")(image, return_tensors="pt")
    ours = build_eval_transform(cfg)(image)
    torch.testing.assert_close(ours, theirs["pixel_values"][0], rtol=0, atol=1e-5)
    # A folder vitkit wrote before crop_mode existed: its model centre-cropped, as its vitkit_config says.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["vitkit_config"] = {"crop_pct": 0.9}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert ((vitkit.load(tmp_path / "hf").cfg.crop_mode, vitkit.load(tmp_path / "hf").cfg.crop_pct)
            == ("center", 0.9))


def test_transformers_fields_win_over_a_stale_vitkit_config(tmp_path):
    """transformers keeps vitkit_config when it re-saves a config someone changed: what transformers computes
    with (hidden_act, layer_norm_eps, the preprocessor's mean and std) wins; vitkit_config keeps the crop."""
    ours = randomize_(vitkit.create_model("ViT-S/16", image_size=32, patch_size=8, dim=64, depth=1,
                                          num_heads=4,
                                          mlp_dim=96, num_classes=3, gelu="tanh", crop_pct=0.9)).eval()
    with pytest.warns(UserWarning, match="no centre crop"):
        folder = write(ours, tmp_path / "out", to="hf")
    ref = transformers.ViTForImageClassification.from_pretrained(folder)
    ref.config.hidden_act, ref.config.layer_norm_eps = "gelu", 1e-3  # a changed model, re-saved
    ref = transformers.ViTForImageClassification(ref.config).eval()
    ref.load_state_dict(transformers.ViTForImageClassification.from_pretrained(folder).state_dict())
    ref.save_pretrained(tmp_path / "changed")
    assert "vitkit_config" in json.loads((tmp_path / "changed" / "config.json").read_text())
    processor = transformers.ViTImageProcessor(size={"height": 32, "width": 32}, resample=3,
                                               image_mean=[0.1, 0.2, 0.3], image_std=[0.4, 0.5, 0.6])
    processor.save_pretrained(tmp_path / "changed")
    back = vitkit.load(tmp_path / "changed")
    assert (back.cfg.gelu, back.cfg.ln_eps, back.cfg.mean, back.cfg.std) == ("exact", 1e-3, (0.1, 0.2, 0.3),
                                                                              (0.4, 0.5, 0.6))
    assert (back.cfg.crop_mode, back.cfg.crop_pct) == ("center", 0.9)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_same(back(x), ref(x).logits, "re-saved HF folder with a stale vitkit_config vs transformers")


def test_a_pooler_narrower_than_the_model_round_trips(tmp_path):
    """ViTModel's pooler_output_size may differ from hidden_size: read as the pre-logits width, and written
    back as pooler_output_size, so that transformers and vitkit read the same function."""
    ref = randomize_(transformers.ViTModel(hf_config(pooler_output_size=40))).eval()
    ref.save_pretrained(tmp_path / "hf")
    ours = vitkit.load(tmp_path / "hf")
    assert ours.cfg.representation_size == 40
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing for transformers to do differently
        folder = write(ours, tmp_path / "out", to="hf")
    assert json.loads((folder / "config.json").read_text())["pooler_output_size"] == 40
    back = transformers.ViTModel.from_pretrained(folder).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_same(back(x).pooler_output, ref(x).pooler_output, "vitkit written as HF with a 40-wide pooler")
        assert_same(vitkit.load(folder)(x), ref(x).pooler_output, "HF -> vitkit -> HF -> vitkit")
