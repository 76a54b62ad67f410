"""MixUp (Zhang et al. 2018) and CutMix (Yun et al. 2019) over pairs of images fixed by their place in the
global batch, with draws from each pair's own random stream (vitkit.streams).

The images at global positions 2k and 2k+1 are partners: each becomes lam x its own image plus (1 - lam) x
its partner's (MixUp), or its own image with a box pasted from its partner's (CutMix, lam then the area left
uncovered), and the soft labels mix alike. Each pair draws its own lam ~ Beta(alpha, alpha), its own box and,
with both on, which of the two it gets (even odds), all from the stream of its first image. timm calls this
its "pair" mode; the papers draw one lam per batch. Because nothing depends on which images share a process
or micro-batch, a run mixes the same pairs alike on 1 or 8 processes. A micro-batch holds whole pairs when
its first position and size are even (vitkit's batches always start at an even position when the batch per
process is even); an image whose partner falls outside its micro-batch stays unmixed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..streams import MIX, beta, fold_in, open_uniform
from .augment import AugmentConfig


def partners(first: int, n: int) -> torch.Tensor:
    """The index within a micro-batch of each image's partner: the images at global positions first .. first
    + n - 1, paired 2k with 2k+1; an image whose partner lies outside the micro-batch is its own."""
    positions = torch.arange(first, first + n)
    partner = positions ^ 1
    inside = (partner >= first) & (partner < first + n)
    return torch.where(inside, partner, positions) - first


def cutmix_boxes(lam: torch.Tensor, u: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """CutMix's box per image as torchvision's v2.CutMix and timm draw it, from lam and two uniforms
    u (B, 2): a centre anywhere in the image, half-sides 0.5 sqrt(1 - lam) times the image's, clipped at the
    border. Returns (B, 4) int64 (x1, y1, x2, y2)."""
    cx = (u[:, 0] * width).long().clamp_(max=width - 1)
    cy = (u[:, 1] * height).long().clamp_(max=height - 1)
    r = 0.5 * torch.sqrt(1.0 - lam)
    half_w, half_h = (r * width).long(), (r * height).long()
    x1, x2 = (cx - half_w).clamp(min=0), (cx + half_w).clamp(max=width)
    y1, y2 = (cy - half_h).clamp(min=0), (cy + half_h).clamp(max=height)
    return torch.stack([x1, y1, x2, y2], dim=1)


def mix_pairs(x: torch.Tensor, y: torch.Tensor, streams: torch.Tensor, first: int, aug: AugmentConfig,
              num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MixUp or CutMix (the module's docstring) of a micro-batch whose images are at global positions `first`
    .. `first` + B - 1: images (B, C, H, W) float, integer labels (B,), the images' streams (B, 2) ->
    (images, soft labels (B, num_classes) float32). With both MixUp and CutMix off, (x, y) as they are."""
    if aug.mixup <= 0 and aug.cutmix <= 0:
        return x, y
    B, _, H, W = x.shape
    dev = streams.device
    j = partners(first, B).to(dev)
    # Each pair's draws, from its first image's stream: both partners read the same ones.
    pair = fold_in(streams[torch.minimum(torch.arange(B, device=dev), j)], MIX)
    if aug.mixup > 0 and aug.cutmix > 0:
        cut = open_uniform(fold_in(pair, 1), 1)[:, 0] < 0.5
    else:
        cut = torch.full((B,), aug.cutmix > 0, device=dev)
    lam = torch.ones(B, dtype=torch.float64, device=dev)
    if aug.mixup > 0:
        lam = torch.where(cut, lam, beta(fold_in(pair, 2), aug.mixup, aug.mixup))
    if aug.cutmix > 0:
        # The pair's box, pasted each way; lam becomes the fraction of the image left uncovered.
        box = cutmix_boxes(beta(fold_in(pair, 3), aug.cutmix, aug.cutmix), open_uniform(fold_in(pair, 4), 2),
                           H, W)
        area = (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1])
        lam = torch.where(cut, 1.0 - area.to(lam.dtype) / (H * W), lam)
        rows, cols = torch.arange(H, device=dev)[None, :], torch.arange(W, device=dev)[None, :]
        inside = (((rows >= box[:, 1:2]) & (rows < box[:, 3:4]))[:, :, None]
                  & ((cols >= box[:, 0:1]) & (cols < box[:, 2:3]))[:, None, :])  # (B, H, W)
        own = torch.where(cut[:, None, None], (~inside).to(lam.dtype), lam[:, None, None])
    else:
        own = lam[:, None, None].expand(B, H, W)
    # Per pixel, the weight of the image's own value: lam everywhere for MixUp, 0 or 1 for CutMix.
    own = own[:, None].to(device=x.device, dtype=x.dtype)
    j_x = j.to(x.device)
    mixed = own * x + (1.0 - own) * x[j_x]
    onehot = F.one_hot(y.long(), num_classes).to(torch.float32)
    weight = lam.to(device=onehot.device, dtype=torch.float32)[:, None]
    return mixed, weight * onehot + (1.0 - weight) * onehot[j.to(onehot.device)]
