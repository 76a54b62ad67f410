"""The model of eq. 1-4: shapes, gradients, parameter counts, the paper's equivalences, and numerical equality
with timm's VisionTransformer given the same weights."""

from __future__ import annotations

import math
from functools import partial

import pytest
import timm.models.vision_transformer as timm_vit
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import vitkit
from operator_helpers import operators_called
from vitkit import ViTConfig, count_flops, count_parameters, create_model, get_config
from vitkit.config import PRESETS, VARIANTS
from vitkit.cpu.linear import TRAINING_ENGINES, forced_training_engine
from vitkit.init import MIMETIC_QK, MIMETIC_VO, mimetic_factors
from vitkit.model import VisionTransformer, drop_path, patch_dropout
from vitkit.shortcut import ClassTokenShortcut, with_class_token_shortcut, without_class_token_shortcut

POS_EMBEDS = ("learned", "learned-2d", "sincos-2d", "none")


def tiny(**overrides) -> ViTConfig:
    """A ViT small enough for a CPU test: 32 px, patch 8 (16 patches), width 32, two blocks."""
    base = dict(image_size=32, patch_size=8, dim=32, depth=2, num_heads=4, mlp_dim=64, num_classes=10)
    base.update(overrides)
    return ViTConfig(**base)


def randomise_head(model: VisionTransformer) -> VisionTransformer:
    """The classifier starts at zero, which would block every gradient and make logits trivially equal."""
    with torch.no_grad():
        nn.init.normal_(model.head.weight, std=0.5)
        nn.init.normal_(model.head.bias, std=0.5)
    return model


# --- shapes -------------------------------------------------------------------------------------------
PLAIN_PRESETS = [name for name, p in PRESETS.items() if p.config.hybrid_layers is None]


def test_every_variant_patch_and_resolution_has_a_preset():
    for variant in VARIANTS:
        for patch, sizes in ((8, (224, 384)), (14, (224, 518)), (16, (224, 384)), (32, (224, 384))):
            for i, size in enumerate(sizes):
                name = f"ViT-{variant}/{patch}" + ("" if i == 0 else f"@{size}")
                cfg = PRESETS[name].config
                assert (cfg.patch_size, cfg.image_size) == (patch, (size, size))
                assert (cfg.dim, cfg.depth, cfg.num_heads, cfg.mlp_dim) == VARIANTS[variant]
    assert len(PLAIN_PRESETS) == 5 * 4 * 2


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_shapes_on_meta_device(name):
    """Every preset at its real size: the meta device propagates shapes without allocating or computing.
    A hybrid's tokens are its ResNet's stride-16 (R50) or stride-32 (R26) feature map."""
    cfg = get_config(name)
    stride = cfg.patch_size * (1 if cfg.hybrid_layers is None else {3: 16, 4: 32}[len(cfg.hybrid_layers)])
    gh, gw = cfg.image_size[0] // stride, cfg.image_size[1] // stride
    with torch.device("meta"):
        model = create_model(name)
        x = torch.empty(2, 3, *cfg.image_size)
        features, attentions = model.forward_features(x, return_attention=True)
        logits = model.forward_head(features)
    assert features.shape == (2, 1 + gh * gw, cfg.dim)
    assert logits.shape == (2, 1000)
    assert len(attentions) == cfg.depth
    assert attentions[0].shape == (2, cfg.num_heads, 1 + gh * gw, 1 + gh * gw)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_family_forward_on_cpu_with_reduced_depth(variant):
    """Each family's real width and heads compute on the CPU (one block, 32 px, patch 16: 5 tokens)."""
    model = create_model(f"ViT-{variant}/16", depth=1, image_size=32, num_classes=7)
    cfg = model.cfg
    feats = model.forward_features(torch.randn(2, 3, 32, 32))
    assert feats.shape == (2, 5, cfg.dim)
    assert torch.isfinite(feats).all()
    assert model.forward_head(feats).shape == (2, 7)


@pytest.mark.parametrize(
    "overrides, tokens",
    [
        (dict(), 17),
        (dict(pool="gap", class_token=False), 16),
        (dict(image_size=(32, 48)), 1 + 4 * 6),  # non-square
        (dict(image_size=(48, 16), pos_embed="learned-2d"), 1 + 6 * 2),
        (dict(image_size=(16, 40), pos_embed="sincos-2d", pool="gap", class_token=False), 2 * 5),
        (dict(in_chans=1, mean=(0.5,), std=(0.5,)), 17),
        (dict(num_classes=0), 17),
    ],
)
def test_tiny_shapes(overrides, tokens):
    cfg = tiny(**overrides)
    model = VisionTransformer(cfg)
    x = torch.randn(3, cfg.in_chans, *cfg.image_size)
    feats = model.forward_features(x)
    assert feats.shape == (3, tokens, cfg.dim)
    assert cfg.num_tokens == tokens
    logits = model(x)
    assert logits.shape == ((3, cfg.num_classes) if cfg.num_classes else (3, cfg.dim))


def test_wrong_input_size_names_both_shapes():
    model = VisionTransformer(tiny())
    with pytest.raises(ValueError, match=r"\(B, 3, 32, 32\).*\(1, 3, 48, 32\); resize the images to 32x32"):
        model(torch.randn(1, 3, 48, 32))
    with pytest.raises(ValueError, match=r"\(1, 1, 32, 32\): 1 channels where the model takes 3"):
        model(torch.randn(1, 1, 32, 32))
    for shape in ((3, 32, 32), (32,)):  # one image without its batch axis; not an image at all
        with pytest.raises(ValueError, match=r"a batch of images \(B, 3, 32, 32\).*unsqueeze"):
            model(torch.randn(*shape))


# --- gradients ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [dict(pos_embed=kind) for kind in POS_EMBEDS]
    + [dict(pos_embed=kind, pool="gap", class_token=False) for kind in POS_EMBEDS]
    + [dict(representation_size=24), dict(pool="gap", class_token=True), dict(gelu="tanh", qkv_bias=False)],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_every_parameter_gets_a_gradient(overrides):
    model = randomise_head(VisionTransformer(tiny(**overrides)))
    model(torch.randn(2, 3, 32, 32)).square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} has a zero gradient"


def test_parameters_match_the_options():
    names = lambda **o: {n for n, _ in VisionTransformer(tiny(**o)).named_parameters()}  # noqa: E731
    assert {"cls_token", "pos_embed"} <= names()
    assert "cls_token" not in names(pool="gap", class_token=False)
    assert {"pos_embed_row", "pos_embed_col", "pos_embed_cls"} <= names(pos_embed="learned-2d")
    assert not any(n.startswith("pos_embed") for n in names(pos_embed="sincos-2d"))
    assert not any(n.startswith("pos_embed") for n in names(pos_embed="none"))
    assert {"pre_logits.weight", "pre_logits.bias"} <= names(representation_size=24)
    assert "blocks.0.attn.qkv.bias" not in names(qkv_bias=False)


# --- parameter counts (meta device) -------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, expected",
    [
        ("ViT-Ti/16", 5_717_416),
        ("ViT-S/16", 22_050_664),
        ("ViT-B/16", 86_567_656),
        ("ViT-L/16", 304_326_632),
        ("ViT-H/14", 632_045_800),
    ],
)
def test_parameter_counts_with_a_1000_class_head(name, expected):
    assert count_parameters(get_config(name)) == expected


def test_vit_h14_count_without_head_is_the_papers_632m_figure():
    # 630,764,800 is the head-less count: 632,045,800 (above) less the 1000-class head's 1280 * 1000 + 1000.
    assert count_parameters(get_config("ViT-H/14", num_classes=0)) == 630_764_800


def test_count_parameters_allocates_nothing_and_agrees_with_a_real_model():
    cfg = tiny(representation_size=24, pos_embed="learned-2d")
    assert count_parameters(cfg) == sum(p.numel() for p in VisionTransformer(cfg).parameters())


@pytest.mark.parametrize(
    "name, overrides",
    [("ViT-B/16", {}), ("ViT-S/32", dict(representation_size=384, image_size=(224, 320))), ("ViT-H/14", {})],
)
def test_count_flops_equals_torch_flop_counter(name, overrides):
    """The closed form equals what torch counts for the matmuls, convolution and attention of the plain
    forward (every token through every block; the class-token shortcut skips most of the last block, see
    below)."""
    with torch.device("meta"):
        model = create_model(name, **overrides)
        x = torch.empty(1, 3, *model.cfg.image_size)
        with FlopCounterMode(display=False) as counter:
            model(x)
    assert count_flops(model.cfg) == counter.get_total_flops()


@pytest.mark.parametrize("engine", ["plain", *TRAINING_ENGINES])
def test_the_shortcut_in_float32_plain_and_accelerated(engine):
    """In float32 (PyTorch's operators, or an accelerated model's linear layers on each training engine, the
    last block's query rows a slice of its q;k;v weight) the shortcut's logits and gradients match the full
    computation's."""
    torch.manual_seed(0)
    model = randomise_head(VisionTransformer(tiny(qkv_bias=True))).train()
    if engine == "plain":
        with_class_token_shortcut(model)  # PyTorch's modules
    else:
        vitkit.accelerate(model)
    x = torch.randn(4, 3, *model.cfg.image_size)
    with forced_training_engine("mkl" if engine == "plain" else engine):
        fast = model(x)
        g_fast = torch.autograd.grad(fast.square().sum(), list(model.parameters()))
    full = model.forward_head(model.forward_features(x))
    g_full = torch.autograd.grad(full.square().sum(), list(model.parameters()))
    torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_fast, g_full, strict=True):  # float32 sums in another order: relative to the largest
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())
    qkv = model.blocks[-1].attn.qkv.weight
    assert qkv.grad is None and g_fast[[p is qkv for p in model.parameters()].index(True)].abs().sum() > 0


@pytest.mark.parametrize("overrides", [{}, dict(representation_size=24), dict(pool="gap")])
def test_the_shortcut_updates_only_the_class_token_in_the_last_block(overrides):
    """The class-token shortcut (eq. 4 reads only z_L^0) gives the full computation's logits and gradients,
    and saves the last block's queries, projection, MLP and all but one attention row."""
    model = with_class_token_shortcut(VisionTransformer(tiny(**overrides)).train())
    nn.init.normal_(model.head.weight, std=0.5)
    x = torch.randn(3, 3, *model.cfg.image_size)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model.forward_head(model.forward_features(x)), rtol=0, atol=1e-5)
    model.double()  # gradients in float64, where summation order leaves no visible trace
    x = x.double()
    fast = model(x)
    full = model.forward_head(model.forward_features(x))
    torch.testing.assert_close(fast, full)
    g_fast = torch.autograd.grad(fast.square().sum(), list(model.parameters()))
    g_full = torch.autograd.grad(full.square().sum(), list(model.parameters()))
    for a, b in zip(g_fast, g_full, strict=True):
        torch.testing.assert_close(a, b)
    with torch.device("meta"):
        meta = with_class_token_shortcut(VisionTransformer(model.cfg))
        with FlopCounterMode(display=False) as counter:
            meta(torch.empty(1, 3, *model.cfg.image_size))
    cfg = model.cfg
    T, D = cfg.num_tokens, cfg.dim
    saved = 0 if cfg.pool == "gap" else 2 * ((T - 1) * (2 * D * D + 2 * D * cfg.mlp_dim)
                                             + 2 * (T - 1) * T * D)
    assert counter.get_total_flops() == count_flops(cfg) - saved


def test_the_plain_model_runs_the_whole_last_block_and_the_speed_layers_swap_the_shortcut_in():
    """A forward hook on the plain model's last block sees every token, (B, N, D), as Grad-CAM-style tools
    expect; accelerate and optimize take the shortcut (the hook then sees the class token), plain() undoes
    it, and a model that is not exactly a VisionTransformer is left alone."""
    model = VisionTransformer(tiny())
    seen = []
    model.blocks[-1].register_forward_hook(lambda m, args, out: seen.append(tuple(out[0].shape)))
    x = torch.randn(2, 3, 32, 32)
    model(x)
    assert seen == [(2, 17, 32)]
    assert type(vitkit.optimize(model)) is ClassTokenShortcut and type(model) is VisionTransformer
    vitkit.accelerate(model)
    assert type(model) is ClassTokenShortcut and vitkit.cpu.is_accelerated(model)
    model(x)
    assert seen[-1] == (2, 1, 32)
    vitkit.cpu.plain(model)
    assert type(model) is VisionTransformer and not vitkit.cpu.is_accelerated(model)
    assert type(without_class_token_shortcut(model)) is VisionTransformer

    class Mine(VisionTransformer):
        pass

    assert type(with_class_token_shortcut(Mine(tiny()))) is Mine


def test_hybrid_flops_add_the_resnet_stem_to_the_transformer():
    """R50+ViT-B/16: the transformer's closed form (its 'patch' is a 1x1 projection of 1024 ResNet channels)
    plus the ResNet's convolutions as torch counts them."""
    cfg = get_config("R50+ViT-B/16")
    with torch.device("meta"):
        resnet = VisionTransformer(cfg).patch_embed.backbone
        with FlopCounterMode(display=False) as counter:
            resnet(torch.empty(1, 3, 224, 224))
    plain = count_flops(get_config("ViT-B/16"))  # the same transformer on 196 patches of 16 x 16 x 3
    projection = 2 * 196 * 768 * 1024  # 1x1 convolution of the 14 x 14 x 1024 feature map
    assert count_flops(cfg) == plain - 2 * 196 * 768 * 3 * 16 * 16 + projection + counter.get_total_flops()


def test_vit_b16_flops_match_the_published_figure():
    # timm lists 17.58 GMACs for ViT-B/16 at 224 px, which also counts LayerNorm, softmax and GELU (~0.1 %).
    assert count_flops(get_config("ViT-B/16")) / 2 / 1e9 == pytest.approx(17.58, rel=2e-3)


# --- eq. 1: the patch embedding -----------------------------------------------------------------------
def test_patch_convolution_is_a_linear_map_of_flattened_patches():
    """x_p E: cut the image into P x P patches, flatten each as the paper does (P, P, C), multiply by E."""
    cfg = tiny(image_size=(24, 40), patch_size=8)
    model = VisionTransformer(cfg)
    x = torch.randn(2, 3, 24, 40)
    B, C, H, W, P = 2, 3, 24, 40, 8
    patches = x.reshape(B, C, H // P, P, W // P, P).permute(0, 2, 4, 3, 5, 1)  # (B, gh, gw, P, P, C)
    patches = patches.reshape(B, (H // P) * (W // P), P * P * C)  # raster order of the patches
    conv = model.patch_embed.proj
    E = conv.weight.permute(2, 3, 1, 0).reshape(P * P * C, cfg.dim)  # (P^2 C, D)
    expected = patches @ E + conv.bias
    torch.testing.assert_close(model.patch_embed(x), expected, rtol=1e-5, atol=1e-5)


def test_embed_is_eq1():
    """z_0 = [x_class; x_p E] + E_pos, before dropout."""
    model = VisionTransformer(tiny())
    x = torch.randn(2, 3, 32, 32)
    tokens = torch.cat([model.cls_token.expand(2, -1, -1), model.patch_embed(x)], dim=1)
    torch.testing.assert_close(model.embed(x), tokens + model.pos_embed)


# --- attention ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [dict(), dict(pool="gap", class_token=False, image_size=(32, 48))])
def test_fused_and_explicit_attention_agree(overrides):
    model = VisionTransformer(tiny(**overrides)).eval()
    x = torch.randn(2, 3, *model.cfg.image_size)
    fused = model.forward_features(x)
    explicit, attentions = model.forward_features(x, return_attention=True)
    torch.testing.assert_close(explicit, fused, rtol=1e-5, atol=1e-5)
    T = model.cfg.num_tokens
    assert len(attentions) == model.cfg.depth
    for a in attentions:
        assert a.shape == (2, model.cfg.num_heads, T, T)
        assert (a >= 0).all()
        torch.testing.assert_close(a.sum(-1), torch.ones(2, model.cfg.num_heads, T), rtol=0, atol=1e-5)


def test_training_through_sdpa_and_through_the_explicit_fallback_agree(monkeypatch):
    """The plain model attends through F.scaled_dot_product_attention, and through the explicit softmax where
    SDPA raises NotImplementedError (its CPU kernel under forward-mode AD): both give the same loss and
    gradients."""
    torch.manual_seed(0)
    model = VisionTransformer(tiny()).train()
    for p in model.parameters():  # away from the zero-initialised head, so every gradient is non-zero,
        p.data.normal_(0, 0.3)  # and with peaked attention, so that the softmax matters
    x, y = torch.randn(3, 3, 32, 32), torch.tensor([0, 1, 2])

    def loss_and_grads():
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def sdpa_calls():
        return operators_called(lambda: model(x), "aten::scaled_dot_product_attention")

    assert sdpa_calls()
    sdpa_loss, sdpa_grads = loss_and_grads()

    def no_derivative(*args, **kwargs):
        raise NotImplementedError("no forward derivative")

    monkeypatch.setattr(F, "scaled_dot_product_attention", no_derivative)
    assert not sdpa_calls()
    explicit_loss, explicit_grads = loss_and_grads()
    torch.testing.assert_close(explicit_loss, sdpa_loss, rtol=1e-5, atol=1e-6)
    for name, grad in sdpa_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(explicit_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_explicit_attention_is_softmax_of_scaled_dot_products():
    """The returned weights are softmax(q k^T / sqrt(d_h)) of the first block, recomputed by hand."""
    model = VisionTransformer(tiny()).eval()
    x = torch.randn(1, 3, 32, 32)
    _, attentions = model.forward_features(x, return_attention=True)
    z = model.blocks[0].norm1(model.embed(x))[0]  # (T, D)
    q, k, _ = model.blocks[0].attn.qkv(z).split(model.cfg.dim, dim=-1)
    Dh = model.cfg.head_dim
    for h in range(model.cfg.num_heads):
        qh, kh = q[:, h * Dh:(h + 1) * Dh], k[:, h * Dh:(h + 1) * Dh]
        expected = torch.softmax(qh @ kh.T / math.sqrt(Dh), dim=-1)
        torch.testing.assert_close(attentions[0][0, h], expected, rtol=1e-5, atol=1e-6)


def test_explicit_attention_stays_fp32_under_bf16_autocast():
    """Under bf16 autocast (training on a CPU with native bf16) the projections run in bf16 but the attention
    matrices in fp32: the weights are the fp32 softmax of the (bf16-rounded) q and k, recomputed by hand; the
    block's output goes on in bf16. A model cast to bf16 still returns its attention."""
    torch.manual_seed(0)
    model = VisionTransformer(tiny()).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)  # peaked attention, where bf16 logits would show
    x = torch.randn(1, 3, 32, 32)
    z = model.blocks[0].norm1(model.embed(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, attn = model.blocks[0].attn(z, return_attention=True)
        q, k, _ = model.blocks[0].attn.qkv(z)[0].float().split(model.cfg.dim, dim=-1)
    assert attn.dtype == torch.float32 and out.dtype == torch.bfloat16
    Dh = model.cfg.head_dim
    for h in range(model.cfg.num_heads):
        qh, kh = q[:, h * Dh:(h + 1) * Dh], k[:, h * Dh:(h + 1) * Dh]
        expected = torch.softmax(qh @ kh.T / math.sqrt(Dh), dim=-1)
        torch.testing.assert_close(attn[0, h], expected, rtol=1e-5, atol=1e-6)
    bf16 = VisionTransformer(tiny()).to(torch.bfloat16).eval()
    logits, attentions = bf16.forward_features(x.to(torch.bfloat16), return_attention=True)
    assert logits.dtype == torch.bfloat16 and len(attentions) == bf16.cfg.depth


# --- patch dropout ------------------------------------------------------------------------------------
def test_patch_dropout_keeps_the_class_token_and_an_ordered_subset_of_patches():
    x = torch.arange(2 * 17 * 3, dtype=torch.float32).reshape(2, 17, 3)  # 1 prefix + 16 patch tokens
    torch.manual_seed(0)
    y = patch_dropout(x, 0.25, num_prefix=1, training=True)
    assert y.shape == (2, 1 + 12, 3)
    torch.testing.assert_close(y[:, 0], x[:, 0])
    for b in range(2):
        rows = (y[b, 1:, 0] / 3).long() - 17 * b  # which token each kept row was
        assert (rows[1:] > rows[:-1]).all() and rows.min() >= 1 and rows.max() <= 16
        torch.testing.assert_close(y[b, 1:], x[b, rows])
    assert not torch.equal(y[0, 1:, 0] / 3, y[1, 1:, 0] / 3 - 17)  # each image draws its own subset
    assert patch_dropout(x, 0.25, 1, training=False) is x and patch_dropout(x, 0.0, 1, training=True) is x
    with pytest.raises(ValueError, match="patch_dropout"):
        tiny(patch_dropout=1.0)


def test_patch_dropout_in_the_model_drops_tokens_in_training_only():
    model = VisionTransformer(tiny(patch_dropout=0.5))
    x = torch.randn(2, 3, 32, 32)
    model.train()
    torch.manual_seed(3)
    feats = model.forward_features(x)
    assert feats.shape == (2, 1 + 8, model.cfg.dim)  # 16 patches, half kept
    model.eval()
    assert model.forward_features(x).shape == (2, 17, model.cfg.dim)
    z = model.embed(x)
    torch.manual_seed(3)
    z = patch_dropout(z, 0.5, 1, training=True)
    for block in model.blocks:
        z, _ = block(z)
    torch.testing.assert_close(feats, model.norm(z), rtol=1e-5, atol=1e-5)


# --- pooling and heads --------------------------------------------------------------------------------
def test_token_pooling_reads_the_class_token_and_gap_averages_the_patches():
    x = torch.randn(2, 3, 32, 32)
    token = VisionTransformer(tiny(representation_size=None))
    feats = token.forward_features(x)
    torch.testing.assert_close(token.forward_head(feats, pre_logits=True), feats[:, 0])

    gap = VisionTransformer(tiny(pool="gap", class_token=False))
    feats = gap.forward_features(x)
    assert feats.shape[1] == 16  # no class token
    torch.testing.assert_close(gap.forward_head(feats, pre_logits=True), feats.mean(dim=1))

    # GAP over a model that keeps a class token averages the patch tokens only.
    gap_cls = VisionTransformer(tiny(pool="gap", class_token=True))
    feats = gap_cls.forward_features(x)
    torch.testing.assert_close(gap_cls.forward_head(feats, pre_logits=True), feats[:, 1:].mean(dim=1))


def test_gap_override_drops_the_class_token_as_in_the_paper():
    assert create_model("ViT-B/16", pool="gap", depth=1).cls_token is None
    assert get_config("ViT-B/16", pool="gap").class_token is False


def test_zero_initialised_head_gives_zero_logits():
    for overrides in (dict(), dict(representation_size=24), dict(pool="gap", class_token=False)):
        model = VisionTransformer(tiny(**overrides))
        logits = model(torch.randn(4, 3, 32, 32))
        assert torch.equal(logits, torch.zeros(4, 10))


def test_pre_training_head_is_tanh_hidden_layer_then_classifier():
    model = randomise_head(VisionTransformer(tiny(representation_size=24)))
    x = torch.randn(2, 3, 32, 32)
    feats = model.forward_features(x)
    hidden = torch.tanh(feats[:, 0] @ model.pre_logits.weight.T + model.pre_logits.bias)
    torch.testing.assert_close(model.forward_head(feats, pre_logits=True), hidden)
    torch.testing.assert_close(model(x), hidden @ model.head.weight.T + model.head.bias)


# --- options ------------------------------------------------------------------------------------------
def test_gelu_and_layernorm_options_reach_the_layers():
    model = VisionTransformer(tiny(gelu="tanh", ln_eps=1e-5))
    assert model.blocks[0].mlp.act.approximate == "tanh"
    assert all(m.eps == 1e-5 for m in model.modules() if isinstance(m, nn.LayerNorm))
    exact = VisionTransformer(tiny())
    assert exact.blocks[0].mlp.act.approximate == "none"
    assert all(m.eps == 1e-6 for m in exact.modules() if isinstance(m, nn.LayerNorm))


def test_block_is_pre_layernorm_with_residuals():
    """z' = MSA(LN(z)) + z (eq. 2); z = MLP(LN(z')) + z' (eq. 3), with GELU between the MLP's layers."""
    model = VisionTransformer(tiny(gelu="tanh")).eval()
    block, z = model.blocks[0], torch.randn(2, 17, 32)
    attn = block.attn
    y = F.layer_norm(z, (32,), block.norm1.weight, block.norm1.bias, eps=1e-6)
    q, k, v = attn.qkv(y).reshape(2, 17, 3, 4, 8).permute(2, 0, 3, 1, 4)
    a = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1) @ v
    z1 = attn.proj(a.transpose(1, 2).reshape(2, 17, 32)) + z
    y = F.layer_norm(z1, (32,), block.norm2.weight, block.norm2.bias, eps=1e-6)
    z2 = block.mlp.fc2(F.gelu(block.mlp.fc1(y), approximate="tanh")) + z1
    torch.testing.assert_close(block(z)[0], z2, rtol=1e-5, atol=1e-5)


def test_dropout_and_stochastic_depth_act_only_in_training():
    model = VisionTransformer(tiny(dropout=0.1, attn_dropout=0.1, drop_path=0.2, depth=3))
    assert [b.drop_path for b in model.blocks] == pytest.approx([0.0, 0.1, 0.2])  # linear in depth
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    torch.testing.assert_close(model.forward_features(x), model.forward_features(x), rtol=0, atol=0)
    model.train()
    assert not torch.allclose(model.forward_features(x), model.forward_features(x))


def test_drop_path_drops_whole_samples_and_keeps_the_mean():
    x = torch.ones(20_000, 3, 2)
    y = drop_path(x, 0.25, training=True)
    per_sample = y.flatten(1)
    assert ((per_sample == 0).all(1) | (per_sample == 1 / 0.75).all(1)).all()
    assert y.mean().item() == pytest.approx(1.0, abs=0.03)
    assert drop_path(x, 0.25, training=False) is x


# --- initialisation -----------------------------------------------------------------------------------
def test_initialisation_follows_the_reference_code():
    torch.manual_seed(0)
    cfg = tiny(dim=256, num_heads=4, mlp_dim=512, depth=1, patch_size=16, image_size=64,
               representation_size=128)
    model = VisionTransformer(cfg)
    # vit_jax/models_vit.py: the class token zeros, the position embedding normal(0.02), not truncated.
    assert torch.equal(model.cls_token, torch.zeros(1, 1, 256))
    assert model.pos_embed.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.pos_embed.abs().max() > 0.05  # past the +-2 sigma a truncated normal stops at
    # Patch projection and pre-logits: LeCun normal, variance 1 / fan_in.
    for w, fan_in in ((model.patch_embed.proj.weight, 3 * 16 * 16), (model.pre_logits.weight, 256)):
        assert w.std().item() == pytest.approx(fan_in**-0.5, rel=0.05)
    assert torch.equal(model.patch_embed.proj.bias, torch.zeros(256))
    # Encoder linears: Xavier uniform; q, k and v each as their own D x D map.
    qkv = model.blocks[0].attn.qkv.weight
    bound = math.sqrt(6 / (256 + 256))
    for w in qkv.chunk(3):
        assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound
    fc1 = model.blocks[0].mlp.fc1
    assert fc1.weight.abs().max() <= math.sqrt(6 / (256 + 512))
    assert 0 < fc1.bias.abs().max() < 1e-4  # N(0, 1e-6)
    assert torch.equal(model.blocks[0].attn.qkv.bias, torch.zeros(3 * 256))
    assert torch.equal(model.head.weight, torch.zeros(10, 128))



def test_mimetic_factors_are_the_truncated_svd_of_noise_plus_identity():
    # The reference: numpy's SVD of the same target, alpha Z + beta I with Z ~ N(0, 1/dim), cut to the rank.
    import numpy as np

    for alpha, beta, dim, rank in ((0.7, 0.7, 24, 6), (0.4, -0.4, 24, 24)):
        torch.manual_seed(3)
        target = (alpha * torch.randn(dim, dim) / math.sqrt(dim) + beta * torch.eye(dim)).double().numpy()
        u, s, vh = np.linalg.svd(target)
        expected = (u[:, :rank] * s[:rank]) @ vh[:rank]
        torch.manual_seed(3)
        left, right = mimetic_factors(alpha, beta, dim, rank)
        assert left.shape == right.shape == (dim, rank)
        np.testing.assert_allclose((left @ right.T).double().numpy(), expected, atol=1e-5)
        if rank == dim:
            np.testing.assert_allclose((left @ right.T).double().numpy(), target, atol=1e-5)


def test_mimetic_attention_init_puts_identities_in_the_head_products():
    torch.manual_seed(0)
    D, H = 96, 4
    model = VisionTransformer(tiny(dim=D, num_heads=H, mlp_dim=128, depth=2, attn_init="mimetic"))
    plain = VisionTransformer(tiny(dim=D, num_heads=H, mlp_dim=128, depth=2))
    Dh = D // H
    for block in model.blocks:
        w, proj = block.attn.qkv.weight.detach(), block.attn.proj.weight.detach()
        for h in range(H):
            # The attention logits of head h are x (W_q^h)^T W_k^h x^T: a rank-Dh part of 0.7 Z + 0.7 I,
            # whose diagonal keeps about Dh / D of the identity's weight plus the largest noise directions.
            qk = w[h * Dh:(h + 1) * Dh].T @ w[D + h * Dh:D + (h + 1) * Dh]
            assert torch.linalg.matrix_rank(qk).item() == Dh
            assert qk.diagonal().mean().item() > 0.5 * MIMETIC_QK[1] * Dh / D
        # The value and output maps: v W_o^T = x W_v^T W_o^T, full rank, = 0.4 Z - 0.4 I.
        vo = w[2 * D:].T @ proj.T
        off = vo - torch.diag(vo.diagonal())
        assert vo.diagonal().mean().item() == pytest.approx(MIMETIC_VO[1], abs=0.05)
        assert off.std().item() == pytest.approx(MIMETIC_VO[0] / math.sqrt(D), rel=0.1)
        assert torch.equal(block.attn.qkv.bias, torch.zeros(3 * D))
        assert torch.equal(block.attn.proj.bias, torch.zeros(D))
    # The default (the paper's Xavier) has neither structure: its W_v W_o diagonal is near zero.
    vo = plain.blocks[0].attn.qkv.weight[2 * D:].T @ plain.blocks[0].attn.proj.weight.T
    assert abs(vo.diagonal().mean().item()) < 0.05
    with pytest.raises(ValueError, match="attn_init='orthogonal'"):
        tiny(attn_init="orthogonal")


# --- numerical equality with timm ---------------------------------------------------------------------
def timm_twin(cfg: ViTConfig) -> nn.Module:
    act = partial(nn.GELU, approximate="tanh" if cfg.gelu == "tanh" else "none")
    return timm_vit.VisionTransformer(
        img_size=cfg.image_size, patch_size=cfg.patch_size, in_chans=cfg.in_chans,
        num_classes=cfg.num_classes, embed_dim=cfg.dim, depth=cfg.depth, num_heads=cfg.num_heads,
        mlp_ratio=cfg.mlp_dim / cfg.dim, qkv_bias=cfg.qkv_bias, class_token=cfg.class_token,
        global_pool="token" if cfg.pool == "token" else "avg", fc_norm=False, act_layer=act,
        norm_layer=partial(nn.LayerNorm, eps=cfg.ln_eps),
    ).eval()


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(pool="gap", class_token=False),
        dict(gelu="tanh", image_size=(32, 48), qkv_bias=False),
        dict(dim=64, depth=3, num_heads=8, mlp_dim=96, pool="gap", class_token=False, in_chans=1,
             mean=(0.5,), std=(0.5,)),
    ],
    ids=["token", "gap", "tanh-nonsquare-nobias", "gap-wide-1ch"],
)
def test_equal_to_timm_given_the_same_weights(overrides):
    cfg = tiny(**overrides)
    ours = randomise_head(VisionTransformer(cfg)).eval()
    theirs = timm_twin(cfg)
    theirs.load_state_dict(ours.state_dict(), strict=True)  # same names and shapes, nothing left over
    x = torch.randn(3, cfg.in_chans, *cfg.image_size)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_features(x), theirs.forward_features(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
        _, attentions = ours.forward_features(x, return_attention=True)
    assert len(attentions) == cfg.depth


def test_the_counts_take_a_preset_name_and_refuse_other_things():
    assert count_parameters("ViT-B/16") == count_parameters(get_config("ViT-B/16")) == 86_567_656
    assert count_flops("vit_small_patch16_224") == count_flops(get_config("ViT-S/16"))
    with pytest.raises(TypeError, match="ViTConfig or a preset name, got int"):
        count_parameters(16)
