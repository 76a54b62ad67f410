"""Google's Flax checkpoints (.npz): the vision_transformer repository's naming and big_vision's.

vision_transformer (the paper's released files; REFERENCE.md lists the shapes):
    embedding/{kernel,bias}, cls, Transformer/posembed_input/pos_embedding (1, N+1, D),
    Transformer/encoderblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3},
    Transformer/encoder_norm, pre_logits (ImageNet-21k files), head.
    The R50 hybrid adds the ResNet at the top level: conv_root, gn_root, block{s}/unit{u}/{conv,gn}{1,2,3},
    and a first unit's conv_proj / gn_proj.
big_vision:
    the same under `params/` (or `opt/target/`), blocks numbered LayerNorm_0, MultiHeadDotProductAttention_0,
    LayerNorm_1, MlpBlock_0, the position table at the top level (`pos_embedding`, no class-token row: the
    class token gets no position, so a zero row is added), no table at all for the fixed sin-cos embedding,
    and "scan" files that stack every block under `Transformer/encoderblock/` with a leading depth axis.

Flax kernels are (in, out) or, for attention, (D, heads, head_dim) and (heads, head_dim, D): they are
transposed and reshaped into PyTorch's (out, in) layout; the number of heads is read from the query
kernel's middle axis. Flax's `nn.gelu` is the tanh approximation, recorded as `gelu="tanh"`.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import CheckpointError
from .common import (
    INCEPTION_MEAN,
    INCEPTION_STD,
    Converted,
    Hints,
    add_class_row,
    default_class_names,
    fuse_qkv,
    infer_config,
    rename,
)

PREFIXES = ("params/", "opt/target/")


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of an .npz file, refusing pickled object arrays (they could run code)."""
    try:
        with np.load(str(path), allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except ValueError as e:
        raise CheckpointError(f"{path}: refused: the .npz holds pickled objects, not plain arrays "
                              f"({e})") from None
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"{path}: not a readable .npz file ({e})") from None


def conv(w: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(w.transpose(3, 2, 0, 1)))  # HWIO -> OIHW


def dense(w: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(w.T))  # (in, out) -> (out, in)


def qkv_kernel(w: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(w.reshape(w.shape[0], -1).T))  # (D, H, Dh) -> (H*Dh, D)


def out_kernel(w: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(w.reshape(-1, w.shape[-1]).T))  # (H, Dh, D) -> (D, H*Dh)


def flat(w: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(w.reshape(-1)))


def same(w: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(w))


def block_rules(big_vision: bool) -> list:
    ln1, mha, ln2, mlp = (0, 0, 1, 0) if big_vision else (0, 1, 2, 3)
    b = r"Transformer/encoderblock_(\d+)/"
    att = b + f"MultiHeadDotProductAttention_{mha}/"
    return [
        (b + f"LayerNorm_{ln1}/scale", r"blocks.\1.norm1.weight", same),
        (b + f"LayerNorm_{ln1}/bias", r"blocks.\1.norm1.bias", same),
        (att + r"(query|key|value)/kernel", r"blocks.\1.attn.\2.weight", qkv_kernel),
        (att + r"(query|key|value)/bias", r"blocks.\1.attn.\2.bias", flat),
        (att + r"out/kernel", r"blocks.\1.attn.proj.weight", out_kernel),
        (att + r"out/bias", r"blocks.\1.attn.proj.bias", same),
        (b + f"LayerNorm_{ln2}/scale", r"blocks.\1.norm2.weight", same),
        (b + f"LayerNorm_{ln2}/bias", r"blocks.\1.norm2.bias", same),
        (b + f"MlpBlock_{mlp}/Dense_0/kernel", r"blocks.\1.mlp.fc1.weight", dense),
        (b + f"MlpBlock_{mlp}/Dense_0/bias", r"blocks.\1.mlp.fc1.bias", same),
        (b + f"MlpBlock_{mlp}/Dense_1/kernel", r"blocks.\1.mlp.fc2.weight", dense),
        (b + f"MlpBlock_{mlp}/Dense_1/bias", r"blocks.\1.mlp.fc2.bias", same),
    ]


def _stage(s: str) -> str:
    return str(int(s) - 1)


HYBRID_RULES = [
    (r"conv_root/kernel", "patch_embed.backbone.stem.conv.weight", conv),
    (r"gn_root/scale", "patch_embed.backbone.stem.norm.weight", same),
    (r"gn_root/bias", "patch_embed.backbone.stem.norm.bias", same),
    (r"block(\d+)/unit(\d+)/conv([123])/kernel", "stages.{s}.blocks.{u}.conv{r}.weight", conv),
    (r"block(\d+)/unit(\d+)/gn([123])/scale", "stages.{s}.blocks.{u}.norm{r}.weight", same),
    (r"block(\d+)/unit(\d+)/gn([123])/bias", "stages.{s}.blocks.{u}.norm{r}.bias", same),
    (r"block(\d+)/unit(\d+)/conv_proj/kernel", "stages.{s}.blocks.{u}.downsample.conv.weight", conv),
    (r"block(\d+)/unit(\d+)/gn_proj/scale", "stages.{s}.blocks.{u}.downsample.norm.weight", same),
    (r"block(\d+)/unit(\d+)/gn_proj/bias", "stages.{s}.blocks.{u}.downsample.norm.bias", same),
]


def _rename_hybrid(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray | torch.Tensor]:
    """The ResNet's keys (units counted from 1 in Flax, from 0 in PyTorch) to vitkit names, already
    converted; the rest untouched."""
    out: dict[str, np.ndarray | torch.Tensor] = {}
    for key, value in arrays.items():
        for pattern, name, fn in HYBRID_RULES:
            m = re.fullmatch(pattern, key)
            if m:
                if m.groups():
                    s, u, r = (list(m.groups()) + [""])[:3]
                    name = "patch_embed.backbone." + name.format(s=_stage(s), u=_stage(u), r=r)
                out[name] = fn(value)
                break
        else:
            out[key] = value
    return out


def unstack_scan(arrays: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """big_vision "scan" files: `Transformer/encoderblock/...` arrays with a leading depth axis become
    `Transformer/encoderblock_{i}/...`."""
    scanned = {k: v for k, v in arrays.items() if k.startswith("Transformer/encoderblock/")}
    if not scanned:
        return arrays
    depths = {v.shape[0] for v in scanned.values()}
    if len(depths) != 1:
        raise CheckpointError(f"{source}: scanned encoder arrays disagree on the depth axis: "
                              f"{sorted(depths)}")
    out = {k: v for k, v in arrays.items() if k not in scanned}
    for key, value in scanned.items():
        rest = key[len("Transformer/encoderblock/"):]
        for i in range(value.shape[0]):
            out[f"Transformer/encoderblock_{i}/{rest}"] = value[i]
    return out


def detect_layout(arrays: dict[str, np.ndarray]) -> tuple[str, str]:
    """("vision_transformer" or "big_vision", key prefix), as the names show."""
    for prefix in PREFIXES:
        if f"{prefix}embedding/kernel" in arrays:
            return "big_vision", prefix
    if "embedding/kernel" not in arrays:
        raise CheckpointError("no 'embedding/kernel' (nor under params/ or opt/target/): not a ViT .npz")
    big = "pos_embedding" in arrays or any(k.startswith("Transformer/encoderblock/") for k in arrays) \
        or "Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel" in arrays
    return ("big_vision" if big else "vision_transformer"), ""


def from_npz(arrays: dict[str, np.ndarray], hints: Hints, source: str) -> Converted:
    """A Google .npz (either naming) as vitkit tensors and config."""
    try:
        layout, prefix = detect_layout(arrays)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from None
    if prefix:  # keys outside the prefix stay as they are, and are reported as unexpected below
        arrays = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in arrays.items()}
    big_vision = layout == "big_vision"
    arrays = unstack_scan(arrays, source)
    q = arrays.get("Transformer/encoderblock_0/MultiHeadDotProductAttention_"
                   f"{0 if big_vision else 1}/query/kernel")
    if q is not None and hints.num_heads is None:
        hints.num_heads = int(q.shape[1])  # (D, heads, head_dim)
    state = _rename_hybrid(arrays)
    rules = [
        (r"patch_embed\.(.*)", r"patch_embed.\1"),  # the ResNet, converted above
        (r"embedding/kernel", "patch_embed.proj.weight", conv),
        (r"embedding/bias", "patch_embed.proj.bias", same),
        (r"cls", "cls_token", same),
        (r"pos_embedding" if big_vision else r"Transformer/posembed_input/pos_embedding", "pos_embed", same),
        *block_rules(big_vision),
        (r"Transformer/encoder_norm/scale", "norm.weight", same),
        (r"Transformer/encoder_norm/bias", "norm.bias", same),
        (r"pre_logits/kernel", "pre_logits.weight", dense),
        (r"pre_logits/bias", "pre_logits.bias", same),
        (r"head/kernel", "head.weight", dense),
        (r"head/bias", "head.bias", same),
    ]
    state = rename(state, rules, source, layout)
    state = fuse_qkv({k.replace(".attn.query.", ".attn.q.").replace(".attn.key.", ".attn.k.")
                      .replace(".attn.value.", ".attn.v."): v for k, v in state.items()},
                     "blocks.{i}.attn.{part}.{kind}", source)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    if "pos_embed" in state and state["pos_embed"].dim() == 2:
        state["pos_embed"] = state["pos_embed"].unsqueeze(0)
    if big_vision and "cls_token" in state and "pos_embed" in state:
        state = add_class_row(state)  # big_vision adds positions before prepending the class token
    cfg_hints = {"gelu": "tanh", "ln_eps": 1e-6, "mean": INCEPTION_MEAN, "std": INCEPTION_STD}
    if big_vision:
        cfg_hints["pos_embed"] = "sincos-2d"  # big_vision's fixed table leaves no array behind
    if any(k.startswith("patch_embed.backbone.") for k in state):
        cfg_hints["hybrid_norm"] = "flax"  # the ResNet's constants these weights were trained with
    for k, v in cfg_hints.items():
        hints.config.setdefault(k, v)
    # Google's released ViTs are square (224, 384 px; big_vision's too): a square grid is what they are, not a
    # guess to warn of on every file (a name or image_size= still gives another size).
    cfg = infer_config(state, hints, source, square_only=True)
    return Converted(cfg, state, default_class_names(cfg.num_classes, hints.class_names), source, layout)
