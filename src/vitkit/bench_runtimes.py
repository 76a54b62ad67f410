"""The inference runtimes a deploying user would pick instead of PyTorch, as contenders of `vitkit bench`:
ONNX Runtime and OpenVINO, each at the precisions it offers on the CPU.

- `ort-fp32`: onnxruntime's CPU provider, every graph optimisation on (ORT_ENABLE_ALL);
- `ort-int8`: the same file through `onnxruntime.quantization.quantize_dynamic` (int8 weights, activations
  quantised per call), ONNX Runtime's own int8 path for transformers;
- `openvino-fp32`: OpenVINO's CPU plugin with `INFERENCE_PRECISION_HINT=f32` (its default on a CPU with
  native bf16 is bf16, which is `openvino-bf16`);
- `openvino-int8`: `nncf.quantize` with the transformer preset, calibrated on random inputs of the cell's
  shape, compiled with the plugin's defaults; on a CPU without VNNI with NNCF's overflow fix in every layer
  (7-bit weights), as NNCF advises there: AVX2's and AVX-512's `vpmaddubsw` sums pairs of int8 products in
  int16, which saturates (logits of a small random ViT were 40 % off without it on an AVX2-only AMD EPYC).

Each starts from the contender's own randomly initialised vitkit model (the same architecture as every other
contender), exported with `vitkit.export.export_onnx`, and is compiled for the cell's input shape at its first
call (a warm-up call of the benchmark). The runtimes get the thread count PyTorch has. They are a benchmark
extra (`pip install 'vitkit[bench-runtimes]'`), not a dependency of vitkit: a contender whose package is
missing fails with the one-line install hint (vitkit.extras).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .config import ViTConfig
from .cpu.hardware import cpu_has_vnni
from .extras import available as extra_available
from .extras import require

RUNTIMES: tuple[str, ...] = ("ort-fp32", "ort-int8", "openvino-fp32", "openvino-bf16", "openvino-int8")
# each runtime's modules (keys of vitkit.extras.EXTRAS), the ONNX exporter's included
MODULES = {"ort": ("onnxscript", "onnxruntime"), "openvino": ("onnxscript", "openvino", "nncf")}


def _need(runtime: str) -> None:
    for module in MODULES[runtime]:
        require(module, f"vitkit bench's {runtime} contenders")


def available(name: str) -> bool:
    """Whether runtime contender `name`'s packages are installed (and, for bf16, the CPU has it natively)."""
    from .cpu.hardware import cpu_has_native_bf16

    if name.endswith("bf16") and not cpu_has_native_bf16():
        return False
    return all(extra_available(m) for m in MODULES[name.split("-")[0]])


Compile = Callable[[Path, tuple[int, ...]], Callable[[np.ndarray], np.ndarray]]


class Runtime:
    """A runtime's compiled model, called like a module: the first call exports `model` to ONNX (once, into
    a folder of its own), and the first call at each input shape compiles for it (`compile_for(onnx_path,
    shape) -> run`); later calls run it. Returns the logits as a tensor."""

    def __init__(self, model: torch.nn.Module, compile_for: Compile):
        self.model, self.compile_for = model, compile_for
        self.compiled: dict[tuple[int, ...], Callable[[np.ndarray], np.ndarray]] = {}
        self.folder = tempfile.TemporaryDirectory(prefix="vitkit-runtime-")

    def eval(self) -> Runtime:
        return self

    def onnx(self) -> Path:
        path = Path(self.folder.name) / "model.onnx"
        if not path.exists():
            from .export import export_onnx

            export_onnx(self.model, path)
        return path

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = tuple(x.shape)
        run = self.compiled.get(shape)
        if run is None:
            run = self.compiled[shape] = self.compile_for(self.onnx(), shape)
        return torch.from_numpy(np.asarray(run(x.detach().numpy())))


def build_ort(model: torch.nn.Module, precision: str) -> Runtime:
    """`model` (a vitkit VisionTransformer) through ONNX Runtime at `precision` ("fp32" or "int8")."""
    _need("ort")
    import onnxruntime as ort

    def compile_for(path: Path, shape: tuple[int, ...]) -> Callable[[np.ndarray], np.ndarray]:
        if precision == "int8":
            from onnxruntime.quantization import QuantType, quantize_dynamic

            fp32, path = path, path.with_name("model-int8.onnx")
            if not path.exists():
                quantize_dynamic(fp32, path, weight_type=QuantType.QInt8)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads, options.inter_op_num_threads = torch.get_num_threads(), 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda x: session.run(None, {name: x})[0]

    return Runtime(model, compile_for)


def calibration_batches(shape: tuple[int, ...], size: int, images: torch.Tensor | None = None,
                        seed: int = 0) -> list[np.ndarray]:
    """Inputs of `shape` for int8 calibration, about `size` images in all: consecutive batches of `images`
    (model inputs, as preprocessed; a short last batch dropped) where given, else seeded random ones."""
    if images is not None:
        b = shape[0]
        batches = [images[i: i + b].numpy() for i in range(0, len(images) - b + 1, b)][: max(1, size // b)]
        if not batches:
            raise ValueError(f"{len(images)} calibration images make no batch of {b}")
        return batches
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).numpy() for _ in range(max(1, size // shape[0]))]


def build_openvino(model: torch.nn.Module, precision: str, calibration_size: int = 32,
                   calibration: torch.Tensor | None = None) -> Runtime:
    """`model` through OpenVINO's CPU plugin at `precision` ("fp32", "bf16" or "int8"). int8 is calibrated on
    `calibration_size` images: of `calibration` (model inputs, as preprocessed) where given, as a deploying
    user would on their own data, else random ones (enough for timing)."""
    _need("openvino")
    import openvino as ov

    def compile_for(path: Path, shape: tuple[int, ...]) -> Callable[[np.ndarray], np.ndarray]:
        core = ov.Core()
        graph = core.read_model(str(path))
        graph.reshape({graph.inputs[0].any_name: list(shape)})
        config = {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "PERFORMANCE_HINT": "LATENCY"}
        if precision == "int8":
            import nncf
            from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

            samples = calibration_batches(shape, calibration_size, calibration)
            # Without VNNI every layer's int16 pair sums can saturate, not only the first's (NNCF's default).
            advanced = (None if cpu_has_vnni()
                        else AdvancedQuantizationParameters(overflow_fix=OverflowFix.ENABLE))
            graph = nncf.quantize(graph, nncf.Dataset(samples), model_type=nncf.ModelType.TRANSFORMER,
                                  subset_size=len(samples), advanced_parameters=advanced)
        else:
            config["INFERENCE_PRECISION_HINT"] = {"fp32": "f32", "bf16": "bf16"}[precision]
        compiled = core.compile_model(graph, "CPU", config)
        request = compiled.create_infer_request()
        return lambda x: request.infer({0: x})[compiled.outputs[0]]

    return Runtime(model, compile_for)


def builders(make_model: Callable[[ViTConfig], torch.nn.Module]) -> dict[str, Callable[[ViTConfig], Runtime]]:
    """The runtime contenders, each given the vitkit model `make_model(cfg)` builds."""
    return {
        "ort-fp32": lambda cfg: build_ort(make_model(cfg), "fp32"),
        "ort-int8": lambda cfg: build_ort(make_model(cfg), "int8"),
        "openvino-fp32": lambda cfg: build_openvino(make_model(cfg), "fp32"),
        "openvino-bf16": lambda cfg: build_openvino(make_model(cfg), "bf16"),
        "openvino-int8": lambda cfg: build_openvino(make_model(cfg), "int8"),
    }
