"""Linear probe: multinomial logistic regression on frozen representations.

The features are standardised with the training set's statistics; the inverse regularisation strength C is
given, or chosen from a small grid on a held-out tenth of the training set and then refitted on all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..extras import require

DEFAULT_C_GRID = (0.01, 0.1, 1.0, 10.0)


@dataclass(frozen=True)
class ProbeResult:
    accuracy: float  # on the test features
    train_accuracy: float
    C: float
    validation: dict[float, float] = field(default_factory=dict)  # C -> held-out accuracy, when swept


def _as_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _fit(x: np.ndarray, y: np.ndarray, C: float, max_iter: int):
    require("sklearn", "the linear probe")
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    clf = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=max_iter))
    return clf.fit(x, y)


def linear_probe(train_x: torch.Tensor | np.ndarray, train_y: torch.Tensor | np.ndarray,
                 test_x: torch.Tensor | np.ndarray, test_y: torch.Tensor | np.ndarray,
                 C: float | None = None, c_grid: Sequence[float] = DEFAULT_C_GRID, max_iter: int = 1000,
                 seed: int = 0) -> ProbeResult:
    """Fit a logistic-regression probe on (train_x, train_y), report its accuracy on (test_x, test_y)."""
    xtr, ytr = _as_numpy(train_x).astype(np.float64), _as_numpy(train_y).astype(np.int64)
    xte, yte = _as_numpy(test_x).astype(np.float64), _as_numpy(test_y).astype(np.int64)
    if xtr.ndim != 2 or ytr.shape != (xtr.shape[0],):
        raise ValueError(f"need features (N, D) and labels (N,), got {xtr.shape} and {ytr.shape}")
    if len(np.unique(ytr)) < 2:
        raise ValueError("a probe needs training examples of at least two classes")
    validation: dict[float, float] = {}
    if C is None:
        if len(c_grid) == 0:
            raise ValueError("give C or a non-empty grid of C values to choose from")
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(ytr))
        n_val = max(1, len(ytr) // 10)
        val, fit = order[:n_val], order[n_val:]
        for c in c_grid:
            clf = _fit(xtr[fit], ytr[fit], c, max_iter)
            validation[float(c)] = float((clf.predict(xtr[val]) == ytr[val]).mean())
        C = max(validation, key=lambda c: (validation[c], -c))  # ties: the stronger regularisation
    clf = _fit(xtr, ytr, C, max_iter)
    return ProbeResult(
        accuracy=float((clf.predict(xte) == yte).mean()),
        train_accuracy=float((clf.predict(xtr) == ytr).mean()),
        C=float(C),
        validation=validation,
    )
