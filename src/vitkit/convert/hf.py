"""Hugging Face transformers' `ViTModel` and `ViTForImageClassification`.

A saved model is a folder: `config.json` (model_type "vit": hidden_size, num_attention_heads, layer_norm_eps,
hidden_act, image_size, id2label, ...), `model.safetensors` or `pytorch_model.bin` (or their shards), and
usually `preprocessor_config.json` (image_mean, image_std, resample; ViTImageProcessor resizes straight to the
model's size, ignoring the aspect ratio: vitkit's crop_mode="squash"). Files use the names below
(transformers 4 and what transformers 5 still writes); transformers 5's in-memory names
(`layers.{i}.attention.q_proj`, ...) are read too. The separate query, key and value projections are stacked
into vitkit's fused q;k;v.

`ViTModel`'s pooler (dense + tanh on the class token) is the paper's pre-training head, so it maps to
vitkit's `pre_logits`; a `ViTModel` has no classifier, so it becomes a vitkit model with
`num_classes=0` whose output is the pooler output.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointError
from ..files import write_model_folder
from ..model import VisionTransformer
from .common import Converted, Hints, default_class_names, fuse_qkv, infer_config, rename, split_qkv

HF_LAYER_NORM_EPS = 1e-12  # transformers' ViTConfig default, used when a file comes without config.json
HF_PART = {"query": "q", "key": "k", "value": "v", "q_proj": "q", "k_proj": "k", "v_proj": "v"}
# PIL resampling codes, as preprocessor_config.json stores them.
RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}

_V4 = r"(?:vit\.|deit\.)?encoder\.layer\.(\d+)\."
_V5 = r"(?:vit\.|deit\.)?layers\.(\d+)\."
RULES = [
    (r"(?:vit\.|deit\.)?embeddings\.cls_token", "cls_token"),
    (r"(?:deit\.)?embeddings\.distillation_token", "dist_token"),
    (r"(?:vit\.|deit\.)?embeddings\.position_embeddings", "pos_embed"),
    (r"(?:vit\.|deit\.)?embeddings\.patch_embeddings\.projection\.(weight|bias)", r"patch_embed.proj.\1"),
    (_V4 + r"attention\.attention\.(query|key|value)\.(weight|bias)", r"blocks.\1.attn.\2.\3"),
    (_V4 + r"attention\.output\.dense\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (_V4 + r"intermediate\.dense\.(weight|bias)", r"blocks.\1.mlp.fc1.\2"),
    (_V4 + r"output\.dense\.(weight|bias)", r"blocks.\1.mlp.fc2.\2"),
    (_V4 + r"layernorm_before\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (_V4 + r"layernorm_after\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (_V5 + r"attention\.(q_proj|k_proj|v_proj)\.(weight|bias)", r"blocks.\1.attn.\2.\3"),
    (_V5 + r"attention\.o_proj\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (_V5 + r"mlp\.(fc1|fc2)\.(weight|bias)", r"blocks.\1.mlp.\2.\3"),
    (_V5 + r"layernorm_before\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (_V5 + r"layernorm_after\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (r"(?:vit\.|deit\.)?layernorm\.(weight|bias)", r"norm.\1"),
    (r"(?:vit\.|deit\.)?pooler\.dense\.(weight|bias)", r"pre_logits.\1"),
    (r"classifier\.(weight|bias)", r"head.\1"),
    # DeiTForImageClassificationWithTeacher: a head on the class token and one on the distillation token
    (r"cls_classifier\.(weight|bias)", r"head.\1"),
    (r"distillation_classifier\.(weight|bias)", r"head_dist.\1"),
]


def is_hf_state(keys: set[str]) -> bool:
    return any(k.endswith("embeddings.patch_embeddings.projection.weight") for k in keys)


def hints_from_config(config: dict[str, Any], preprocessor: dict[str, Any] | None, source: str) -> Hints:
    """What config.json and preprocessor_config.json say: heads, image size, activation, eps, labels.

    A folder vitkit wrote also holds `vitkit_config`, for what transformers' fields cannot say (crop, name,
    ...). transformers keeps that entry when it re-saves a config someone changed, so it may be stale: the
    fields transformers reads (hidden_act, layer_norm_eps, image_size, num_attention_heads, the preprocessor's
    mean, std and resample) win over it.
    """
    if config.get("model_type", "vit") not in ("vit", "deit"):
        raise CheckpointError(f"{source}: a Hugging Face {config.get('model_type')!r} model, not a plain ViT "
                              "(model_type 'vit', or 'deit' with its distillation token)")
    if config.get("pooler_act", "tanh") != "tanh":
        raise CheckpointError(f"{source}: pooler_act={config['pooler_act']!r}; vitkit's pre-logits use tanh")
    written = config.get("vitkit_config") or {}  # a folder vitkit wrote: the fields HF cannot hold
    # (written before ViTConfig had crop_mode: the model's own preprocessing then always centre-cropped)
    cfg: dict[str, Any] = {
        "ln_eps": HF_LAYER_NORM_EPS,
        # ViTImageProcessor resizes straight to the model's size (aspect ratio not kept), no crop
        "crop_mode": "squash", "crop_pct": 1.0,
        "interpolation": "bilinear",  # ViTImageProcessor's default resample
        **({"crop_mode": "center", **written} if written else {}),
        **stated_by_hf(config, preprocessor, source),
    }
    cfg.setdefault("gelu", "exact")  # transformers' default hidden_act, "gelu"
    hints = Hints(name=str(config.get("_name_or_path", "")))
    hints.num_heads = config.get("num_attention_heads") or written.get("num_heads")
    size = config.get("image_size", written.get("image_size"))
    if size is not None:
        hints.image_size = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    cfg.pop("image_size", None)
    hints.config = cfg
    labels = config.get("id2label")
    if labels:
        names = [labels[k] for k in sorted(labels, key=int)]
        # transformers fills id2label with "LABEL_i" when a model has no labels: those are not names.
        if names != [f"LABEL_{i}" for i in range(len(names))]:
            hints.class_names = names
    return hints


def stated_by_hf(config: dict[str, Any], preprocessor: dict[str, Any] | None, source: str) -> dict[str, Any]:
    """The ViTConfig fields that config.json and preprocessor_config.json state themselves (activation, eps,
    mean, std, resampling): what transformers computes with, whatever else the folder says."""
    out: dict[str, Any] = {}
    if "hidden_act" in config:
        act = config["hidden_act"]
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"{source}: hidden_act={act!r} is not one vitkit has "
                                  "(gelu, gelu_new, gelu_pytorch_tanh)")
        out["gelu"] = "exact" if act == "gelu" else "tanh"
    if config.get("layer_norm_eps") is not None:
        out["ln_eps"] = float(config["layer_norm_eps"])
    if preprocessor:
        if preprocessor.get("image_mean") is not None:
            out["mean"] = preprocessor["image_mean"]
            out["std"] = preprocessor["image_std"]
        if preprocessor.get("resample") in RESAMPLE:
            out["interpolation"] = RESAMPLE[preprocessor["resample"]]
    return out


def from_hf(state: dict[str, torch.Tensor], hints: Hints, source: str) -> Converted:
    state = rename(state, RULES, source, "Hugging Face")
    for long, short in HF_PART.items():
        state = {k.replace(f".attn.{long}.", f".attn.{short}."): v for k, v in state.items()}
    state = fuse_qkv(state, "blocks.{i}.attn.{part}.{kind}", source)
    if "dist_token" in state and "head.weight" in state and "head_dist.weight" not in state:
        raise CheckpointError(f"{source}: a DeiTForImageClassification, whose classifier reads the class "
                              "token alone while a distillation token stays in the sequence; vitkit's "
                              "distilled models average the two heads "
                              "(DeiTForImageClassificationWithTeacher, timm's deit_*_distilled)")
    if "ln_eps" not in hints.config:
        hints.config["ln_eps"] = HF_LAYER_NORM_EPS
    cfg = infer_config(state, hints, source)
    return Converted(cfg, state, default_class_names(cfg.num_classes, hints.class_names), source, "hf")


# --- writing ------------------------------------------------------------------------------------------
def to_hf(model: VisionTransformer, class_names: list[str] | None = None
          ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """The state dict, config.json and preprocessor_config.json of the transformers model equal to `model`:
    `ViTForImageClassification` when it has a classifier, else `ViTModel` (with the pre-logits as pooler).
    What transformers will do differently is a warning: a pooler without weights, a preprocessor that squashes
    where this model centre-crops."""
    cfg = model.cfg
    problems = []
    if not cfg.class_token or cfg.pool != "token":
        problems.append("transformers' ViT classifies from the class token (this model pools by GAP)")
    if cfg.pos_embed != "learned":
        problems.append(f"transformers' ViT has only a learned 1D position table, not {cfg.pos_embed!r}")
    if cfg.hybrid_layers is not None:
        problems.append("transformers has no ResNet hybrid ViT in its current versions")
    if cfg.spt:
        problems.append("transformers' ViT has no shifted patch tokenization (spt)")
    if cfg.lsa:
        problems.append("transformers' ViT has no locality self-attention (lsa)")
    if cfg.distilled:
        problems.append("vitkit writes transformers' ViT, which has no distillation token (write it for "
                        "timm)")
    if cfg.num_classes > 0 and cfg.representation_size:
        problems.append("ViTForImageClassification has no pre-logits layer before its classifier")
    if problems:
        raise ValueError("cannot write this model for Hugging Face transformers: " + "; ".join(problems))
    classify = cfg.num_classes > 0
    if not classify and cfg.representation_size is None:
        warnings.warn("this model has no pre-logits layer, so ViTModel's pooler gets no weights and "
                      "transformers initialises it at random: use last_hidden_state (whose first token is "
                      "this model's representation), or load with ViTModel.from_pretrained(folder, "
                      "add_pooling_layer=False)",
                      stacklevel=2)
    if cfg.crop_mode == "center":
        warnings.warn("ViTImageProcessor has no centre crop: it resizes a whole image to the input size, "
                      f"where this model resizes and centre-crops (crop_pct {cfg.crop_pct:g}); images of "
                      "another shape will be preprocessed differently", stacklevel=2)
    prefix = "vit." if classify else ""
    state = split_qkv({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                      "blocks.{i}.attn.{part}.{kind}")
    names = {"q": "query", "k": "key", "v": "value"}
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if key == "cls_token":
            new = "embeddings.cls_token"
        elif key == "pos_embed":
            new = "embeddings.position_embeddings"
        elif key.startswith("patch_embed.proj."):
            new = "embeddings.patch_embeddings.projection." + parts[-1]
        elif key.startswith("blocks."):
            i, rest = parts[1], ".".join(parts[2:-1])
            inner = {"norm1": "layernorm_before", "norm2": "layernorm_after",
                     "attn.proj": "attention.output.dense",
                     "mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense"}.get(rest)
            if inner is None:  # attn.q / attn.k / attn.v
                inner = f"attention.attention.{names[rest.split('.')[-1]]}"
            new = f"encoder.layer.{i}.{inner}.{parts[-1]}"
        elif key.startswith("norm."):
            new = "layernorm." + parts[-1]
        elif key.startswith("pre_logits."):
            new = "pooler.dense." + parts[-1]
        elif key.startswith("head."):
            out["classifier." + parts[-1]] = value
            continue
        else:
            raise ValueError(f"no Hugging Face name for {key!r}")
        out[prefix + new] = value
    h, w = cfg.image_size
    config: dict[str, Any] = {
        "architectures": ["ViTForImageClassification" if classify else "ViTModel"],
        "model_type": "vit",
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.depth, "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.mlp_dim,
        "hidden_act": "gelu" if cfg.gelu == "exact" else "gelu_pytorch_tanh",
        "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.attn_dropout,
        "layer_norm_eps": cfg.ln_eps, "image_size": h if h == w else [h, w], "patch_size": cfg.patch_size,
        "num_channels": cfg.in_chans, "qkv_bias": cfg.qkv_bias, "encoder_stride": cfg.patch_size,
        "pooler_output_size": cfg.representation_size or cfg.dim, "pooler_act": "tanh",
        "vitkit_config": cfg.to_dict(),  # what transformers' config cannot hold (crop_pct, name, ...)
    }
    if classify:
        labels = class_names or [f"LABEL_{i}" for i in range(cfg.num_classes)]
        config["id2label"] = {str(i): n for i, n in enumerate(labels)}
        config["label2id"] = {n: i for i, n in enumerate(labels)}
    preprocessor = {
        "image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": h, "width": w},
        "resample": {v: k for k, v in RESAMPLE.items()}.get(cfg.interpolation, 3), "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(cfg.mean),
        "image_std": list(cfg.std),
    }
    return out, config, preprocessor


def write_hf(model: VisionTransformer, folder: str | Path, class_names: list[str] | None = None) -> Path:
    """A folder `transformers.ViTForImageClassification.from_pretrained` (or ViTModel) reads."""
    state, config, preprocessor = to_hf(model, class_names)
    return write_model_folder(folder, state, "pt",
                              {"config.json": config, "preprocessor_config.json": preprocessor})
