"""torchvision's VisionTransformer state dicts against torchvision itself."""

from __future__ import annotations

import pytest
import torch

import vitkit
from convert_reference import assert_same, load_noting, randomize_
from vitkit.checkpoint import CheckpointError
from vitkit.convert.common import IMAGENET_MEAN, IMAGENET_STD

tv = pytest.importorskip("torchvision.models.vision_transformer")


def tiny_tv(**kw):
    args = dict(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=128, mlp_dim=96,
                num_classes=1000)
    args.update(kw)
    return randomize_(tv.VisionTransformer(**args)).eval()


def test_state_dict_equals_torchvision(tmp_path):
    ref = tiny_tv()
    torch.save(ref.state_dict(), tmp_path / "vit_tiny-0123abcd.pth")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = vitkit.load(tmp_path / "vit_tiny-0123abcd.pth")
        assert_same(ours(x), ref(x), "torchvision state dict vs torchvision")
    cfg = ours.cfg
    assert ((cfg.mean, cfg.std, cfg.interpolation, cfg.crop_pct)
            == (IMAGENET_MEAN, IMAGENET_STD, "bilinear", 0.875))
    assert ours.class_names[:2] == ["tench", "goldfish"] and len(ours.class_names) == 1000


def test_pre_logits_and_the_vit_name_gives_heads(tmp_path):
    """torchvision's representation layer is vitkit's pre_logits; a `vit_b_*` name gives ViT-B's 12 heads
    (said, as this model is not ViT-B's width)."""
    ref = tiny_tv(hidden_dim=96, num_heads=12, representation_size=48, num_classes=7)
    torch.save(ref.state_dict(), tmp_path / "vit_b_16-c867db91.pth")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"assumed 12 heads, as ViT-B/16 \(which the name "
                                                          r"vit_b_16 names\) has, though its width is 96, "
                                                          r"not 768"):
        ours = vitkit.load(tmp_path / "vit_b_16-c867db91.pth")
        assert (ours.cfg.num_heads, ours.cfg.representation_size) == (12, 48)
        assert_same(ours(x), ref(x), "torchvision with pre_logits vs torchvision")


def test_training_checkpoint_wrapper(tmp_path):
    """torchvision's reference scripts save {"model": state_dict, "optimizer": ..., "epoch": ...}."""
    ref = tiny_tv(num_classes=4)
    torch.save({"model": ref.state_dict(), "epoch": 3, "args": None}, tmp_path / "checkpoint.pth")
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert_same(vitkit.load(tmp_path / "checkpoint.pth")(x), ref(x), "torchvision training checkpoint")



def test_a_torchvision_file_says_which_heads_it_assumed_and_nothing_else(tmp_path):
    """torchvision's ViT is square and pools by its class token, so only the heads of its fused q;k;v are
    assumed: 4 heads of 16 in a 64-wide model load as one head of 64, said; num_heads=4 gives the model."""
    ref = tiny_tv(hidden_dim=64, num_heads=4, num_layers=1, num_classes=5)
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    model, notes = load_noting(tmp_path / "w.pth")
    assert model.cfg.num_heads == 1
    assert len(notes) == 1 and notes[0].startswith(
        f"{tmp_path / 'w.pth'} holds no config that gives its number of heads: assumed 1 head of 64 (the "
        "64-wide convention); pass num_heads= if the model has another count; on the command line, `vitkit "
        "convert")
    model, notes = load_noting(tmp_path / "w.pth", num_heads=4)
    assert model.cfg.num_heads == 4 and notes == []
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=1e-5)


def test_swag_weights_get_swags_preprocessing(tmp_path):
    """torchvision's SWAG weights (384, 512, 518 px) are evaluated with a bicubic resize to the full size and
    no crop, not the 224 recipe's resize to 256 and crop; vitkit's transform then equals torchvision's."""
    import numpy as np
    from PIL import Image
    from torchvision.models import ViT_B_16_Weights

    from vitkit.data.transforms import build_eval_transform

    ref = tiny_tv(image_size=384, patch_size=32, num_layers=1, hidden_dim=64, mlp_dim=32, num_classes=3)
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    model, _ = load_noting(tmp_path / "w.pth", num_heads=2)
    assert (model.cfg.image_size, model.cfg.interpolation, model.cfg.crop_pct) == ((384, 384), "bicubic", 1.0)
    swag = ViT_B_16_Weights.IMAGENET1K_SWAG_E2E_V1.transforms()
    assert (swag.crop_size, swag.resize_size, swag.interpolation.value) == ([384], [384], "bicubic")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (400, 500, 3), dtype=np.uint8))
    ours = build_eval_transform(model.cfg)(image)
    theirs = swag(image)
    # one uint8 level apart at most (rounding), in normalised units; the 224 recipe's crop differs everywhere
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1.01 / 255 / min(IMAGENET_STD))


def test_heads_a_name_gives_that_do_not_divide_the_width_are_an_error_that_says_so(tmp_path):
    ref = tiny_tv(hidden_dim=64, num_heads=4, num_layers=1, num_classes=5)
    torch.save(ref.state_dict(), tmp_path / "vit_b_16-c867db91.pth")
    with pytest.raises(CheckpointError,
                       match=r"vit_b_16-c867db91\.pth: its width 64 is not divisible by 12, the "
                             r"heads of ViT-B/16, which its name \(vit_b_16\) names; pass num_heads="):
        vitkit.load(tmp_path / "vit_b_16-c867db91.pth")
    model, _ = load_noting(tmp_path / "vit_b_16-c867db91.pth", num_heads=4)
    with torch.no_grad():
        x = torch.randn(2, 3, 32, 32)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=1e-5)
