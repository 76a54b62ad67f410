"""Export a ViT to ONNX with the dynamo exporter, and check the file with onnxruntime against PyTorch.

The graph takes `pixel_values` (batch, C, H, W), normalised as the checkpoint's preprocessing says, with a
dynamic batch axis, and returns `logits` (batch, classes). The preprocessing and the class names are stored
in the file's metadata (`vitkit.preprocessing`, `vitkit.class_names`, JSON), so that the file alone is
enough to use the model.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from .checkpoint import preprocessing
from .inference import OPTIMIZED
from .model import VisionTransformer

INPUT_NAME = "pixel_values"
OUTPUT_NAME = "logits"
DEFAULT_ATOL = 1e-4
# LayerNormalization, which every ViT block uses, entered ONNX in opset 17.
MIN_OPSET = 17


@dataclass(frozen=True)
class ExportCheck:
    """onnxruntime against PyTorch on random inputs: the largest absolute difference per batch size, and the
    largest logit (PyTorch's) that the differences are judged against."""

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


def export_onnx(model: VisionTransformer, path: str | Path, class_names: list[str] | None = None,
                opset: int | None = None) -> Path:
    """Write `model` (as fp32, in eval mode, on the CPU; a copy where it is not so already) to `path` as ONNX
    with a dynamic batch axis; returns the path.
    `opset`: the ONNX operator set, MIN_OPSET up to what the installed onnx knows (None: the exporter's)."""
    import onnx

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
    program.model.metadata_props.update({
        "vitkit.preprocessing": json.dumps(preprocessing(cfg)),
        "vitkit.config": json.dumps(cfg.to_dict()),
        "vitkit.class_names": json.dumps(class_names),
    })
    program.save(str(path))
    return path


def check_onnx(model: nn.Module, path: str | Path, batch_sizes: tuple[int, ...] = (1, 3),
               atol: float = DEFAULT_ATOL, seed: int = 0) -> ExportCheck:
    """Run the ONNX file with onnxruntime (CPU) and PyTorch on the same random inputs, at several batch
    sizes (which also proves the batch axis is dynamic); returns the largest differences."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (inp,) = session.get_inputs()
    model = _exportable(model)
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    diffs = {}
    largest = 0.0
    for b in batch_sizes:
        x = torch.randn(b, cfg.in_chans, *cfg.image_size, generator=gen)
        with torch.inference_mode():
            ref = model(x).numpy()
        (out,) = session.run([OUTPUT_NAME], {inp.name: x.numpy()})
        if out.shape != ref.shape:
            raise ValueError(f"{path}: onnxruntime returned shape {out.shape}, PyTorch {ref.shape} at batch "
                             f"{b}")
        diffs[b] = float(abs(out - ref).max())
        largest = max(largest, float(abs(ref).max()))
    return ExportCheck(diffs, atol, largest)
