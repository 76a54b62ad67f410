"""Export a ViT to ONNX with the dynamo exporter, or to OpenVINO IR converted from that file, and check the
result with its runtime (onnxruntime, OpenVINO's CPU plugin) against PyTorch.

The graph takes `pixel_values` (batch, C, H, W), normalised as the checkpoint's preprocessing says, with a
dynamic batch axis, and returns `logits` (batch, classes). The preprocessing, the config and the class names
are stored beside the graph as JSON strings, so that the file alone is enough to use the model: in the ONNX
file's metadata (`vitkit.preprocessing`, `vitkit.config`, `vitkit.class_names`), in the IR's runtime info
(`model.get_rt_info(["vitkit", "preprocessing"])`, and so on). OpenVINO is an extra
(`pip install 'vitkit[openvino]'`).
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from .checkpoint import preprocessing
from .config import ViTConfig
from .extras import require
from .inference import OPTIMIZED
from .model import VisionTransformer

INPUT_NAME = "pixel_values"
OUTPUT_NAME = "logits"
DEFAULT_ATOL = 1e-4
# LayerNormalization, which every ViT block uses, entered ONNX in opset 17.
MIN_OPSET = 17
OPENVINO = "vitkit export --to openvino"  # the feature that names the extra when a package is missing
# OpenVINO's CPU plugin runs bf16 by default on a CPU with native bf16 (AVX512-BF16, AMX): ask for fp32.
OPENVINO_FP32 = {"INFERENCE_PRECISION_HINT": "f32"}


@dataclass(frozen=True)
class ExportCheck:
    """An exported file's runtime against PyTorch on random inputs: the largest absolute difference per batch
    size, and the largest logit (PyTorch's) that the differences are judged against."""

    max_abs_diff: dict[int, float]
    atol: float
    max_abs_logit: float = 0.0

    @property
    def tolerance(self) -> float:
        """atol relative to the largest logit, absolute below 1: fp32 rounding grows with the values."""
        return self.atol * max(1.0, self.max_abs_logit)

    @property
    def ok(self) -> bool:
        return all(d <= self.tolerance for d in self.max_abs_diff.values())

    @property
    def worst(self) -> float:
        return max(self.max_abs_diff.values())


def _exportable(model: nn.Module) -> nn.Module:
    """`model` as export and its check run it, fp32 in eval mode on the CPU: the model itself if it is so
    already, else a copy made so (the caller's model keeps its mode, dtype and device). vitkit.optimize's
    output is refused: its packed layers are operators of this machine that no exporter knows."""
    done = getattr(model, OPTIMIZED, None)
    if done is not None:
        raise ValueError(f"this model comes from vitkit.optimize(precision={done!r}), whose layers run on "
                         "this machine's own operators: export the model you passed to vitkit.optimize")
    params = list(model.parameters())
    if not model.training and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params):
        return model
    return copy.deepcopy(model).float().eval().cpu()


def metadata(cfg: ViTConfig, class_names: list[str] | None) -> dict[str, str]:
    """What an exported file carries beside the graph, each a JSON string: the preprocessing its inputs need,
    the config and the class names."""
    return {"preprocessing": json.dumps(preprocessing(cfg)), "config": json.dumps(cfg.to_dict()),
            "class_names": json.dumps(class_names)}


def export_onnx(model: VisionTransformer, path: str | Path, class_names: list[str] | None = None,
                opset: int | None = None) -> Path:
    """Write `model` (as fp32, in eval mode, on the CPU; a copy where it is not so already) to `path` as ONNX
    with a dynamic batch axis; returns the path.
    `opset`: the ONNX operator set, MIN_OPSET up to what the installed onnx knows (None: the exporter's)."""
    onnx = require("onnx", "vitkit export", extra="onnx")
    require("onnxscript", "vitkit export", extra="onnx")  # torch.onnx's dynamo exporter writes through it

    path = Path(path)
    if path.suffix != ".onnx":
        raise ValueError(f"{path}: the output file should end in .onnx")
    newest = onnx.defs.onnx_opset_version()
    if opset is not None and not MIN_OPSET <= opset <= newest:
        raise ValueError(f"opset {opset}: a ViT needs opset {MIN_OPSET} or newer (LayerNormalization), and "
                         f"the installed onnx {onnx.__version__} knows up to {newest}")
    model = _exportable(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    example = torch.randn(2, cfg.in_chans, *cfg.image_size)
    batch = torch.export.Dim("batch", min=1, max=4096)
    kwargs = {} if opset is None else {"opset_version": opset}
    with torch.inference_mode(False), torch.no_grad():
        program = torch.onnx.export(
            model, (example,), dynamo=True, input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: batch},), verbose=False, **kwargs,
        )
    if program is None:
        raise RuntimeError("torch.onnx.export returned no program")
    written = program.model.opset_imports.get("")
    if opset is not None and written != opset:
        # the exporter falls back to its own opset when conversion fails
        raise ValueError(f"opset {opset}: the exporter could not convert the graph to it (it made opset "
                         f"{written}); nothing was written to {path}")
    # program.model is the ONNX IR that save() serialises; its metadata_props is a plain str -> str dict.
    program.model.metadata_props.update({f"vitkit.{k}": v for k, v in metadata(cfg, class_names).items()})
    program.save(str(path))
    return path


def compare_logits(model: nn.Module, run: Callable[[np.ndarray], np.ndarray], batch_sizes: tuple[int, ...],
                   atol: float, seed: int, runtime: str) -> ExportCheck:
    """`run` (an exported file's runtime: pixel values to logits) and PyTorch on the same random inputs, at
    several batch sizes (which also proves the batch axis is dynamic); `runtime` names it in errors."""
    model = _exportable(model)
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    diffs = {}
    largest = 0.0
    for b in batch_sizes:
        x = torch.randn(b, cfg.in_chans, *cfg.image_size, generator=gen)
        with torch.inference_mode():
            ref = model(x).numpy()
        out = run(x.numpy())
        if out.shape != ref.shape:
            raise ValueError(f"{runtime} returned shape {out.shape}, PyTorch {ref.shape} at batch {b}")
        diffs[b] = float(abs(out - ref).max())
        largest = max(largest, float(abs(ref).max()))
    return ExportCheck(diffs, atol, largest)


def check_onnx(model: nn.Module, path: str | Path, batch_sizes: tuple[int, ...] = (1, 3),
               atol: float = DEFAULT_ATOL, seed: int = 0) -> ExportCheck:
    """Run the ONNX file with onnxruntime (CPU) and PyTorch on the same random inputs (`compare_logits`)."""
    ort = require("onnxruntime", "vitkit export's check", extra="onnx")

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (inp,) = session.get_inputs()
    return compare_logits(model, lambda x: session.run([OUTPUT_NAME], {inp.name: x})[0], batch_sizes, atol,
                          seed, f"{path}: onnxruntime")


def _openvino():
    """openvino imported, with the ONNX exporter the IR is converted from, or MissingExtra."""
    ov = require("openvino", OPENVINO, extra="openvino")
    for module in ("onnx", "onnxscript"):
        require(module, OPENVINO, extra="openvino")
    return ov


def export_openvino(model: VisionTransformer, path: str | Path, class_names: list[str] | None = None) -> Path:
    """Write `model` (as fp32, in eval mode, on the CPU; a copy where it is not so already) as OpenVINO IR:
    the graph to `path` (.xml), the fp32 weights beside it (.bin); returns the path."""
    path = Path(path)
    if path.suffix != ".xml":
        raise ValueError(f"{path}: the output file should end in .xml (OpenVINO IR, its weights in .bin)")
    ov = _openvino()
    model = _exportable(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Converted from the dynamo exporter's ONNX file, not by OpenVINO's PyTorch frontend: both give PyTorch's
    # logits to fp32 rounding, but the frontend traces the model a second way (TorchScript), while the ONNX
    # file is the graph `vitkit export` checks with onnxruntime, its names and symbolic batch axis included.
    with tempfile.TemporaryDirectory(prefix="vitkit-export-") as tmp:
        onnx_path = export_onnx(model, Path(tmp) / "model.onnx", class_names=class_names)
        graph = ov.convert_model(str(onnx_path))
        for key, value in metadata(model.cfg, class_names).items():
            graph.set_rt_info(value, ["vitkit", key])
        ov.save_model(graph, str(path), compress_to_fp16=False)  # the default stores the weights as fp16
    return path


def check_openvino(model: nn.Module, path: str | Path, batch_sizes: tuple[int, ...] = (1, 3),
                   atol: float = DEFAULT_ATOL, seed: int = 0) -> ExportCheck:
    """Run the IR with OpenVINO's CPU plugin at fp32 and PyTorch on the same random inputs
    (`compare_logits`)."""
    ov = require("openvino", OPENVINO, extra="openvino")
    compiled = ov.Core().compile_model(str(path), "CPU", OPENVINO_FP32)
    logits = compiled.output(OUTPUT_NAME)
    return compare_logits(model, lambda x: compiled({INPUT_NAME: x})[logits], batch_sizes, atol, seed,
                          f"{path}: OpenVINO")
