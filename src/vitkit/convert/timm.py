"""timm's VisionTransformer (and its ResNet hybrids): vitkit uses timm's parameter names, so the mapping is
the identity, written out as rules so that anything timm has and vitkit does not (fc_norm, norm_pre,
register tokens, layer scale, attention pooling, q/k norms) is reported instead of dropped.

A timm folder, as `timm.models.push_to_hf_hub` writes it and the Hugging Face hub serves it, holds
`config.json` ({"architecture", "num_classes", "pretrained_cfg": {mean, std, input_size, ...}, "model_args"})
and `model.safetensors` (or `pytorch_model.bin`). The hub serves timm's own folders without `model_args`: a
config that gives no num_heads then gets them (and the activation, class-token position, pooling) from timm's
builder of the architecture with what model_args there are, run on the meta device, where timm is installed
(unless a vitkit preset's name alone says them). transformers' TimmWrapper folders (model_type "timm_wrapper")
hold the same config and timm's names under `timm_model.`.

A bare state dict (timm's names, also vitkit's own) says nothing of what its shapes leave open: the heads of
the fused q;k;v, whether a model with a class token pools by it or by averaging the patch tokens
(global_pool='avg' with fc_norm=False keeps it), and whether its grid is square. Unless its name is a
preset's whose shapes it has, these are assumed (as `infer_config` says) with a warning that names the
argument of `vitkit.load` that sets them (num_heads=, pool=, image_size=).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointError
from ..config import CROP_MODES, PRESETS, Preset, ViTConfig, get_preset
from ..files import write_model_folder
from ..model import VisionTransformer
from .common import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Converted,
    Hints,
    add_class_row,
    default_class_names,
    infer_config,
    is_square,
    named_preset,
    patch_stride_of,
    rename,
    sizes_in_name,
    warn_assumed,
)

_BLOCK = r"blocks\.(\d+)\.(norm1|attn\.qkv|attn\.proj|norm2|mlp\.fc1|mlp\.fc2)\.(weight|bias)"
RULES = [
    (r"cls_token", "cls_token"),
    (r"dist_token", "dist_token"),  # DeiT's distilled models (timm's VisionTransformerDistilled)
    (r"pos_embed", "pos_embed"),
    (r"patch_embed\.proj\.(weight|bias)", r"patch_embed.proj.\1"),
    (r"patch_embed\.backbone\.(stem\.(?:conv|norm)\.(?:weight|bias))", r"patch_embed.backbone.\1"),
    (r"patch_embed\.backbone\.(stages\.\d+\.blocks\.\d+\.(?:conv[123]|norm[123]|downsample\.conv|"
     r"downsample\.norm)\.(?:weight|bias))", r"patch_embed.backbone.\1"),
    (_BLOCK, r"blocks.\1.\2.\3"),
    (r"norm\.(weight|bias)", r"norm.\1"),
    (r"pre_logits\.fc\.(weight|bias)", r"pre_logits.\1"),  # timm < 0.9 kept the representation layer
    (r"head\.(weight|bias)", r"head.\1"),
    (r"head_dist\.(weight|bias)", r"head_dist.\1"),
]

TIMM_GELU_TANH = "gelu_tanh"
# vitkit's position embeddings timm's ViT has, by its name
TIMM_POS_EMBED = {"learned": "learn", "none": "none"}
# timm's VisionTransformer builds its LayerNorms with this epsilon; model_args cannot change it
TIMM_LN_EPS = 1e-6


def timm_mlp_ratio(dim: int, mlp_dim: int) -> float:
    """The `mlp_ratio` for which timm's hidden width `int(dim * mlp_ratio)` is `mlp_dim`: mlp_dim / dim itself
    can land a hair below it in floating point (352 * (480 / 352) = 479.99999...), and int() truncates."""
    ratio = mlp_dim / dim
    while int(dim * ratio) < mlp_dim:
        ratio = math.nextafter(ratio, math.inf)
    return ratio


def is_timm_state(keys: set[str]) -> bool:
    return "patch_embed.proj.weight" in keys or "patch_embed.backbone.stem.conv.weight" in keys


TIMM_WRAPPER_PREFIX = "timm_model."  # transformers' TimmWrapperModel keeps the timm model under this name


def unwrap_timm_wrapper(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The timm state dict inside a transformers TimmWrapper folder (config.json: model_type "timm_wrapper",
    with timm's architecture and model_args): timm's names under `timm_model.`; other folders as they are."""
    if (config.get("model_type") != "timm_wrapper"
            or not all(k.startswith(TIMM_WRAPPER_PREFIX) for k in state)):
        return state
    return {k[len(TIMM_WRAPPER_PREFIX):]: v for k, v in state.items()}


def hints_from_config(config: dict[str, Any], source: str) -> Hints:
    """What a timm config.json says that the tensors do not.

    A folder vitkit wrote also holds `vitkit_config`, for what timm's fields cannot say (LayerNorm eps, name,
    ...). Someone who edits the folder's config.json edits timm's fields, which timm computes with, and may
    leave that entry as it was: the fields timm reads (model_args' heads, image size and activation,
    pretrained_cfg's mean, std, interpolation and crop) win over it.
    """
    pcfg = config.get("pretrained_cfg", config)  # older files kept everything at the top level
    args = config.get("model_args", {}) or {}
    hints = Hints(name=str(config.get("architecture", "")), architecture=str(config.get("architecture", "")),
                  architecture_args=dict(args))
    if pcfg.get("tag"):
        hints.name += f".{pcfg['tag']}"
    written = config.get("vitkit_config") or {}  # a folder vitkit wrote: the whole config
    hints.num_heads = args.get("num_heads") or written.get("num_heads")
    size = args.get("img_size") or (pcfg.get("input_size") or [None])[1:] or written.get("image_size") or None
    if isinstance(size, int):
        size = (size, size)
    if size:
        hints.image_size = (int(size[0]), int(size[1]))
    # model_args say how the model was built; timm's config.json also records the model's global_pool at the
    # top level (save_config_for_hf), also when model_args are absent (the architecture's own pooling).
    pool = args.get("global_pool", config.get("global_pool"))
    if pool in ("avg", "token"):
        hints.pool = "gap" if pool == "avg" else "token"
    cfg: dict[str, Any] = {k: v for k, v in written.items() if k not in ("image_size", "num_heads")}
    for ours, theirs in (("mean", "mean"), ("std", "std"), ("interpolation", "interpolation"),
                         ("crop_pct", "crop_pct")):
        if pcfg.get(theirs) is not None:
            cfg[ours] = pcfg[theirs]
    if pcfg.get("crop_mode") in CROP_MODES:  # timm's third, "border" (pad to fit), vitkit does not have
        cfg["crop_mode"] = pcfg["crop_mode"]
    act = args.get("act_layer")
    if act is not None:
        if act not in ("gelu", TIMM_GELU_TANH):
            raise CheckpointError(f"{source}: activation {act!r} is not one vitkit has (gelu, gelu_tanh)")
        cfg["gelu"] = "tanh" if act == TIMM_GELU_TANH else "exact"
    hints.config = cfg
    names = config.get("label_names", pcfg.get("label_names"))
    if isinstance(names, dict):
        names = [names[k] for k in sorted(names, key=int)]
    # transformers (a TimmWrapper folder) fills the names with "LABEL_i" when a model has none: not names.
    hints.class_names = (list(names) if names and list(names) != [f"LABEL_{i}" for i in range(len(names))]
                         else None)
    if "no_embed_class" in args:
        hints.no_embed_class = bool(args["no_embed_class"])
    return hints


def architecture_defaults(architecture: str, model_args: dict[str, Any]) -> dict[str, Any] | None:
    """What timm's builder of `architecture` (with `model_args`) makes that shapes cannot tell: width (to
    check against the tensors'), heads, activation, LayerNorm eps, whether the class token has a position row,
    and the pooling. Read from the model built on the meta device, so no weights are allocated. None without
    timm, for a name timm does not know, or for a model that is not a ViT of timm's blocks."""
    try:
        import timm
    except ImportError:
        return None
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = timm.create_model(architecture, pretrained=False, **model_args)
    except Exception:  # any builder's failure (an unknown name, arguments it refuses) only leaves the guess
        return None
    try:
        block = model.blocks[0]
        act = block.mlp.act
        found = {"dim": int(model.embed_dim), "num_heads": int(block.attn.num_heads),
                 "ln_eps": float(block.norm1.eps),
                 "no_embed_class": bool(getattr(model, "no_embed_class", False)),
                 "global_pool": getattr(model, "global_pool", None)}
    except (AttributeError, IndexError, TypeError):
        return None
    found["gelu"] = ({"none": "exact", "tanh": "tanh"}.get(act.approximate) if isinstance(act, torch.nn.GELU)
                     else None)
    found["activation"] = type(act).__name__
    return found


def hints_from_architecture(hints: Hints, dim: int, source: str) -> Hints:
    """The heads (and activation, eps, class-token position, pooling) of a timm folder whose config.json gives
    no num_heads (the hub serves timm's own folders without model_args), from timm's builder of its
    architecture with the model_args there are; a vitkit preset's name alone already says them (`heads_for`).
    Left to the warned guess where timm is not installed, does not know the name, or builds another width than
    the tensors'."""
    if hints.num_heads or not hints.architecture:
        return hints
    if named_preset(hints.architecture) is not None and not hints.architecture_args:
        return hints
    built = architecture_defaults(hints.architecture, hints.architecture_args)
    if built is None or built["dim"] != dim:
        return hints
    if built["gelu"] is None:
        raise CheckpointError(f"{source}: timm's {hints.architecture} uses the activation "
                              f"{built['activation']}, not one vitkit has (GELU, exact or tanh)")
    hints.num_heads = built["num_heads"]
    hints.config.setdefault("gelu", built["gelu"])
    hints.config.setdefault("ln_eps", built["ln_eps"])
    if hints.no_embed_class is None:
        hints.no_embed_class = built["no_embed_class"]
    if hints.pool is None and built["global_pool"] in ("avg", "token"):
        hints.pool = "gap" if built["global_pool"] == "avg" else "token"
    return hints


def lacks_class_row(rows: int, stride: int, hints: Hints, source: str) -> bool:
    """Whether a position table of `rows` rows beside a class token has no row for it (timm's no_embed_class),
    when config.json does not say.

    An image size (the caller's, or one the name mentions) gives the patch count, which decides. Else the
    shape does: a square table is one row per patch of a square grid, a square plus one a square grid and the
    class row. The first is a guess that is warned of (a 6x8 grid and the class row have the 49 rows of a 7x7
    grid without it); a table that is neither is an error naming both counts.
    """
    sizes = ([hints.image_size] if hints.image_size else []) + sizes_in_name(hints.name)
    for h, w in sizes:
        patches = (h // stride) * (w // stride)
        if patches in (rows, rows - 1):
            return patches == rows
    if hints.image_size:
        return False  # the grid's check names the size that does not fit
    if is_square(rows) and not is_square(rows - 1):
        side = math.isqrt(rows)
        warn_assumed(source, "class token's position row",
                     f"none (timm's no_embed_class=True): its {rows} position "
                     f"rows a {side}x{side} grid of patches, not {rows - 1} patches and the class token's "
                     "row",
                     "pass image_size=(H, W) if the grid is another (its patch count then tells)")
        return True
    if not is_square(rows - 1):
        raise CheckpointError(f"{source}: the position table has {rows} rows, not a square grid of patches "
                              f"with the class token's row ({rows - 1} patches) or without it ({rows}, "
                              "timm's no_embed_class); give the image size (e.g. vitkit.load(path, "
                              "image_size=(H, W)))")
    return False


def from_timm(state: dict[str, torch.Tensor], hints: Hints, source: str) -> Converted:
    """A timm state dict (and what its config says) as vitkit tensors and config."""
    state = rename(state, RULES, source, "timm")
    if "patch_embed.proj.weight" in state:
        hints = hints_from_architecture(hints, state["patch_embed.proj.weight"].shape[0], source)
    no_embed_class = hints.no_embed_class
    if "cls_token" in state and "pos_embed" in state and "dist_token" not in state:  # DeiT's: rows for both
        if no_embed_class is None:
            no_embed_class = lacks_class_row(state["pos_embed"].shape[1], patch_stride_of(state), hints,
                                             source)
        if no_embed_class:
            state = add_class_row(state)
    if "deit" in hints.name.lower() and "mean" not in hints.config:
        # DeiT's files (same names as timm's, no config) were trained on ImageNet-normalised pixels.
        hints.config.update(mean=IMAGENET_MEAN, std=IMAGENET_STD)
    # timm's global_pool='avg' may keep the class token (fc_norm=False): its names do not tell the pooling.
    cfg = infer_config(state, hints, source, token_or_gap=True)
    if "crop_pct" not in hints.config:
        # timm's own default for its ViTs: 0.9 of the image at 224 px, the whole image at 384 and above.
        cfg = cfg.replace(crop_pct=1.0 if max(cfg.image_size) >= 384 else 0.9)
    return Converted(cfg, state, default_class_names(cfg.num_classes, hints.class_names), source, "timm")


# --- writing ------------------------------------------------------------------------------------------
SHAPE_FIELDS = ("dim", "depth", "num_heads", "mlp_dim", "patch_size", "hybrid_layers")


def architecture_name(cfg: ViTConfig) -> str:
    """The timm architecture whose builder makes this model once `model_args` are applied: the registered
    model of the same shape (width, depth, heads, MLP, patch, ResNet), preferring the one of the same input
    size and then the one `cfg.name` names (timm names a model at another size by its builder's size);
    for a shape timm registers none of, its plain ViT (or the hybrid with the same ResNet), whose
    `model_args` make any shape (`shape_description` says what the model is). A model with a distillation
    token: DeiT's distilled ViT of its width at 224 or 384 px (timm's VisionTransformerDistilled)."""
    if cfg.distilled:
        size = {192: "tiny", 384: "small"}.get(cfg.dim, "base")
        return f"deit_{size}_distilled_patch16_{384 if min(cfg.image_size) >= 384 else 224}"
    same = [p for p in PRESETS.values() if p.in_timm
            and all(getattr(p.config, k) == getattr(cfg, k) for k in SHAPE_FIELDS)]
    if same:
        def rank(p: Preset) -> tuple[bool, bool]:
            return (p.config.image_size != cfg.image_size, p.timm_name != cfg.name.split(".", 1)[0])
        return min(same, key=rank).timm_name
    if cfg.hybrid_layers is not None:
        for name in ("R50+ViT-B/16", "R26+ViT-S/32"):
            preset = get_preset(name)
            if preset.config.hybrid_layers == cfg.hybrid_layers:
                return preset.timm_name
        raise ValueError(f"no timm architecture has the ResNet {cfg.hybrid_layers}; "
                         "write this hybrid as vitkit or Hugging Face instead")
    return "vit_base_patch16_224"


def shape_description(cfg: ViTConfig) -> str:
    """The model's shape in words, e.g. "ViT: 4 layers, width 128, 4 heads, MLP 512, patch 4, 28x28 input"."""
    body = "ResNet+ViT" if cfg.hybrid_layers is not None else "ViT"
    return (f"{body}: {cfg.depth} layers, width {cfg.dim}, {cfg.num_heads} heads, MLP {cfg.mlp_dim}, "
            f"patch {cfg.patch_size}, {cfg.image_size[0]}x{cfg.image_size[1]} input")


def to_timm(model: VisionTransformer, class_names: list[str] | None = None
            ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """timm's state dict and config.json for `model`."""
    cfg = model.cfg
    problems = []
    if cfg.pos_embed not in TIMM_POS_EMBED:
        problems.append(f"timm's VisionTransformer has no {cfg.pos_embed!r} position embedding")
    if cfg.distilled and (cfg.hybrid_layers is not None or cfg.pos_embed != "learned"):
        problems.append("timm's distilled ViT (VisionTransformerDistilled) is a plain ViT with a learned "
                        "position table")
    if cfg.spt:
        problems.append("timm's VisionTransformer has no shifted patch tokenization (spt)")
    if cfg.lsa:
        problems.append("timm's VisionTransformer has no locality self-attention (lsa)")
    if cfg.hybrid_width != 64 and cfg.hybrid_layers is not None:
        problems.append(f"timm's hybrids have a ResNet of width 64, this one {cfg.hybrid_width}")
    if cfg.representation_size:
        # timm >= 0.9 has no pre-logits layer: its checkpoint_filter_fn drops pre_logits.fc.*, so timm would
        # compute another function (or refuse the head's width).
        problems.append("timm's VisionTransformer has no pre-logits layer (it drops pre_logits.fc.* on "
                        "loading)")
    if cfg.ln_eps > TIMM_LN_EPS * (1 + 1e-9):
        problems.append(f"timm's VisionTransformer normalises with LayerNorm eps {TIMM_LN_EPS:g}, this model "
                        f"with {cfg.ln_eps:g}")
    if problems:
        raise ValueError("cannot write this model for timm: " + "; ".join(problems)
                         + "; write it as vitkit instead")
    if cfg.hybrid_layers is not None and cfg.hybrid_norm != "timm":
        warnings.warn("timm's hybrid ResNet standardises its kernels by sqrt(var + 1e-8) with GroupNorm eps "
                      f"1e-5, this model ({cfg.hybrid_norm}) by (std + 1e-5) with eps 1e-6: timm's outputs "
                      "will differ slightly (about 1e-3 relative in the tokens)", stacklevel=2)
    if cfg.ln_eps < TIMM_LN_EPS * (1 - 1e-9):
        # Hugging Face's configs say 1e-12 (for weights Google trained with 1e-6): a change of the normalised
        # value by about eps / (2 variance), relative, below 1e-4 for any token of variance 0.005 or more.
        warnings.warn(f"timm normalises with LayerNorm eps {TIMM_LN_EPS:g}, this model with {cfg.ln_eps:g}: "
                      "timm's outputs will differ slightly from this model's", stacklevel=2)
    state = {key: value.detach().cpu().contiguous() for key, value in model.state_dict().items()}
    args: dict[str, Any] = {
        "img_size": list(cfg.image_size), "patch_size": cfg.patch_size, "in_chans": cfg.in_chans,
        "embed_dim": cfg.dim, "depth": cfg.depth, "num_heads": cfg.num_heads,
        "mlp_ratio": timm_mlp_ratio(cfg.dim, cfg.mlp_dim), "qkv_bias": cfg.qkv_bias,
        "class_token": cfg.class_token, "global_pool": "token" if cfg.pool == "token" else "avg",
        # vitkit normalises every token before pooling, as the paper (and timm's token pool)
        "fc_norm": False,
    }
    if cfg.pos_embed != "learned":
        args["pos_embed"] = TIMM_POS_EMBED[cfg.pos_embed]
    if cfg.gelu == "tanh":
        args["act_layer"] = TIMM_GELU_TANH
    if cfg.hybrid_layers is not None:
        args["patch_size"] = cfg.patch_size
    config: dict[str, Any] = {
        # timm calls `architecture` with `model_args`, so it must be a name timm registers: a model of a shape
        # timm has none of names timm's plain ViT there, and the description says what the model is
        "architecture": architecture_name(cfg),
        "architecture_description": shape_description(cfg),
        "num_classes": cfg.num_classes,
        "num_features": cfg.dim,
        "global_pool": args["global_pool"],
        "model_args": args,
        "pretrained_cfg": {
            "input_size": [cfg.in_chans, *cfg.image_size], "fixed_input_size": True,
            "interpolation": cfg.interpolation, "crop_pct": cfg.crop_pct, "crop_mode": cfg.crop_mode,
            "mean": list(cfg.mean), "std": list(cfg.std), "num_classes": cfg.num_classes,
            "classifier": ["head", "head_dist"] if cfg.distilled else "head",
        },
        "vitkit_config": cfg.to_dict(),
    }
    if class_names:
        config["label_names"] = list(class_names)
    return state, config


def write_timm(model: VisionTransformer, folder: str | Path, class_names: list[str] | None = None) -> Path:
    """A timm hub folder: config.json and model.safetensors (what `timm.create_model('local-dir:...')` and
    vitkit read)."""
    state, config = to_timm(model, class_names)
    return write_model_folder(folder, state, "pt", {"config.json": config})
