"""`--set key=value` overrides of a TrainConfig: dotted keys into the nested settings (or a short alias), each
value parsed for its field's type. An unknown key is refused with the list of valid ones; every override is
applied before the settings check themselves, so that the order of the `--set`s does not matter.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from ..config import TRAINING_RATES, ViTConfig, gap_drops_class_token
from .settings import TrainConfig


def valid_keys(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key `--set` accepts, e.g. 'optim.lr', 'model.dim'."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            keys += valid_keys(t, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


# Short names for the keys a fine-tuning command line sets most (`--set image_size=384 --set data=cifar10`).
ALIASES = {"image_size": "model.image_size", "data": "data.name", "lr": "optim.lr"}


def apply_overrides(cfg: TrainConfig, overrides: list[str] | tuple[str, ...]) -> TrainConfig:
    """Apply `key=value` strings (dotted keys into the nested settings, or one of ALIASES). Values are parsed
    for the field's type; unknown keys and values of the wrong type raise ValueError naming them.

    Every override is applied before the settings are checked, each group rebuilt once with all of its
    changes: the groups check their fields together (pool='gap' needs class_token=False, dim a multiple of
    num_heads, min_lr <= lr), so checking one override at a time would refuse a valid combination or not
    depending on the order of the `--set`s. A later `--set` of the same key wins."""
    changes: dict[str, tuple[Any, str]] = {}  # dotted key -> (parsed value, the item as given)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value, e.g. optim.lr=0.001")
        key, text = (part.strip() for part in item.split("=", 1))
        key = ALIASES.get(key, key)
        changes[key] = (parse_value(text, field_type(key), key), f"{key}={text}")
    # As create_model and get_config: GAP from scratch means no class token (the paper's D.3) unless
    # class_token is set too (timm's GAP that keeps its class token); fine-tuning keeps the checkpoint's.
    init = changes["init"][0] if "init" in changes else cfg.init
    model_changes = {key.removeprefix("model."): value for key, (value, _) in changes.items()
                     if key.startswith("model.")}
    if gap_drops_class_token(model_changes) and not init:
        changes["model.class_token"] = (False, "model.pool=gap")
    # `init` first: the model becomes the checkpoint's architecture, and the model settings set alongside are
    # applied to (and checked against) it rather than the recipe's.
    if "init" in changes:
        cfg = _with_changes(cfg, {"init": changes.pop("init")})
        if cfg.init:
            cfg = dataclasses.replace(cfg, model=init_model_config(cfg.init, cfg.model))
            from ..transfer import SHAPE_FIELDS

            fixed = [item for key, (value, item) in changes.items() if key.startswith("model.")
                     and key[len("model."):] in SHAPE_FIELDS
                     and value != getattr(cfg.model, key[len("model."):])]
            if fixed:
                raise ValueError(f"--set {', '.join(fixed)}: fine-tuning from init={cfg.init} keeps its "
                                 f"architecture, whose weights fix {', '.join(SHAPE_FIELDS)}")
            if cfg.model.lsa and changes.get("model.lsa", (True, ""))[0] is False:
                raise ValueError(f"--set {changes['model.lsa'][1]}: fine-tuning from init={cfg.init} keeps "
                                 "its locality self-attention (lsa), whose temperatures it learned")
    return _with_changes(cfg, changes)


def field_type(key: str) -> Any:
    """The type of the setting a dotted key names; an unknown key, or a group of settings, raises
    ValueError."""
    t: Any = TrainConfig
    for name in key.split("."):
        if not dataclasses.is_dataclass(t) or name not in {f.name for f in dataclasses.fields(t)}:
            raise ValueError(f"unknown key {key!r}; valid keys: {', '.join(valid_keys())}")
        t = typing.get_type_hints(t)[name]
    if dataclasses.is_dataclass(t):
        raise ValueError(f"{key!r} is a group of settings; set one of its keys, e.g. "
                         f"{valid_keys(t, key + '.')[0]}")
    return t


def _with_changes(obj: Any, changes: dict[str, tuple[Any, str]]) -> Any:
    """`obj` with `changes` (dotted key below obj -> (value, the `--set` item)) applied: each nested group is
    rebuilt once with all of its changes, then `obj` once with its own and the rebuilt groups, so that each
    dataclass validates the combination. A refusal names the `--set` items of the group that refused."""
    if not changes:
        return obj
    own: dict[str, tuple[Any, str]] = {}
    nested: dict[str, dict[str, tuple[Any, str]]] = {}
    for key, change in changes.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = change
        else:
            own[head] = change
    kwargs = {name: _with_changes(getattr(obj, name), sub) for name, sub in nested.items()}
    kwargs.update({name: value for name, (value, _) in own.items()})
    try:
        return dataclasses.replace(obj, **kwargs)
    except ValueError as e:
        # A group's own items are to blame; with none, one of the nested ones (a check across groups).
        items = [item for _, item in own.values()] or [item for _, item in changes.values()]
        raise ValueError(f"--set {', '.join(items)}: {e}") from None


def init_model_config(init: str, recipe_model: ViTConfig) -> ViTConfig:
    """With `init`, the model is the checkpoint's architecture (its head replaced later for the data's
    classes). The recipe keeps its resolution where the checkpoint's patches tile it (else the checkpoint's
    own), and its training-only rates (dropout, stochastic depth, patch dropout: `TRAINING_RATES`)."""
    from .. import load

    src = load(init).cfg
    size = recipe_model.image_size
    if size[0] % src.patch_stride or size[1] % src.patch_stride:
        size = src.image_size
    return src.replace(image_size=size, representation_size=None,
                       **{k: getattr(recipe_model, k) for k in TRAINING_RATES})


_NONE = ("none", "null", "")


def parse_value(text: str, t: Any, key: str = "value") -> Any:
    """Parse `text` as type `t` (bool, int, float, str, Literal, tuples, X | None)."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() in _NONE:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return parse_value(text, a, key)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{key}={text!r}: cannot parse")
    if origin is Literal:
        if text not in args:
            raise ValueError(f"{key}={text!r}: choose from {', '.join(map(str, args))}")
        return text
    if origin is tuple:
        # "28x28" for (28, 28); names (freeze patterns) keep their x
        sizes = text if args and args[0] is str else text.replace("x", ",")
        parts = [p for p in sizes.split(",") if p.strip()] if text else []
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(parse_value(p.strip(), args[0], key) for p in parts)
        if len(parts) == 1 and len(args) > 1:  # "28" for (28, 28)
            parts = parts * len(args)
        if len(parts) != len(args):
            raise ValueError(f"{key}={text!r}: expected {len(args)} comma-separated values")
        return tuple(parse_value(p.strip(), a, key) for p, a in zip(parts, args, strict=True))
    if t is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key}={text!r}: expected true or false")
    if t is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{key}={text!r}: expected an integer") from None
    if t is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{key}={text!r}: expected a number") from None
    if t is str:
        return text
    raise ValueError(f"{key}: cannot set a value of type {t}")
