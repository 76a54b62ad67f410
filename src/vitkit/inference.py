"""Make a ViT fast for inference without changing what it computes.

`optimize(model, precision)` returns a model for inference (eval mode, no gradients):

- "fp32" (the default): the same function to within 1e-4. On a CPU every linear layer's weight is reordered
  once into oneDNN's blocked layout and the layer runs through oneDNN (`torch.ops.mkldnn._linear_pointwise`),
  with the MLP's GELU fused into its first layer. Measured on our 2-core AVX-512 CPU (docs/speed.md), oneDNN's
  packed GEMM is 10-20 % faster than the MKL `addmm` that `nn.Linear` calls, and GELU no longer makes a
  second pass over the (T, 4D) hidden activations. Attention already runs through
  `F.scaled_dot_product_attention` with one fused q;k;v projection (see model.py). The encoder blocks become
  FusedBlocks: the residual adds ride on the output projections (oneDNN's binary post-op), and the last block,
  which updates only the class token, attends through the key and value projections instead of projecting
  every token's key and value (`attend_through_projections`). The patch convolution becomes one packed linear
  map of the flattened patches. Together about 2-3 % of ViT-S/16 at batch 1. The layers that multiply one row
  per image (the classifier, the last block's class-token layers) also keep a plain copy of their weight for
  calls of at most two rows, where MKL's matrix-vector kernels beat oneDNN's. With `compile=True`,
  torch.compile (inductor, with freezing on the CPU) is applied on top.
- "int8": dynamic quantisation of the encoder's linear layers (int8 weights per output channel,
  activations quantised per call to 8 bits where the CPU has VNNI; fbgemm's kernels). On CPUs with native bf16
  the attention matrices are computed in bf16 (softmax in fp32). The blocks are FusedBlocks as in fp32, and
  each runs as one compiled operator where it can be built (`torch.ops.vitkit.int8_block`, src/vitkit/csrc,
  vitkit.kernels; `VITKIT_KERNELS=0` turns it off): one parallel region per block in which each thread goes
  through its own share of the tokens, two meeting points between the threads instead of one per operator
  (ViT-S/16 on our 2-core CPU 1.04-1.34x faster at batch 1, 1.06x at batch 16); the activations' int8 scales
  are then per share of the tokens. Either way an image's int8 scales depend on the other images of its call,
  so its logits change slightly with the batch it is in (fp32's do not). The patch projection, the LayerNorms
  and the classifier stay in fp32. The function changes slightly: the Fashion-MNIST test set keeps >= 99 % of
  its fp32 top-1 predictions (benchmarks/bench_inference.py).
- "bf16": the weights in bfloat16, inputs cast on the way in and logits cast back to fp32; for GPUs, and for
  CPUs with native bf16 (AVX512-BF16, AMX: our AMD EPYC runs ViT-S/16 about 1.8x faster than fp32). On
  CPUs without it `optimize` refuses with a ValueError rather than fall back: they emulate bf16 at about a
  third of the fp32 speed (our Ice Lake machines). bf16 keeps 8 bits of mantissa, so logits differ from
  fp32 by about 1e-2, not 1e-4: it is a different function, like int8.

`compile=False` (the default) never compiles, so `vitkit predict` and `vitkit eval` can call `optimize(model)`
for free. `compile=True` applies torch.compile (inductor; with freezing on the CPU); `compile="auto"` does so
only on CUDA, where it pays for itself in a long-running job. On our CPU, compiling ViT-S/16 took 34 s and
gained 1.03x, less than the oneDNN path above (docs/speed.md). It compiles for the shapes it is called with
(`dynamic=False`): each new batch size compiles again, so a job that calls it with many sizes should pad its
batches to one (a last, smaller batch costs one more compilation).

The process's allocator matters as much as the kernels at large batches: glibc faults every large activation
tensor in afresh from the kernel, a quarter of the int8 ViT-S/16 time at batch 16 on our CPU. Call
`vitkit.retain_freed_memory()` once in a program (the CLI's eval, predict and bench do; see
vitkit.allocator); `optimize` leaves process-wide settings alone.

The returned model is a copy; the argument is left untouched. It keeps the VisionTransformer interface
(forward_features with return_attention, forward_head) unless it was compiled.
"""

from __future__ import annotations

import copy
import warnings
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gelu import gelu_
from .hardware import cpu_has_native_bf16, cpu_has_vnni
from .kernels import int8_block_available
from .linear import MKL_MAX_ROWS, onednn_available, rows
from .model import Block, PatchEmbed, VisionTransformer, merge_heads, split_heads
from .qkv_attention import qkv_attention, qkv_attention_applies

Precision = Literal["fp32", "int8", "bf16"]
PRECISIONS: tuple[str, ...] = ("fp32", "int8", "bf16")
CompileMode = bool | Literal["auto"]
# The attribute that marks optimize's output, with its precision as the value: vitkit.save refuses such models.
OPTIMIZED = "vitkit_optimized"


def onednn_linear_available() -> bool:
    """Whether this torch build can run prepacked oneDNN linear layers: oneDNN's linear kernel (the one
    vitkit.linear uses) plus its weight reordering."""
    return onednn_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


NOT_SAVED = ("a model from vitkit.optimize has no state dict and cannot be pickled (its packed or int8 weights "
             "are opaque operators of this machine): save the model you passed to vitkit.optimize, and optimize it "
             "again after loading")


class _Unsaved(nn.Module):
    """A layer of optimize's output whose weights live in an opaque packed form, outside its parameters: a state
    dict or a pickle of it would silently lack them, so both raise TypeError(NOT_SAVED); and `.to()`, `.double()`,
    `.half()`, `.cuda()` would convert the model around them, which then fails at its first call, so a conversion
    to anything but fp32 on the CPU raises TypeError at once."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        raise TypeError(NOT_SAVED)

    def __getstate__(self):
        raise TypeError(NOT_SAVED)

    def _apply(self, fn, recurse=True):
        probe = fn(torch.zeros(1))  # what the conversion makes of an fp32 CPU tensor
        if probe.dtype != torch.float32 or probe.device.type != "cpu":
            raise TypeError(f"vitkit.optimize's output runs on the CPU in the precision it was made for, and cannot "
                            f"be converted to {probe.dtype} on {probe.device}: convert the model itself and "
                            "optimize that, e.g. vitkit.optimize(model.to(...), precision=...)")
        return super()._apply(fn, recurse)


class PackedLinear(_Unsaved):
    """An inference-only nn.Linear whose weight lives in oneDNN's blocked layout, optionally followed by a
    fused GELU (`activation="gelu"`). `batch_hint` is the number of rows the packing is tuned for (any number
    works). With `few_rows`, the layer also keeps its weight in the plain layout and multiplies inputs of at
    most vitkit.linear.MKL_MAX_ROWS rows through MKL (`F.linear`), 1.2-2x faster there than oneDNN: for the
    layers that see one row per image (the classifier, the last block's class-token layers)."""

    def __init__(self, linear: nn.Linear, activation: Literal["none", "gelu"] = "none",
                 approximate: Literal["none", "tanh"] = "none", batch_hint: int = 197, few_rows: bool = False):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().float().contiguous()
        # Plain attributes, not buffers: an mkldnn tensor cannot be saved, copied or moved like a dense one.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.plain_weight = weight.clone() if few_rows else None
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.activation = activation
        self.approximate = approximate if activation == "gelu" else ""

    def _check(self, x: torch.Tensor) -> None:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"PackedLinear runs fp32 on the CPU, got {x.dtype} on {x.device}")

    def _through_mkl(self, x: torch.Tensor) -> bool:
        return self.plain_weight is not None and rows(x) <= MKL_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        if self._through_mkl(x):
            y = F.linear(x, self.plain_weight, self.bias)
            return gelu_(y, self.approximate) if self.activation == "gelu" else y
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, self.activation, [],
                                                  self.approximate)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + (x W^T + b) in one oneDNN call (its binary post-op), for a layer without activation."""
        self._check(x)
        if self.activation != "none":
            raise ValueError("PackedLinear.add is for layers without a fused activation")
        if self._through_mkl(x):
            return F.linear(x, self.plain_weight, self.bias).add_(residual)
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), self.packed_weight, self.bias,
                                                         "add")

    def __deepcopy__(self, memo):
        raise TypeError("a model from vitkit.optimize cannot be copied (its oneDNN-packed weights are opaque): "
                        "call vitkit.optimize again on the original model")

    def extra_repr(self) -> str:
        act = f", activation=gelu({self.approximate})" if self.activation == "gelu" else ""
        few = f", MKL up to {MKL_MAX_ROWS} rows" if self.plain_weight is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed{act}{few}"


def _gelu_approximate(act: nn.Module) -> Literal["none", "tanh"] | None:
    """The `approximate` of an nn.GELU, or None for any other activation (which then is not fused)."""
    if isinstance(act, nn.GELU) and act.approximate in ("none", "tanh"):
        return act.approximate  # type: ignore[return-value]
    return None


def per_image_linears(model: nn.Module) -> list[nn.Module]:
    """The linear layers of a VisionTransformer that multiply one row per image: the classifier (and the
    pre-logits layer), and, where the last block is a FusedBlock for few queries, its class-token layers
    (the query projection, the attention's output projection, the MLP)."""
    if not isinstance(model, VisionTransformer):
        return []
    layers = [model.head, model.pre_logits]
    last = model.blocks[-1] if len(model.blocks) else None
    if isinstance(last, FusedBlock) and last.query is not None:
        layers += [last.query, last.attn.proj, last.mlp.fc1, last.mlp.fc2]
    return [layer for layer in layers if isinstance(layer, nn.Linear)]


def pack_linears(model: nn.Module, batch_hint: int = 197) -> nn.Module:
    """Replace, in place, every nn.Linear of `model` by a PackedLinear; where a module has an `fc1` followed
    by an nn.GELU `act` (our Mlp), the GELU is fused into fc1 and `act` becomes the identity. The layers of
    per_image_linears keep a plain weight for few rows (PackedLinear's `few_rows`)."""
    few = {id(layer) for layer in per_image_linears(model)}
    for module in list(model.modules()):
        fc1, act = getattr(module, "fc1", None), getattr(module, "act", None)
        approximate = _gelu_approximate(act) if act is not None else None
        if isinstance(fc1, nn.Linear) and approximate is not None:
            module.fc1 = PackedLinear(fc1, "gelu", approximate, batch_hint, few_rows=id(fc1) in few)
            module.act = nn.Identity()
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, PackedLinear(child, batch_hint=batch_hint, few_rows=id(child) in few))
    return model


class LinearPatchEmbed(nn.Module):
    """The patch projection x_p E of eq. 1 as what it is, one linear map (`proj`, an nn.Linear) of each
    flattened patch: the patches are cut out with a reshape (one copy of the image). Packed (pack_linears), it
    is faster than oneDNN's convolution on these strided, non-overlapping windows."""

    def __init__(self, patch_embed: PatchEmbed):
        super().__init__()
        conv = patch_embed.proj
        self.patch_size = conv.kernel_size[0]
        self.proj = nn.Linear(conv.in_channels * self.patch_size**2, conv.out_channels, bias=conv.bias is not None)
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


def attend_through_projections(q: torch.Tensor, h: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                               b_v: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(q k^T scale) v for a few queries, without projecting the keys and values of every token.

    q: (B, H, Q, Dh) queries; h: (B, T, D) the normalised tokens; w_k, w_v: (H, Dh, D) the key and value
    projections per head; b_v: (H, 1, Dh) the value bias. With k_j = W_k h_j + b_k and v_j = W_v h_j + b_v:

        q . k_j = (W_k^T q) . h_j + q . b_k   (the last term is the same for every j: softmax drops it)
        sum_j a_j v_j = W_v (sum_j a_j h_j) + b_v   (the weights a_j sum to 1)

    so the attention costs 2 Q D^2 + 2 Q H T D multiply-adds instead of the 2 T D^2 of projecting every
    token's key and value: for one class-token query of ViT-S/16, 1.2 M instead of 58 M. The same function up
    to float rounding (another order of summation). Returns (B, H, Q, Dh).

    Every product is a plain batched one over images or over heads, never broadcast over the other: a product
    broadcast over heads copies each image's tokens once per head (which made the int8 ViT-B/16 at batch 16
    1.09x slower)."""
    B, H, Q, Dh = q.shape
    D = h.shape[-1]
    by_head = q.transpose(0, 1).reshape(H, B * Q, Dh)  # a copy of the few queries only
    q_in = torch.bmm(by_head, w_k).view(H, B, Q, D).transpose(0, 1).reshape(B, H * Q, D)  # W_k^T q, per head
    attn = torch.bmm(q_in, h.transpose(1, 2)).mul_(scale).softmax(dim=-1)  # (B, H * Q, T)
    mixed = torch.bmm(attn, h).view(B, H, Q, D).transpose(0, 1).reshape(H, B * Q, D)  # sum_j a_j h_j, per head
    out = torch.bmm(mixed, w_v.transpose(1, 2)).view(H, B, Q, Dh).transpose(0, 1)  # (B, H, Q, Dh)
    return out if b_v is None else out.add_(b_v)


def residual_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + layer(x), in one call where the layer can (PackedLinear.add, DynamicInt8Linear.add)."""
    add = getattr(layer, "add", None)
    return add(x, residual) if callable(add) else residual + layer(x)


class FusedBlock(Block):
    """An encoder block (eq. 2 and 3) for inference, computing what Block computes in fewer passes over
    memory and fewer FLOPs, whatever its linear layers have become (packed fp32, int8):

    - the residual adds ride on the attention's output projection and the MLP's second layer
      (`residual_add`: for packed layers one oneDNN call, its binary post-op);
    - with `few_queries`, a call with `queries` (the last block of a class-token model, which updates only the
      class token) projects the queries of those tokens only (`query`, the first third of q;k;v) and attends
      through the key and value projections (`attend_through_projections`) instead of projecting every
      token's key and value: the whole q;k;v product of that block but a sliver;
    - `attention_dtype=torch.bfloat16` computes the attention matrices in bf16 (`bf16_attention`; the int8
      model on CPUs with native bf16), else the fused fp32 kernel.

    With return_attention, or in training mode, it runs as Block."""

    def __init__(self, block: Block, few_queries: bool = False):
        nn.Module.__init__(self)
        self.norm1, self.attn, self.norm2, self.mlp = block.norm1, block.attn, block.norm2, block.mlp
        self.drop_path = block.drop_path
        self.train(block.training)
        self.attention_dtype: torch.dtype | None = None
        self.int8_kernel = False  # the whole block through torch.ops.vitkit.int8_block (quantize_linears_int8)
        self.query = None
        if few_queries:
            qkv, heads = block.attn.qkv, block.attn.num_heads
            D = qkv.in_features
            w = qkv.weight.detach().float()
            self.query = nn.Linear(D, D, bias=qkv.bias is not None)
            with torch.no_grad():
                self.query.weight.copy_(w[:D])
                if qkv.bias is not None:
                    self.query.bias.copy_(qkv.bias[:D])
            self.query.requires_grad_(False)
            self.register_buffer("key_weight", w[D:2 * D].reshape(heads, D // heads, D).clone(), persistent=False)
            self.register_buffer("value_weight", w[2 * D:].reshape(heads, D // heads, D).clone(), persistent=False)
            b_v = None if qkv.bias is None else qkv.bias.detach().float()[2 * D:].reshape(heads, 1, D // heads)
            self.register_buffer("value_bias", None if b_v is None else b_v.clone(), persistent=False)

    def forward(self, x: torch.Tensor, return_attention: bool = False, queries: int | None = None):
        if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # The packed and int8 layers compute in fp32 only: as an fp32 model's own kernels would, the block
            # ignores autocast (which would hand them bf16 attention outputs).
            with torch.autocast("cpu", enabled=False):
                return self.forward(x.float(), return_attention, queries)
        if return_attention or self.training:
            return super().forward(x, return_attention, queries)
        if self.int8_kernel and queries is None:
            return int8_block(self, x), None
        heads, h = self.attn.num_heads, self.norm1(x)
        if queries is not None and self.query is not None and queries * heads < h.shape[1]:
            (q,) = split_heads(self.query(h[:, :queries]), heads, parts=1)  # (B, H, queries, Dh)
            y = attend_through_projections(q, h, self.key_weight, self.value_weight, self.value_bias,
                                           self.attn.scale)
            y = merge_heads(y)
        elif self.attention_dtype == torch.bfloat16:
            y = bf16_attention(self.attn.qkv(h), heads, self.attn.scale, queries)
        else:
            qkv = self.attn.qkv(h)
            if queries is None and qkv_attention_applies(qkv):
                y = qkv_attention(qkv, heads, self.attn.scale)
            else:
                q, k, v = split_heads(qkv, heads)
                y = merge_heads(F.scaled_dot_product_attention(q if queries is None else q[:, :, :queries], k, v))
        x = x if queries is None else x[:, :queries]
        x = residual_add(self.attn.proj, y, x)  # (2)
        return residual_add(self.mlp.fc2, self.mlp.act(self.mlp.fc1(self.norm2(x))), x), None  # (3)


def fuse_blocks(model: nn.Module) -> nn.Module:
    """Replace, in place, the encoder blocks of a VisionTransformer by FusedBlocks (with class-token pooling the
    last one ready for few queries, the class-token shortcut of VisionTransformer.forward) and its patch
    convolution by a LinearPatchEmbed. The linear layers stay as they are, for pack_linears or
    quantize_linears_int8 to convert. Other models are left alone."""
    blocks = getattr(model, "blocks", None)
    if isinstance(model, VisionTransformer) and all(type(b) is Block for b in blocks):
        shortcut = model.cfg.pool == "token"  # GAP models never call a block with `queries`
        for i, block in enumerate(blocks):
            blocks[i] = FusedBlock(block, few_queries=shortcut and i == len(blocks) - 1)
        if type(model.patch_embed) is PatchEmbed:
            model.patch_embed = LinearPatchEmbed(model.patch_embed)
    return model


class DynamicInt8Linear(_Unsaved):
    """nn.Linear with int8 weights (symmetric, one scale per output channel) and activations quantised
    per call (asymmetric uint8, one scale per tensor), through fbgemm's `quantized::linear_dynamic`.

    torch.ao's DynamicQuantizedLinear always uses 7-bit activations (`reduce_range=True`), a guard against
    the int16 saturation of AVX2's and AVX-512's `vpmaddubsw`. CPUs with VNNI accumulate in int32 and need no
    guard: there we use all 8 bits, which halves the activation rounding error (and is as fast). 8-bit
    activations on a CPU without VNNI are refused: fbgemm's sums would saturate (errors of the order of the
    outputs themselves)."""

    def __init__(self, linear: nn.Linear, reduce_range: bool | None = None):
        super().__init__()
        if reduce_range is False and not cpu_has_vnni():
            raise ValueError("reduce_range=False (8-bit activations) needs a CPU with VNNI, and this one has none: "
                             "fbgemm's int16 sums would saturate; use reduce_range=True or None (the CPU's choice)")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero = torch.zeros_like(scale, dtype=torch.long)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")
            qweight = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self.reduce_range = (not cpu_has_vnni()) if reduce_range is None else reduce_range

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, reduce_range=self.reduce_range)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + (x W^T + b), added into the product's fresh output (no third tensor)."""
        return self(x).add_(residual)

    def extra_repr(self) -> str:
        bits = 7 if self.reduce_range else 8
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, {bits}-bit activations"


class GELUInPlace(nn.Module):
    """GELU written over its input: inference only, where nothing else reads the pre-activation."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_(x, self.approximate)


def bf16_attention(qkv: torch.Tensor, num_heads: int, scale: float, queries: int | None = None) -> torch.Tensor:
    """Multi-head softmax(q k^T scale) v from the fused q;k;v projection's output (B, T, 3D), with both
    products in bfloat16 (torch's CPU softmax of bf16 computes in fp32 and rounds once at the end). For the
    int8 model on CPUs with native bf16 (AVX512-BF16, AMX), where these small batched products run faster
    than the fp32 kernel; the int8 model is already a different function from the fp32 one, and the
    agreement test covers this part too. q, k and v are laid out per head in one copy, the scale rides on the
    first product (`baddbmm`'s alpha: no pass of its own), and the heads are merged back in fp32 in one more
    copy: (B, queries or T, D) fp32."""
    B, T, width = qkv.shape
    D, Dh = width // 3, width // (3 * num_heads)
    heads = qkv.to(torch.bfloat16).view(B, T, 3, num_heads, Dh).permute(2, 0, 3, 1, 4).contiguous()
    q, k, v = heads.unbind(0)  # each (B, H, T, Dh)
    if queries is not None:
        q = q[:, :, :queries]
    Q = q.shape[2]
    q, k, v = (t.reshape(B * num_heads, t.shape[2], Dh) for t in (q, k, v))
    scores = torch.baddbmm(q.new_empty(B * num_heads, Q, T), q, k.transpose(1, 2), beta=0, alpha=scale)
    y = torch.bmm(scores.softmax(dim=-1), v).view(B, num_heads, Q, Dh)
    out = torch.empty(B, Q, num_heads, Dh, dtype=torch.float32, device=qkv.device)
    return out.copy_(y.transpose(1, 2)).view(B, Q, D)


def int8_block_eligible(block: nn.Module) -> bool:
    """Whether `block` is a FusedBlock that torch.ops.vitkit.int8_block computes: int8 linear layers with one
    activation bit width, affine LayerNorms over the width, and an in-place GELU between the MLP's layers."""
    if not isinstance(block, FusedBlock):
        return False
    attn, mlp = block.attn, block.mlp
    linears = [getattr(attn, "qkv", None), getattr(attn, "proj", None), getattr(mlp, "fc1", None),
               getattr(mlp, "fc2", None)]
    norms = [block.norm1, block.norm2]
    return (all(isinstance(lin, DynamicInt8Linear) for lin in linears)
            and len({lin.reduce_range for lin in linears}) == 1
            and isinstance(getattr(mlp, "act", None), GELUInPlace)
            and all(type(n) is nn.LayerNorm and n.elementwise_affine and n.bias is not None
                    and len(n.normalized_shape) == 1 for n in norms))


def int8_block(block: FusedBlock, x: torch.Tensor, shares: int | None = None) -> torch.Tensor:
    """eq. 2 and 3 for every token of `x` (B, T, D) through torch.ops.vitkit.int8_block (src/vitkit/csrc): the
    block as one parallel region with two meeting points between the threads instead of one per operator. It
    computes what the operator-by-operator path computes, except that the activations' int8 scales are per
    thread's share of the tokens rather than per tensor: `shares` (default: the number of intra-op threads)
    sets the cut, so the result depends slightly on it. On our 2-core CPU, against the operator-by-operator
    path: ViT-S/16 1.04x (the machine's fast state) to 1.34x (its slow state) at batch 1, 1.06x at batch 16;
    ViT-B/16 1.15x and 1.03x (docs/speed.md, "Session 12")."""
    attn, mlp = block.attn, block.mlp
    return torch.ops.vitkit.int8_block(
        x, block.norm1.weight, block.norm1.bias, block.norm1.eps, block.norm2.weight, block.norm2.bias,
        block.norm2.eps, attn.qkv.packed, attn.proj.packed, mlp.fc1.packed, mlp.fc2.packed,
        attn.qkv.reduce_range, attn.num_heads, attn.scale, block.attention_dtype == torch.bfloat16,
        mlp.act.approximate, torch.get_num_threads() if shares is None else shares)


def quantize_linears_int8(model: nn.Module) -> nn.Module:
    """Replace, in place, the encoder's linear layers (`blocks.*`) by DynamicInt8Linear, the MLP's GELU by
    an in-place one, and, on CPUs with native bf16, a FusedBlock's attention matrices by bf16 ones; FusedBlocks
    then run through the compiled int8 block operator where it can be built (vitkit.kernels). The
    classifier and the patch projection stay fp32: they cost little and carry the decision."""
    blocks = getattr(model, "blocks", None)
    target = blocks if isinstance(blocks, nn.Module) else model
    for module in list(target.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, DynamicInt8Linear(child))
    for module in list(target.modules()):
        approximate = _gelu_approximate(getattr(module, "act", None))
        if isinstance(getattr(module, "fc1", None), DynamicInt8Linear) and approximate is not None:
            module.act = GELUInPlace(approximate)
        if isinstance(module, FusedBlock) and cpu_has_native_bf16():
            module.attention_dtype = torch.bfloat16
    eligible = [m for m in target.modules() if int8_block_eligible(m)]
    if eligible and int8_block_available():
        for block in eligible:
            block.int8_kernel = True
    return model


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

    def embed_bf16(x: torch.Tensor) -> torch.Tensor:
        return embed(_to_bf16(x))

    def forward_features_fp32(x: torch.Tensor, return_attention: bool = False):
        out = forward_features(x, return_attention)
        if return_attention:
            tokens, attentions = out
            return tokens.float(), [a.float() for a in attentions]
        return out.float()

    def forward_head_fp32(features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return forward_head(_to_bf16(features), pre_logits).float()

    model.embed, model.forward_features, model.forward_head = embed_bf16, forward_features_fp32, forward_head_fp32
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
    if hasattr(model, "_orig_mod"):  # torch.compile's wrapper: its graphs would be traced through packed layers
        raise ValueError("vitkit.optimize takes the model itself, not torch.compile's wrapper of it: "
                         "vitkit.optimize(model, compile=True) compiles it")
    device = _model_device(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if precision in ("fp32", "int8") and dtype != torch.float32:
        raise ValueError(f"precision={precision!r} starts from a float32 model; this one's parameters are {dtype}: "
                         "call model.float() first" + (" (or precision='bf16' on a GPU)" if dtype != torch.float64
                                                       else ""))
    if precision == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        raise ValueError(
            "precision='bf16' needs a GPU or a CPU with native bf16 (AVX512-BF16 or AMX); this CPU would emulate "
            "it at about a third of the fp32 speed: use precision='fp32' or 'int8', or move the model to a GPU"
        )
    if precision == "int8" and device.type != "cpu":
        raise ValueError(f"precision='int8' runs on the CPU (fbgemm kernels), the model is on {device}")
    if precision == "int8" and compile is True:
        raise ValueError("compile=True with precision='int8' is not supported (only fp32 and bf16 compile); "
                         "use compile=False")
    out = copy.deepcopy(model).eval()
    out.requires_grad_(False)
    if precision == "fp32" and device.type == "cpu" and onednn_linear_available():
        pack_linears(fuse_blocks(out))
    elif precision == "int8":
        quantize_linears_int8(fuse_blocks(out))
        if onednn_linear_available():
            pack_linears(out)  # what stays fp32: the patch projection, the classifier
    elif precision == "bf16":
        _cast_bf16(out)
    do_compile = compile is True or (compile == "auto" and device.type == "cuda" and precision != "int8")
    if do_compile:
        if precision == "fp32" and device.type == "cpu":
            # Inductor does its own weight packing from plain linear layers: start again from them.
            out = copy.deepcopy(model).eval()
            out.requires_grad_(False)
        out = _compile(out, device)
    # No gradients flow through the optimized layers: an input that requires them is detached, so that a
    # backward() through the output fails loudly instead of leaving the input's .grad silently None.
    out.register_forward_pre_hook(_detach_inputs)
    setattr(out, OPTIMIZED, precision)
    return out


def _detach_inputs(module: nn.Module, args: tuple) -> tuple:
    """optimize()'s forward pre-hook: the inputs, detached."""
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
