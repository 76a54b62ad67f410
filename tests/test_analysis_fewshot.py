"""Few-shot regularised least squares (big_vision's fewshot_lsr) and the linear probe."""

import numpy as np
import pytest
import torch

from vitkit.analysis.fewshot import (
    BIAS_FEATURE,
    class_permutations,
    draw_shots,
    fewshot_eval,
    fit_lsr,
    signed_one_hot,
    take_shots,
)
from vitkit.analysis.probe import linear_probe


def _clusters(n_per_class, K=10, D=32, spread=0.3, seed=0, noise_seed=100):
    """K well-separated Gaussian clusters: linearly separable for any sensible classifier. `seed` fixes the
    centres, `noise_seed` the points around them."""
    g = torch.Generator().manual_seed(seed)
    centres = 5.0 * torch.randn(K, D, generator=g)
    y = torch.arange(K).repeat_interleave(n_per_class)
    x = centres[y] + spread * torch.randn(len(y), D, generator=torch.Generator().manual_seed(noise_seed))
    perm = torch.randperm(len(y), generator=g)
    return x[perm], y[perm]


def _ridge_reference(x, y, K, l2):
    """The same fit computed another way: ordinary least squares on the system augmented with sqrt(l2) I."""
    x = x.numpy().astype(np.float64)
    mean, std = x.mean(0), x.std(0) + 1e-5  # numpy's std is the population std, as big_vision's jnp.std
    X = np.concatenate([(x - mean) / std, np.full((len(x), 1), BIAS_FEATURE)], axis=1)
    Y = 2.0 * np.eye(K)[y.numpy()] - 1.0
    d = X.shape[1]
    A = torch.from_numpy(np.concatenate([X, np.sqrt(l2) * np.eye(d)]))
    B = torch.from_numpy(np.concatenate([Y, np.zeros((d, K))]))
    return torch.linalg.lstsq(A, B).solution


@pytest.mark.parametrize("n_per_class", [1, 3, 40])  # fewer points than dimensions, and more
def test_closed_form_equals_ridge_by_lstsq(n_per_class):
    x, y = _clusters(n_per_class, K=5, D=24)
    for l2 in (1e-2, 1.0, 2.0**10):
        model = fit_lsr(x, y, 5, l2)
        ref = _ridge_reference(x, y, 5, l2)
        torch.testing.assert_close(model.weight, ref, rtol=1e-7, atol=1e-9)


def test_closed_form_equals_the_normal_equations_solved_directly():
    x, y = _clusters(8, K=4, D=6)
    model = fit_lsr(x, y, 4, 3.0)
    X = torch.cat([(x.double() - model.mean) / model.std, torch.full((len(x), 1), BIAS_FEATURE,
                                                                    dtype=torch.float64)], 1)
    w = torch.linalg.solve(X.T @ X + 3.0 * torch.eye(7, dtype=torch.float64), X.T @ signed_one_hot(y, 4))
    torch.testing.assert_close(model.weight, w)


def test_separable_features_are_classified_perfectly():
    train_x, train_y = _clusters(30)
    test_x, test_y = _clusters(20, noise_seed=7)  # the same centres, other points
    results = fewshot_eval(train_x, train_y, test_x, test_y, shots=(1, 5, 10, 25), seeds=3)
    assert [r.shots for r in results] == [1, 5, 10, 25]
    for r in results:
        assert len(r.accuracies) == 3
        assert r.mean == 1.0, f"{r.shots} shots: {r.accuracies}"


def test_shots_are_per_class_nested_and_seeded():
    labels = np.repeat(np.arange(4), 7)
    perms = class_permutations(labels, 4, np.random.default_rng(0))
    five, ten = take_shots(perms, 5), take_shots(perms, 7)
    assert np.bincount(labels[five], minlength=4).tolist() == [5, 5, 5, 5]
    assert set(five) <= set(ten)
    again = class_permutations(labels, 4, np.random.default_rng(0))
    assert all((a == b).all() for a, b in zip(perms, again, strict=True))
    with pytest.raises(ValueError, match="class 0 has 7 training examples, fewer than 8"):
        take_shots(perms, 8)


def test_precomputed_draws_on_a_subset_give_the_same_result():
    train_x, train_y = _clusters(12, spread=4.0)  # overlapping clusters: accuracy below 100 %
    test_x, test_y = _clusters(5, spread=4.0, noise_seed=9)
    full = fewshot_eval(train_x, train_y, test_x, test_y, shots=(1, 3), seeds=2, l2_reg=1.0)
    draws = draw_shots(train_y, 10, (1, 3), 2)
    needed = np.unique(np.concatenate(list(draws.values())))
    assert len(needed) <= 2 * 3 * 10 < len(train_y)
    row = {int(i): j for j, i in enumerate(needed)}
    local = {k: np.array([row[int(i)] for i in v]) for k, v in draws.items()}
    sub = fewshot_eval(train_x[needed], train_y[needed], test_x, test_y, shots=(1, 3), num_classes=10,
                       seeds=2, l2_reg=1.0, draws=local)
    assert [r.accuracies for r in sub] == [r.accuracies for r in full]
    assert 0.2 < full[0].mean < 1.0


def test_chance_level_on_random_labels_and_errors():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(400, 16, generator=g)
    y = torch.randint(0, 4, (400,), generator=g)
    res = fewshot_eval(x[:200], y[:200], x[200:], y[200:], shots=(10,), num_classes=4, seeds=5)[0]
    assert 0.1 < res.mean < 0.45  # no signal: near 1/4
    with pytest.raises(ValueError, match="l2_reg"):
        fit_lsr(x, y, 4, 0.0)
    with pytest.raises(ValueError, match="labels"):
        fit_lsr(x, y[:10], 4)


def test_linear_probe_on_separable_features():
    train_x, train_y = _clusters(20)
    test_x, test_y = _clusters(10, noise_seed=7)  # the same centres, other points
    res = linear_probe(train_x, train_y, test_x, test_y)
    assert res.accuracy == 1.0 and res.train_accuracy == 1.0
    assert res.C in (0.01, 0.1, 1.0, 10.0) and len(res.validation) == 4
    fixed = linear_probe(train_x, train_y, test_x, test_y, C=0.5)
    assert fixed.C == 0.5 and fixed.validation == {} and fixed.accuracy == 1.0


def test_linear_probe_matches_sklearn_directly():
    from sklearn.linear_model import LogisticRegression

    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    res = linear_probe(x[:200], y[:200], x[200:], y[200:], C=1.0)
    xs = x.numpy().astype(np.float64)
    mu, sd = xs[:200].mean(0), xs[:200].std(0)
    clf = LogisticRegression(C=1.0, max_iter=1000).fit((xs[:200] - mu) / sd, y[:200].numpy())
    assert res.accuracy == pytest.approx((clf.predict((xs[200:] - mu) / sd) == y[200:].numpy()).mean())
    with pytest.raises(ValueError, match="two classes"):
        linear_probe(x[:10], torch.zeros(10), x[:10], torch.zeros(10))
