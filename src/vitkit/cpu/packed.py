"""oneDNN-packed linear layers for inference, and the patch projection as one linear map.

`PackedLinear` holds its weight in oneDNN's blocked layout, reordered once for the CPU, and may fuse the MLP's
GELU (oneDNN's post-op) or a residual add (`add`, its binary post-op) into the product. `vitkit.optimize`
swaps it in for every nn.Linear of a copy of the model. Packed weights are opaque: such a layer has no state
dict and cannot be pickled, copied or converted (`Unsaved`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention import autocast_off
from ..model import PatchEmbed
from . import autotune
from .build import gemm_available
from .linear import MKL_MAX_ROWS, inference_engine, rows
from .private import onednn_linear, onednn_linear_add, pack_weight


def gelu_(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU written over `x` (no gradient): for inference, where nothing else reads the pre-activation."""
    return torch.ops.aten.gelu_(x, approximate=approximate or "none")


NOT_SAVED = ("a model from vitkit.optimize has no state dict and cannot be pickled (its packed or int8 "
             "weights are opaque operators of this machine): save the model you passed to vitkit.optimize, "
             "and optimize it again after loading")


class Unsaved(nn.Module):
    """A layer of optimize's output whose weights live in an opaque packed form, outside its parameters: a
    state dict or a pickle of it would silently lack them, so both raise TypeError(NOT_SAVED), and a deep copy
    raises TypeError too; `.to()`, `.double()`, `.half()`, `.cuda()` would convert the model around them,
    which then fails at its first call, so a conversion to anything but the layer's dtype (`dtype`, fp32
    unless set) on the CPU raises TypeError at once."""

    dtype: torch.dtype = torch.float32

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        raise TypeError(NOT_SAVED)

    def __getstate__(self):
        raise TypeError(NOT_SAVED)

    def __deepcopy__(self, memo):
        raise TypeError("a model from vitkit.optimize cannot be copied (its packed or int8 weights are "
                        "opaque): call vitkit.optimize again on the original model")

    def _apply(self, fn, recurse=True):
        probe = fn(torch.zeros(1, dtype=self.dtype))  # what the conversion makes of a CPU tensor of ours
        if probe.dtype != self.dtype or probe.device.type != "cpu":
            raise TypeError("vitkit.optimize's output runs on the CPU in the precision it was made for, and "
                            f"cannot be converted to {probe.dtype} on {probe.device}: convert the model "
                            "itself and optimize that, e.g. vitkit.optimize(model.to(...), precision=...)")
        return super()._apply(fn, recurse)


class PackedLinear(Unsaved):
    """An inference-only nn.Linear whose weight lives in oneDNN's blocked layout, optionally followed by a
    fused GELU (`activation="gelu"`). `batch_hint` is the number of rows the packing is tuned for (any number
    works). The layer keeps its weight in the plain layout too, and multiplies through whichever is faster on
    this machine at the rows of each call (`engine`): MKL's `F.linear` (PyTorch's own), the packed oneDNN
    product, or, on an AVX2 CPU, vitkit's own (`gemm_linear`, on a third copy of the weight, packed in panels:
    csrc/gemm.cpp)."""

    def __init__(self, linear: nn.Linear, activation: Literal["none", "gelu"] = "none",
                 approximate: Literal["none", "tanh"] = "none", batch_hint: int = 197):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # bf16 stays bf16 (optimize's bf16 model on a CPU with native bf16); anything else computes in fp32
        self.dtype = torch.bfloat16 if linear.weight.dtype == torch.bfloat16 else torch.float32
        weight = linear.weight.detach().to(self.dtype).contiguous()
        # Plain attributes, not buffers: an mkldnn tensor cannot be saved, copied or moved like a dense one.
        self.packed_weight = pack_weight(weight, batch_hint)
        self.plain_weight = weight
        self.bias = None if linear.bias is None else linear.bias.detach().to(self.dtype).clone()
        fits = self.dtype == torch.float32 and self.out_features % 16 == 0
        self.gemm_weight = torch.ops.vitkit.gemm_pack(weight) if fits and gemm_available() else None
        self.activation = activation
        self.approximate = approximate if activation == "gelu" else ""

    def _check(self, x: torch.Tensor) -> None:
        if x.dtype != self.dtype or x.device.type != "cpu":
            name = "bf16" if self.dtype == torch.bfloat16 else "fp32"
            raise ValueError(f"this PackedLinear runs {name} on the CPU, got {x.dtype} on {x.device}")

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b by F.linear on the plain weight, in the layer's dtype whatever autocast says (as the
        packed product)."""
        with autocast_off(x.device.type):
            return F.linear(x, self.plain_weight, self.bias)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x)
        return gelu_(y, self.approximate) if self.activation == "gelu" else y

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed_weight, self.bias, self.activation, self.approximate)

    def _gemm(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.ops.vitkit.gemm_linear(x, self.gemm_weight, self.bias, residual)
        return gelu_(y, self.approximate) if self.activation == "gelu" else y

    def engine(self, x: torch.Tensor) -> str:
        """"plain", "packed" or "gemm" (AVX2 CPUs) for an input of these rows: MKL up to MKL_MAX_ROWS rows
        (its matrix-vector kernels beat oneDNN's), else the fastest on this machine (vitkit.cpu.autotune). The
        default, kept unless another is clearly faster and taken with tuning off, follows `inference_engine`'s
        rule: "plain" where it names MKL (many rows on Intel CPUs), else "packed"."""
        n = rows(x)
        if n <= MKL_MAX_ROWS:
            return "plain"
        gemm = self.gemm_weight is not None
        shape = (n, self.in_features, self.out_features, self.bias is not None, self.activation,
                 self.approximate) + (("bf16",) if self.dtype == torch.bfloat16 else ()) + (("gemm",) * gemm)

        def candidates():
            sample = torch.randn(n, self.in_features, generator=autotune.generator()).to(self.dtype)
            found = {"plain": lambda: self._plain(sample), "packed": lambda: self._packed(sample)}
            return found | ({"gemm": lambda: self._gemm(sample)} if gemm else {})

        default = "plain" if inference_engine(n) == "mkl" else "packed"
        return autotune.choose("packed-linear", shape, candidates, default)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        engine = self.engine(x)
        return self._plain(x) if engine == "plain" else self._gemm(x) if engine == "gemm" else self._packed(x)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + (x W^T + b), for a layer without activation: packed, in one oneDNN call (its binary
        post-op)."""
        self._check(x)
        if self.activation != "none":
            raise ValueError("PackedLinear.add is for layers without a fused activation")
        engine = self.engine(x)
        if engine == "plain":
            return self._linear(x).add_(residual)
        if engine == "gemm":
            return self._gemm(x, residual)
        return onednn_linear_add(x, residual, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        act = f", activation=gelu({self.approximate})" if self.activation == "gelu" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed{act}"


class LinearPatchEmbed(nn.Module):
    """The patch projection x_p E of eq. 1 as what it is, one linear map (`proj`, an nn.Linear) of each
    flattened patch: the patches are cut out with a reshape (one copy of the image). Packed (pack_linears), it
    is faster than oneDNN's convolution on these strided, non-overlapping windows."""

    def __init__(self, patch_embed: PatchEmbed):
        super().__init__()
        conv = patch_embed.proj
        self.patch_size = conv.kernel_size[0]
        self.proj = nn.Linear(conv.in_channels * self.patch_size**2, conv.out_channels,
                              bias=conv.bias is not None)
        with torch.no_grad():
            self.proj.weight.copy_(conv.weight.reshape(conv.out_channels, -1))  # (D, C P P), as the patches
            if conv.bias is not None:
                self.proj.bias.copy_(conv.bias)
        self.proj.requires_grad_(conv.weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        P = self.patch_size
        patches = x.reshape(B, C, H // P, P, W // P, P).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(B, (H // P) * (W // P), C * P * P)  # sizes named: B may be 0
        return self.proj(patches)  # (B, N, D), patches in raster order
