"""GPU speed of vitkit against timm: inference and the training step of ViT-B/16 with bf16,
flash attention and torch.compile, in one process.

One command, a few minutes, a table and a JSON file (a record for benchmarks/results/: gpu-infer, gpu-train).

    .venv/bin/python benchmarks/bench_gpu.py --json gpu.json                 # ViT-B/16 on cuda:0
    .venv/bin/python benchmarks/bench_gpu.py --no-compile                    # skip torch.compile (faster)
    .venv/bin/python benchmarks/bench_gpu.py --only training --json t.json   # one part per device call
    # CUDA graphs
    .venv/bin/python benchmarks/bench_gpu.py --only training --train-compile-mode reduce-overhead
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --tiny --no-compile   # the same code on the CPU

What is measured, every contender with the same architecture and random weights, calls interleaved in a fresh
random order each round (`vitkit.timing.interleaved_times`), each call ending in a device synchronisation;
img/s are medians, ratios are paired round by round (`vitkit.timing.paired_ratio`):

- inference: vitkit in fp32 and through `vitkit.optimize(model, "bf16")` (bf16 weights), with and without
  `compile=True`; timm's VisionTransformer (fused attention) in bf16, with and without torch.compile;
- training step (forward, cross-entropy, backward, AdamW): vitkit and timm under bf16 autocast with fp32
  weights, each eager and compiled.

Before timing, one forward of each bf16 model runs with PyTorch's SDPA restricted to the flash kernel (on
CUDA), so a model that would not reach flash attention fails loudly instead of being timed on another kernel.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import vitkit
from vitkit.bench import build_timm, machine_info, write_json
from vitkit.config import ViTConfig
from vitkit.timing import interleaved_times, paired_ratio

TINY = ViTConfig(image_size=32, patch_size=8, dim=64, depth=2, num_heads=4, mlp_dim=128, num_classes=10,
                 name="tiny")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bf16_allowed(device: torch.device) -> bool:
    """bf16 on every GPU vitkit supports, and on CPUs that compute it natively (as vitkit.optimize allows)."""
    from vitkit.cpu.hardware import cpu_has_native_bf16

    return device.type == "cuda" or cpu_has_native_bf16()


def check_flash(model: nn.Module, x: torch.Tensor) -> None:
    """Run one forward with SDPA limited to the flash kernel: raises if the model's attention cannot use
    it."""
    if x.device.type != "cuda":
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with torch.inference_mode(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        model(x)


def inference_models(cfg: ViTConfig, device: torch.device, compile: bool) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    plain = vitkit.create_model(cfg).to(device).eval()
    with torch.no_grad():
        nn.init.normal_(plain.head.weight, std=0.02)  # vitkit's classifier starts at zero
    models: dict[str, nn.Module] = {"vitkit-fp32": plain}
    timm_model = build_timm(cfg).to(device).eval()
    if bf16_allowed(device):
        models["vitkit-bf16"] = vitkit.optimize(plain, "bf16")
        models["timm-bf16"] = timm_model.to(torch.bfloat16)
        if compile:
            models["vitkit-bf16-compiled"] = vitkit.optimize(plain, "bf16", compile=True)
            models["timm-bf16-compiled"] = torch.compile(models["timm-bf16"])
    else:
        models["timm-fp32"] = timm_model
    return models


def measure_inference(cfg: ViTConfig, device: torch.device, batch: int, repeats: int, warmup: int,
                      compile: bool, rng: random.Random) -> dict:
    models = inference_models(cfg, device, compile)
    x = torch.randn(batch, cfg.in_chans, *cfg.image_size, device=device)
    inputs = {name: x.to(torch.bfloat16) if name.startswith("timm-bf16") else x for name in models}
    for name, model in models.items():
        if "bf16" in name:
            check_flash(model, inputs[name])

    def call(name: str) -> Callable[[], None]:
        def run() -> None:
            models[name](inputs[name])
            synchronize(device)
        return run

    with torch.inference_mode():
        times = interleaved_times({name: call(name) for name in models}, repeats, warmup, rng)
    return summarize(times, batch, reference="timm-bf16" if "timm-bf16" in times else "timm-fp32")


def training_steps(cfg: ViTConfig, device: torch.device, batch: int, compile: bool,
                   compile_mode: str | None = None) -> dict[str, Callable[[], None]]:
    """One training step per contender; `compile_mode` is torch.compile's mode for the compiled ones (None:
    its default; "reduce-overhead" replays CUDA graphs, for a step whose GPU waits on the host's launches)."""
    torch.manual_seed(0)
    x = torch.randn(batch, cfg.in_chans, *cfg.image_size, device=device)
    y = torch.randint(0, cfg.num_classes, (batch,), device=device)
    autocast = bf16_allowed(device)
    steps = {}
    builders = {"vitkit": lambda: vitkit.create_model(cfg), "timm": lambda: build_timm(cfg)}
    for name, build in builders.items():
        for compiled in (False, True) if compile else (False,):
            model = build().to(device).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05,
                                    fused=True if device.type == "cuda" else None)
            forward = torch.compile(model, mode=compile_mode) if compiled else model

            def step(forward=forward, opt=opt) -> None:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = F.cross_entropy(forward(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                synchronize(device)

            steps[f"{name}{'-compiled' if compiled else ''}"] = step
    return steps


def measure_training(cfg: ViTConfig, device: torch.device, batch: int, repeats: int, warmup: int,
                     compile: bool, rng: random.Random, profile: int = 0,
                     compile_mode: str | None = None) -> dict:
    steps = training_steps(cfg, device, batch, compile, compile_mode)
    times = interleaved_times(steps, repeats, warmup, rng)
    result = {**summarize(times, batch, reference="timm"), "compile_mode": compile_mode or "default"}
    if profile:
        result["profile"] = {name: profile_step(step, profile) for name, step in steps.items()}
    return result


def profile_step(step: Callable[[], None], rows: int) -> dict:
    """Where one (warm) step's time goes, under the profiler (which slows the host): the wall time, the host's
    time in PyTorch's operators, the device's time in kernels (totals in ms), and the `rows` operators that
    keep the device (else the host) busiest. Kernel time well under the step's time means the host is the
    bottleneck (Python and operator dispatch launching the kernels), not the GPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    step()
    with profile(activities=activities) as prof:
        step()
    events = prof.key_averages()
    # As the profiler's own table totals them: the kernels' time (the operators' device time is the same time
    # again, seen from the operator that launched them).
    device_time = sum(e.self_device_time_total for e in events
                      if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e3
    host_time = sum(e.self_cpu_time_total for e in events) / 1e3
    wall = ((prof.events()[-1].time_range.end - prof.events()[0].time_range.start) / 1e3 if prof.events()
            else 0.0)
    key = "self_cuda_time_total" if device_time else "self_cpu_time_total"
    return {"wall_ms": wall, "host_ops_ms": host_time, "device_kernels_ms": device_time,
            "table": events.table(sort_by=key, row_limit=rows)}


def summarize(times: dict[str, list[float]], batch: int, reference: str) -> dict:
    """img/s (medians) and each contender's speed over the reference's, paired round by round."""
    return {
        "batch": batch,
        "reference": reference,
        "images_per_s": {name: batch / statistics.median(t) for name, t in times.items()},
        "vs_reference": {name: paired_ratio(t, [times[reference]]) for name, t in times.items()},
        "seconds": times,
    }


def print_table(title: str, result: dict) -> None:
    print(f"\n{title}, batch {result['batch']} (ratios paired against {result['reference']})")
    for name, ips in result["images_per_s"].items():
        print(f"  {name:>24}  {ips:10.1f} img/s  {result['vs_reference'][name]:6.2f}x")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    p.add_argument("--model", default="ViT-B/16", help="preset to measure (default: ViT-B/16)")
    p.add_argument("--tiny", action="store_true", help="a tiny model instead of --model (a smoke test)")
    p.add_argument("--batch", type=int, default=128, help="inference batch size")
    p.add_argument("--train-batch", type=int, default=64, help="training batch size")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds first (compilation happens here)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip the torch.compile contenders")
    p.add_argument("--only", choices=["inference", "training"], default=None,
                   help="measure one part only (to split the work over two short device calls)")
    p.add_argument("--train-compile-mode", default="default",
                   choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                   help="torch.compile's mode for the compiled training steps (reduce-overhead: CUDA graphs)")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="also profile one training step of each contender and print its ROWS busiest "
                        "operators")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu for a smoke test)")
    if min(args.batch, args.train_batch, args.repeats) < 1 or args.warmup < 0:
        p.error("batch sizes and repeats must be >= 1, warmup >= 0")
    cfg = TINY if args.tiny else vitkit.get_config(args.model)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 contenders on tensor cores, as timm's scripts do
        torch.backends.cudnn.allow_tf32 = True
    rng = random.Random(0)
    report = {
        "machine": {**machine_info(), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu"},
        "model": cfg.name or args.model,
    }
    if args.only in (None, "inference"):
        report["inference"] = measure_inference(cfg, device, args.batch, args.repeats, args.warmup,
                                                args.compile, rng)
    if args.only in (None, "training"):
        report["training"] = measure_training(cfg, device, args.train_batch, args.repeats, args.warmup,
                                              args.compile, rng, args.profile,
                                              None if args.train_compile_mode == "default"
                                              else args.train_compile_mode)
    print(f"{report['model']} on {report['machine']['device']}")
    if "inference" in report:
        print_table("inference", report["inference"])
    if "training" in report:
        title = "training step (bf16 autocast)" if bf16_allowed(device) else "training step (fp32)"
        mode = report["training"]["compile_mode"]
        print_table(title + (f", compiled with mode={mode}" if args.compile and mode != "default" else ""),
                    report["training"])
        for name, prof in report["training"].get("profile", {}).items():
            print(f"\nprofile of one {name} training step (under the profiler): {prof['wall_ms']:.1f} ms "
                  f"wall, {prof['host_ops_ms']:.1f} ms in host operators, {prof['device_kernels_ms']:.1f} ms "
                  "in kernels")
            print(prof["table"])
    if args.json:
        write_json(report, args.json)
    return report


if __name__ == "__main__":
    main()
