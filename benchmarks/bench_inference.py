r"""Inference benchmarks: the speed table (vitkit against timm, Hugging Face and torchvision) and the int8
agreement of a trained checkpoint on the Fashion-MNIST test set.

    .venv/bin/python benchmarks/bench_inference.py speed --threads 1 --json runs/bench-1.json \
        --markdown runs/bench-1.md
    .venv/bin/python benchmarks/bench_inference.py agreement --checkpoint runs/fmnist-demo
    .venv/bin/python benchmarks/bench_inference.py agreement --checkpoint runs/fm/last --runtimes

`speed` is `vitkit bench` with the same options (see vitkit.bench). `agreement` runs the checkpoint on all
10,000 test images plain, through optimize('fp32') and through optimize('int8'), and reports the top-1
agreement of int8 with fp32, both accuracies, the largest fp32 difference and the throughput of each (after
one untimed call). With `--runtimes` the int8 models of ONNX Runtime (`quantize_dynamic`) and OpenVINO
(`nncf.quantize`, calibrated on `--calibration` training images, the first of the training split) are measured
beside it, each with its agreement with fp32 (vitkit.bench_runtimes; the bench-runtimes extra).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import vitkit
from vitkit import bench
from vitkit.inference import optimize


def run_speed(args: argparse.Namespace) -> None:
    from rich.console import Console

    config = bench.BenchConfig(
        models=tuple(args.model), batch_sizes=tuple(args.batch), repeats=args.repeats, warmup=args.warmup,
        settle=args.settle, threads=args.threads or None,
        contenders=tuple(args.contender) if args.contender else bench.CONTENDERS,
    )
    start = time.time()
    report = bench.run(config, on_progress=lambda done, total: print(f"\r{done}/{total} timed calls", end=""))
    print(f"\rmeasured in {time.time() - start:.0f} s" + " " * 20)
    console = Console(width=130)
    console.print(bench.format_table(report))
    for line in bench.summarize(report):
        console.print(line)
    if args.json:
        bench.write_json(report, args.json)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(bench.format_markdown(report))


def fashion_mnist_test(split: str = "test") -> tuple[torch.Tensor, torch.Tensor]:
    """The 10,000 test images (uint8, N x 1 x 28 x 28) and labels, through vitkit.data's loader (or those of
    `split`)."""
    from vitkit.data import resolve

    ds = resolve("fashion-mnist", split, download=False)
    return ds.images, ds.targets


def runtime_variants(model: torch.nn.Module, calibration: torch.Tensor, size: int) -> dict:
    """The int8 models of ONNX Runtime and OpenVINO made from `model`; OpenVINO's calibrated on `size` images
    of `calibration` (model inputs)."""
    from vitkit.bench_runtimes import build_openvino, build_ort

    return {"ort-int8": build_ort(model, "int8"),
            "openvino-int8": build_openvino(model, "int8", calibration_size=size, calibration=calibration)}


def run_agreement(args: argparse.Namespace) -> None:
    from vitkit.data.transforms import normalize_batch

    if args.threads:
        torch.set_num_threads(args.threads)
    model = vitkit.load(args.checkpoint).eval()
    images, labels = fashion_mnist_test()
    variants = {"fp32": model, "fp32-opt": optimize(model, "fp32"), "int8": optimize(model, "int8")}
    if args.runtimes:
        train_images, _ = fashion_mnist_test("train")
        calibration = normalize_batch(train_images[: args.calibration], model.cfg)
        variants.update(runtime_variants(model, calibration, args.calibration))
    logits = {name: [] for name in variants}
    seconds = dict.fromkeys(variants, 0.0)
    with torch.inference_mode():
        # one untimed call each first: the runtimes quantise and compile for the batch's shape at their first
        # call, and vitkit's layers time their engines once per shape
        first = normalize_batch(images[: args.batch_size], model.cfg)
        for m in variants.values():
            m(first)
        for i in range(0, len(images), args.batch_size):
            x = normalize_batch(images[i: i + args.batch_size], model.cfg)
            for name, m in variants.items():
                start = time.perf_counter()
                logits[name].append(m(x))
                seconds[name] += time.perf_counter() - start
    out = {name: torch.cat(chunks) for name, chunks in logits.items()}
    pred = {name: o.argmax(-1) for name, o in out.items()}
    n = len(labels)
    result = {
        "checkpoint": str(args.checkpoint), "images": n, "threads": torch.get_num_threads(),
        "accuracy": {name: (p == labels).float().mean().item() for name, p in pred.items()},
        "int8_top1_agreement_with_fp32": (pred["int8"] == pred["fp32"]).float().mean().item(),
        **({"top1_agreement_with_fp32": {name: (pred[name] == pred["fp32"]).float().mean().item()
                                         for name in pred if name != "fp32"},
            "calibration_images": args.calibration} if args.runtimes else {}),
        "int8_disagreements": int((pred["int8"] != pred["fp32"]).sum()),
        "fp32_opt_max_abs_diff": (out["fp32-opt"] - out["fp32"]).abs().max().item(),
        "int8_max_abs_diff": (out["int8"] - out["fp32"]).abs().max().item(),
        "images_per_s": {name: n / s for name, s in seconds.items()},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("speed", help="the speed table (as `vitkit bench`)")
    s.add_argument("--model", "-m", action="append", default=None)
    s.add_argument("--batch", "-b", action="append", type=int, default=None)
    s.add_argument("--contender", "-c", action="append", default=None)
    s.add_argument("--repeats", "-r", type=int, default=10)
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--settle", type=int, default=1,
                   help="untimed calls of a contender before each timed one (vitkit bench --settle)")
    s.add_argument("--threads", "-t", type=int, default=0)
    s.add_argument("--json", default=None)
    s.add_argument("--markdown", default=None, help="also write the table as Markdown here")
    a = sub.add_parser("agreement", help="int8 vs fp32 on the Fashion-MNIST test set")
    a.add_argument("--checkpoint", default="runs/fmnist-demo")
    a.add_argument("--batch-size", type=int, default=250)
    a.add_argument("--threads", "-t", type=int, default=0)
    a.add_argument("--json", default=None)
    a.add_argument("--runtimes", action="store_true",
                   help="also ONNX Runtime's and OpenVINO's int8 models (the bench-runtimes extra)")
    a.add_argument("--calibration", type=int, default=500,
                   help="training images OpenVINO's int8 model is calibrated on (with --runtimes)")
    args = p.parse_args()
    if args.command == "speed":
        args.model = args.model or ["ViT-S/16", "ViT-B/16"]
        args.batch = args.batch or [1, 16]
        run_speed(args)
    else:
        run_agreement(args)


if __name__ == "__main__":
    main()
