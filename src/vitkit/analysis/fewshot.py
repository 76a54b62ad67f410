"""Few-shot linear evaluation, as in the paper (Sec. 4.1, "few-shot accuracies").

A closed-form, L2-regularised least-squares fit from frozen representations to {-1, 1}^K targets, the
evaluator of big_vision (`fewshot_lsr`): the features are standardised with the training shots' mean and
standard deviation, a constant feature of 100 is appended so that the bias is almost unregularised, and

    W = (X^T X + l2 I)^{-1} X^T Y     (or, with fewer points than dimensions, X^T (X X^T + l2 I)^{-1} Y),

solved through the eigen-decomposition of X^T X (or X X^T). The prediction is the arg-max of X_test W.
Shots are drawn per class from a seeded permutation; accuracy is averaged over several seeds. big_vision's
defaults: l2 = 2^10, 3 seeds, shots 1, 5, 10, 25.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

BIAS_FEATURE = 100.0  # big_vision's constant: large, so that the bias is barely regularised
DEFAULT_L2 = 2.0**10
DEFAULT_SHOTS = (1, 5, 10, 25)


@dataclass(frozen=True)
class LinearModel:
    """An affine classifier on standardised features: argmax(((x - mean) / std, 100) @ weight)."""

    weight: torch.Tensor  # (D + 1, K); the last row multiplies the constant bias feature
    mean: torch.Tensor  # (D,)
    std: torch.Tensor  # (D,)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return _design(x.to(torch.float64), self.mean, self.std) @ self.weight

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.scores(x).argmax(dim=1)


def _design(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Standardise and append the constant bias feature: (N, D) -> (N, D + 1)."""
    z = (x - mean) / std
    return torch.cat([z, torch.full((z.shape[0], 1), BIAS_FEATURE, dtype=z.dtype, device=z.device)], dim=1)


def signed_one_hot(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Labels (N,) -> targets (N, K) in {-1, 1}: +1 for the true class, -1 elsewhere."""
    return 2.0 * torch.nn.functional.one_hot(labels.long(), num_classes).to(torch.float64) - 1.0


def fit_lsr(x: torch.Tensor, labels: torch.Tensor, num_classes: int,
            l2_reg: float = DEFAULT_L2) -> LinearModel:
    """The regularised least-squares classifier of `x` (N, D) to {-1, 1}^K targets, in closed form."""
    if x.dim() != 2 or labels.shape != (x.shape[0],):
        raise ValueError(f"need features (N, D) and labels (N,), got {tuple(x.shape)} and "
                         f"{tuple(labels.shape)}")
    if l2_reg <= 0:
        raise ValueError(f"l2_reg must be positive, got {l2_reg}")
    x = x.detach().to(torch.float64)
    mean = x.mean(dim=0)
    std = x.std(dim=0, unbiased=False) + 1e-5  # population std, as numpy's default
    xd = _design(x, mean, std)  # (N, D+1)
    y = signed_one_hot(labels, num_classes)  # (N, K)
    n, d = xd.shape
    if n >= d:  # (X^T X + l2 I)^{-1} X^T Y = Q diag(1 / (e + l2)) Q^T X^T Y
        eigs, q = torch.linalg.eigh(xd.T @ xd)
        lhs, rhs = q, q.T @ (xd.T @ y)
    else:  # X^T (X X^T + l2 I)^{-1} Y = X^T Q diag(1 / (e + l2)) Q^T Y
        eigs, q = torch.linalg.eigh(xd @ xd.T)
        lhs, rhs = xd.T @ q, q.T @ y
    weight = (lhs / (eigs + l2_reg)) @ rhs  # (D+1, K)
    return LinearModel(weight, mean, std)


def class_permutations(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """For each class, the indices of its examples in a random order."""
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def take_shots(permutations: list[np.ndarray], shots: int) -> np.ndarray:
    """The first `shots` indices of every class's permutation: the sets for 1, 5, 10, 25 shots are nested,
    as in big_vision."""
    for c, members in enumerate(permutations):
        if len(members) < shots:
            raise ValueError(f"class {c} has {len(members)} training examples, fewer than {shots} shots")
    return np.concatenate([members[:shots] for members in permutations])


@dataclass(frozen=True)
class FewShotResult:
    shots: int
    accuracies: tuple[float, ...]  # one per seed

    @property
    def mean(self) -> float:
        return float(np.mean(self.accuracies))

    @property
    def std(self) -> float:
        return float(np.std(self.accuracies))


def draw_shots(labels: np.ndarray | torch.Tensor, num_classes: int, shots: Sequence[int],
               seeds: int) -> dict[tuple[int, int], np.ndarray]:
    """Indices of the training examples for every (seed, shots): seed s permutes each class's examples with
    numpy's default_rng(s), as big_vision, and `shots` takes the first ones of each class (so the sets of one
    seed are nested). Only these examples' features are ever needed."""
    if seeds < 1:
        raise ValueError(f"seeds must be at least 1, got {seeds}")
    labels = labels.cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    draws = {}
    for seed in range(seeds):
        perms = class_permutations(labels, num_classes, np.random.default_rng(seed))
        for s in shots:
            draws[(seed, s)] = take_shots(perms, s)
    return draws


def fewshot_eval(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
                 shots: Sequence[int] = DEFAULT_SHOTS, num_classes: int | None = None,
                 l2_reg: float = DEFAULT_L2, seeds: int = 3,
                 draws: dict[tuple[int, int], np.ndarray] | None = None) -> list[FewShotResult]:
    """Few-shot accuracy on (test_x, test_y) of classifiers fitted to `shots` per class drawn from
    (train_x, train_y), for each number of shots, over `seeds` random draws (see draw_shots).

    `draws`, when given, are the (seed, shots) -> row indices into train_x to use instead of drawing them
    here: a caller that drew them from a whole dataset's labels needs only those rows' features.
    """
    K = int(num_classes if num_classes is not None else max(int(train_y.max()), int(test_y.max())) + 1)
    if draws is None:
        draws = draw_shots(train_y, K, shots, seeds)
    test_y = test_y.long()
    per_shot: dict[int, list[float]] = {s: [] for s in shots}
    for seed in range(seeds):
        for s in shots:
            idx = torch.as_tensor(draws[(seed, s)], dtype=torch.long)
            model = fit_lsr(train_x[idx], train_y[idx], K, l2_reg)
            per_shot[s].append((model.predict(test_x) == test_y).double().mean().item())
    return [FewShotResult(s, tuple(per_shot[s])) for s in shots]
