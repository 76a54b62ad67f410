"""Helpers for the conversion tests: random weights everywhere, the logit comparison, and writers of Google's
.npz layouts made independently of vitkit's reader (from a timm model, following the documented names)."""

from __future__ import annotations

import numpy as np
import torch

TOLERANCE = 1e-4  # largest logit difference, relative to the largest logit


def randomize_(module: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Random values in every parameter (norm scales around 1), so no weight is trivially 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return module


def relative_difference(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def assert_same(ours: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """Assert the logits agree to TOLERANCE relative to the largest; print the measured difference."""
    assert ours.shape == ref.shape, f"{what}: shapes {tuple(ours.shape)} vs {tuple(ref.shape)}"
    rel = relative_difference(ours, ref)
    print(f"\n[{what}] largest logit difference relative to the largest logit: {rel:.2e}")
    assert rel < TOLERANCE, f"{what}: largest relative logit difference {rel:.2e}"
    return rel


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)


def timm_to_npz_arrays(model, big_vision: bool = False, scan: bool = False,
                       pre_logits: torch.nn.Linear | None = None) -> dict[str, np.ndarray]:
    """The .npz arrays of a timm VisionTransformer, in Google's vision_transformer layout or big_vision's.

    vision_transformer: LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3, position table
    under Transformer/posembed_input with the class row. big_vision: prefix params/, _0/_0/_1/_0, the
    position table at the top level without the class row (the model's class row must then be zero), and
    with `scan` every block stacked under Transformer/encoderblock/.
    """
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    D = sd["pos_embed"].shape[-1]
    H = model.blocks[0].attn.num_heads
    a: dict[str, np.ndarray] = {}
    a["embedding/kernel"] = _np(sd["patch_embed.proj.weight"].permute(2, 3, 1, 0))  # OIHW -> HWIO
    a["embedding/bias"] = _np(sd["patch_embed.proj.bias"])
    pos = sd["pos_embed"]
    if "cls_token" in sd:
        a["cls"] = _np(sd["cls_token"])
    if big_vision:
        if "cls_token" in sd:
            assert torch.all(pos[:, 0] == 0), "big_vision gives the class token no position"
            pos = pos[:, 1:]
        a["pos_embedding"] = _np(pos)
    else:
        a["Transformer/posembed_input/pos_embedding"] = _np(pos)
    ln1, mha, ln2, mlp = (0, 0, 1, 0) if big_vision else (0, 1, 2, 3)
    for i in range(len(model.blocks)):
        b = f"Transformer/encoderblock_{i}/"
        p = f"blocks.{i}."
        a[b + f"LayerNorm_{ln1}/scale"] = _np(sd[p + "norm1.weight"])
        a[b + f"LayerNorm_{ln1}/bias"] = _np(sd[p + "norm1.bias"])
        qkv_w = sd[p + "attn.qkv.weight"].chunk(3)
        qkv_b = sd[p + "attn.qkv.bias"].chunk(3)
        for name, w, bias in zip(("query", "key", "value"), qkv_w, qkv_b, strict=True):
            a[b + f"MultiHeadDotProductAttention_{mha}/{name}/kernel"] = _np(w.T.reshape(D, H, D // H))
            a[b + f"MultiHeadDotProductAttention_{mha}/{name}/bias"] = _np(bias.reshape(H, D // H))
        a[b + f"MultiHeadDotProductAttention_{mha}/out/kernel"] = _np(
            sd[p + "attn.proj.weight"].T.reshape(H, D // H, D))
        a[b + f"MultiHeadDotProductAttention_{mha}/out/bias"] = _np(sd[p + "attn.proj.bias"])
        a[b + f"LayerNorm_{ln2}/scale"] = _np(sd[p + "norm2.weight"])
        a[b + f"LayerNorm_{ln2}/bias"] = _np(sd[p + "norm2.bias"])
        for r, fc in enumerate(("fc1", "fc2")):
            a[b + f"MlpBlock_{mlp}/Dense_{r}/kernel"] = _np(sd[p + f"mlp.{fc}.weight"].T)
            a[b + f"MlpBlock_{mlp}/Dense_{r}/bias"] = _np(sd[p + f"mlp.{fc}.bias"])
    a["Transformer/encoder_norm/scale"] = _np(sd["norm.weight"])
    a["Transformer/encoder_norm/bias"] = _np(sd["norm.bias"])
    if pre_logits is not None:
        a["pre_logits/kernel"] = _np(pre_logits.weight.T)
        a["pre_logits/bias"] = _np(pre_logits.bias)
    if "head.weight" in sd:
        a["head/kernel"] = _np(sd["head.weight"].T)
        a["head/bias"] = _np(sd["head.bias"])
    if hasattr(model.patch_embed, "backbone"):
        bb = model.patch_embed.backbone
        a["conv_root/kernel"] = _np(bb.stem.conv.weight.permute(2, 3, 1, 0))
        a["gn_root/scale"] = _np(bb.stem.norm.weight)
        a["gn_root/bias"] = _np(bb.stem.norm.bias)
        for s, stage in enumerate(bb.stages):
            for u, unit in enumerate(stage.blocks):
                q = f"block{s + 1}/unit{u + 1}/"
                for r in (1, 2, 3):
                    a[q + f"conv{r}/kernel"] = _np(getattr(unit, f"conv{r}").weight.permute(2, 3, 1, 0))
                    a[q + f"gn{r}/scale"] = _np(getattr(unit, f"norm{r}").weight)
                    a[q + f"gn{r}/bias"] = _np(getattr(unit, f"norm{r}").bias)
                if unit.downsample is not None:
                    a[q + "conv_proj/kernel"] = _np(unit.downsample.conv.weight.permute(2, 3, 1, 0))
                    a[q + "gn_proj/scale"] = _np(unit.downsample.norm.weight)
                    a[q + "gn_proj/bias"] = _np(unit.downsample.norm.bias)
    if big_vision and scan:
        stacked: dict[str, list[np.ndarray]] = {}
        for key in [k for k in a if k.startswith("Transformer/encoderblock_")]:
            i, rest = key[len("Transformer/encoderblock_"):].split("/", 1)
            stacked.setdefault(rest, [None] * len(model.blocks))[int(i)] = a.pop(key)
        for rest, arrays in stacked.items():
            a[f"Transformer/encoderblock/{rest}"] = np.stack(arrays)
    if big_vision:
        a = {f"params/{k}": v for k, v in a.items()}
    return a


# --- what vitkit.load says it assumed of a bare file --------------------------------------------------------
def load_noting(path, **kw):
    """The model vitkit.load gives, and the messages of the UserWarnings it gave."""
    import warnings

    import vitkit

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = vitkit.load(path, **kw)
    return model, [str(w.message) for w in seen if issubclass(w.category, UserWarning)]


def assert_noted(notes: list[str], pattern: str) -> None:
    import re

    assert any(re.search(pattern, n) for n in notes), f"no warning matches {pattern!r}: {notes}"


def assert_same_logits(model, ref, size) -> None:
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=1e-5)
