"""Locality Self-Attention (vitkit.lsa): against a reference written from Lee et al.'s description, in the
model, the counts, optimize and accelerate (save, ONNX, the writers and training: test_small_data_options)."""

import copy

import pytest
import torch

import vitkit
from vitkit.config import ViTConfig
from vitkit.lsa import LocalitySelfAttention, others_only

SMALL = ViTConfig(image_size=(12, 16), patch_size=4, in_chans=2, dim=32, depth=2, num_heads=2, mlp_dim=64,
                  num_classes=5, lsa=True)


def reference_lsa(x, attn):
    """LSA as the paper writes it, with the module's weights: per head, R = q k^T times that head's learned
    scale, R_ii = -inf for every token i, softmax over the keys, times v; heads concatenated, projected."""
    B, T, D = x.shape
    H = attn.num_heads
    q, k, v = (x @ attn.qkv.weight.T + attn.qkv.bias).split(D, dim=-1)
    out = []
    for h in range(H):
        part = slice(h * D // H, (h + 1) * D // H)
        scores = torch.einsum("bid,bjd->bij", q[..., part], k[..., part]) * attn.head_scale[h]
        for i in range(T):
            scores[:, i, i] = float("-inf")
        out.append(scores.softmax(-1) @ v[..., part])
    return torch.cat(out, -1) @ attn.proj.weight.T + attn.proj.bias


@pytest.fixture
def attention():
    torch.manual_seed(0)
    attn = LocalitySelfAttention(SMALL).eval()
    with torch.no_grad():  # scales away from their shared start, so that each head's own one is checked
        attn.head_scale.copy_(torch.tensor([0.9, 0.2]))
    return attn


def test_attention_equals_the_reference_on_both_paths(attention):
    x = torch.randn(3, 13, SMALL.dim)
    expected = reference_lsa(x, attention)
    fast, none = attention(x)
    explicit, weights = attention(x, return_attention=True)
    assert none is None
    torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(explicit, expected, rtol=1e-5, atol=1e-5)
    assert weights.diagonal(dim1=-2, dim2=-1).abs().max() == 0  # no token attends to itself
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 2, 13))


def test_few_queries_are_the_first_rows_of_all(attention):
    x = torch.randn(2, 9, SMALL.dim)
    full, _ = attention(x)
    first, _ = attention(x, queries=2)
    torch.testing.assert_close(first, full[:, :2], rtol=1e-5, atol=1e-6)
    assert others_only(2, 4).tolist() == [[False, True, True, True], [True, False, True, True]]


def test_the_scale_learns_and_starts_at_the_papers():
    model = vitkit.create_model(SMALL)
    attn = model.blocks[0].attn
    assert isinstance(attn, LocalitySelfAttention)
    torch.testing.assert_close(attn.head_scale.detach(), torch.full((2,), 16**-0.5))
    with torch.no_grad():
        model.head.weight.normal_()  # the zero-initialised classifier passes no gradient back
    model(torch.randn(2, 2, 12, 16)).square().sum().backward()
    assert attn.head_scale.grad is not None and attn.head_scale.grad.abs().sum() > 0
    plain = SMALL.replace(lsa=False)
    assert vitkit.count_parameters(SMALL) == sum(p.numel() for p in model.parameters())
    assert vitkit.count_parameters(SMALL) - vitkit.count_parameters(plain) == SMALL.depth * SMALL.num_heads
    from vitkit.train.optim import param_groups

    no_decay = next(g for g in param_groups(model, 0.1) if g["weight_decay"] == 0)["params"]
    assert any(p is attn.head_scale for p in no_decay)  # a temperature, like the norms, is not decayed


@pytest.mark.parametrize("precision,atol", [("fp32", 1e-4), ("int8", 0.5)])
def test_optimize_keeps_the_masked_attention(precision, atol, monkeypatch):
    torch.manual_seed(0)
    model = vitkit.create_model(SMALL.replace(image_size=32, in_chans=3)).eval()
    with torch.no_grad():
        model.head.weight.normal_(std=0.2)
        for block in model.blocks:  # keys equal to queries and sharper: each token's own score its largest
            block.attn.head_scale.mul_(2.0)
            block.attn.qkv.weight[32:64] = block.attn.qkv.weight[:32]
            block.attn.qkv.bias[32:64] = block.attn.qkv.bias[:32]
    fast = vitkit.optimize(model, precision, compile=False)
    x = torch.randn(4, 3, 32, 32)
    with torch.inference_mode():
        expected = model(x)
        torch.testing.assert_close(fast(x), expected, rtol=0, atol=atol)
        # The same model with only the mask lifted is further off than atol: the check could tell them apart.
        monkeypatch.setattr(vitkit.lsa, "others_only", lambda q, k, device=None: torch.ones(q, k, dtype=bool))
        assert (model(x) - expected).abs().max() > 4 * atol


def test_accelerate_keeps_it_and_its_function():
    torch.manual_seed(0)
    model = vitkit.create_model(SMALL).eval()
    with torch.no_grad():
        model.head.weight.normal_(std=0.2)
    fast = vitkit.accelerate(copy.deepcopy(model))  # its linear layers swapped, the class-token shortcut on
    assert type(fast.blocks[0].attn) is LocalitySelfAttention
    x = torch.randn(3, 2, 12, 16)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)


def test_fine_tuning_turns_it_on_from_a_plain_model_and_never_off(tmp_path):
    """A plain checkpoint fine-tunes into LSA (--set model.lsa=true): its weights carried over, each head's
    temperature starting at the 1/sqrt(d) the plain attention scaled by. An LSA checkpoint keeps its
    learned temperatures: turning LSA off is refused, by prepare_finetune and by --set before training."""
    from vitkit.train.prepare import build_model
    from vitkit.train.recipes import get_recipe
    from vitkit.transfer import prepare_finetune

    torch.manual_seed(0)
    plain = vitkit.create_model(SMALL.replace(lsa=False))
    vitkit.save(plain, tmp_path / "plain")
    model = build_model(get_recipe("finetune", [f"init={tmp_path / 'plain'}", "model.lsa=true"]), 3)
    attn = model.blocks[1].attn
    assert type(attn) is LocalitySelfAttention and model.cfg.lsa
    torch.testing.assert_close(attn.head_scale.detach(), torch.full((2,), 16**-0.5))
    torch.testing.assert_close(attn.qkv.weight, plain.blocks[1].attn.qkv.weight)

    vitkit.save(model, tmp_path / "lsa")
    with pytest.raises(ValueError, match="cannot turn lsa off when transferring"):
        prepare_finetune(model, 3, lsa=False)
    with pytest.raises(ValueError, match=r"--set model.lsa=false: fine-tuning from init=.* keeps its loc"):
        get_recipe("finetune", [f"init={tmp_path / 'lsa'}", "model.lsa=false"])


@pytest.mark.parametrize("changes", [dict(image_size=(4, 4)), dict(patch_dropout=0.9, image_size=(8, 8))])
def test_config_refuses_a_single_token(changes):
    """With every token's own score masked, one token alone has nothing to attend to (a softmax of -inf)."""
    with pytest.raises(ValueError, match=r"lsa=True .* needs two tokens or more, got 0 prefix and 1 patch"):
        SMALL.replace(class_token=False, pool="gap", **changes)
    assert SMALL.replace(**changes).lsa  # with the class token there are two
