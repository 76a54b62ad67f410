"""Fine-tuning a pre-trained checkpoint of any format at a higher, non-square resolution (Sec. 3.2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitkit
from convert_reference import randomize_, timm_to_npz_arrays
from vitkit.convert import write
from vitkit.posemb import resample_pos_embed
from vitkit.transfer import prepare_finetune


def pretrained(tmp_path, fmt: str) -> str:
    """A small 'pre-trained' model (32 px, 10 classes, with the pre-logits layer but as timm, which has none),
    saved as `fmt`."""
    model = randomize_(vitkit.create_model("ViT-S/16", image_size=32, patch_size=8, dim=64, depth=2,
                                           num_heads=2, mlp_dim=128, num_classes=10,
                                           representation_size=None if fmt == "timm" else 64)).eval()
    if fmt == "npz":
        timm = pytest.importorskip("timm")
        ref = randomize_(timm.models.vision_transformer.VisionTransformer(
            img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10)).eval()
        path = tmp_path / "ViT-S_8.npz"
        np.savez(path, **timm_to_npz_arrays(ref, pre_logits=model.pre_logits))
        return str(path)
    return str(write(model, tmp_path / fmt, to=fmt))


def sgd_steps(model, x, y, steps: int) -> list[float]:
    """The paper's fine-tuning optimiser: SGD with momentum 0.9, gradient clipping at global norm 1."""
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fmt", ["vitkit", "timm", "npz"])
def test_finetune_at_a_larger_non_square_size(tmp_path, fmt):
    path = pretrained(tmp_path, fmt)
    source = vitkit.load(path)
    model = prepare_finetune(path, num_classes=4, image_size=(48, 64))
    cfg = model.cfg
    assert ((cfg.image_size, cfg.grid_size, cfg.num_classes, cfg.representation_size)
            == ((48, 64), (6, 8), 4, None))
    assert cfg.gelu == source.cfg.gelu and cfg.mean == source.cfg.mean  # the source's own maths carry over
    expected = resample_pos_embed(source.pos_embed.detach(), (4, 4), (6, 8), num_prefix_tokens=1)
    torch.testing.assert_close(model.pos_embed.detach(), expected)
    assert model.pre_logits is None and not model.head.weight.any() and not model.head.bias.any()
    x, y = torch.randn(16, 3, 48, 64), torch.arange(16) % 4
    losses = sgd_steps(model, x, y, steps=8)
    assert losses[0] == pytest.approx(np.log(4), abs=1e-5)  # a zero head: uniform predictions
    assert losses[-1] < 0.7 * losses[0], losses


def test_overrides_that_change_weight_shapes_are_refused(tmp_path):
    path = pretrained(tmp_path, "vitkit")
    with pytest.raises(ValueError, match=r"cannot change \['dim'\]"):
        prepare_finetune(path, num_classes=2, dim=128)
    model = prepare_finetune(path, num_classes=2, drop_path=0.1)
    assert model.cfg.drop_path == 0.1 and model.training
