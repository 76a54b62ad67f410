"""Principal components of patch-embedding filters."""

import pytest
import torch

from vitkit import create_model
from vitkit.analysis.filters import filter_principal_components, to_display


def test_known_directions_and_variances_come_back():
    D, C, P = 64, 3, 4
    g = torch.Generator().manual_seed(1)
    dims = C * P * P
    directions, _ = torch.linalg.qr(torch.randn(dims, 4, generator=g, dtype=torch.float64))  # (48, 4)
    variances = torch.tensor([9.0, 4.0, 1.0, 0.25], dtype=torch.float64)
    # Coefficients: zero-mean, mutually orthogonal columns, scaled so that the sample variance along
    # direction i is exactly variances[i].
    coeff = torch.randn(D, 4, generator=g, dtype=torch.float64)
    coeff, _ = torch.linalg.qr(coeff - coeff.mean(0))
    coeff = coeff * torch.sqrt(variances * (D - 1))
    offset = torch.randn(dims, generator=g, dtype=torch.float64)  # a common mean filter, removed by PCA
    weight = (coeff @ directions.T + offset).reshape(D, C, P, P).float()

    pcs = filter_principal_components(weight, k=28)
    assert pcs.components.shape == (28, C, P, P)
    got = pcs.components.reshape(28, dims)[:4]
    for i in range(4):
        cos = torch.dot(got[i], directions[:, i]).abs()
        assert cos > 1 - 1e-5, f"component {i}: |cos| = {cos}"
    torch.testing.assert_close(pcs.variance[:4], variances, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pcs.explained[:4], variances / variances.sum(), rtol=1e-5, atol=1e-5)
    assert pcs.variance[4:].max() < 1e-8  # nothing else varies


def test_components_of_a_model_are_orthonormal_with_a_fixed_sign():
    model = create_model("ViT-Ti/16", image_size=32, patch_size=8, dim=40, depth=1, num_heads=2, mlp_dim=64)
    pcs = filter_principal_components(model.patch_embed.proj.weight, k=28)
    flat = pcs.components.reshape(28, -1)
    torch.testing.assert_close(flat @ flat.T, torch.eye(28, dtype=torch.float64), atol=1e-10, rtol=0)
    assert (pcs.variance[:-1] >= pcs.variance[1:]).all()
    pivot = flat.abs().argmax(1)
    assert (flat.gather(1, pivot[:, None]) > 0).all()
    # Fewer filters than components asked for: at most D components.
    few = filter_principal_components(model.patch_embed.proj.weight[:5], k=28)
    assert few.components.shape[0] == 5


def test_display_ranges_and_errors():
    rgb = to_display(torch.randn(3, 4, 4))
    assert rgb.shape == (4, 4, 3) and rgb.min() == 0 and rgb.max() == 1
    grey = to_display(torch.randn(1, 4, 4))
    assert grey.shape == (4, 4)
    assert torch.all(to_display(torch.zeros(3, 2, 2)) == 0.5)
    with pytest.raises(ValueError, match=r"\(D, C, P, P\)"):
        filter_principal_components(torch.randn(8, 48))
