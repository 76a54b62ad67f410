"""Shifted Patch Tokenization (SPT; Lee, Lee & Song, "Vision Transformer for Small-Size Datasets", 2021): a
patch embedding that also sees each patch's neighbourhood, for ViTs trained from scratch on little data.

The image and four copies of it shifted by half a patch diagonally (up-left, up-right, down-left, down-right;
zeros shifted in) are stacked along the channels; each P x P patch of the stack, 5 C P^2 values, is
layer-normalised and projected to the model width. Where eq. 1's x_p E sees only its own patch, each token
here also sees the half patch around it: a little of a convolutional stem's locality at the cost of a wider
projection. Not in the ViT paper: `ViTConfig(spt=True)` opts in (docs/training.md says what it did on
Fashion-MNIST).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ViTConfig

SHIFTS = 4  # the diagonal copies beside the image itself


def shifted_stack(x: torch.Tensor, shift: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, 5C, H, W): the image, then its copies moved by `shift` pixels towards the
    bottom-right, bottom-left, top-right and top-left (each copy's pixel (i, j) is the image's (i - s, j - s),
    (i - s, j + s), (i + s, j - s), (i + s, j + s)); pixels shifted in from outside are zero."""
    h, w = x.shape[-2:]
    padded = F.pad(x, (shift, shift, shift, shift))
    corners = ((0, 0), (0, 2 * shift), (2 * shift, 0), (2 * shift, 2 * shift))
    return torch.cat([x] + [padded[..., i:i + h, j:j + w] for i, j in corners], dim=1)


def patch_vectors(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C P^2): each P x P patch flattened channel-major (as a convolution's weight
    (D, C, P, P) is), patches in raster order."""
    b, c, h, w = x.shape
    gh, gw = h // p, w // p
    return x.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * p * p)


class ShiftedPatchEmbed(nn.Module):
    """SPT in place of eq. 1's patch projection: (B, C, H, W) -> (B, N, D). `proj` is a convolution over the
    5C stacked channels (kernel = stride = P) so that it is initialised, counted and shown as the plain
    patch projection is; it is applied as the linear map it is, after the LayerNorm of each patch vector."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.patch_size = cfg.patch_size
        self.shift = cfg.patch_size // 2
        channels = (1 + SHIFTS) * cfg.in_chans
        self.norm = nn.LayerNorm(channels * cfg.patch_size**2, eps=cfg.ln_eps)
        self.proj = nn.Conv2d(channels, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        patches = self.norm(patch_vectors(shifted_stack(x, self.shift), self.patch_size))
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)
