"""The encoder block for inference: what the model's Block computes, in fewer passes over memory and FLOPs."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention import merge_heads, split_heads
from ..model import Block
from .attention import attend, implementation
from .bf16_block import Operands, bf16_block, bf16_block_chosen
from .fp32_block import fp32_block, fp32_block_chosen
from .int8 import bf16_attention, int8_block


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
    # sum_j a_j h_j, per head
    mixed = torch.bmm(attn, h).view(B, H, Q, D).transpose(0, 1).reshape(H, B * Q, D)
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
      model on CPUs with native bf16), else the fused fp32 kernel;
    - the int8 model's blocks run as one operator (`int8_kernel`, vitkit.cpu.int8), and so may the fp32
      model's on AVX-512 and AVX2 CPUs (`fp32_operands`, vitkit.cpu.fp32_block) and the bf16 model's on CPUs
      with AVX512-BF16 (`bf16_operands`, vitkit.cpu.bf16_block), where that is faster.

    With return_attention, or in training mode, it runs as Block."""

    def __init__(self, block: Block, few_queries: bool = False):
        nn.Module.__init__(self)
        self.norm1, self.attn, self.norm2, self.mlp = block.norm1, block.attn, block.norm2, block.mlp
        self.drop_path = block.drop_path
        self.train(block.training)
        self.attention_dtype: torch.dtype | None = None
        # the whole block through torch.ops.vitkit.int8_block (quantize_linears_int8)
        self.int8_kernel = False
        # the fp32 block operator's weights and biases (vitkit.cpu.convert.fp32_block_operators), else None
        self.fp32_operands: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        # the bf16 block operator's weights, biases and LayerNorm parameters
        # (vitkit.cpu.convert.bf16_block_operators), else None
        self.bf16_operands: Operands | None = None
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
            self.register_buffer("key_weight", w[D:2 * D].reshape(heads, D // heads, D).clone(),
                                 persistent=False)
            self.register_buffer("value_weight", w[2 * D:].reshape(heads, D // heads, D).clone(),
                                 persistent=False)
            b_v = (None if qkv.bias is None
                   else qkv.bias.detach().float()[2 * D:].reshape(heads, 1, D // heads))
            self.register_buffer("value_bias", None if b_v is None else b_v.clone(), persistent=False)

    def forward(self, x: torch.Tensor, return_attention: bool = False, queries: int | None = None,
                stream: torch.Tensor | None = None):
        if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # The packed and int8 layers compute in their own dtype (fp32, or a bf16 model's bf16): as a
            # model's own kernels would, the block ignores autocast (which would hand them other dtypes).
            with torch.autocast("cpu", enabled=False):
                return self.forward(x.to(self.layers_dtype()), return_attention, queries, stream)
        if return_attention or self.training:
            return super().forward(x, return_attention, queries, stream)
        if self.int8_kernel and queries is None:
            return int8_block(self, x), None
        if self.fp32_operands is not None and queries is None and fp32_block_chosen(self, x):
            return fp32_block(self, x), None
        if self.bf16_operands is not None and queries is None and bf16_block_chosen(self, x):
            return bf16_block(self, x), None
        return self.forward_layers(x, queries), None

    def layers_dtype(self) -> torch.dtype:
        """The dtype the block's layers compute in: a packed layer's own (bf16 in a bf16 model), else fp32."""
        qkv = self.attn.qkv
        return qkv.dtype if isinstance(getattr(qkv, "dtype", None), torch.dtype) else qkv.weight.dtype

    def forward_layers(self, x: torch.Tensor, queries: int | None = None) -> torch.Tensor:
        """The block's output for inference, layer by layer (the class docstring's fusions): eq. 2 and 3 for
        every token of x, or for its first `queries` tokens."""
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
            if queries is None:
                y = attend(implementation(qkv, heads, 0.0, False), qkv, heads, self.attn.scale)
            else:
                q, k, v = split_heads(qkv, heads)
                y = merge_heads(F.scaled_dot_product_attention(q[:, :, :queries], k, v))
        x = x if queries is None else x[:, :queries]
        x = residual_add(self.attn.proj, y, x)  # (2)
        return residual_add(self.mlp.fc2, self.mlp.act(self.mlp.fc1(self.norm2(x))), x)  # (3)
