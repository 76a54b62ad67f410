"""Inference speed of vitkit against timm, Hugging Face and torchvision, measured side by side.

Shared machines are noisy, so absolute times from different runs mean little. The harness therefore
measures every contender of a cell (model x batch size) in one process, with the repetitions interleaved in
a fresh random order each round, each contender's timed call after a pause and an untimed call of its own
(`vitkit.timing.interleaved_times`). It reports medians of the times, and the ratios between contenders (and
MFU) as medians of ratios taken within each round (`vitkit.timing.paired_ratio`). The fp32 SGEMM peak that
model FLOP utilisation (MFU) is measured against is one more contender in the same loop: a big `torch.mm`,
timed under the same conditions as the models.

All models have random weights and the same architecture (built from one ViTConfig), so they do the same
FLOPs (`vitkit.count_flops`). The process's allocator is set first (`vitkit.retain_freed_memory`):
it is process-wide, so every contender runs with it alike.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .bench_runtimes import RUNTIMES
from .bench_runtimes import builders as runtime_builders
from .config import ViTConfig, get_config
from .counting import count_flops
from .cpu.hardware import ISA_HOLD_ENV, cpu_has_native_bf16, cpu_has_vnni
from .model import create_model
from .timing import interleaved_times, paired_ratio

# The anchors: the other implementations we compare against.
ANCHORS: tuple[str, ...] = ("timm", "hf-eager", "hf-sdpa", "torchvision")
# vitkit's contenders: the accelerated model (vitkit.accelerate) and what `vitkit.optimize` makes of it.
OURS: tuple[str, ...] = ("vitkit", "vitkit-fp32-opt", "vitkit-int8")
CONTENDERS: tuple[str, ...] = OURS + ANCHORS  # the default set
# Measured only when asked for (`-c vitkit-bf16`): it needs a GPU or a CPU with native bf16.
# The plain model (no CPU kernels swapped in) is measured only when asked for too (`-c vitkit-plain`).
OPTIONAL: tuple[str, ...] = ("vitkit-bf16", "vitkit-plain")
# What a deploying user would run instead (`vitkit bench --runtimes`: vitkit.bench_runtimes), timm compiled.
RUNTIME_CONTENDERS: tuple[str, ...] = ("timm-compiled", *RUNTIMES)
# Each vitkit contender's rivals among the runtimes: the same precision.
RUNTIME_RIVALS: dict[str, tuple[str, ...]] = {
    "vitkit-fp32-opt": ("ort-fp32", "openvino-fp32"),
    "vitkit-int8": ("ort-int8", "openvino-int8"),
    "vitkit-bf16": ("openvino-bf16",),
}
SGEMM = "sgemm"
# The same product through oneDNN with a prepacked operand, what optimize('fp32') runs: for reference only,
# MFU is against torch.mm.
SGEMM_ONEDNN = "sgemm-onednn"


# --- the contenders -------------------------------------------------------------------------------------
class LogitsOnly(nn.Module):
    """Hugging Face models return an output object: keep the logits, so every contender returns a tensor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits


def _square(cfg: ViTConfig, who: str) -> int:
    h, w = cfg.image_size
    if h != w:
        raise ValueError(f"{who} builds square images only, got image_size={cfg.image_size}")
    return h


def build_timm(cfg: ViTConfig) -> nn.Module:
    """timm's VisionTransformer with the same architecture, fused attention
    (F.scaled_dot_product_attention)."""
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(
        img_size=cfg.image_size, patch_size=cfg.patch_size, in_chans=cfg.in_chans,
        num_classes=cfg.num_classes,
        embed_dim=cfg.dim, depth=cfg.depth, num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_dim / cfg.dim,
        qkv_bias=cfg.qkv_bias, global_pool="token", drop_path_rate=cfg.drop_path,
        patch_drop_rate=cfg.patch_dropout,
    )
    if not all(block.attn.fused_attn for block in model.blocks):
        raise RuntimeError("timm's fused attention is off (TIMM_FUSED_ATTN=0?): the comparison would be "
                           "unfair")
    return model


def build_hf(cfg: ViTConfig, attn_implementation: str) -> nn.Module:
    """Hugging Face's ViTForImageClassification with the given attention implementation ('eager', 'sdpa')."""
    from transformers import ViTConfig as HFConfig
    from transformers import ViTForImageClassification

    hf_cfg = HFConfig(
        hidden_size=cfg.dim, num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.mlp_dim, image_size=_square(cfg, "Hugging Face ViT"), patch_size=cfg.patch_size,
        num_channels=cfg.in_chans, num_labels=cfg.num_classes, layer_norm_eps=cfg.ln_eps,
        qkv_bias=cfg.qkv_bias,
    )
    model = ViTForImageClassification._from_config(hf_cfg, attn_implementation=attn_implementation)
    return LogitsOnly(model)


def build_torchvision(cfg: ViTConfig) -> nn.Module:
    """torchvision's VisionTransformer (what `vit_b_16` builds, at any size)."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(
        image_size=_square(cfg, "torchvision's ViT"), patch_size=cfg.patch_size, num_layers=cfg.depth,
        num_heads=cfg.num_heads, hidden_dim=cfg.dim, mlp_dim=cfg.mlp_dim, num_classes=cfg.num_classes,
    )


def build_vitkit(cfg: ViTConfig, precision: str | None = None, fast: bool = True) -> nn.Module:
    """vitkit's model: accelerated (precision None; plain too with fast=False) or through `vitkit.optimize`
    (no compile)."""
    from .cpu import accelerate
    from .inference import optimize

    model = create_model(cfg)
    # Random, non-zero weights everywhere (vitkit's classifier starts at zero), like the other contenders.
    with torch.no_grad():
        for p in model.head.parameters():
            nn.init.normal_(p, std=0.02)
    if precision is None:
        return accelerate(model) if fast else model
    return optimize(model, precision, compile=False)


def build_timm_compiled(cfg: ViTConfig) -> nn.Module:
    """timm's model through torch.compile (inductor, `freezing` on: the weights folded in as constants, as
    for inference); it compiles at its first call, a warm-up call."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    return torch.compile(build_timm(cfg).eval())


BUILDERS: dict[str, Callable[[ViTConfig], nn.Module]] = {
    "vitkit": build_vitkit,
    "vitkit-plain": lambda cfg: build_vitkit(cfg, fast=False),
    "vitkit-fp32-opt": lambda cfg: build_vitkit(cfg, "fp32"),
    "vitkit-int8": lambda cfg: build_vitkit(cfg, "int8"),
    "vitkit-bf16": lambda cfg: build_vitkit(cfg, "bf16"),
    "timm": build_timm,
    "hf-eager": lambda cfg: build_hf(cfg, "eager"),
    "hf-sdpa": lambda cfg: build_hf(cfg, "sdpa"),
    "torchvision": build_torchvision,
    "timm-compiled": build_timm_compiled,
    # ONNX Runtime and OpenVINO, from the plain vitkit model exported to ONNX
    **runtime_builders(lambda cfg: build_vitkit(cfg, fast=False)),
}


# --- configuration and results --------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    """What to measure. `models` are preset names or ViTConfigs (tests use tiny ones)."""

    models: tuple[str | ViTConfig, ...] = ("ViT-S/16", "ViT-B/16")
    batch_sizes: tuple[int, ...] = (1, 16)
    contenders: tuple[str, ...] = CONTENDERS
    repeats: int = 10
    warmup: int = 2
    settle: int = 1  # untimed calls of a contender before each timed one (interleaved_times)
    pause_s: float = 0.1  # seconds of quiet before each contender's turn, where settle > 0
    threads: int | None = None  # None: torch's default (all cores)
    sgemm_size: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [c for c in self.contenders if c not in BUILDERS]
        if unknown:
            raise ValueError(f"unknown contenders {unknown}; choose from "
                             f"{', '.join(CONTENDERS + OPTIONAL + RUNTIME_CONTENDERS)}")
        if not self.contenders:
            raise ValueError("no contenders to measure")
        if self.repeats < 1 or self.warmup < 0 or self.settle < 0 or self.pause_s < 0:
            raise ValueError(f"repeats={self.repeats} must be >= 1, warmup={self.warmup}, "
                             f"settle={self.settle} and pause_s={self.pause_s} >= 0")
        if any(b < 1 for b in self.batch_sizes) or not self.batch_sizes:
            raise ValueError(f"batch sizes {self.batch_sizes} must be positive")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads} must be >= 1")
        if self.sgemm_size < 16:
            raise ValueError(f"sgemm_size={self.sgemm_size} is too small to measure a peak")


@dataclass
class Measurement:
    """The times of one contender in one cell, and what follows from them."""

    model: str
    batch: int
    contender: str
    seconds: list[float] = field(default_factory=list)
    flops_per_image: float = 0.0

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def images_per_s(self) -> float:
        return self.batch / self.median_s

    @property
    def gflops(self) -> float:
        return self.flops_per_image * self.batch / self.median_s / 1e9


@dataclass
class Cell:
    model: str
    batch: int
    flops_per_image: float
    sgemm_seconds: list[float]
    sgemm_size: int
    results: dict[str, Measurement]
    onednn_gflops: float | None = None

    @property
    def sgemm_gflops(self) -> float:
        return sgemm_gflops(statistics.median(self.sgemm_seconds), self.sgemm_size)

    def best_anchor(self) -> Measurement | None:
        anchors = [m for name, m in self.results.items() if name in ANCHORS]
        return max(anchors, key=lambda m: m.images_per_s) if anchors else None

    def rows(self) -> list[dict[str, Any]]:
        """One dict per contender. `vs_best_anchor` is paired (see paired_ratio) against the fastest anchor
        of each round; `mfu` is paired with the SGEMM of the same round."""
        best = self.best_anchor()
        anchor_times = [m.seconds for name, m in self.results.items() if name in ANCHORS]
        sgemm_flops = 2.0 * self.sgemm_size**3
        rows = []
        for name, m in self.results.items():
            model_flops = self.flops_per_image * self.batch
            # model FLOP/s over SGEMM FLOP/s, round by round: (model_flops / t) / (sgemm_flops / t_sgemm)
            mfu = statistics.median(model_flops * ts / (sgemm_flops * t)
                                    for t, ts in zip(m.seconds, self.sgemm_seconds, strict=True))
            runtimes = [self.results[r].seconds for r in RUNTIME_RIVALS.get(name, ()) if r in self.results]
            rows.append({
                "model": self.model, "batch": self.batch, "contender": name,
                # against the faster of ONNX Runtime and OpenVINO at the same precision, where measured
                "vs_best_runtime": paired_ratio(m.seconds, runtimes) if runtimes else None,
                "images_per_s": m.images_per_s, "latency_ms": 1e3 * m.median_s,
                "vs_best_anchor": paired_ratio(m.seconds, anchor_times) if anchor_times else None,
                "vs_best_anchor_of_medians": m.images_per_s / best.images_per_s if best else None,
                "best_anchor": best.contender if best else None,
                "gflops": m.gflops, "mfu": mfu,
                "seconds": m.seconds,
            })
        return rows


# --- measuring ------------------------------------------------------------------------------------------
def sgemm_gflops(seconds: float, n: int) -> float:
    """GFLOP/s of an n x n by n x n fp32 product taking `seconds` (2 n^3 FLOPs)."""
    return 2.0 * n**3 / seconds / 1e9


def cells_parser(description: str) -> argparse.ArgumentParser:
    """The command line of a benchmark over cells of models and batch sizes (benchmarks/bench_int8_*.py):
    -m/--model and -b/--batch (repeatable), --threads, --repeats, --warmup and --json."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("-m", "--model", action="append", default=None,
                   help="a preset name, repeatable (default: ViT-S/16 and ViT-B/16)")
    p.add_argument("-b", "--batch", type=int, action="append", default=None,
                   help="a batch size, repeatable (default: 1 and 16)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=8, help="interleaved rounds per cell")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of each contender first")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def _label(model: str | ViTConfig) -> str:
    if isinstance(model, ViTConfig):
        h, w = model.image_size
        return model.name or f"D{model.dim}-L{model.depth}-P{model.patch_size}@{h}x{w}"
    return model


def measure_cell(model: str | ViTConfig, batch: int, config: BenchConfig, rng: random.Random,
                 progress: Callable[[], None] | None = None) -> Cell:
    """Build every contender for one model and batch size and time them interleaved with the SGEMM."""
    cfg = model if isinstance(model, ViTConfig) else get_config(model)
    torch.manual_seed(config.seed)
    x = torch.randn(batch, cfg.in_chans, *cfg.image_size)
    n = config.sgemm_size
    a, b = torch.randn(n, n), torch.randn(n, n)
    models = {name: BUILDERS[name](cfg).eval() for name in config.contenders}
    calls: dict[str, Callable[[], Any]] = {name: (lambda m=m: m(x)) for name, m in models.items()}
    calls[SGEMM] = lambda: torch.mm(a, b)
    from .cpu.private import onednn_linear, onednn_packing_available, pack_weight

    if onednn_packing_available():
        packed = pack_weight(b.t().contiguous(), n)
        calls[SGEMM_ONEDNN] = lambda: onednn_linear(a, packed, None)
    with torch.inference_mode():
        times = interleaved_times(calls, config.repeats, config.warmup, rng, progress, config.settle,
                                  config.pause_s if config.settle else 0.0)
    flops = count_flops(cfg)
    label = _label(model)
    results = {name: Measurement(label, batch, name, times[name], flops) for name in config.contenders}
    onednn = sgemm_gflops(statistics.median(times[SGEMM_ONEDNN]), n) if SGEMM_ONEDNN in times else None
    return Cell(label, batch, flops, times[SGEMM], n, results, onednn)


def machine_info() -> dict[str, Any]:
    """The CPU (its name, and the features that decide what the int8 and bf16 paths can do), threads and
    versions: what makes figures of different runs comparable or not."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "vnni": cpu_has_vnni(),
        "native_bf16": cpu_has_native_bf16(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
        # the variables that hold the libraries to a narrower instruction set (an AVX2 proxy), as set
        "isa_hold": {k: os.environ[k] for k in ISA_HOLD_ENV if k in os.environ},
    }


def run(config: BenchConfig, on_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Measure every cell of `config`; returns a JSON-ready dict (machine, SGEMM peak, one row per
    contender and cell). `on_progress(done, total)` is called after every timed call."""
    from .cpu.allocator import retain_freed_memory

    retained = retain_freed_memory()  # process-wide, so every contender runs with the same allocator
    previous_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        rng = random.Random(config.seed)
        cells_spec = [(m, b) for m in config.models for b in config.batch_sizes]
        from .cpu.private import onednn_packing_available

        references = 2 if onednn_packing_available() else 1
        total = len(cells_spec) * config.repeats * (len(config.contenders) + references)
        done = 0

        def tick() -> None:
            nonlocal done
            done += 1
            if on_progress:
                on_progress(done, total)

        cells = [measure_cell(m, b, config, rng, tick) for m, b in cells_spec]
        info = {**machine_info(), "allocator": "glibc, freed memory retained" if retained else "default"}
    finally:
        torch.set_num_threads(previous_threads)
    sgemm = [c.sgemm_gflops for c in cells]
    sgemm_seconds = [c.sgemm_seconds for c in cells]
    onednn = [c.onednn_gflops for c in cells if c.onednn_gflops is not None]
    return {
        "machine": info,
        "config": {**asdict(config), "models": [_label(m) for m in config.models]},
        "sgemm_gflops": {"median_over_cells": statistics.median(sgemm), "per_cell": sgemm,
                         "size": config.sgemm_size, "seconds_per_cell": sgemm_seconds},
        "onednn_gemm_gflops": ({"median_over_cells": statistics.median(onednn), "per_cell": onednn}
                               if onednn else None),
        "rows": [row for cell in cells for row in cell.rows()],
    }


# --- reporting ------------------------------------------------------------------------------------------
def describe_cpu(info: dict[str, Any]) -> str:
    """The CPU of a report's `machine` in a few words: its name, ATen's vector ISA and whether it has VNNI
    (int8 dot products: without them `optimize(int8)` gains far less over fp32) and native bf16."""
    features = [info.get("cpu_capability") or "?"]
    for key, name in (("vnni", "VNNI"), ("native_bf16", "bf16")):
        if key in info:  # reports written before these were recorded lack them
            features.append(f"{name} {'yes' if info[key] else 'no'}")
    return f"{info['cpu']} ({', '.join(features)})"


def format_table(report: dict[str, Any]):
    """A rich Table of a `run` report."""
    from rich.table import Table

    info = report["machine"]
    sgemm = report["sgemm_gflops"]["median_over_cells"]
    onednn = report.get("onednn_gemm_gflops")
    extra = f", oneDNN GEMM {onednn['median_over_cells']:.0f}" if onednn else ""
    table = Table(title=f"inference, fp32 unless named; {describe_cpu(info)}, {info['threads']} thread(s); "
                        f"SGEMM (torch.mm) {sgemm:.0f} GFLOP/s{extra}; ratios and MFU paired round by round")
    for col, justify in (("model", "left"), ("batch", "right"), ("contender", "left"), ("img/s", "right"),
                         ("ms/batch", "right"), ("vs best anchor", "right"), ("GFLOP/s", "right"),
                         ("MFU", "right")):
        table.add_column(col, justify=justify)
    previous = None
    for row in report["rows"]:
        cell = (row["model"], row["batch"])
        if previous is not None and cell != previous:
            table.add_section()
        previous = cell
        ratio = row["vs_best_anchor"]
        style = "bold" if row["contender"].startswith("vitkit") else ""
        table.add_row(row["model"], str(row["batch"]), row["contender"], f"{row['images_per_s']:.2f}",
                      f"{row['latency_ms']:.1f}", "-" if ratio is None else f"{ratio:.2f}x",
                      f"{row['gflops']:.0f}", f"{100 * row['mfu']:.0f} %", style=style)
    return table


def format_markdown(report: dict[str, Any]) -> str:
    """The table of a `run` report in Markdown (for docs/speed.md)."""
    sgemm = report["sgemm_gflops"]["median_over_cells"]
    onednn = report.get("onednn_gemm_gflops")
    lines = [
        f"{describe_cpu(report['machine'])}, {report['machine']['threads']} thread(s), "
        f"torch {report['machine']['torch']}; "
        f"SGEMM (torch.mm {report['sgemm_gflops']['size']}^3) {sgemm:.0f} GFLOP/s"
        + (f", oneDNN GEMM {onednn['median_over_cells']:.0f} GFLOP/s" if onednn else "")
        + " (medians). img/s and ms: medians; 'vs best anchor' and MFU: medians of per-round ratios.",
        "",
        "| model | batch | contender | img/s | ms/batch | vs best anchor | MFU |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        ratio = row["vs_best_anchor"]
        name = f"**{row['contender']}**" if row["contender"].startswith("vitkit") else row["contender"]
        lines.append(f"| {row['model']} | {row['batch']} | {name} | {row['images_per_s']:.2f} | "
                     f"{row['latency_ms']:.0f} | {'-' if ratio is None else f'{ratio:.2f}x'} | "
                     f"{100 * row['mfu']:.0f} % |")
    return "\n".join(lines) + "\n"


def write_json(report: Any, path) -> None:
    from pathlib import Path

    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def summarize(report: dict[str, Any], contenders: Iterable[str] = OURS + OPTIONAL) -> list[str]:
    """One line per (cell, vitkit contender): the ratio to the best anchor, for the docs and the CLI."""
    lines = []
    for row in report["rows"]:
        if row["contender"] in contenders and row["vs_best_anchor"] is not None and not math.isnan(
                row["vs_best_anchor"]):
            runtime = row.get("vs_best_runtime")
            lines.append(f"{row['model']} batch {row['batch']}: {row['contender']} "
                         f"{row['vs_best_anchor']:.2f}x the best anchor ({row['best_anchor']}), "
                         + (f"{runtime:.2f}x the faster runtime at its precision, " if runtime else "")
                         + f"MFU {100 * row['mfu']:.0f} %")
    return lines
