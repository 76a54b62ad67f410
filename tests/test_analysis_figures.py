"""The figure helpers: tile placement, upsampling, and that every plot renders to a small PNG."""

import numpy as np
import torch

from vitkit.analysis import figures
from vitkit.analysis.filters import filter_principal_components


def test_similarity_mosaic_places_each_map_on_its_grid_cell():
    gh, gw = 2, 3
    sim = np.arange(6)[:, None, None] * np.ones((6, gh, gw))
    m = figures.similarity_mosaic(sim)
    assert m.shape == (gh * (gh + 1) - 1, gw * (gw + 1) - 1)
    # Map 4 is patch (row 1, column 1): its tile starts at row 1 * (gh + 1), column 1 * (gw + 1).
    assert (m[3:5, 4:7] == 4).all()
    assert np.isnan(m[2]).all() and np.isnan(m[:, 3]).all()  # separators


def test_upsample_map():
    up = figures.upsample_map(torch.full((4,), 2.0), (2, 2), (8, 8))
    assert up.shape == (8, 8) and np.allclose(up, 1.0)
    one_hot = figures.upsample_map(torch.tensor([0.0, 0.0, 0.0, 1.0]), (2, 2), (8, 8))
    assert one_hot[-1, -1] == 1.0 and one_hot[0, 0] == 0.0


def test_every_plot_saves_a_small_png(tmp_path):
    g = torch.Generator().manual_seed(0)
    figs = {
        "attention": figures.plot_attention([np.random.rand(16, 16, 3), np.random.rand(16, 16)],
                                            [torch.rand(4), torch.rand(2, 2)], (2, 2), suptitle="t"),
        "filters": figures.plot_filters(filter_principal_components(torch.randn(40, 3, 4, 4, generator=g))),
        "filters_grey": figures.plot_filters(
            filter_principal_components(torch.randn(40, 1, 4, 4, generator=g))),
        "posemb": figures.plot_position_similarity(torch.rand(12, 3, 4) * 2 - 1),
        "distance": figures.plot_attention_distance(torch.rand(4, 3) * 50, reference=40.0),
        "fewshot": figures.plot_fewshot({"model": [(1, 50.0, 2.0), (5, 70.0, 1.0)]}),
    }
    for name, fig in figs.items():
        path = figures.save_figure(fig, tmp_path / f"{name}.png")
        data = path.read_bytes()
        assert data[:4] == b"\x89PNG" and 1_000 < len(data) < 300_000, name
