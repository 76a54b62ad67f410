"""Make a ViT fast for inference without changing what it computes: `optimize(model, precision)`.

It returns a copy of the model for inference (eval mode, no gradients):

Every precision takes the class-token shortcut (`vitkit.shortcut`: with token pooling the last block
updates the class token only).

- "fp32" (the default): the same function to within 1e-4. On a CPU the encoder blocks become FusedBlocks
  (`vitkit.cpu.fused_block`: residual adds fused into the output projections; the last block of a class-token
  model attends through the key and value projections for its one query), the patch convolution one linear
  map, and every linear layer a PackedLinear (`vitkit.cpu.packed`: the weight reordered once into oneDNN's
  blocked layout, the MLP's GELU fused in). The layers that multiply one row per image keep a plain copy of
  their weight for calls of at most two rows, where MKL's matrix-vector kernels beat oneDNN's. On AVX-512 and
  AVX2 CPUs each block but the class-token shortcut's last runs as one compiled operator where that is timed
  faster (`vitkit.cpu.fp32_block`: vitkit's own products on a further copy of the weights, GELU by Abramowitz
  and Stegun's erf to 3e-7).
- "int8": dynamic quantisation of the encoder's linear layers (`vitkit.cpu.int8`: int8 weights per output
  channel, activations quantised per call, 8 bits where the CPU has VNNI). On CPUs with AVX512-VNNI and no
  AMX the products are vitkit's own, each token quantised with its own scale; elsewhere fbgemm's, or oneDNN's
  where they are faster, one scale per tensor. Each block runs as one compiled operator where it can be built
  (`torch.ops.vitkit.int8_block` or `int8_block_vnni`, its attention on the fastest kernel here;
  `VITKIT_KERNELS=0` turns it off; without it, the attention matrices are bf16 on CPUs with native bf16).
  With one scale per tensor an image's int8 scales depend on the other images of its call, so its logits
  change slightly with the batch; vitkit's own products scale each token on its own, and there the patch
  projection is int8 too (each patch with its own scale). The LayerNorms and the classifier stay fp32. The
  function changes slightly: the Fashion-MNIST test set keeps >= 99 % of its fp32 top-1 predictions
  (benchmarks/bench_inference.py).
- "bf16": the weights in bfloat16, inputs cast on the way in and logits cast back to fp32; for GPUs, and for
  CPUs with native bf16 (AVX512-BF16, AMX), where the blocks are FusedBlocks and every linear layer a bf16
  PackedLinear (GELU and the residual adds fused in, as in fp32), the LayerNorms run on vitkit's bf16 kernel
  with AVX512-BF16 (`vitkit.cpu.bf16_norm`), and the attention on the fastest of SDPA's bf16 kernel and
  vitkit's operator (in bf16 on AVX512-BF16's tiles, else in fp32 on the projection cast to fp32). With
  AVX512-BF16 each block but the class-token shortcut's last runs as one compiled operator where that is timed
  faster (`vitkit.cpu.bf16_block`: vitkit's own bf16 products on a further copy of the weights). On other
  CPUs it is refused with a ValueError: they emulate bf16 at about a third of the fp32 speed. Logits differ
  from fp32 by about 1e-2: a different function, like int8.

`compile=False` (the default) never compiles, so the command line can call `optimize(model)` for free;
`compile=True` applies torch.compile (inductor; with freezing on the CPU), once per batch size it is called
with; `compile="auto"` only on CUDA. On a 2-core CPU compiling ViT-S/16 took about half a minute and gained
less than the oneDNN path above (docs/speed.md).

The process's allocator matters as much as the kernels at large batches: call
`vitkit.retain_freed_memory()` once in a program (vitkit.cpu.allocator); `optimize` leaves process-wide
settings alone. The returned model keeps the VisionTransformer interface (forward_features with
return_attention, forward_head) unless it was compiled; it has no state dict and cannot be pickled.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
import torch.nn as nn

from .cpu.bf16_norm import bf16_layer_norms
from .cpu.convert import (
    bf16_block_operators,
    fp32_block_operators,
    fuse_blocks,
    pack_linears,
    quantize_linears_int8,
)
from .cpu.hardware import cpu_has_native_bf16
from .cpu.private import onednn_packing_available
from .folder_format import OPTIMIZED
from .model import VisionTransformer
from .shortcut import with_class_token_shortcut

Precision = Literal["fp32", "int8", "bf16"]
PRECISIONS: tuple[str, ...] = ("fp32", "int8", "bf16")
CompileMode = bool | Literal["auto"]
# The attribute that marks optimize's output, with its precision as the value: vitkit.save refuses such
# models.


def _cast_bf16(model: nn.Module) -> nn.Module:
    """Weights in bf16; inputs are cast on the way in, outputs back to fp32. On a VisionTransformer, every
    entry point keeps its fp32 interface: forward, forward_features (tokens and attention maps) and
    forward_head."""
    model.to(torch.bfloat16)
    if not isinstance(model, VisionTransformer):
        def cast_inputs(_module, args, kwargs):
            return tuple(_to_bf16(a) for a in args), kwargs

        def cast_output(_module, _args, output):
            return output.float() if torch.is_tensor(output) else output

        model.register_forward_pre_hook(cast_inputs, with_kwargs=True)
        model.register_forward_hook(cast_output)
        return model
    # Instance attributes in front of the class's methods: forward reaches the images through embed and the
    # logits through forward_head, so these three cover every path in.
    embed, forward_features, forward_head = model.embed, model.forward_features, model.forward_head

    def embed_bf16(x: torch.Tensor, streams: torch.Tensor | None = None) -> torch.Tensor:
        return embed(_to_bf16(x), streams)

    def forward_features_fp32(x: torch.Tensor, return_attention: bool = False,
                              streams: torch.Tensor | None = None):
        out = forward_features(x, return_attention, streams)
        if return_attention:
            tokens, attentions = out
            return tokens.float(), [a.float() for a in attentions]
        return out.float()

    def forward_head_fp32(features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return forward_head(_to_bf16(features), pre_logits).float()

    model.embed, model.forward_features, model.forward_head = (embed_bf16, forward_features_fp32,
                                                               forward_head_fp32)
    return model


def _to_bf16(x):
    return x.to(torch.bfloat16) if torch.is_tensor(x) and x.is_floating_point() else x


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _compile(model: nn.Module, device: torch.device) -> nn.Module:
    """torch.compile with inductor; on the CPU with freezing, which folds the weights in as constants and
    lets inductor prepack them."""
    options = {"freezing": True} if device.type == "cpu" else {}
    return torch.compile(model, backend="inductor", options=options, dynamic=False)


def optimize(model: nn.Module, precision: Precision = "fp32", compile: CompileMode = False) -> nn.Module:
    """A copy of `model` made fast for inference (see the module docstring for what each precision does).

    compile: False (default), True, or "auto" (compile only on CUDA).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose from {', '.join(PRECISIONS)}")
    done = getattr(model, OPTIMIZED, None)
    if done is not None:
        raise ValueError(f"this model already comes from vitkit.optimize(precision={done!r}): "
                         "optimize the original model instead")
    if compile not in (True, False, "auto"):
        raise ValueError(f"compile={compile!r}: choose True, False or 'auto'")
    if hasattr(model, "_orig_mod"):
        # torch.compile's wrapper: its graphs would be traced through packed layers
        raise ValueError("vitkit.optimize takes the model itself, not torch.compile's wrapper of it: "
                         "vitkit.optimize(model, compile=True) compiles it")
    device = _model_device(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if precision in ("fp32", "int8") and dtype != torch.float32:
        raise ValueError(f"precision={precision!r} starts from a float32 model; this one's parameters are "
                         f"{dtype}: call model.float() first"
                         + (" (or precision='bf16' on a GPU)" if dtype != torch.float64 else ""))
    if precision == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        raise ValueError(
            "precision='bf16' needs a GPU or a CPU with native bf16 (AVX512-BF16 or AMX); this CPU would "
            "emulate it at about a third of the fp32 speed: use precision='fp32' or 'int8', or move the "
            "model to a GPU"
        )
    if precision == "int8" and device.type != "cpu":
        raise ValueError(f"precision='int8' runs on the CPU (fbgemm or oneDNN kernels), the model is on "
                         f"{device}")
    if precision == "int8" and compile is True:
        raise ValueError("compile=True with precision='int8' is not supported (only fp32 and bf16 compile); "
                         "use compile=False")
    do_compile = compile is True or (compile == "auto" and device.type == "cuda" and precision != "int8")
    # Compiled on the CPU, inductor packs the weights itself, from plain linear layers: nothing to pack first.
    pack = device.type == "cpu" and onednn_packing_available() and not do_compile
    out = with_class_token_shortcut(copy.deepcopy(model).eval())
    out.requires_grad_(False)
    if precision == "fp32" and pack:
        fp32_block_operators(pack_linears(fuse_blocks(out)))
    elif precision == "int8":
        quantize_linears_int8(fuse_blocks(out))
        if onednn_packing_available():
            pack_linears(out)  # what stays fp32: the classifier (and the patch projection, but on VNNI)
    elif precision == "bf16" and pack:
        # the blocks fused while fp32 (FusedBlock derives its few-query layers from the fp32 weights), then
        # every linear layer packed in bf16, the blocks readied for the bf16 block operator, the LayerNorms on
        # vitkit's bf16 kernel where it runs
        bf16_layer_norms(bf16_block_operators(pack_linears(_cast_bf16(fuse_blocks(out)))))
    elif precision == "bf16":
        _cast_bf16(out)
    if do_compile:
        out = _compile(out, device)
    # No gradients flow through the optimized layers: an input that requires them is detached, so that a
    # backward() through the output fails loudly instead of leaving the input's .grad silently None.
    out.register_forward_pre_hook(_detach_inputs)
    setattr(out, OPTIMIZED, precision)
    return out


def _detach_inputs(module: nn.Module, args: tuple) -> tuple:
    """optimize()'s forward pre-hook: the inputs, detached."""
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
