"""Position-embedding maths (Sec. 3.2, Appendix D.4): the fixed 2D sin-cos table and 2D resampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed

from vitkit import ViTConfig, resample_pos_embed
from vitkit.model import VisionTransformer
from vitkit.posemb import resample_state_dict, sincos_2d
from vitkit.transfer import prepare_finetune


def tiny(**overrides) -> ViTConfig:
    base = dict(image_size=32, patch_size=8, dim=32, depth=1, num_heads=4, mlp_dim=64, num_classes=10)
    base.update(overrides)
    return ViTConfig(**base)


# --- sin-cos table ------------------------------------------------------------------------------------
def big_vision_sincos(h: int, w: int, width: int, temperature: float = 10_000.0) -> np.ndarray:
    """big_vision's posemb_sincos_2d written out again in numpy, one position at a time."""
    q = width // 4
    omega = 1.0 / temperature ** (np.arange(q) / (q - 1))
    rows = []
    for y in range(h):
        for x in range(w):
            xs, ys = x * omega, y * omega
            rows.append(np.concatenate([np.sin(xs), np.cos(xs), np.sin(ys), np.cos(ys)]))
    return np.stack(rows)


@pytest.mark.parametrize("grid, dim", [((4, 4), 32), ((3, 5), 64), ((14, 14), 768)])
def test_sincos_matches_big_vision(grid, dim):
    table = sincos_2d(grid, dim)
    assert table.shape == (grid[0] * grid[1], dim)
    assert table.dtype == torch.float32
    np.testing.assert_allclose(table.numpy(), big_vision_sincos(*grid, dim), rtol=0, atol=1e-6)


def test_sincos_known_values():
    table = sincos_2d((2, 3), 16)  # 4 frequencies from 1 to 1/10000
    q = 4
    origin = table[0]
    torch.testing.assert_close(origin, torch.tensor([0.0] * q + [1.0] * q + [0.0] * q + [1.0] * q))
    # Row 0, column 1: x = 1 so the fastest x-frequency is sin(1), the slowest sin(1e-4).
    assert table[1, 0].item() == pytest.approx(np.sin(1.0))
    assert table[1, q - 1].item() == pytest.approx(np.sin(1e-4), rel=1e-4)
    # Row 1, column 0 (raster order: index 3): y = 1.
    assert table[3, 2 * q].item() == pytest.approx(np.sin(1.0))
    assert table[3, 0].item() == 0.0


def test_sincos_rejects_a_width_not_divisible_by_4():
    with pytest.raises(ValueError, match="divisible by 4, got 30"):
        sincos_2d((2, 2), 30)


def test_sincos_model_uses_the_fixed_table_and_no_row_for_the_class_token():
    model = VisionTransformer(tiny(pos_embed="sincos-2d", image_size=(24, 40)))
    table = model.position_table()[0]
    assert torch.equal(table[0], torch.zeros(32))
    torch.testing.assert_close(table[1:], sincos_2d((3, 5), 32))
    assert "pos_embed_fixed" not in model.state_dict()  # rebuilt from the config, never stored


def test_learned_2d_table_concatenates_row_and_column_halves():
    model = VisionTransformer(tiny(pos_embed="learned-2d", image_size=(24, 40)))
    table = model.position_table()[0]  # (1 + 3 * 5, D)
    assert table.shape == (16, 32)
    torch.testing.assert_close(table[0], model.pos_embed_cls[0, 0])
    for r in range(3):
        for c in range(5):
            row = table[1 + r * 5 + c]
            torch.testing.assert_close(row[:16], model.pos_embed_row[0, r])
            torch.testing.assert_close(row[16:], model.pos_embed_col[0, c])


# --- resampling ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["bicubic", "bilinear", "bilinear-corners"])
def test_resampling_to_the_same_grid_is_the_identity(mode):
    table = torch.randn(1, 1 + 6 * 4, 8)
    out = resample_pos_embed(table, (6, 4), (6, 4), num_prefix_tokens=1, mode=mode)
    assert torch.equal(out, table)
    flat = torch.randn(6 * 4, 8)  # rank 2, no prefix
    assert torch.equal(resample_pos_embed(flat, (6, 4), (6, 4), num_prefix_tokens=0, mode=mode), flat)


def test_bilinear_halving_of_a_linear_table_is_exact():
    """A table linear in (row, col): halving the grid samples it at pixel centres 2i + 0.5, 2j + 0.5."""
    gh, gw, D = 8, 6, 3
    r, c = torch.meshgrid(torch.arange(gh, dtype=torch.float32), torch.arange(gw, dtype=torch.float32),
                          indexing="ij")
    coef = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, -3.0]])  # channel k = a_k * row + b_k * col
    grid = torch.stack([a * r + b * c for a, b in coef], dim=-1).reshape(gh * gw, D)
    cls = torch.full((1, D), 7.0)
    # Plain bilinear sampling (antialias would average each output over a 2x2-pixel triangle instead).
    out = resample_pos_embed(torch.cat([cls, grid]), (gh, gw), (4, 3), mode="bilinear", antialias=False)
    assert out.shape == (1 + 4 * 3, D)
    assert torch.equal(out[0], cls[0])  # the class token's row is kept as is
    r2, c2 = torch.meshgrid(2 * torch.arange(4.0) + 0.5, 2 * torch.arange(3.0) + 0.5, indexing="ij")
    expected = torch.stack([a * r2 + b * c2 for a, b in coef], dim=-1).reshape(12, D)
    torch.testing.assert_close(out[1:], expected)


def test_bilinear_upsampling_of_a_linear_table_is_linear_inside_the_border():
    """Doubling a linear ramp: interior samples lie at (i + 0.5) / 2 - 0.5 and stay on the line."""
    ramp = torch.arange(5.0)[None, :].expand(4, 5)  # value = column index
    out = resample_pos_embed(ramp.reshape(20, 1), (4, 5), (8, 10), num_prefix_tokens=0, mode="bilinear")
    out = out.reshape(8, 10)
    expected = (torch.arange(10.0) + 0.5) / 2 - 0.5
    torch.testing.assert_close(out[:, 1:-1], expected[1:-1].expand(8, 8))
    torch.testing.assert_close(out[:, 0], torch.zeros(8))  # the border clamps to the first column
    torch.testing.assert_close(out[:, -1], torch.full((8,), 4.0))


@pytest.mark.parametrize("old, new", [((7, 7), (12, 12)), ((4, 6), (8, 3)), ((14, 14), (37, 37))])
@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
def test_resampling_matches_timm_by_default_and_without_antialias(old, new, prefix, mode):
    table = torch.randn(1, prefix + old[0] * old[1], 16)
    ours = resample_pos_embed(table, old, new, num_prefix_tokens=prefix, mode=mode)
    theirs = resample_abs_pos_embed(table, list(new), list(old), num_prefix_tokens=prefix, interpolation=mode)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # timm's defaults: antialias=True
    plain = resample_pos_embed(table, old, new, num_prefix_tokens=prefix, mode=mode, antialias=False)
    torch.testing.assert_close(plain, resample_abs_pos_embed(table, list(new), list(old),
                                                             num_prefix_tokens=prefix,
                                                             interpolation=mode, antialias=False),
                               rtol=1e-5, atol=1e-5)
    if mode == "bicubic":  # another kernel (a = -0.5 against -0.75), upsampling too
        assert (ours - plain).abs().max() > 1e-3
    elif new[0] >= old[0] and new[1] >= old[1]:  # antialiased bilinear upsampling is bilinear upsampling
        torch.testing.assert_close(ours, plain, rtol=0, atol=1e-5)


@pytest.mark.parametrize("old, new", [((4, 1), (7, 1)), ((5, 1), (3, 2)), ((1, 4), (1, 7))])
def test_a_grid_one_patch_wide_resamples_as_any_other(old, new):
    """Channel k of the table is an image; torch's antialiased kernels misread a one-wide grid in the
    permuted layout the table reshapes to, so resample_pos_embed hands them a contiguous one."""
    table = torch.randn(old[0] * old[1], 8)
    out = resample_pos_embed(table, old, new, num_prefix_tokens=0)
    for k in range(8):
        image = table[:, k].reshape(1, 1, *old).contiguous()
        expected = F.interpolate(image, size=new, mode="bicubic", align_corners=False, antialias=True)
        torch.testing.assert_close(out[:, k], expected.reshape(-1))


@pytest.mark.parametrize("old, new", [((14, 14), (24, 24)), ((7, 7), (12, 12)), ((4, 6), (8, 3))])
def test_bilinear_corners_is_the_papers_scipy_zoom(old, new):
    """vit_jax resamples the grid with scipy.ndimage.zoom(order=1), corner patch onto corner patch; the class
    token's row stays."""
    from scipy import ndimage

    table = torch.randn(1 + old[0] * old[1], 16, dtype=torch.float64)
    ours = resample_pos_embed(table, old, new, num_prefix_tokens=1, mode="bilinear-corners")
    grid = table[1:].reshape(*old, 16).numpy()
    zoomed = ndimage.zoom(grid, (new[0] / old[0], new[1] / old[1], 1), order=1)
    assert zoomed.shape[:2] == new
    torch.testing.assert_close(ours[0], table[0])
    torch.testing.assert_close(ours[1:], torch.from_numpy(zoomed.reshape(-1, 16)), rtol=1e-5, atol=1e-5)
    # pixel areas: differs
    aligned = resample_pos_embed(table, old, new, num_prefix_tokens=1, mode="bilinear")
    assert (aligned - ours).abs().max() > 1e-2


def test_learned_2d_halves_are_resampled_along_their_axis_in_the_mode_asked():
    """Each half of a learned-2d table is a 1D table: resampled in the given mode along its axis (it used to
    be linear whatever the mode)."""
    old = ViTConfig(image_size=(32, 48), patch_size=8, dim=16, depth=1, num_heads=2, mlp_dim=32,
                    pos_embed="learned-2d")
    new = old.replace(image_size=(56, 40))
    state = {"pos_embed_row": torch.randn(1, 4, 8), "pos_embed_col": torch.randn(1, 6, 8)}
    out = {mode: resample_state_dict(state, old, new, mode=mode) for mode in ("bicubic", "bilinear")}
    for key, g_new in (("pos_embed_row", 7), ("pos_embed_col", 5)):
        for mode in ("bicubic", "bilinear"):
            image = state[key].permute(0, 2, 1)[..., None].contiguous()  # (1, D/2, g, 1)
            expected = F.interpolate(image, size=(g_new, 1), mode=mode, align_corners=False, antialias=True)
            torch.testing.assert_close(out[mode][key], expected[..., 0].permute(0, 2, 1))
        assert (out["bicubic"][key] - out["bilinear"][key]).abs().max() > 1e-3


def test_resampling_matches_interpolating_each_channel_as_an_image():
    """Channel k of rows 1.. is a gh x gw image in raster order; interpolate it alone and compare."""
    gh, gw, D = 3, 5, 4
    table = torch.randn(1 + gh * gw, D)
    out = resample_pos_embed(table, (gh, gw), (6, 7), mode="bicubic")
    for k in range(D):
        image = table[1:, k].reshape(1, 1, gh, gw)
        expected = F.interpolate(image, size=(6, 7), mode="bicubic", align_corners=False,
                                 antialias=True).reshape(-1)
        torch.testing.assert_close(out[1:, k], expected)


def test_a_square_grid_may_be_one_int():
    table = torch.randn(1 + 16, 8)
    torch.testing.assert_close(resample_pos_embed(table, 4, 6), resample_pos_embed(table, (4, 4), (6, 6)))
    for bad in ("4x4", "4", 4.7, (4.0, 4), (4, 4, 1), True):
        with pytest.raises(ValueError,
                           match=r"old_grid=.* must be an int or a \(rows, columns\) pair of ints"):
            resample_pos_embed(table, bad, 6)


def test_resampling_errors_name_the_problem():
    with pytest.raises(ValueError, match="25 rows; a 4x4 grid with 1 prefix token\\(s\\) needs 17"):
        resample_pos_embed(torch.randn(25, 8), (4, 4), (8, 8))
    with pytest.raises(ValueError, match="'nearest'"):
        resample_pos_embed(torch.randn(17, 8), (4, 4), (8, 8), mode="nearest")


# --- a model at a new size from weights trained at another --------------------------------------------
def test_finetune_at_a_higher_resolution_resamples_the_position_embedding():
    src = VisionTransformer(tiny(representation_size=24))
    model = prepare_finetune(src, num_classes=3, image_size=(48, 40))
    assert model.cfg.grid_size == (6, 5)
    expected = resample_pos_embed(src.pos_embed.detach(), (4, 4), (6, 5), num_prefix_tokens=1)
    torch.testing.assert_close(model.pos_embed.detach(), expected)
    assert torch.equal(model.cls_token, src.cls_token)
    assert torch.equal(model.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)
    assert model.pre_logits is None and torch.equal(model.head.weight, torch.zeros(3, 32))
    assert model(torch.randn(2, 3, 48, 40)).shape == (2, 3)


def test_learned_2d_halves_are_resampled_along_their_own_axis():
    old, new = tiny(pos_embed="learned-2d"), tiny(pos_embed="learned-2d", image_size=(64, 16))
    state = VisionTransformer(old).state_dict()
    out = resample_state_dict(state, old, new)
    assert out["pos_embed_row"].shape == (1, 8, 16) and out["pos_embed_col"].shape == (1, 2, 16)
    # 4 rows to 8, in the default mode
    row = F.interpolate(state["pos_embed_row"].transpose(1, 2)[..., None].contiguous(), size=(8, 1),
                        mode="bicubic", antialias=True)[..., 0].transpose(1, 2)
    torch.testing.assert_close(out["pos_embed_row"], row)
    assert torch.equal(out["pos_embed_cls"], state["pos_embed_cls"])
    VisionTransformer(new).load_state_dict(out)  # fits the new grid exactly
