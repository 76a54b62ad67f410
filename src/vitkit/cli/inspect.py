"""`vitkit models` (the presets) and `vitkit info` (what a checkpoint holds)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table


def models(
    filter: str = typer.Argument("", help="Show only presets whose name contains this text (e.g. 'B/16')."),
    classes: int = typer.Option(1000, "--classes", min=0, help="Head size used for the parameter count."),
) -> None:
    """Table of the presets: parameters, GFLOPs and GMACs per image, and tokens. GMACs (multiply-adds) are
    what timm, fvcore and most papers after ViT call FLOPs; GFLOPs count 2 per multiply-add."""
    from ..config import PRESETS, get_preset
    from ..counting import count_flops, count_parameters
    from .main import UsageError

    try:
        named = get_preset(filter).name if filter else None  # "R50+B/16", "vit_base_patch16_224.augreg"
    except KeyError:
        named = None

    table = Table(title=f"vitkit presets (parameters with a {classes}-class head)",
                  caption="timm name: - where timm has no such model; vitkit takes its timm-style name too "
                          "(vit_huge_patch16_224). GFLOPs count 2 per multiply-add; GMACs count "
                          "multiply-adds, the figure timm, fvcore and most papers call FLOPs")
    for col, justify in (("name", "left"), ("timm name", "left"), ("image", "right"), ("params", "right"),
                         ("GFLOPs", "right"), ("GMACs", "right"), ("tokens", "right")):
        table.add_column(col, justify=justify)
    shown = 0
    for preset in PRESETS.values():
        matches = filter.lower() in preset.name.lower() or filter.lower() in preset.timm_name
        if filter and not matches and preset.name != named:
            continue
        shown += 1
        cfg = preset.config.replace(num_classes=classes)
        h, w = cfg.image_size
        flops = count_flops(cfg)  # a hybrid's is counted by running its ResNet on the meta device
        table.add_row(preset.name, preset.timm_name if preset.in_timm else "-", f"{h}x{w}",
                      f"{count_parameters(cfg):,}", f"{flops / 1e9:.2f}", f"{flops / 2e9:.2f}",
                      str(cfg.num_tokens))
    if not shown:
        raise UsageError(f"no preset matches {filter!r}",
                         "`vitkit models` lists them all; e.g. `vitkit models B/16`")
    Console(width=120).print(table)


def info(path: Path = typer.Argument(..., help="A checkpoint folder or file.")) -> None:
    """What a checkpoint holds: architecture, parameters, classes and preprocessing."""
    from .. import load
    from ..checkpoint import preprocessing
    from ..config import changes_from_preset
    from ..counting import count_flops

    model = load(path)
    cfg = model.cfg
    changes = changes_from_preset(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    names = getattr(model, "class_names", None)
    flops = count_flops(cfg)
    rows = [
        ("path", str(path)),
        ("name", (cfg.name or "-") + (f" (the preset with {', '.join(changes)})" if changes else "")),
        ("image size", f"{cfg.image_size[0]}x{cfg.image_size[1]}, {cfg.in_chans} channel(s)"),
        ("patch", f"{cfg.patch_size} (grid {cfg.grid_size[0]}x{cfg.grid_size[1]}, {cfg.num_tokens} tokens)"
                  + (", shifted patch tokenization (spt)" if cfg.spt else "")),
        ("width / depth / heads / MLP", f"{cfg.dim} / {cfg.depth} / {cfg.num_heads} / {cfg.mlp_dim}"
                                        + (", locality self-attention (lsa)" if cfg.lsa else "")),
        ("pooling / position embedding", f"{cfg.pool} / {cfg.pos_embed}"),
        ("GELU / LayerNorm eps", f"{cfg.gelu} / {cfg.ln_eps:g}"),
        ("pre-logits", str(cfg.representation_size or "none")),
        ("hybrid ResNet units", str(cfg.hybrid_layers) if cfg.hybrid_layers else "none"),
        ("parameters", f"{n_params:,}"),
        ("GFLOPs per image", f"{flops / 1e9:.3g} (2 per multiply-add; {flops / 2e9:.3g} GMACs, what timm and "
                             "fvcore call FLOPs)"),
        ("classes", f"{cfg.num_classes}" + (f": {', '.join(names[:10])}" + (" ..." if len(names) > 10 else "")
                                            if names else "")),
        ("preprocessing", str(preprocessing(cfg))),
    ]
    table = Table(show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    Console(width=120).print(table)


def register(app: typer.Typer) -> None:
    app.command()(models)
    app.command()(info)
