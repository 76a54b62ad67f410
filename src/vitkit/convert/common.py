"""What every format's converter shares: renaming with full accounting of keys, and inferring the
architecture from the tensors once they carry vitkit's names.

Each format module turns its file's tensors into vitkit names (a thin mapping, every key consumed or
reported), then `infer_config` reads the architecture from the shapes, and `build_model` checks that every
tensor fits before loading it. Nothing is dropped silently: a key that no rule maps is "unexpected", a key
the model needs and the file lacks is "missing", a tensor of the wrong shape is "misshapen", and all of them
are listed in one `CheckpointError`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointError, check_state_dict, model_from_state
from ..config import VARIANTS, Preset, ViTConfig, get_preset
from ..model import VisionTransformer

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INCEPTION_MEAN = (0.5, 0.5, 0.5)  # Google's ViTs: pixels scaled to [-1, 1]
INCEPTION_STD = (0.5, 0.5, 0.5)
HEAD_DIM_CONVENTION = 64  # every published ViT but ViT-H (1280 / 16 = 80) uses 64-wide heads


@dataclass
class Hints:
    """What the file's surroundings (a config.json, its name, the caller) say about the model.

    Shapes decide everything they can; hints fill in what shapes cannot tell: the number of heads of a
    fused q;k;v projection, a non-square image, the activation, LayerNorm eps and preprocessing.
    `config` holds ViTConfig fields to set as they are (gelu, ln_eps, mean, std, ...).
    """

    name: str = ""
    num_heads: int | None = None
    image_size: tuple[int, int] | None = None
    pool: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    class_names: list[str] | None = None
    no_embed_class: bool | None = None  # the class token gets no position row (timm's no_embed_class)
    # The timm architecture a timm config.json names, and its model_args: timm's builder fills in the rest.
    architecture: str = ""
    architecture_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Converted:
    """A checkpoint turned into vitkit's terms, before any model is built."""

    cfg: ViTConfig
    state: dict[str, torch.Tensor]
    class_names: list[str] | None
    source: str  # the file or folder, for messages
    format: str  # "vitkit", "timm", "hf", "torchvision", "npz" or "big_vision"


Rule = tuple  # (regex over the source key, replacement using \1 groups[, function(value) -> tensor])


# Tensors only vitkit's models have, by the option that adds them: named when a bare file holds them.
VITKIT_OWN = ((r"blocks\.\d+\.attn\.head_scale", "locality self-attention (lsa)"),
              (r"patch_embed\.norm\.(weight|bias)", "shifted patch tokenization (spt)"))


def rename(state: dict[str, Any], rules: list[Rule], source: str, fmt: str) -> dict[str, Any]:
    """Rename every key by the first rule whose regex matches it in full, applying the rule's function to
    the value if it has one; a key no rule matches is an error, listed with all the others.

    Two source keys mapping to one name is an error too: one of them would be silently lost.
    """
    compiled = [(re.compile(rule[0]), rule[1], rule[2] if len(rule) > 2 else None) for rule in rules]
    out: dict[str, Any] = {}
    unexpected, clashes = [], []
    for key, value in state.items():
        for pattern, repl, fn in compiled:
            m = pattern.fullmatch(key)
            if m:
                new = m.expand(repl)
                if new in out:
                    clashes.append(f"{key} -> {new}")
                out[new] = fn(value) if fn is not None else value
                break
        else:
            unexpected.append(key)
    if unexpected or clashes:
        parts = []
        if unexpected:
            parts.append(f"unexpected keys (not part of a {fmt} ViT that vitkit can represent) "
                         f"{_abbrev(sorted(unexpected))}")
            own = sorted({name for key in unexpected for pattern, name in VITKIT_OWN
                          if re.fullmatch(pattern, key)})
            if own:
                parts.append(f"their names are those of vitkit's own {' and '.join(own)}, which a file of "
                             "bare tensors does not describe: load the folder vitkit.save wrote")
        if clashes:
            parts.append(f"keys that map to the same tensor {clashes}")
        raise CheckpointError(f"{source}: " + "; ".join(parts))
    return out


def fuse_qkv(state: dict[str, torch.Tensor], pattern: str, source: str) -> dict[str, torch.Tensor]:
    """Stack separate query, key and value projections into one q;k;v tensor, rows q first.

    `pattern` names the pieces with `{i}` (block), `{part}` (q, k or v) and `{kind}` (weight or bias), e.g.
    "blocks.{i}.attn.{part}.{kind}"; the fused tensor is "blocks.{i}.attn.qkv.{kind}". A block with only
    some of the three pieces is an error naming what is missing.
    """
    state = dict(state)
    regex = re.compile(re.escape(pattern).replace(r"\{i\}", r"(\d+)").replace(r"\{part\}", r"(q|k|v)")
                       .replace(r"\{kind\}", r"(weight|bias)"))
    groups: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key in list(state):
        m = regex.fullmatch(key)
        if m:
            i, part, kind = m.groups()
            groups.setdefault((i, kind), {})[part] = state.pop(key)
    missing = []
    for (i, kind), parts in sorted(groups.items()):
        absent = [p for p in "qkv" if p not in parts]
        if absent:
            missing += [pattern.format(i=i, part=p, kind=kind) for p in absent]
            continue
        state[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    if missing:
        raise CheckpointError(f"{source}: missing attention keys {missing}")
    return state


def split_qkv(state: dict[str, torch.Tensor], pattern: str) -> dict[str, torch.Tensor]:
    """The inverse of `fuse_qkv`: "blocks.{i}.attn.qkv.{kind}" into three tensors named by `pattern`."""
    out = {}
    for key, value in state.items():
        m = re.fullmatch(r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", key)
        if m is None:
            out[key] = value
            continue
        i, kind = m.groups()
        for part, piece in zip("qkv", value.chunk(3, dim=0), strict=True):
            out[pattern.format(i=i, part=part, kind=kind)] = piece.contiguous()
    return out


def _abbrev(keys: list[str], limit: int = 40) -> str:
    return str(keys) if len(keys) <= limit else f"{keys[:limit]} and {len(keys) - limit} more"


# --- the architecture from the shapes -----------------------------------------------------------------
# src/vitkit/: warnings name the code that called it
_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep


def warn_assumed(source: str, what: str, assumed: str, advice: str) -> None:
    """A UserWarning that `source` holds no config that gives its `what` (number of heads, image size,
    pooling), that vitkit `assumed` it, and how to say it (`advice`: the argument of vitkit.load; the convert
    options follow). Attributed to the first caller outside vitkit (the line that called `vitkit.load`), so
    that it names the user's code, not vitkit's."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    message = (f"{source} holds no config that gives its {what}: assumed {assumed}; {advice}; on the command "
               "line, `vitkit convert FILE FOLDER --num-heads N --image-size HxW --pool P` writes it once as "
               "a vitkit folder that says all three")
    warnings.warn(message, UserWarning, stacklevel=level)


def warn_assumed_heads(source: str, assumed: str) -> None:
    """warn_assumed for the heads of a fused q;k;v, which no shape tells."""
    warn_assumed(source, "number of heads", assumed, "pass num_heads= if the model has another count")


def named_preset(name: str) -> Preset | None:
    """The preset a checkpoint's name names: a timm or paper name ("vit_base_patch16_224.augreg_in21k"), a
    release file's ("vit_base_patch16_224-80ecf9dd"), or DeiT's ("deit_tiny_patch16_224", timm's plain
    ViT; "deit_tiny_distilled_patch16_224", the same with a distillation token)."""
    if not name:
        return None
    base = name.split("-", 1)[0] if "/" not in name else name
    deit = re.sub(r"^deit_", "vit_", base).replace("_distilled_", "_")
    for candidate in dict.fromkeys((name, base, deit)):
        try:
            return get_preset(candidate)
        except (KeyError, TypeError):
            continue
    return None


def is_the_preset(preset: Preset | None, dim: int, depth: int, mlp_dim: int, patch: int,
                  hybrid_layers: tuple[int, ...] | None) -> bool:
    """Whether the tensors are exactly the named preset's architecture (so that the name fixes what shapes
    cannot: the heads, the pooling, the image size)."""
    if preset is None:
        return False
    c = preset.config
    return ((c.dim, c.depth, c.mlp_dim, c.patch_size, c.hybrid_layers)
            == (dim, depth, mlp_dim, patch, hybrid_layers))


def heads_for(dim: int, mlp_dim: int, hints: Hints, exact: bool = False) -> tuple[int, str]:
    """Number of heads of a fused q;k;v projection, which shapes cannot tell, and how it was guessed ("" when
    it is known).

    In order: the hint (a config file, the npz query kernel, the caller: known); the preset the name
    resolves to, when its width matches (known when `exact`: the tensors are that preset's); the paper's
    variant with this width and MLP size (Table 1, DeiT's Ti and S); else the 64-wide head convention (one
    head below 64 channels). The last three are guesses, and `infer_config` warns of them.
    """
    if hints.num_heads:
        return hints.num_heads, ""
    preset = named_preset(hints.name)
    if preset is not None and preset.config.dim == dim:
        return preset.config.num_heads, "" if exact else (f"as {preset.name} has, the model its name "
                                                          f"{hints.name!r} names (though its other shapes "
                                                          "are not that model's)")
    for variant, (width, _depth, heads, mlp) in VARIANTS.items():
        if (width, mlp) == (dim, mlp_dim):
            return heads, f"as ViT-{variant} of width {width} and MLP {mlp} (Table 1)"
    if dim % HEAD_DIM_CONVENTION == 0:
        return dim // HEAD_DIM_CONVENTION, f"(the {HEAD_DIM_CONVENTION}-wide convention)"
    return 1, f"(the width {dim} is not a multiple of {HEAD_DIM_CONVENTION}, the usual head width)"


def _heads_text(heads: int, dim: int) -> str:
    return f"{heads} head{'s' if heads != 1 else ''} of {dim // heads}"


_SIZE_IN_NAME = re.compile(r"(?:^|[_\-.])(?:res_?)?(\d{2,4})(?:x(\d{2,4}))?(?=$|[_\-.])")


def sizes_in_name(name: str) -> list[tuple[int, int]]:
    """Image sizes a name mentions ("vit_base_patch16_384" -> (384, 384), "..._224x320" -> (224, 320))."""
    return [(int(h), int(w or h)) for h, w in _SIZE_IN_NAME.findall(name)]


def grid_for(rows: int, stride: int, hints: Hints, source: str, square_only: bool = False,
             sizes: tuple[tuple[int, int], ...] = ()) -> tuple[int, int]:
    """The (gh, gw) patch grid of a position table with `rows` patch rows.

    The image size comes from the hint when there is one, else from a size in the name (or `sizes`, the
    named preset's) that fits, else the grid is taken as square: known for a format that has only square
    grids (`square_only`, torchvision), else a guess that is warned of (a 4x16 table has the rows of an 8x8
    one). A non-square table with no hint is an error, since its shape cannot be guessed.
    """
    candidates = ([hints.image_size] if hints.image_size else []) + sizes_in_name(hints.name) + list(sizes)
    for h, w in candidates:
        if h % stride == 0 and w % stride == 0 and (h // stride) * (w // stride) == rows:
            return h // stride, w // stride
    if hints.image_size:
        h, w = hints.image_size
        raise CheckpointError(f"{source}: image size {h}x{w} with patch stride {stride} gives "
                              f"{(h // stride) * (w // stride)} patches, the position table has {rows}")
    side = math.isqrt(rows)
    if side * side != rows:
        raise CheckpointError(f"{source}: the position table has {rows} patch rows, not a square grid; give "
                              "the image size (e.g. vitkit.load(path, image_size=(H, W)))")
    if not square_only and rows > 1:
        px = side * stride
        warn_assumed(source, "image size",
                     f"a square {side}x{side} grid of {stride}-pixel patches ({px}x{px} "
                     f"images) for its {rows} position rows",
                     "pass image_size=(H, W) if the images are not square")
    return side, side


def is_square(n: int) -> bool:
    return n > 0 and math.isqrt(n) ** 2 == n


def add_class_row(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A zero position row for the class token, for files whose class token gets no position (big_vision,
    timm's no_embed_class): [cls + 0; patches + E_pos] computes exactly what they compute."""
    pos = state["pos_embed"]
    state = dict(state)
    state["pos_embed"] = torch.cat([pos.new_zeros(1, 1, pos.shape[-1]), pos], dim=1)
    return state


def patch_stride_of(state: dict[str, torch.Tensor]) -> int:
    """Pixels per token: the patch size, times the hybrid ResNet's stride (4, then 2 per further stage)."""
    stride = state["patch_embed.proj.weight"].shape[-1]
    stages = count_indexed(state, "patch_embed.backbone.stages.{}.blocks.0.conv1.weight")
    return stride * (4 * 2 ** (stages - 1) if stages else 1)


def count_indexed(state: dict[str, Any], pattern: str) -> int:
    """How many consecutive indices i have pattern.format(i) in state (blocks, stages, units)."""
    n = 0
    while pattern.format(n) in state:
        n += 1
    return n


def infer_config(state: dict[str, torch.Tensor], hints: Hints, source: str, square_only: bool = False,
                 token_or_gap: bool = False) -> ViTConfig:
    """The ViTConfig that `state` (vitkit names) fits: widths, depth, patch, heads, image size, head.

    What the shapes do not fix (the heads of a fused q;k;v, a square grid, the pooling) comes from the hints;
    where they say nothing, it is assumed and a UserWarning says what was assumed and which argument of
    `vitkit.load` sets it. `square_only`: the format has only square images (torchvision). `token_or_gap`: a
    model with a class token may pool by it or by averaging the patch tokens (timm's global_pool='avg' keeps
    the class token); in other formats a class token means token pooling.
    """
    def shape(key: str) -> tuple[int, ...]:
        if key not in state:
            raise CheckpointError(f"{source}: missing key {key!r} (vitkit name), needed to read the "
                                  "architecture")
        return tuple(state[key].shape)

    fields: dict[str, Any] = {}
    if "patch_embed.backbone.stem.conv.weight" in state:
        layers = []
        while f"patch_embed.backbone.stages.{len(layers)}.blocks.0.conv1.weight" in state:
            i = len(layers)
            layers.append(count_indexed(state, f"patch_embed.backbone.stages.{i}.blocks.{{}}.conv1.weight"))
        width, in_chans = shape("patch_embed.backbone.stem.conv.weight")[:2]
        fields.update(hybrid_layers=tuple(layers), hybrid_width=width, in_chans=in_chans)
        dim, _, patch, patch_w = shape("patch_embed.proj.weight")
    else:
        dim, in_chans, patch, patch_w = shape("patch_embed.proj.weight")
        fields["in_chans"] = in_chans
    if patch != patch_w:
        raise CheckpointError(f"{source}: non-square patches {patch}x{patch_w} are not supported")
    depth = count_indexed(state, "blocks.{}.norm1.weight")
    if depth == 0:
        raise CheckpointError(f"{source}: no encoder blocks found (no 'blocks.0.norm1.weight' after "
                              "renaming)")
    mlp_dim = shape("blocks.0.mlp.fc1.weight")[0]
    class_token, distilled = "cls_token" in state, "dist_token" in state
    preset = named_preset(hints.name)
    exact = is_the_preset(preset, dim, depth, mlp_dim, patch, fields.get("hybrid_layers"))
    heads, how = heads_for(dim, mlp_dim, hints, exact)
    if how:
        warn_assumed_heads(source, f"{_heads_text(heads, dim)} {how}")
    fields.update(patch_size=patch, dim=dim, depth=depth, mlp_dim=mlp_dim, class_token=class_token,
                  distilled=distilled, qkv_bias="blocks.0.attn.qkv.bias" in state, num_heads=heads)
    stated = hints.pool or hints.config.get("pool") or ("token" if distilled else None)  # DeiT's two heads
    fields["pool"] = stated or _pool_for(class_token, token_or_gap, preset, exact, source)
    fields["num_classes"] = shape("head.weight")[0] if "head.weight" in state else 0
    fields["representation_size"] = shape("pre_logits.weight")[0] if "pre_logits.weight" in state else None
    prefix = int(class_token) + int(distilled)
    stride = patch_stride_of(state)
    if "pos_embed" in state:
        fields["pos_embed"] = "learned"
        rows = shape("pos_embed")[1] - prefix
    else:
        fields["pos_embed"] = hints.config.get("pos_embed", "none")
        rows = None
    if rows is not None:
        known = (tuple(preset.config.image_size),) if exact else ()
        gh, gw = grid_for(rows, stride, hints, source, square_only, known)
        fields["image_size"] = (gh * stride, gw * stride)
    elif hints.image_size:
        fields["image_size"] = hints.image_size
    else:  # no table (a fixed sin-cos embedding, or none): the largest size the name mentions, else 224
        sizes = [s for s in sizes_in_name(hints.name) if s[0] % stride == 0 and s[1] % stride == 0]
        fields["image_size"] = max(sizes) if sizes else (224, 224)
        if not sizes and fields["pos_embed"] != "none":  # the size sets the fixed table, so the function
            side = 224 // stride
            warn_assumed(source, "image size",
                         f"224x224 images (a {side}x{side} grid of {stride}-pixel patches) for "
                         f"its fixed {fields['pos_embed']} position embedding, which leaves no table to "
                         "count",
                         "pass image_size=(H, W) if the model was trained at another size")
    for key, value in hints.config.items():
        fields.setdefault(key, value)
    fields.setdefault("name", hints.name)
    valid = {f.name for f in dataclasses.fields(ViTConfig)}
    try:
        return ViTConfig(**{k: v for k, v in fields.items() if k in valid})
    except ValueError as e:
        raise CheckpointError(f"{source}: the tensors describe no valid ViT ({e})") from None


def _pool_for(class_token: bool, token_or_gap: bool, preset: Preset | None, exact: bool, source: str) -> str:
    """The pooling the tensors allow, when nothing says it: GAP without a class token, else the class token's
    output: known where the format (or the named preset) has only that, else assumed, with a warning."""
    if not class_token:
        return "gap"
    if exact and preset is not None:
        return preset.config.pool
    if token_or_gap:
        warn_assumed(source, "pooling", "pool='token' (the class token's output, timm's global_pool='token')",
                     "pass pool='gap' if the model averages the patch tokens (timm's global_pool='avg' with "
                     "its class token kept)")
    return "token"


def build_model(converted: Converted, map_location: str | torch.device = "cpu") -> VisionTransformer:
    """The model of `converted`, after checking that every tensor fits it (all problems listed at once)."""
    label = (converted.source if converted.format == "vitkit"
             else f"{converted.source} ({converted.format} format)")
    with torch.device("meta"):
        check_state_dict(VisionTransformer(converted.cfg), converted.state, label)
    model = model_from_state(VisionTransformer, converted.cfg, {
        k: v.to(torch.float32) if v.is_floating_point() else v for k, v in converted.state.items()})
    model.class_names = converted.class_names
    return model.to(map_location).eval()


# --- class names --------------------------------------------------------------------------------------
def imagenet_classes() -> list[str]:
    """The 1000 ImageNet-1k class names, in the index order every public ImageNet classifier uses."""
    text = resources.files("vitkit.data").joinpath("imagenet_classes.txt").read_text(encoding="utf-8")
    names = [line for line in text.splitlines() if line]
    assert len(names) == 1000, f"imagenet_classes.txt has {len(names)} names"
    return names


def default_class_names(num_classes: int, given: list[str] | None) -> list[str] | None:
    """The names a file comes with; failing those, ImageNet-1k's for a 1000-class head (what every public
    1000-class ViT is trained on); else none."""
    if given is not None and len(given) == num_classes:
        return list(given)
    return imagenet_classes() if num_classes == 1000 else None

