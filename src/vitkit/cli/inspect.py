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
    """Table of the presets: parameters, GFLOPs per image and tokens."""
    from ..config import PRESETS
    from ..model import count_flops, count_parameters

    table = Table(title=f"vitkit presets (parameters with a {classes}-class head)")
    for col, justify in (("name", "left"), ("timm name", "left"), ("image", "right"), ("params", "right"),
                         ("GFLOPs", "right"), ("tokens", "right")):
        table.add_column(col, justify=justify)
    for preset in PRESETS.values():
        if filter and filter.lower() not in preset.name.lower() and filter.lower() not in preset.timm_name:
            continue
        cfg = preset.config.replace(num_classes=classes)
        h, w = cfg.image_size
        table.add_row(preset.name, preset.timm_name, f"{h}x{w}", f"{count_parameters(cfg):,}",
                      f"{count_flops(cfg) / 1e9:.2f}", str(cfg.num_tokens))
    Console(width=120).print(table)


def info(path: Path = typer.Argument(..., help="A checkpoint folder or file.")) -> None:
    """What a checkpoint holds: architecture, parameters, classes and preprocessing."""
    from .. import load
    from ..checkpoint import preprocessing
    from ..model import count_flops

    model = load(path)
    cfg = model.cfg
    n_params = sum(p.numel() for p in model.parameters())
    names = getattr(model, "class_names", None)
    rows = [
        ("path", str(path)),
        ("name", cfg.name or "-"),
        ("image size", f"{cfg.image_size[0]}x{cfg.image_size[1]}, {cfg.in_chans} channel(s)"),
        ("patch", f"{cfg.patch_size} (grid {cfg.grid_size[0]}x{cfg.grid_size[1]}, {cfg.num_tokens} tokens)"),
        ("width / depth / heads / MLP", f"{cfg.dim} / {cfg.depth} / {cfg.num_heads} / {cfg.mlp_dim}"),
        ("pooling / position embedding", f"{cfg.pool} / {cfg.pos_embed}"),
        ("GELU / LayerNorm eps", f"{cfg.gelu} / {cfg.ln_eps:g}"),
        ("pre-logits", str(cfg.representation_size or "none")),
        ("hybrid ResNet units", str(cfg.hybrid_layers) if cfg.hybrid_layers else "none"),
        ("parameters", f"{n_params:,}"),
        ("GFLOPs per image", f"{count_flops(cfg) / 1e9:.2f}"),
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
