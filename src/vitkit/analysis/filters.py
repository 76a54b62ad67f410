"""The principal components of the patch-embedding filters (the paper's Fig. 7, left).

Each of the D rows of E (eq. 1) is a filter over a P x P x C patch. The paper shows the top principal
components of these D filters: for a trained model they resemble plausible basis functions for a
low-dimensional representation of the fine structure within each patch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FilterComponents:
    """`components` (k, C, P, P): unit-norm principal directions, largest variance first, each with its
    largest-magnitude entry positive; `variance` (k,): the variance of the filters along each;
    `explained` (k,): that variance as a share of the total."""

    components: torch.Tensor
    variance: torch.Tensor
    explained: torch.Tensor


def filter_principal_components(weight: torch.Tensor, k: int = 28) -> FilterComponents:
    """Principal components of patch-embedding filters `weight` (D, C, P, P), e.g.
    `model.patch_embed.proj.weight`. Returns at most min(k, D, C*P*P) components."""
    if weight.dim() != 4:
        raise ValueError(f"patch-embedding weight must be (D, C, P, P), got shape {tuple(weight.shape)}")
    if k < 1:
        raise ValueError(f"number of components must be positive, got {k}")
    D, C, P, Q = weight.shape
    if D < 2:
        raise ValueError(f"principal components need at least 2 filters, got {D}")
    x = weight.detach().to(torch.float64).reshape(D, C * P * Q)
    x = x - x.mean(dim=0, keepdim=True)  # centre over the filters
    _, s, vh = torch.linalg.svd(x, full_matrices=False)  # rows of vh: the directions, by singular value
    k = min(k, vh.shape[0])
    comps = vh[:k]
    # Make the sign deterministic: the largest-magnitude entry of each component is positive.
    pivot = comps.abs().argmax(dim=1)
    signs = torch.sign(comps.gather(1, pivot[:, None]))
    signs[signs == 0] = 1.0
    comps = comps * signs
    variance = s**2 / (D - 1)
    total = variance.sum()
    explained = variance[:k] / total if total > 0 else torch.zeros(k, dtype=variance.dtype)
    return FilterComponents(comps.reshape(k, C, P, Q), variance[:k], explained)


def to_display(component: torch.Tensor) -> torch.Tensor:
    """A (C, P, P) component as a displayable (P, P, 3) or (P, P) image in [0, 1], min-max scaled.

    Three channels are shown as RGB, one as grey; any other count shows the channels' mean in grey.
    """
    c = component.detach().to(torch.float64)
    if c.shape[0] == 3:
        img = c.permute(1, 2, 0)
    elif c.shape[0] == 1:
        img = c[0]
    else:
        img = c.mean(dim=0)
    lo, hi = img.min(), img.max()
    return (img - lo) / (hi - lo) if hi > lo else torch.full_like(img, 0.5)
