"""Cosine similarity of position embeddings."""

import pytest
import torch

from vitkit import create_model
from vitkit.analysis.posemb_similarity import position_similarity


def test_self_similarity_is_one_on_the_diagonal_and_symmetric():
    gh, gw, D = 3, 5, 16  # a non-square grid
    table = torch.randn(1, 1 + gh * gw, D)
    sim = position_similarity(table, (gh, gw), num_prefix_tokens=1)
    assert sim.shape == (gh * gw, gh, gw)
    flat = sim.reshape(gh * gw, gh * gw)
    torch.testing.assert_close(torch.diagonal(flat), torch.ones(gh * gw, dtype=torch.float64))
    torch.testing.assert_close(flat, flat.T)
    # Map i, at grid cell (r, c), holds the similarities of patch i = r * gw + c: its own cell is 1.
    assert sim[7, 1, 2] == pytest.approx(1.0)
    # Independent check of one entry.
    a, b = table[0, 1 + 3], table[0, 1 + 11]
    assert (flat[3, 11].item()
            == pytest.approx(torch.nn.functional.cosine_similarity(a, b, dim=0).item(), abs=1e-6))


def test_orthonormal_table_gives_the_identity():
    gh, gw, D = 4, 4, 32
    q, _ = torch.linalg.qr(torch.randn(D, gh * gw, dtype=torch.float64))
    table = 3.0 * q.T  # orthogonal rows, any length
    sim = position_similarity(table, (gh, gw))
    torch.testing.assert_close(sim.reshape(16, 16), torch.eye(16, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("pos_embed", ["learned", "learned-2d", "sincos-2d"])
def test_every_position_embedding_of_a_model(pos_embed):
    model = create_model("ViT-Ti/16", image_size=(16, 24), patch_size=8, dim=32, depth=1, num_heads=2,
                         mlp_dim=64, pos_embed=pos_embed)
    sim = position_similarity(model.position_table(), model.cfg.grid_size, model.cfg.num_prefix_tokens)
    assert sim.shape == (6, 2, 3)
    torch.testing.assert_close(torch.diagonal(sim.reshape(6, 6)), torch.ones(6, dtype=torch.float64))


def test_wrong_grid_is_an_error():
    with pytest.raises(ValueError, match="needs 17"):
        position_similarity(torch.randn(1, 10, 8), (4, 4), num_prefix_tokens=1)


def test_no_table_is_a_clear_error():
    model = create_model("ViT-Ti/16", image_size=32, patch_size=8, dim=32, depth=1, num_heads=2, mlp_dim=64,
                         pos_embed="none")
    assert model.position_table() is None
    with pytest.raises(TypeError, match=r"got NoneType: model.position_table\(\) gives it"):
        position_similarity(model.position_table(), (4, 4), 1)
