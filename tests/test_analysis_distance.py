"""Mean attention distance."""

import math

import pytest
import torch

from vitkit import create_model
from vitkit.analysis.distance import attention_distance, mean_attention_distance, patch_distances


def _brute_force_mean_pairwise(gh, gw, patch):
    cells = [(r, c) for r in range(gh) for c in range(gw)]
    total = 0.0
    for r1, c1 in cells:
        for r2, c2 in cells:
            total += math.hypot(r1 - r2, c1 - c2) * patch
    return total / len(cells) ** 2


def test_attention_on_itself_is_at_distance_zero():
    T = 1 + 12
    eye = torch.eye(T).expand(3, 2, T, T)
    torch.testing.assert_close(attention_distance(eye, (3, 4), 16, 1), torch.zeros(3, 2, dtype=torch.float64))


@pytest.mark.parametrize("grid,patch", [((4, 4), 16), ((3, 5), 7), ((1, 2), 10)])
def test_uniform_attention_is_the_grid_mean_pairwise_distance(grid, patch):
    gh, gw = grid
    N = gh * gw
    # The class token takes half of every row; the patch part is uniform once re-normalised.
    a = torch.full((2, 3, 1 + N, 1 + N), 0.5 / N)
    a[..., 0] = 0.5
    expected = _brute_force_mean_pairwise(gh, gw, patch)
    got = attention_distance(a, grid, patch, num_prefix_tokens=1)
    torch.testing.assert_close(got, torch.full((2, 3), expected, dtype=torch.float64))
    # And with no class token at all.
    u = torch.full((1, 1, N, N), 1.0 / N)
    assert attention_distance(u, grid, patch, 0).item() == pytest.approx(expected)


def test_a_known_case_and_the_distance_table():
    # Two patches side by side, each attending only to the other: 10 pixels apart.
    a = torch.tensor([[0.0, 1.0], [1.0, 0.0]])[None, None]
    assert attention_distance(a, (1, 2), 10, 0).item() == pytest.approx(10.0)
    d = patch_distances((2, 3), 4)
    assert d[0, 5].item() == pytest.approx(4 * math.hypot(1, 2))  # (0,0) to (1,2)
    torch.testing.assert_close(d, d.T)


def test_all_layers_of_a_model():
    model = create_model("ViT-Ti/16", image_size=32, patch_size=8, dim=32, depth=3, num_heads=2,
                         mlp_dim=64).eval()
    with torch.no_grad():
        _, attns = model.forward_features(torch.randn(4, 3, 32, 32), return_attention=True)
    dist = mean_attention_distance(attns, model.cfg.grid_size, model.cfg.patch_size, 1)
    assert dist.shape == (3, 2)
    largest = patch_distances(model.cfg.grid_size, 8).max()
    assert (dist >= 0).all() and (dist <= largest).all()
    torch.testing.assert_close(dist[1], attention_distance(attns[1], (4, 4), 8, 1).mean(0))
    with pytest.raises(ValueError, match="does not fit"):
        attention_distance(attns[0], (3, 3), 8, 1)
