"""`vitkit analyze attention|filters|posemb|distance` (the paper's Figures 6 and 7), `vitkit fewshot` (the
few-shot linear evaluation) and `vitkit probe` (a logistic-regression probe), on any checkpoint vitkit
loads."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from .device import DEVICE_HELP, parse_device

analyze_app = typer.Typer(
    help="Look inside a ViT as the paper does: attention maps (Fig. 6), filters, position embeddings and "
         "attention distance (Fig. 7).",
    no_args_is_help=True,
)

CKPT_HELP = "A checkpoint vitkit loads (a vitkit folder, or any format `vitkit info` reads)."


FAST_HELP = "Run through vitkit.accelerate's CPU kernels (same results, faster); nothing is swapped on a GPU."


def _load(ckpt: str, fast: bool = False, dev=None):
    """The model of `ckpt`, on `dev` where given, and with `fast` accelerated (vitkit.accelerate)."""
    from .. import load
    from ..cpu import accelerate

    model = load(ckpt)
    if dev is not None:
        model = model.to(dev)
    return accelerate(model) if fast else model


def _label(ckpt: str, model) -> str:
    """The checkpoint's name and the architecture, for figure titles."""
    cfg = model.cfg
    gh, gw = cfg.grid_size
    name = cfg.name or Path(ckpt.rstrip("/")).name
    return (f"{name} (D {cfg.dim}, {cfg.depth} layers, {cfg.num_heads} heads, patch {cfg.patch_size}, "
            f"{gh}x{gw} grid)")


def _write_json(path: Path | None, payload: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")
        typer.echo(f"numbers written to {path}")


def _parse_ints(text: str, what: str, minimum: int = 1, example: str = "1,5,10,25") -> list[int]:
    from .main import UsageError

    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"{what} {text!r} is not a comma-separated list of integers",
                         f"e.g. {what} {example}") from None
    if not values or any(v < minimum for v in values):
        raise UsageError(f"{what} {text!r} must list integers >= {minimum}", f"e.g. {what} {example}")
    return values


# --- vitkit analyze attention -------------------------------------------------------------------------------
@analyze_app.command("attention")
def attention(
    ckpt: str = typer.Argument(..., help=CKPT_HELP),
    images: list[Path] | None = typer.Argument(None, help="Image files to explain (or use --data)."),
    data: str | None = typer.Option(None, "--data", "-d",
                                    help="Take the images from this dataset (name or folder) "
                                         "instead of files."),
    split: str = typer.Option("auto", help="With --data: test, val or train; auto is the data's test split, "
                                           "else its val split, else a folder's own images."),
    data_dir: Path | None = typer.Option(None, "--data-dir",
                                         help="Where to look for (and download) named datasets."),
    indices: str = typer.Option("0,1,2,3", help="With --data: which items, comma-separated."),
    out: Path = typer.Option(Path("attention.png"), "--out", "-o",
                             help="PNG to write (or a folder to write it in)."),
    layer: int | None = typer.Option(None, "--layer", help="Show this layer's raw attention (0-based, -1 the "
                                     "last) instead of the rollout through all layers."),
    head: int | None = typer.Option(None, "--head", help="With --layer: one head's attention instead of the "
                                    "heads' mean."),
    discard: float = typer.Option(0.0, "--discard", help="Rollout: zero this fraction of the weakest "
                                  "attention weights in each row first (0 = the paper's plain rollout)."),
    fast: bool = typer.Option(True, "--fast/--no-fast", help=FAST_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
) -> None:
    """Attention maps from the class token to the patches, overlaid on the images (Fig. 6).

    By default, attention rollout: the heads' mean plus the identity (the residual path), rows re-normalised,
    multiplied through all layers. A GAP model uses the mean over the patch tokens instead (its
    representation).
    """
    import torch

    from ..analysis.figures import plot_attention, save_figure
    from ..analysis.inputs import load_image, to_display
    from ..analysis.rollout import attention_rollout, layer_attention
    from ..data import resolve
    from ..data.datasets import evaluation_split
    from ..data.transforms import build_eval_transform
    from .main import UsageError

    if head is not None and layer is None:
        raise UsageError("--head needs --layer", "e.g. --layer -1 --head 0")
    if not 0 <= discard < 1:
        raise UsageError(f"--discard {discard:g} must be at least 0 and below 1", "e.g. --discard 0.9")
    if bool(images) == (data is not None):
        raise UsageError("give image files or --data, not both or neither",
                         "e.g. `vitkit analyze attention CKPT cat.jpg` or `... CKPT --data fashion-mnist`")
    dev = parse_device(device)
    model = _load(ckpt, fast, dev)
    cfg = model.cfg
    transform = build_eval_transform(cfg)
    if data is not None:
        split = evaluation_split(data, split)
        dataset = resolve(data, split, data_dir)
        picked = _parse_ints(indices, "--indices", minimum=0, example="0,1,6,8")
        bad = [i for i in picked if i >= len(dataset)]
        if bad:
            raise UsageError(f"--indices {bad} out of range: {data} ({split}) has {len(dataset)} items")
        classes = getattr(dataset, "classes", None)
        items = [dataset[i] for i in picked]
        x = torch.stack([transform(im) for im, _ in items])  # (B, C, H, W)
        titles = [f"{data} #{i}" + (f": {classes[y]}" if classes else "") for i, (_, y) in zip(picked, items,
                                                                                            strict=True)]
    else:
        x = torch.stack([transform(load_image(p, cfg)) for p in images])  # (B, C, H, W)
        titles = [p.name for p in images]
    with torch.inference_mode():
        _, attns = model.forward_features(x.to(dev), return_attention=True)
    attns = [a.cpu() for a in attns]
    if layer is None:
        maps = attention_rollout(attns, cfg.num_prefix_tokens, discard_ratio=discard, pool=cfg.pool)
        method = "rollout"
    else:
        maps = layer_attention(attns, layer, cfg.num_prefix_tokens, head, pool=cfg.pool)
        method = f"layer {layer}" + (f", head {head}" if head is not None else ", mean of heads")
    query = "class token" if cfg.pool == "token" else "mean patch token (GAP)"
    fig = plot_attention([to_display(xi, cfg) for xi in x], list(maps), cfg.grid_size,
                         titles=titles, method=method,
                         suptitle=f"Attention from the {query}: {_label(ckpt, model)}")
    typer.echo(f"wrote {save_figure(fig, out, name_in_folder='attention.png')}")


# --- vitkit analyze filters ---------------------------------------------------------------------------------
@analyze_app.command("filters")
def filters(
    ckpt: str = typer.Argument(..., help=CKPT_HELP),
    out: Path = typer.Option(Path("filters.png"), "--out", "-o",
                             help="PNG to write (or a folder to write it in)."),
    components: int = typer.Option(28, "--components", "-k", min=1,
                                   help="How many principal components to show."),
) -> None:
    """The first principal components of the patch-embedding filters as RGB or grey patches (Fig. 7, left)."""
    from ..analysis.figures import plot_filters, save_figure
    from ..analysis.filters import filter_principal_components
    from .main import UsageError

    model = _load(ckpt)
    proj = getattr(model.patch_embed, "proj", None)
    if model.cfg.hybrid_layers is not None or proj is None:  # a hybrid's proj is a 1x1 map of ResNet channels
        raise UsageError(f"{ckpt}: a hybrid model has no patch filters (its patches are ResNet features)",
                         "use a plain ViT checkpoint")
    if model.cfg.spt:  # vitkit.spt: the projection reads five shifted copies of a patch, layer-normalised
        raise UsageError(f"{ckpt}: a model with shifted patch tokenization (spt) projects each patch with "
                         "its four shifted copies, layer-normalised: its filters are not Fig. 7's patch "
                         "filters",
                         "use a checkpoint of a ViT without spt")
    pcs = filter_principal_components(proj.weight, components)
    fig = plot_filters(pcs, title=f"Patch-embedding filters, first {pcs.components.shape[0]} principal "
                                  f"components:\n{_label(ckpt, model)}")
    typer.echo(f"wrote {save_figure(fig, out, name_in_folder='filters.png')}")
    shares = ", ".join(f"{100 * float(v):.1f}%" for v in pcs.explained[:5])
    typer.echo(f"variance explained by the first components: {shares}")


# --- vitkit analyze posemb ----------------------------------------------------------------------------------
@analyze_app.command("posemb")
def posemb(
    ckpt: str = typer.Argument(..., help=CKPT_HELP),
    out: Path = typer.Option(Path("posemb.png"), "--out", "-o",
                             help="PNG to write (or a folder to write it in)."),
) -> None:
    """Cosine similarity of each patch's position embedding with all others, tiled on the grid (Fig. 7,
    centre)."""
    from ..analysis.figures import plot_position_similarity, save_figure
    from ..analysis.posemb_similarity import position_similarity
    from .main import UsageError

    model = _load(ckpt)
    table = model.position_table()
    if table is None:
        raise UsageError(f"{ckpt}: the model has no position embedding (pos_embed='none')",
                         "use a checkpoint with learned or sin-cos position embeddings")
    sim = position_similarity(table, model.cfg.grid_size, model.cfg.num_prefix_tokens)
    fig = plot_position_similarity(sim, title=f"Position embedding similarity ({model.cfg.pos_embed}):\n"
                                              f"{_label(ckpt, model)}")
    typer.echo(f"wrote {save_figure(fig, out, name_in_folder='posemb.png')}")


# --- vitkit analyze distance --------------------------------------------------------------------------------
@analyze_app.command("distance")
def distance(
    ckpt: str = typer.Argument(..., help=CKPT_HELP),
    data: str = typer.Option(..., "--data", "-d",
                             help="Dataset name (fashion-mnist, cifar10, cifar100) or image folder."),
    split: str = typer.Option("auto", help="Split: test, val or train; auto is the data's test split, else "
                                           "its val split, else a folder's own images."),
    data_dir: Path | None = typer.Option(None, "--data-dir",
                                         help="Where to look for (and download) named datasets."),
    num_images: int = typer.Option(256, "--num-images", "-n",
                                   help="Images to average over: N spread evenly over the split, so every "
                                        "class has its share."),
    batch_size: int = typer.Option(32, "--batch-size", "-b", min=1, help="Images per forward pass."),
    out: Path = typer.Option(Path("distance.png"), "--out", "-o",
                             help="PNG to write (or a folder to write it in)."),
    json_out: Path | None = typer.Option(None, "--json",
                                         help="Also write the (layers x heads) numbers here."),
    fast: bool = typer.Option(True, "--fast/--no-fast", help=FAST_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
) -> None:
    """Mean attention distance in pixels of every head against depth (Fig. 7, right)."""
    import torch
    from tqdm.auto import tqdm

    from ..analysis.distance import attention_distance, patch_distances
    from ..analysis.features import iterate_batches
    from ..analysis.figures import plot_attention_distance, save_figure
    from ..data import resolve
    from ..data.datasets import evaluation_split
    from ..data.subsets import spread_subset
    from ..data.transforms import build_eval_transform
    from .main import UsageError

    if num_images < 1:
        raise UsageError(f"--num-images must be positive, got {num_images}")
    dev = parse_device(device)
    model = _load(ckpt, fast, dev).eval()
    cfg = model.cfg
    split = evaluation_split(data, split)
    dataset = spread_subset(resolve(data, split, data_dir), num_images)
    total = torch.zeros(cfg.depth, cfg.num_heads, dtype=torch.float64)
    seen = 0
    with torch.inference_mode(), tqdm(total=len(dataset), desc="attention distance", unit="img") as bar:
        for x, _ in iterate_batches(dataset, batch_size, build_eval_transform(cfg)):
            _, attns = model.forward_features(x.to(dev), return_attention=True)
            for i, a in enumerate(attns):
                total[i] += attention_distance(a, cfg.grid_size, cfg.patch_stride,
                                               cfg.num_prefix_tokens).sum(0).cpu()
            seen += x.shape[0]
            bar.update(x.shape[0])
    dist = total / seen  # (layers, heads)
    uniform = float(patch_distances(cfg.grid_size, cfg.patch_stride).mean())
    fig = plot_attention_distance(dist, reference=uniform,
                                  title=f"Mean attention distance over {seen} images of {data}:\n"
                                        f"{_label(ckpt, model)}")
    typer.echo(f"wrote {save_figure(fig, out, name_in_folder='distance.png')}")
    table = Table(title="mean attention distance (pixels)")
    table.add_column("layer", justify="right")
    for col in ("min head", "mean", "max head"):
        table.add_column(col, justify="right")
    for i, row in enumerate(dist):
        table.add_row(str(i), f"{row.min():.1f}", f"{row.mean():.1f}", f"{row.max():.1f}")
    Console(width=100).print(table)
    typer.echo(f"uniform attention over the {cfg.grid_size[0]}x{cfg.grid_size[1]} grid: {uniform:.1f} px")
    _write_json(json_out, {"checkpoint": ckpt, "data": data, "split": split, "images": seen,
                           "uniform_attention_px": uniform, "distance_px": dist.tolist()})


# --- vitkit fewshot / probe ---------------------------------------------------------------------------------
def _cache_file(cache_dir: Path | None, ckpt: str, data: str, split: str, tag: str) -> Path | None:
    if cache_dir is None:
        return None
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{Path(ckpt).name}-{data}-{split}-{tag}")
    return cache_dir / f"{stem}.safetensors"


def _features(model, ckpt: str, data: str, split: str, batch_size: int, cache_dir: Path | None, dev, dataset):
    """Representations of a split's `dataset`, through a cache file when asked."""
    from ..analysis.features import extract_features
    from ..data.transforms import build_eval_transform

    return extract_features(model, dataset,
                            cache=_cache_file(cache_dir, ckpt, data, split, str(len(dataset))),
                            data_key=f"{data}:{split}", batch_size=batch_size,
                            transform=build_eval_transform(model.cfg), device=dev, desc=f"features {split}")


def _train_and_test(data: str, train_split: str, test_split: str, data_dir: Path | None,
                    max_train: int | None, max_test: int | None):
    """The two splits fewshot and probe fit and measure on: the test split's classes numbered as the training
    split's, by name (a folder numbers its own sub-folders), each cut to its --max-* images spread over it.
    A folder without split sub-folders would serve its own images as both: refused."""
    from ..data import resolve
    from ..data.datasets import evaluation_split
    from ..data.subsets import spread_subset
    from ..data.views import with_classes
    from .main import UsageError

    test_split = evaluation_split(data, test_split)
    train_set, test_set = resolve(data, train_split, data_dir), resolve(data, test_split, data_dir)
    if getattr(test_set, "split_of_root", False):  # a folder without split folders: its own images
        raise UsageError(f"{data} has no {train_split}/ and {test_split}/ sub-folders: its {test_split} "
                         f"images would be the {train_split} images themselves",
                         "give a folder with train/ and test/ sub-folders of class folders")
    try:
        test_set = with_classes(test_set, list(getattr(train_set, "classes", None) or []),
                                f"{data} ({test_split})", f"its {train_split} split")
    except ValueError as e:
        raise UsageError(str(e), "the test split's classes must be among the training split's") from None
    return spread_subset(train_set, max_train), spread_subset(test_set, max_test)


def _labels(dataset):
    """A dataset's labels, without decoding images where the dataset keeps them."""
    import torch

    targets = getattr(dataset, "targets", None)
    if targets is not None:
        return torch.as_tensor(targets, dtype=torch.int64)
    return torch.as_tensor([int(dataset[i][1]) for i in range(len(dataset))], dtype=torch.int64)


def fewshot(
    ckpt: str = typer.Argument(..., help=CKPT_HELP),
    data: str = typer.Option(..., "--data", "-d",
                             help="Dataset name (fashion-mnist, cifar10, cifar100) or image folder."),
    shots: str = typer.Option("1,5,10,25", help="Training examples per class, comma-separated."),
    seeds: int = typer.Option(3, help="Random draws of the shots to average over (big_vision: 3)."),
    l2_reg: float = typer.Option(2.0**10, "--l2-reg", help="L2 regularisation of the least-squares fit "
                                 "(big_vision: 2^10)."),
    train_split: str = typer.Option("train", help="Split the shots are drawn from."),
    test_split: str = typer.Option("auto", help="Split the accuracy is measured on (auto: the data's test "
                                                "split, else its val split)."),
    data_dir: Path | None = typer.Option(None, "--data-dir",
                                         help="Where to look for (and download) named datasets."),
    max_train: int | None = typer.Option(None, min=1,
                                         help="Draw the shots from N training images only, spread "
                                              "over the split."),
    max_test: int | None = typer.Option(None, min=1,
                                        help="Use only N test images, spread over the split (faster)."),
    batch_size: int = typer.Option(128, "--batch-size", "-b", min=1, help="Images per forward pass."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help="Cache the features here (safetensors)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the results here."),
    plot: Path | None = typer.Option(None, "--plot", help="Also draw accuracy against shots to this PNG."),
    fast: bool = typer.Option(True, "--fast/--no-fast", help=FAST_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
) -> None:
    """Few-shot linear evaluation as in the paper: least squares to {-1, 1}^K targets on frozen features.

    The fit is closed-form and L2-regularised (big_vision's fewshot_lsr); accuracy is averaged over random
    draws of the shots.
    """
    from ..analysis.features import extract_features
    from ..analysis.fewshot import draw_shots, fewshot_eval
    from ..data.transforms import build_eval_transform
    from .main import UsageError

    shot_list = _parse_ints(shots, "--shots")
    if seeds < 1:
        raise UsageError(f"--seeds must be at least 1, got {seeds}")
    import hashlib

    import numpy as np
    import torch

    dev = parse_device(device)
    model = _load(ckpt, fast, dev)
    train_set, test_set = _train_and_test(data, train_split, test_split, data_dir, max_train, max_test)
    labels = _labels(train_set)
    classes = getattr(train_set, "classes", None)
    K = len(classes) if classes else int(labels.max()) + 1
    counts = torch.bincount(labels, minlength=K).tolist()
    short = [f"{classes[c] if classes else c} ({n})" for c, n in enumerate(counts) if n < max(shot_list)]
    if short:
        raise UsageError(f"{len(short)} of the {K} classes of {data} ({train_split}) have fewer than "
                         f"{max(shot_list)} images for the shots: {', '.join(short[:10])}"
                         + (", ..." if len(short) > 10 else ""),
                         "ask for fewer --shots" + (", or a larger --max-train" if max_train else ""))
    # Draw the shots from all the labels first: only the drawn images' features are needed.
    draws = draw_shots(labels, K, shot_list, seeds)
    needed = np.unique(np.concatenate(list(draws.values())))
    row = {int(i): j for j, i in enumerate(needed)}
    local = {k: np.array([row[int(i)] for i in v]) for k, v in draws.items()}
    subset = torch.utils.data.Subset(train_set, needed.tolist())
    digest = hashlib.sha256(needed.tobytes()).hexdigest()[:12]
    train = extract_features(model, subset,
                             cache=_cache_file(cache_dir, ckpt, data, train_split, f"shots-{digest}"),
                             data_key=f"{data}:{train_split}:{digest}", batch_size=batch_size,
                             transform=build_eval_transform(model.cfg), device=dev,
                             desc=f"features {train_split} (shots)")
    test = _features(model, ckpt, data, test_split, batch_size, cache_dir, dev, test_set)
    results = fewshot_eval(train.features, train.labels, test.features, test.labels, shot_list, K, l2_reg,
                           seeds, draws=local)
    table = Table(title=f"few-shot linear evaluation: {data}, {len(test.labels)} test images, {seeds} seeds")
    for col in ("shots per class", "accuracy %", "std %", "per seed %"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r.shots), f"{100 * r.mean:.2f}", f"{100 * r.std:.2f}",
                      " ".join(f"{100 * a:.2f}" for a in r.accuracies))
    Console(width=100).print(table)
    if plot is not None:
        from ..analysis.figures import plot_fewshot, save_figure

        rows = [(r.shots, 100 * r.mean, 100 * r.std) for r in results]
        fig = plot_fewshot({model.cfg.name or Path(ckpt).name: rows},
                           title=f"Few-shot linear evaluation on {data}\n(mean and std over {seeds} draws of "
                                 "the shots)")
        typer.echo(f"wrote {save_figure(fig, plot)}")
    _write_json(json_out, {"checkpoint": ckpt, "data": data, "l2_reg": l2_reg, "seeds": seeds,
                           "train_pool": len(labels), "train_images": len(train.labels),
                           "test_images": len(test.labels),
                           "results": [{"shots": r.shots, "accuracy": r.mean, "std": r.std,
                                        "per_seed": list(r.accuracies)} for r in results]})


def probe(
    ckpt: str = typer.Argument(..., help=CKPT_HELP),
    data: str = typer.Option(..., "--data", "-d",
                             help="Dataset name (fashion-mnist, cifar10, cifar100) or image folder."),
    c: float | None = typer.Option(None, "--C", help="Inverse regularisation strength; default: chosen from "
                                   "0.01, 0.1, 1, 10 on a held-out tenth of the training features."),
    train_split: str = typer.Option("train", help="Split to fit on."),
    test_split: str = typer.Option("auto", help="Split to measure on (auto: the data's test split, else its "
                                                "val split)."),
    data_dir: Path | None = typer.Option(None, "--data-dir",
                                         help="Where to look for (and download) named datasets."),
    max_train: int | None = typer.Option(None, min=1,
                                         help="Use only N training images, spread over the split "
                                              "(faster)."),
    max_test: int | None = typer.Option(None, min=1,
                                        help="Use only N test images, spread over the split (faster)."),
    max_iter: int = typer.Option(1000, min=1, help="L-BFGS iterations."),
    batch_size: int = typer.Option(128, "--batch-size", "-b", min=1, help="Images per forward pass."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help="Cache the features here (safetensors)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the results here."),
    fast: bool = typer.Option(True, "--fast/--no-fast", help=FAST_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
) -> None:
    """Linear probe: logistic regression on frozen representations (standardised features)."""
    from ..analysis.probe import linear_probe

    dev = parse_device(device)
    model = _load(ckpt, fast, dev)
    train_set, test_set = _train_and_test(data, train_split, test_split, data_dir, max_train, max_test)
    train = _features(model, ckpt, data, train_split, batch_size, cache_dir, dev, train_set)
    test = _features(model, ckpt, data, test_split, batch_size, cache_dir, dev, test_set)
    result = linear_probe(train.features, train.labels, test.features, test.labels, C=c, max_iter=max_iter)
    for cv, acc in result.validation.items():
        typer.echo(f"C={cv:g}: held-out accuracy {100 * acc:.2f}%")
    typer.echo(f"linear probe on {data}: test accuracy {100 * result.accuracy:.2f}% "
               f"(train {100 * result.train_accuracy:.2f}%, C={result.C:g}, {len(train.labels)} training and "
               f"{len(test.labels)} test images)")
    _write_json(json_out, {"checkpoint": ckpt, "data": data, "C": result.C, "accuracy": result.accuracy,
                           "train_accuracy": result.train_accuracy, "validation": result.validation,
                           "train_images": len(train.labels), "test_images": len(test.labels)})


def register(app: typer.Typer) -> None:
    app.add_typer(analyze_app, name="analyze")
    app.command()(fewshot)
    app.command()(probe)
