"""Weight initialisers of the ViT: the Flax reference code's truncated normals, and mimetic attention.

Small pure functions that `VisionTransformer.init_weights` and the hybrid's ResNet stem call.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def trunc_normal_(t: torch.Tensor, std: float) -> torch.Tensor:
    """Normal(0, std) truncated at two standard deviations (torch's default cut is at +-2 absolute)."""
    return nn.init.trunc_normal_(t, std=std, a=-2.0 * std, b=2.0 * std)


def lecun_normal_(w: torch.Tensor) -> torch.Tensor:
    """Flax's `lecun_normal`: a normal truncated at +-2 sigma, rescaled so that the variance is 1 / fan_in.

    0.8796... is the standard deviation of a unit normal truncated to [-2, 2].
    """
    std = math.sqrt(1.0 / w[0].numel()) / 0.87962566103423978
    return trunc_normal_(w, std=std)


def mimetic_factors(alpha: float, beta: float, dim: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L, R of shape (dim, rank) with L R^T the best rank-`rank` approximation of alpha Z + beta I, where Z has
    N(0, 1/dim) entries: the factorisation of mimetic initialisation (Trockman & Kolter, 2023, Sec. 4)."""
    target = alpha * torch.randn(dim, dim) / math.sqrt(dim) + beta * torch.eye(dim)
    u, s, vh = torch.linalg.svd(target)
    root = s[:rank].sqrt()
    return u[:, :rank] * root, vh[:rank].T * root


# Mimetic initialisation's (alpha, beta) for W_q W_k^T ~ alpha Z + beta I and W_v W_o ~ alpha Z - beta I: the
# paper's values for ViT-Tiny on CIFAR-10, not tuned for vitkit's presets.
MIMETIC_QK = (0.7, 0.7)
MIMETIC_VO = (0.4, -0.4)


@torch.no_grad()
def mimetic_init_(attn: nn.Module) -> None:
    """Initialise one attention layer so that every head's W_q W_k^T is near the identity (tokens attend to
    tokens like themselves, and so, through the position embedding, to their neighbours) and W_v W_o is near
    minus the identity, the patterns of pre-trained ViTs. Biases are zero."""
    D, H, Dh = attn.proj.in_features, attn.num_heads, attn.head_dim
    w = attn.qkv.weight  # (3D, D): the rows of q, then k, then v; head h owns rows h*Dh:(h+1)*Dh of each
    for h in range(H):
        left, right = mimetic_factors(*MIMETIC_QK, D, Dh)  # x W_q^T W_k x^T = x L R^T x^T
        w[h * Dh:(h + 1) * Dh] = left.T
        w[D + h * Dh:D + (h + 1) * Dh] = right.T
    left, right = mimetic_factors(*MIMETIC_VO, D, D)  # v W_o^T = x W_v^T W_o^T = x L R^T
    w[2 * D:] = left.T
    attn.proj.weight.copy_(right)
    if attn.qkv.bias is not None:
        attn.qkv.bias.zero_()
    attn.proj.bias.zero_()
