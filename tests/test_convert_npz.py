"""Google .npz files (vision_transformer and big_vision naming), written by the test in the documented layout,
loaded by vitkit and by timm's own .npz loader: the logits must agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitkit
from convert_reference import (
    assert_noted,
    assert_same,
    assert_same_logits,
    load_noting,
    randomize_,
    timm_to_npz_arrays,
)
from vitkit.checkpoint import CheckpointError
from vitkit.posemb import sincos_2d

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer as TimmViT  # noqa: E402
from timm.models.vision_transformer import _load_weights  # noqa: E402

SIZE = 32


def tiny_timm(seed: int = 1, **kw) -> TimmViT:
    """timm's ViT with Flax's tanh GELU, as Google's models compute."""
    args = dict(img_size=SIZE, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10,
                act_layer="gelu_tanh")
    args.update(kw)
    return randomize_(TimmViT(**args), seed).eval()


def save_npz(path, arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


def through_timm(path: str, seed: int = 7, **kw) -> TimmViT:
    """A differently initialised timm model, filled by timm's own .npz loader."""
    model = tiny_timm(seed, **kw)
    _load_weights(model, path)
    return model.eval()


def test_vision_transformer_layout(tmp_path):
    ref = tiny_timm()
    path = save_npz(tmp_path / "ViT-B_16.npz", timm_to_npz_arrays(ref))
    check = through_timm(path)
    x = torch.randn(2, 3, SIZE, SIZE)
    with torch.no_grad():
        torch.testing.assert_close(check(x), ref(x))  # the written file is what timm's loader expects
        ours = vitkit.load(path)
        assert_same(ours(x), check(x), "npz vision_transformer vs timm _load_weights")
    cfg = ours.cfg
    assert ((cfg.num_heads, cfg.gelu, cfg.ln_eps, cfg.mean, cfg.image_size)
            == (4, "tanh", 1e-6, (0.5,) * 3, (32, 32)))
    assert ours.class_names is None  # 10 classes: no names to give


def test_pre_logits_and_21k_head(tmp_path):
    """ImageNet-21k files carry the pre-training head: pre_logits (tanh) then the classifier."""
    ref = tiny_timm(num_classes=0)
    g = torch.Generator().manual_seed(3)
    pre = torch.nn.Linear(64, 48)
    head = torch.nn.Linear(48, 21843)
    with torch.no_grad():
        for p in (*pre.parameters(), *head.parameters()):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    arrays = timm_to_npz_arrays(ref, pre_logits=pre)
    arrays["head/kernel"] = head.weight.detach().numpy().T.copy()
    arrays["head/bias"] = head.bias.detach().numpy().copy()
    path = save_npz(tmp_path / "imagenet21k_ViT-B_16.npz", arrays)
    check = through_timm(path, num_classes=0)  # timm drops the representation layer: apply it by hand
    x = torch.randn(2, 3, SIZE, SIZE)
    with torch.no_grad():
        expected = head(torch.tanh(pre(check.forward_features(x)[:, 0])))
        ours = vitkit.load(path)
        assert (ours.cfg.representation_size, ours.cfg.num_classes) == (48, 21843)
        assert_same(ours(x), expected, "npz with pre_logits vs timm features + pre_logits + head")


@pytest.mark.parametrize("scan", [False, True])
def test_big_vision_layout(tmp_path, scan):
    """big_vision: params/ prefix, _0/_0/_1/_0 numbering, position table without the class row, scan
    files stacked on a depth axis; checked against the vision_transformer-layout equivalent through timm."""
    ref = tiny_timm()
    with torch.no_grad():
        ref.pos_embed[:, 0] = 0  # big_vision's class token has no position
    bv = save_npz(tmp_path / "bv.npz", timm_to_npz_arrays(ref, big_vision=True, scan=scan))
    assert ("params/Transformer/encoderblock/LayerNorm_0/scale" in np.load(bv)) == scan
    equivalent = save_npz(tmp_path / "vt.npz", timm_to_npz_arrays(ref))
    check = through_timm(equivalent)
    x = torch.randn(2, 3, SIZE, SIZE)
    with torch.no_grad():
        ours = vitkit.load(bv)
        assert_same(ours(x), check(x), f"npz big_vision{' scan' if scan else ''} vs timm (equivalent layout)")
    assert ours.cfg.num_heads == 4


def test_big_vision_gap_model(tmp_path):
    """No class token, GAP over the normalised tokens: timm's loader reads this big_vision file directly."""
    kw = dict(class_token=False, global_pool="avg", fc_norm=False)
    ref = tiny_timm(**kw)
    path = save_npz(tmp_path / "gap.npz", timm_to_npz_arrays(ref, big_vision=True))
    check = through_timm(path, **kw)
    x = torch.randn(2, 3, SIZE, SIZE)
    with torch.no_grad():
        ours = vitkit.load(path)
        assert (ours.cfg.pool, ours.cfg.class_token) == ("gap", False)
        assert_same(ours(x), check(x), "npz big_vision GAP vs timm _load_weights")


def test_big_vision_sincos_has_no_table(tmp_path):
    """No table to count the grid from: 224 px is assumed, and said, naming image_size=, which gives the
    model."""
    ref = tiny_timm(class_token=False, global_pool="avg", fc_norm=False)
    with torch.no_grad():
        # the fixed table at the trained size
        ref.pos_embed.copy_(sincos_2d((SIZE // 8, SIZE // 8), 64)[None])
    arrays = timm_to_npz_arrays(ref, big_vision=True)
    del arrays["params/pos_embedding"]
    path = save_npz(tmp_path / "sincos.npz", arrays)
    model, notes = load_noting(path)
    assert (model.cfg.pos_embed, model.cfg.image_size) == ("sincos-2d", (224, 224))
    assert_noted(notes,
                 r"sincos\.npz holds no config that gives its image size: assumed 224x224 images \(a 28x28 "
                 r"grid of 8-pixel patches\) for its fixed sincos-2d position embedding.*pass image_size=")
    model, notes = load_noting(path, image_size=SIZE)
    assert not [n for n in notes if "image size" in n], notes
    assert_same_logits(model, ref, (SIZE, SIZE))


def narrow_timm_hybrid(layers, seed: int):
    """timm's hybrid ViT around its own BiT ResNetV2 (non-pre-activation, 'SAME' StdConv eps 1e-8), as
    `_resnetv2` builds it for vit_base_r50_s16_* / vit_small_r26_s32_*, at width 32 to keep the test fast."""
    from functools import partial

    from timm.layers import HybridEmbed, StdConv2dSame
    from timm.models.resnetv2 import ResNetV2

    backbone = ResNetV2(layers=layers, channels=tuple(128 * 2**i for i in range(len(layers))), stem_chs=32,
                        num_classes=0, global_pool="", preact=False, stem_type="same",
                        conv_layer=partial(StdConv2dSame, eps=1e-8))
    model = TimmViT(img_size=32, patch_size=1, embed_dim=64, depth=1, num_heads=2, num_classes=5,
                    act_layer="gelu_tanh", embed_layer=partial(HybridEmbed, backbone=backbone))
    return randomize_(model, seed).eval()


@pytest.mark.parametrize("layers", [(3, 4, 9), (2, 2, 2, 2)], ids=["R50", "R26"])
def test_hybrid_npz(tmp_path, layers):
    """Google's hybrid layout (conv_root, gn_root, block{s}/unit{u}/..., conv_proj/gn_proj), as in the
    released R50+ViT-B_16.npz, through timm's hybrid loader."""
    ref = narrow_timm_hybrid(layers, seed=1)
    path = save_npz(tmp_path / "R50+ViT-B_16.npz", timm_to_npz_arrays(ref))
    check = narrow_timm_hybrid(layers, seed=5)
    _load_weights(check, path)
    x = torch.randn(2, 3, 32, 32)  # a 2x2 grid for R50 (stride 16), 1x1 for R26 (stride 32)
    with torch.no_grad():
        torch.testing.assert_close(check(x), ref(x))
        ours = vitkit.load(path)
        assert (ours.cfg.hybrid_layers, ours.cfg.hybrid_width, ours.cfg.num_heads) == (layers, 32, 2)
        # The ResNet computes as the Flax code that trained such files: timm's model with its constants put
        # to the paper code's (w - mean) / (std + 1e-5) and GroupNorm eps 1e-6 ...
        assert ours.cfg.hybrid_norm == "flax"
        assert_same(ours(x), with_flax_constants(check)(x),
                    f"npz hybrid {layers} vs timm with Flax's constants")
        # ... and with timm's constants as timm's own loader: the two differ by ~1e-3 relative.
        as_timm = vitkit.create_model(ours.cfg.replace(hybrid_norm="timm")).eval()
        as_timm.load_state_dict(ours.state_dict())
        assert_same(as_timm(x), check(x), f"npz hybrid {layers} vs timm _load_weights")
        assert (ours(x) - check(x)).abs().max() > 1e-6


def with_flax_constants(model):
    """A copy of a timm hybrid whose StdConv2dSame layers standardise as vit_jax/models_resnet.py does,
    (w - mean) / (std + 1e-5), and whose GroupNorms take Flax's eps of 1e-6."""
    import copy

    import torch.nn.functional as F
    from timm.layers import StdConv2dSame
    from timm.layers.padding import pad_same

    model = copy.deepcopy(model)

    def forward(conv, x):
        w = conv.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        std = w.var(dim=(1, 2, 3), unbiased=False, keepdim=True).sqrt()
        x = pad_same(x, conv.kernel_size, conv.stride, conv.dilation)
        return F.conv2d(x, (w - mean) / (std + 1e-5), conv.bias, conv.stride, 0, conv.dilation, conv.groups)

    for m in model.modules():
        if isinstance(m, StdConv2dSame):
            m.forward = forward.__get__(m)
        elif isinstance(m, torch.nn.GroupNorm):
            m.eps = 1e-6
    return model


# --- every key accounted for ----------------------------------------------------------------------------
def test_extra_and_missing_arrays_are_listed(tmp_path):
    arrays = timm_to_npz_arrays(tiny_timm())
    arrays["Transformer/encoderblock_0/LayerScale_0/gamma"] = np.ones(64, np.float32)
    path = save_npz(tmp_path / "extra.npz", arrays)
    with pytest.raises(CheckpointError, match=r"unexpected keys .*LayerScale_0/gamma"):
        vitkit.load(path)
    arrays = timm_to_npz_arrays(tiny_timm())
    del arrays["Transformer/encoderblock_1/MlpBlock_3/Dense_1/bias"]
    del arrays["Transformer/encoderblock_0/MultiHeadDotProductAttention_1/value/kernel"]
    path = save_npz(tmp_path / "missing.npz", arrays)
    with pytest.raises(CheckpointError, match=r"missing attention keys \['blocks.0.attn.v.weight'\]"):
        vitkit.load(path)
    arrays = timm_to_npz_arrays(tiny_timm())
    del arrays["Transformer/encoderblock_1/MlpBlock_3/Dense_1/bias"]
    with pytest.raises(CheckpointError, match=r"missing keys \['blocks.1.mlp.fc2.bias'\]"):
        vitkit.load(save_npz(tmp_path / "missing2.npz", arrays))


def test_pickled_object_arrays_are_refused(tmp_path):
    arrays = timm_to_npz_arrays(tiny_timm())
    arrays["evil"] = np.array([{"a": 1}], dtype=object)
    path = tmp_path / "objects.npz"
    np.savez(path, **arrays)
    with pytest.raises(CheckpointError, match="refused: the .npz holds pickled objects"):
        vitkit.load(path)
