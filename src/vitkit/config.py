"""The ViT configuration and the paper's named presets.

A preset is addressed either as in the paper ("ViT-B/16", with "@384" for another resolution) or as in timm
("vit_base_patch16_224", "vit_base_patch16_384"). The widths, depths and heads are the paper's Table 1
(Base, Large, Huge) and DeiT's (Tiny, Small).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

Pool = Literal["token", "gap"]
PosEmbed = Literal["learned", "learned-2d", "sincos-2d", "none"]
Gelu = Literal["exact", "tanh"]

POOLS: tuple[str, ...] = typing.get_args(Pool)
POS_EMBEDS: tuple[str, ...] = typing.get_args(PosEmbed)
GELUS: tuple[str, ...] = typing.get_args(Gelu)
AttnInit = Literal["xavier", "mimetic"]
ATTN_INITS: tuple[str, ...] = typing.get_args(AttnInit)
# The constants of a hybrid ResNet's weight standardisation and GroupNorm: timm's (w / sqrt(var + 1e-8), eps
# 1e-5), or those of the paper's Flax code (vit_jax/models_resnet.py: w / (std + 1e-5), GroupNorm eps 1e-6).
HybridNorm = Literal["timm", "flax"]
HYBRID_NORMS: tuple[str, ...] = typing.get_args(HybridNorm)
# How a position table is resampled to another grid (vitkit.posemb.resample_pos_embed's `mode`): bicubic or
# bilinear on pixel areas as timm, or bilinear corner to corner as the paper's code (scipy.ndimage.zoom).
PosembMode = Literal["bicubic", "bilinear", "bilinear-corners"]
POSEMB_MODES: tuple[str, ...] = typing.get_args(PosembMode)
INTERPOLATIONS: tuple[str, ...] = ("bicubic", "bilinear", "nearest")  # vitkit.data.transforms maps each
# How evaluation fits an image to image_size: "center" keeps the aspect ratio, resizes to cover
# image_size / crop_pct and centre-crops (timm's default); "squash" resizes straight to image_size, ignoring
# the aspect ratio (Hugging Face's ViTImageProcessor, timm's crop_mode="squash").
CROP_MODES: tuple[str, ...] = ("center", "squash")
HYBRID_GROUPS = 32  # GroupNorm groups in the hybrid's ResNet, as BiT: its width must be a multiple


def is_integer(x: Any) -> bool:
    """An int (a numpy one too), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def choice_errors(obj: Any, choices: dict[str, tuple]) -> list[str]:
    """One message per field of `obj` whose value is not among its `choices`, naming the key and the
    choices."""
    return [f"{key}={getattr(obj, key)!r} (choose from {', '.join(map(str, allowed))})"
            for key, allowed in choices.items() if getattr(obj, key) not in allowed]


def is_finite_number(x: Any) -> bool:
    """An int or float (numpy's too) that is neither nan nor infinite, not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _sequence(x: Any) -> tuple | None:
    """The items of a list, tuple or other iterable (not a string), or None."""
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        return None
    return tuple(x)


def int_pair(x: Any, name: str = "image_size", what: str = "(height, width)") -> tuple[int, int]:
    """An int or a pair of ints as a pair (an image's (height, width), a grid's (rows, columns)); ValueError,
    naming `name`, for anything else: floats, strings and bools too."""
    if is_integer(x):
        return (int(x), int(x))
    if isinstance(x, (tuple, list)) and len(x) == 2 and all(is_integer(v) for v in x):
        return (int(x[0]), int(x[1]))
    raise ValueError(f"{name}={x!r} must be an int or a {what} pair of ints")


# Rates that act only in training (regularisers, each in [0, 1)): a fine-tuning run takes them from its
# recipe, not from the pre-trained checkpoint.
TRAINING_RATES = ("dropout", "attn_dropout", "drop_path", "patch_dropout")


def patches_kept(p: float, n: int) -> int:
    """How many of `n` patch tokens PatchDropout at rate `p` keeps: round((1 - p) n), at least one."""
    return max(1, round((1.0 - p) * n))


@dataclass(frozen=True)
class ViTConfig:
    """Everything that defines a ViT's architecture and its input preprocessing.

    `image_size` is (height, width); an int means a square image. The class token exists when
    `class_token` is true; the paper's GAP variant (Appendix D.3) has none and averages the patch tokens.
    `distilled` adds DeiT's distillation token (Touvron et al., ICML 2021) after the class token, with its own
    head taught by a teacher's predictions; the model's logits are the mean of the two heads'.
    `hybrid_layers`, when set, replaces the patch projection by a BiT ResNet stem with that many units
    per stage (Sec. 3.1, "Hybrid Architecture"). `spt` replaces it by Shifted Patch Tokenization (vitkit.spt;
    Lee et al. 2021, for small datasets, not the paper's): each patch with its half-patch neighbourhood.
    `lsa`, the same paper's Locality Self-Attention (vitkit.lsa): a learned scale per head, no self-scores.
    `dynamic_img_size` (timm's name) lets the model take
    images of any size whose sides are multiples of the patch stride: the position table is resampled to
    each batch's grid as it runs (bicubic, antialiased, as timm); `image_size` stays the size it was
    trained at, the grid its table is kept for.
    """

    image_size: tuple[int, int] = (224, 224)
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    representation_size: int | None = None  # pre-training head's hidden layer (tanh); None: fine-tuning head
    pool: Pool = "token"
    class_token: bool = True
    distilled: bool = False
    pos_embed: PosEmbed = "learned"
    dropout: float = 0.0
    attn_dropout: float = 0.0
    drop_path: float = 0.0
    # PatchDropout (Liu et al., 2022; timm's patch_drop_rate): in training, each image keeps a random
    # (1 - patch_dropout) of its patch tokens, after the position embedding; evaluation sees all of them.
    patch_dropout: float = 0.0
    qkv_bias: bool = True
    ln_eps: float = 1e-6
    gelu: Gelu = "exact"
    # How training from scratch initialises the attention weights: "xavier" as the paper's Flax code, or
    # "mimetic" (Trockman & Kolter, ICML 2023): W_q W_k^T near +I and W_v W_o near -I in every layer.
    attn_init: AttnInit = "xavier"
    hybrid_layers: tuple[int, ...] | None = None
    hybrid_width: int = 64  # BiT ResNet root width; only with hybrid_layers
    # The ResNet's normalisation constants (HYBRID_NORMS): "timm", or "flax" as Google's .npz hybrids were
    # trained; they differ by ~1e-3 relative in the tokens. Only with hybrid_layers.
    hybrid_norm: HybridNorm = "timm"
    spt: bool = False
    lsa: bool = False
    dynamic_img_size: bool = False
    # Preprocessing that belongs to the weights (recorded in checkpoints).
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    interpolation: str = "bicubic"
    crop_pct: float = 0.875
    crop_mode: str = "center"
    name: str = ""

    def __post_init__(self) -> None:
        # Normalise the types a JSON round trip or a user may hand us, and refuse the ones that cannot be
        # meant (2.5 layers, a string for a width, NaN for an epsilon) before any arithmetic trips over them.
        type_errors = self._normalise_types()
        if type_errors:
            raise ValueError("invalid ViTConfig: " + "; ".join(type_errors))
        errors = choice_errors(self, {"pool": POOLS, "pos_embed": POS_EMBEDS, "gelu": GELUS,
                                      "attn_init": ATTN_INITS, "hybrid_norm": HYBRID_NORMS,
                                      "interpolation": INTERPOLATIONS, "crop_mode": CROP_MODES})
        for key in ("patch_size", "in_chans", "dim", "depth", "num_heads", "mlp_dim"):
            if getattr(self, key) < 1:
                errors.append(f"{key}={getattr(self, key)} must be a positive integer")
        if self.num_classes < 0:
            errors.append(f"num_classes={self.num_classes} must be >= 0 (0: no head)")
        if self.representation_size is not None and self.representation_size < 1:
            errors.append(f"representation_size={self.representation_size} must be positive or None")
        for key in TRAINING_RATES:
            if not 0.0 <= getattr(self, key) < 1.0:
                errors.append(f"{key}={getattr(self, key)} must be in [0, 1)")
        if self.ln_eps <= 0:
            errors.append(f"ln_eps={self.ln_eps} must be positive")
        if min(self.image_size) < 1:
            errors.append(f"image_size={self.image_size} must be positive")
        if self.hybrid_layers is not None and (not self.hybrid_layers or min(self.hybrid_layers) < 1):
            errors.append(f"hybrid_layers={self.hybrid_layers} must be one or more positive unit counts per "
                          "stage")
        if self.hybrid_width < 1 or self.hybrid_width % HYBRID_GROUPS:
            errors.append(f"hybrid_width={self.hybrid_width} must be a positive multiple of the "
                          f"{HYBRID_GROUPS} GroupNorm groups")
        if not 0 < self.crop_pct <= 1:
            errors.append(f"crop_pct={self.crop_pct} must be in (0, 1]")
        if min(self.std) <= 0:
            errors.append(f"std={self.std} must be positive")
        if errors:  # the checks below divide by these
            raise ValueError("invalid ViTConfig: " + "; ".join(errors))
        if self.pool == "token" and not self.class_token:
            errors.append("pool='token' needs class_token=True")
        if self.distilled and (self.pool != "token" or self.representation_size is not None):
            errors.append("distilled=True (a distillation token) needs pool='token' and no "
                          "representation_size, as DeiT's models")
        if self.dim % self.num_heads:
            errors.append(f"dim={self.dim} is not divisible by num_heads={self.num_heads}")
        if self.spt and (self.hybrid_layers is not None or self.patch_size < 2):
            errors.append("spt=True shifts the image by half a patch before the patch projection: it needs "
                          f"patch_size >= 2 (got {self.patch_size}) and no hybrid_layers")
        if self.pos_embed == "sincos-2d" and self.dim % 4:
            errors.append(f"pos_embed='sincos-2d' needs dim divisible by 4, got {self.dim}")
        if self.pos_embed == "learned-2d" and self.dim % 2:
            errors.append(f"pos_embed='learned-2d' needs an even dim, got {self.dim}")
        h, w = self.image_size
        stride = self.patch_stride
        if h % stride or w % stride:
            errors.append(f"image_size={self.image_size} is not a multiple of the patch stride {stride}")
        kept = patches_kept(self.patch_dropout, (h // stride) * (w // stride))
        if self.lsa and self.num_prefix_tokens + kept < 2:
            errors.append("lsa=True keeps each token from attending to itself: it needs two tokens or more, "
                          f"got {self.num_prefix_tokens} prefix and {kept} patch token(s)")
        for key in ("mean", "std"):
            values = getattr(self, key)
            if len(values) != self.in_chans:
                if len(set(values)) == 1:  # a constant per channel fits any channel count
                    object.__setattr__(self, key, values[:1] * self.in_chans)
                else:
                    errors.append(f"{key}={values} must have in_chans={self.in_chans} entries")
        if errors:
            raise ValueError("invalid ViTConfig: " + "; ".join(errors))

    def _normalise_types(self) -> list[str]:
        """Coerce each field to its declared type where that loses nothing (numpy ints, lists for tuples, an
        int where a float is asked); return a message for each field whose value has the wrong type."""
        errors: list[str] = []

        def put(key: str, value: Any) -> None:
            object.__setattr__(self, key, value)

        try:
            put("image_size", int_pair(self.image_size))
        except ValueError as e:
            errors.append(str(e))
        for key in ("patch_size", "in_chans", "num_classes", "dim", "depth", "num_heads", "mlp_dim",
                    "hybrid_width"):
            value = getattr(self, key)
            if is_integer(value):
                put(key, int(value))
            else:
                errors.append(f"{key}={value!r} must be an integer")
        if self.representation_size is not None:
            if is_integer(self.representation_size):
                put("representation_size", int(self.representation_size))
            else:
                errors.append(f"representation_size={self.representation_size!r} must be an integer or None")
        for key in (*TRAINING_RATES, "ln_eps", "crop_pct"):
            value = getattr(self, key)
            if is_finite_number(value):
                put(key, float(value))
            else:
                errors.append(f"{key}={value!r} must be a finite number")
        for key in ("class_token", "distilled", "qkv_bias", "spt", "lsa", "dynamic_img_size"):
            if not isinstance(getattr(self, key), bool):
                errors.append(f"{key}={getattr(self, key)!r} must be true or false")
        for key in ("pool", "pos_embed", "gelu", "attn_init", "hybrid_norm", "interpolation", "crop_mode",
                    "name"):
            if not isinstance(getattr(self, key), str):
                errors.append(f"{key}={getattr(self, key)!r} must be a string")
        for key in ("mean", "std"):
            value = getattr(self, key)
            values = _sequence(value)
            if values and all(is_finite_number(v) for v in values):
                put(key, tuple(float(v) for v in values))
            else:
                errors.append(f"{key}={value!r} must be a list of finite numbers, one per channel")
        if self.hybrid_layers is not None:
            layers = _sequence(self.hybrid_layers)
            if layers is not None and all(is_integer(n) for n in layers):
                put("hybrid_layers", tuple(int(n) for n in layers))
            else:
                errors.append(f"hybrid_layers={self.hybrid_layers!r} must be a list of unit counts per "
                              "stage, or None")
        return errors

    # --- derived quantities -------------------------------------------------------------------------
    @property
    def backbone_stride(self) -> int:
        """Downsampling of the hybrid's ResNet: 4 in the stem, then 2 in every stage after the first."""
        if self.hybrid_layers is None:
            return 1
        return 4 * 2 ** (len(self.hybrid_layers) - 1)

    @property
    def patch_stride(self) -> int:
        """Pixels per token along each side: P for a plain ViT, P times the ResNet's stride for the hybrid."""
        return self.patch_size * self.backbone_stride

    @property
    def grid_size(self) -> tuple[int, int]:
        h, w = self.image_size
        return (h // self.patch_stride, w // self.patch_stride)

    @property
    def num_patches(self) -> int:
        gh, gw = self.grid_size
        return gh * gw

    @property
    def num_prefix_tokens(self) -> int:
        """The tokens before the patches: the class token, then the distillation token."""
        return int(self.class_token) + int(self.distilled)

    @property
    def num_tokens(self) -> int:
        return self.num_patches + self.num_prefix_tokens

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    # --- (de)serialisation --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["image_size"] = list(self.image_size)
        d["mean"] = list(self.mean)
        d["std"] = list(self.std)
        if self.hybrid_layers is not None:
            d["hybrid_layers"] = list(self.hybrid_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ViTConfig:
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - valid)
        if unknown:
            raise ValueError(f"unknown ViTConfig keys {unknown}; valid keys: {sorted(valid)}")
        return cls(**d)

    def replace(self, **overrides: Any) -> ViTConfig:
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise ValueError(f"unknown ViTConfig keys {unknown}; valid keys: {sorted(valid)}")
        return dataclasses.replace(self, **overrides)


# --- presets ----------------------------------------------------------------------------------------
# (width D, depth, heads, MLP size): Table 1 of the paper for Base/Large/Huge, DeiT for Tiny/Small.
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "Ti": (192, 12, 3, 768),
    "S": (384, 12, 6, 1536),
    "B": (768, 12, 12, 3072),
    "L": (1024, 24, 16, 4096),
    "H": (1280, 32, 16, 5120),
}
TIMM_VARIANT = {"Ti": "tiny", "S": "small", "B": "base", "L": "large", "H": "huge"}
PATCHES = (8, 14, 16, 32)
# The paper fine-tunes at 384 px; patch 14 models (ViT-H/14) are fine-tuned at 518 px.
RESOLUTIONS = {8: (224, 384), 14: (224, 518), 16: (224, 384), 32: (224, 384)}


# The presets' timm-style names that timm's registry has (timm 1.0); vitkit accepts the others too, but timm
# cannot build them by name (a file written for timm then names a model timm has, with model_args).
TIMM_ARCHITECTURES = frozenset({
    "vit_tiny_patch16_224", "vit_tiny_patch16_384", "vit_small_patch8_224", "vit_small_patch16_224",
    "vit_small_patch16_384", "vit_small_patch32_224", "vit_small_patch32_384", "vit_base_patch8_224",
    "vit_base_patch16_224", "vit_base_patch16_384", "vit_base_patch32_224", "vit_base_patch32_384",
    "vit_large_patch14_224", "vit_large_patch16_224", "vit_large_patch16_384", "vit_large_patch32_224",
    "vit_large_patch32_384", "vit_huge_patch14_224", "vit_base_r50_s16_224", "vit_base_r50_s16_384",
    "vit_small_r26_s32_224", "vit_small_r26_s32_384",
})


@dataclass(frozen=True)
class Preset:
    name: str  # paper-style, e.g. "ViT-B/16" or "ViT-B/16@384"
    timm_name: str  # e.g. "vit_base_patch16_384"; timm itself has only those in TIMM_ARCHITECTURES
    config: ViTConfig = field(repr=False)

    @property
    def in_timm(self) -> bool:
        """Whether timm's registry has a model of this name."""
        return self.timm_name in TIMM_ARCHITECTURES


def _build_presets() -> dict[str, Preset]:
    presets: dict[str, Preset] = {}
    for variant, (dim, depth, heads, mlp) in VARIANTS.items():
        for patch in PATCHES:
            for i, res in enumerate(RESOLUTIONS[patch]):
                name = f"ViT-{variant}/{patch}" + ("" if i == 0 else f"@{res}")
                timm_name = f"vit_{TIMM_VARIANT[variant]}_patch{patch}_{res}"
                cfg = ViTConfig(
                    image_size=(res, res), patch_size=patch, dim=dim, depth=depth,
                    num_heads=heads, mlp_dim=mlp, name=timm_name,
                )
                presets[name] = Preset(name, timm_name, cfg)
    # The hybrids of Sec. 3.1: a BiT ResNet whose 1x1 "patches" feed the transformer. R50: the 4th stage
    # removed and the 3rd extended to 9 units, so the feature map has stride 16.
    hybrids = {
        "R50+ViT-B/16": ("vit_base_r50_s16_224", (3, 4, 9), "B", 224),
        "R50+ViT-B/16@384": ("vit_base_r50_s16_384", (3, 4, 9), "B", 384),
        "R26+ViT-S/32": ("vit_small_r26_s32_224", (2, 2, 2, 2), "S", 224),
        "R26+ViT-S/32@384": ("vit_small_r26_s32_384", (2, 2, 2, 2), "S", 384),
    }
    for name, (timm_name, layers, variant, res) in hybrids.items():
        dim, depth, heads, mlp = VARIANTS[variant]
        # 1x1 patches of the feature map: R50 (3 stages) has stride 16, R26 (4 stages) stride 32.
        cfg = ViTConfig(
            image_size=(res, res), patch_size=1, dim=dim, depth=depth, num_heads=heads,
            mlp_dim=mlp, hybrid_layers=layers, name=timm_name,
        )
        presets[name] = Preset(name, timm_name, cfg)
    return presets


PRESETS: dict[str, Preset] = _build_presets()
_BY_TIMM = {p.timm_name: p for p in PRESETS.values()}
_PAPER_NAME = re.compile(r"^(?:(R\d+)\+)?(?:ViT-)?(Ti|S|B|L|H)/(\d+)(?:@(\d+))?$", re.IGNORECASE)


def list_models() -> list[str]:
    """Names of every preset, paper-style ("ViT-B/16", "ViT-B/16@384", "R50+ViT-B/16")."""
    return list(PRESETS)


class UnknownModelError(KeyError):
    """A model name that no preset has (a KeyError, as a dict lookup would raise)."""


def get_preset(name: str) -> Preset:
    """Resolve "ViT-B/16", "ViT-B/16@384", "B/16", "R50+B/16" or "vit_base_patch16_384" to a preset."""
    if not isinstance(name, str):
        raise TypeError(f"a model name must be a string such as 'ViT-B/16', got {name!r}")
    key = name.strip()
    if key in PRESETS:
        return PRESETS[key]
    if key in _BY_TIMM:
        return _BY_TIMM[key]
    # timm names carry a pretrained tag after a dot ("vit_base_patch16_224.augreg_in21k"): the architecture
    # is the part before it.
    base = key.split(".", 1)[0]
    if base in _BY_TIMM:
        return _BY_TIMM[base]
    m = _PAPER_NAME.match(key)
    if m:
        resnet, variant, patch, res = m.groups()
        variant = {v.lower(): v for v in VARIANTS}[variant.lower()]
        canon = (f"{resnet.upper()}+" if resnet else "") + f"ViT-{variant}/{patch}"
        if res and int(res) != 224:
            canon += f"@{res}"
        if canon in PRESETS:
            return PRESETS[canon]
    raise UnknownModelError(f"unknown model {name!r}; `vitkit models` lists the presets (e.g. 'ViT-B/16', "
                            "'vit_base_patch16_224')")


# The fields that shape the network (not its preprocessing, training rates or class count).
ARCHITECTURE_FIELDS = ("image_size", "patch_size", "in_chans", "dim", "depth", "num_heads", "mlp_dim", "pool",
                       "class_token", "distilled", "pos_embed", "qkv_bias", "representation_size",
                       "hybrid_layers", "hybrid_width")


def changes_from_preset(cfg: ViTConfig) -> list[str]:
    """"field=value" for each architecture field in which `cfg` differs from the preset named by `cfg.name`
    (e.g. a ViT-B/16 built at 384 px keeps the name vit_base_patch16_224); [] if it has no preset's name."""
    try:
        preset = get_preset(cfg.name).config
    except KeyError:
        return []
    return [f"{k}={getattr(cfg, k)}" for k in ARCHITECTURE_FIELDS if getattr(cfg, k) != getattr(preset, k)]


def gap_drops_class_token(overrides: dict[str, Any]) -> bool:
    """Whether config `overrides` ask for GAP pooling and leave `class_token` unsaid: then the model is the
    paper's GAP variant, without a class token (App. D.3). `class_token=True` alongside keeps one (timm's GAP
    models). create_model, get_config and `vitkit train --set model.pool=gap` from scratch all follow this."""
    return overrides.get("pool") == "gap" and "class_token" not in overrides


def get_config(name: str, **overrides: Any) -> ViTConfig:
    """The preset's config with `overrides` applied (e.g. num_classes=10, image_size=384)."""
    cfg = get_preset(name).config
    if gap_drops_class_token(overrides):
        overrides["class_token"] = False
    return cfg.replace(**overrides) if overrides else cfg


def check_image_batch(shape: tuple[int, ...], in_chans: int, image_size: tuple[int, int],
                      any_multiple_of: int | None = None) -> None:
    """A ValueError that says what is wrong unless `shape` is a batch (B, in_chans, *image_size) of images;
    with `any_multiple_of`, of images of any size whose sides are multiples of it."""
    h, w = ("H", "W") if any_multiple_of else image_size
    want = f"(B, {in_chans}, {h}, {w})"
    if len(shape) != 4:
        raise ValueError(f"expected a batch of images {want}, got a tensor of shape {shape}; a single image "
                         f"needs a batch axis (x.unsqueeze(0))")
    if shape[1] != in_chans:
        raise ValueError(f"expected images of shape {want}, got {shape}: {shape[1]} channels where the model "
                         f"takes {in_chans} (convert the images, e.g. grey to RGB, or build it with "
                         "in_chans=...)")
    if any_multiple_of:
        if shape[-2] % any_multiple_of or shape[-1] % any_multiple_of or min(shape[-2:]) < 1:
            raise ValueError(f"expected images whose height and width are positive multiples of the patch "
                             f"stride {any_multiple_of}, got {shape}; resize or pad them (e.g. to "
                             f"{image_size[0]}x{image_size[1]})")
        return
    if tuple(shape[-2:]) != tuple(image_size):
        raise ValueError(f"expected images of shape {want}, got {shape}; resize the images to "
                         f"{image_size[0]}x{image_size[1]}, or build the model at this size with "
                         "image_size=... (vitkit.transfer.prepare_finetune resamples a trained model's "
                         "position embedding), or with dynamic_img_size=True to take any multiple of the "
                         "patch size")
