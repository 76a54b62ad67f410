"""Shifted Patch Tokenization (vitkit.spt): against a reference written from Lee et al.'s description, in the
model, the counts, the config and optimize (save, ONNX, the writers and training: test_small_data_options)."""


import pytest
import torch
import torch.nn.functional as F

import vitkit
from vitkit.config import ViTConfig
from vitkit.spt import ShiftedPatchEmbed

SMALL = ViTConfig(image_size=(12, 16), patch_size=4, in_chans=2, dim=32, depth=2, num_heads=2, mlp_dim=64,
                  num_classes=5, spt=True)


def reference_spt(x, weight, bias, norm_weight, norm_bias, p, eps):
    """SPT as the paper describes it, written another way: each copy's pixel (i, j) read from the image at
    (i -/+ s, j -/+ s) by explicit indexing (zero outside), patches by F.unfold, then LayerNorm and the
    linear projection."""
    s = p // 2
    b, c, h, w = x.shape
    copies = [x]
    for di, dj in ((-s, -s), (-s, s), (s, -s), (s, s)):
        y = torch.zeros_like(x)
        for i in range(h):
            for j in range(w):
                si, sj = i + di, j + dj
                if 0 <= si < h and 0 <= sj < w:
                    y[:, :, i, j] = x[:, :, si, sj]
        copies.append(y)
    patches = F.unfold(torch.cat(copies, 1), kernel_size=p, stride=p).transpose(1, 2)  # (B, N, 5C P P)
    patches = F.layer_norm(patches, patches.shape[-1:], norm_weight, norm_bias, eps)
    return patches @ weight.flatten(1).T + bias


def test_shifted_patch_embed_equals_the_reference():
    torch.manual_seed(0)
    embed = ShiftedPatchEmbed(SMALL)
    with torch.no_grad():  # a LayerNorm away from ones and zeros, so that its affine part is checked too
        embed.norm.weight.normal_()
        embed.norm.bias.normal_()
    x = torch.randn(3, 2, 12, 16)
    expected = reference_spt(x, embed.proj.weight, embed.proj.bias, embed.norm.weight, embed.norm.bias, 4,
                             SMALL.ln_eps)
    torch.testing.assert_close(embed(x), expected, rtol=1e-5, atol=1e-5)
    assert embed(x).shape == (3, SMALL.num_patches, SMALL.dim)


def test_one_bright_pixel_moves_half_a_patch_in_each_copy():
    from vitkit.spt import shifted_stack

    x = torch.zeros(1, 1, 8, 8)
    x[0, 0, 3, 4] = 1.0
    stack = shifted_stack(x, 2)
    where = [tuple(torch.nonzero(stack[0, k]).flatten().tolist()) for k in range(5)]
    assert where == [(3, 4), (5, 6), (5, 2), (1, 6), (1, 2)]


def test_the_model_takes_it_and_counts_it():
    model = vitkit.create_model(SMALL)
    assert isinstance(model.patch_embed, ShiftedPatchEmbed)
    plain = SMALL.replace(spt=False)
    extra = (5 - 1) * 2 * 4 * 4 * SMALL.dim + 2 * 5 * 2 * 4 * 4  # the wider projection, the LayerNorm
    assert vitkit.count_parameters(SMALL) == sum(p.numel() for p in model.parameters())
    assert vitkit.count_parameters(SMALL) - vitkit.count_parameters(plain) == extra
    macs = SMALL.num_patches * SMALL.dim * (5 - 1) * 2 * 4 * 4  # the four copies through the projection
    assert vitkit.count_flops(SMALL) - vitkit.count_flops(plain) == 2 * macs
    # LeCun normal over the fan-in of the stacked patch, as the plain projection's over its own
    assert abs(model.patch_embed.proj.weight.std().item() - (5 * 2 * 16) ** -0.5) < 0.02
    assert model(torch.randn(2, 2, 12, 16)).shape == (2, 5)


@pytest.mark.parametrize("changes", [{"patch_size": 1, "image_size": 8},
                                     {"hybrid_layers": (1,), "image_size": 32, "patch_size": 2,
                                      "hybrid_width": 32}])
def test_config_refuses_what_it_cannot_shift(changes):
    with pytest.raises(ValueError, match="spt=True"):
        SMALL.replace(**changes)


def test_fine_tuning_cannot_turn_it_on():
    """The shifted copies widen the patch projection: a plain checkpoint has no weights for them."""
    from vitkit.transfer import prepare_finetune

    with pytest.raises(ValueError, match=r"cannot change \['spt'\] when transferring"):
        prepare_finetune(vitkit.create_model(SMALL.replace(spt=False)), 3, spt=True)


@pytest.mark.parametrize("precision,atol", [("fp32", 1e-4), ("int8", 0.15)])
def test_optimize_keeps_the_shifted_tokens(precision, atol):
    torch.manual_seed(0)
    model = vitkit.create_model(SMALL.replace(image_size=32, in_chans=3)).eval()
    with torch.no_grad():
        model.head.weight.normal_(std=0.2)
    fast = vitkit.optimize(model, precision, compile=False)
    x = torch.randn(4, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=atol)


def test_filters_refuse_it(tmp_path, capsys):
    from vitkit.cli.main import main

    vitkit.save(vitkit.create_model(SMALL), tmp_path / "spt")
    with pytest.raises(SystemExit) as done:
        main(["analyze", "filters", str(tmp_path / "spt"), "--out", str(tmp_path / "f.png")])
    assert done.value.code == 1
    assert "its filters are not Fig. 7's patch filters" in capsys.readouterr().err
    assert not (tmp_path / "f.png").exists()
