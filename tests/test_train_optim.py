"""Schedules, weight-decay groups and the EMA, each against its definition."""

import math

import pytest
import torch

from vitkit import ViTConfig, create_model
from vitkit.train.ema import EMA
from vitkit.train.optim import build_optimizer, cosine_decay, freeze, lr_at, param_groups, set_lr
from vitkit.train.settings import OptimConfig

TINY = ViTConfig(image_size=16, patch_size=4, in_chans=1, num_classes=3, dim=16, depth=2, num_heads=2,
                 mlp_dim=32)


def test_warmup_is_linear_from_the_first_step():
    lrs = [lr_at(s, 100, 1.0, 10, "cosine") for s in range(10)]
    assert lrs == pytest.approx([(s + 1) / 10 for s in range(10)])


def test_cosine_after_warmup():
    total, warm, peak, floor = 110, 10, 2e-3, 1e-5
    for s in (10, 35, 60, 85, 109):
        expected = floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm)))
        assert lr_at(s, total, peak, warm, "cosine", floor) == pytest.approx(expected)
    assert lr_at(10, total, peak, warm, "cosine") == pytest.approx(peak)
    assert cosine_decay(0.5) == pytest.approx(0.5) and cosine_decay(1.0) == pytest.approx(0.0)


def test_linear_decay_and_constant():
    assert lr_at(0, 100, 1.0, 0, "linear") == pytest.approx(1.0)
    assert lr_at(50, 100, 1.0, 0, "linear") == pytest.approx(0.5)
    assert lr_at(60, 100, 1.0, 20, "linear") == pytest.approx(0.5)
    assert lr_at(99, 100, 1.0, 5, "constant") == 1.0
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_at(50, 100, 1.0, 0, "step")


@pytest.mark.parametrize("cfg", [TINY, TINY.replace(pos_embed="learned-2d"), TINY.replace(pool="gap")])
def test_weight_decay_only_on_matrices(cfg):
    model = create_model(cfg)
    decay, no_decay = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert decayed | skipped == set(names.values()) and not decayed & skipped
    assert all(n.endswith("weight") and "norm" not in n for n in decayed)
    expected_skipped = {n for n, p in model.named_parameters()
                        if p.ndim < 2 or n.startswith(("pos_embed", "cls_token"))}
    assert skipped == expected_skipped
    assert "blocks.0.attn.qkv.weight" in decayed and "patch_embed.proj.weight" in decayed
    assert "blocks.0.attn.qkv.bias" in skipped and "norm.weight" in skipped
    if cfg.class_token:
        assert "cls_token" in skipped
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0


def test_adamw_applies_decay_only_to_the_decay_group():
    model = create_model(TINY)
    opt = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradient: only the decay moves a weight
    opt.step()
    for n, p in model.named_parameters():
        if n == "blocks.0.mlp.fc1.weight":
            torch.testing.assert_close(p, before[n] * (1 - 0.1 * 0.5))
        if n in ("blocks.0.mlp.fc1.bias", "pos_embed", "cls_token", "norm.weight"):
            torch.testing.assert_close(p, before[n])


def test_layer_decay_gives_each_layer_its_learning_rate_and_keeps_the_no_decay_parameters():
    """BEiT's layer-wise decay: block i at lr * d^(depth - i), the embeddings at lr * d^(depth + 1), the final
    norm and head at lr; biases, norms, positions and class token without weight decay in every layer."""
    model = create_model(TINY)
    depth, d = len(model.blocks), 0.75
    opt = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.05, layer_decay=d))
    set_lr(opt, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    lr = {names[id(p)]: g["lr"] for g in opt.param_groups for p in g["params"]}
    wd = {names[id(p)]: g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert lr.keys() == set(names.values())
    for name in ("patch_embed.proj.weight", "cls_token", "pos_embed"):
        assert lr[name] == pytest.approx(0.1 * d ** (depth + 1)), name
    for i in range(depth):
        for name in (f"blocks.{i}.attn.qkv.weight", f"blocks.{i}.norm1.bias", f"blocks.{i}.mlp.fc2.weight"):
            assert lr[name] == pytest.approx(0.1 * d ** (depth - i)), name
    assert lr["norm.weight"] == lr["head.weight"] == pytest.approx(0.1)
    assert wd["blocks.0.attn.qkv.weight"] == wd["patch_embed.proj.weight"] == 0.05
    assert wd["blocks.0.attn.qkv.bias"] == wd["pos_embed"] == wd["cls_token"] == wd["norm.weight"] == 0.0
    # off: the two groups as before, at the schedule's learning rate
    plain = build_optimizer(model, OptimConfig(lr=0.1))
    set_lr(plain, 0.02)
    assert [g["group"] for g in plain.param_groups] == ["decay", "no_decay"]
    assert {g["lr"] for g in plain.param_groups} == {0.02}


def test_freeze_by_name_pattern_leaves_those_parameters_out_and_refuses_a_pattern_that_names_none():
    model = create_model(TINY)
    in_block_0 = sum(1 for _ in model.blocks[0].parameters())
    assert freeze(model, ("patch_embed.*", "blocks.[0].*")) == 2 + in_block_0
    opt = build_optimizer(model, OptimConfig(lr=0.1, layer_decay=0.5))
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in held) == (not name.startswith(("patch_embed.", "blocks.0."))), name
    with pytest.raises(ValueError, match=r"optim.freeze: 'block.\*' names no parameter"):
        freeze(create_model(TINY), ("block.*",))


def test_ema_follows_its_formula():
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, decay=0.9)
    shadow = [p.detach().clone() for p in model.parameters()]
    for i in range(30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        d = min(0.9, (1 + i) / (10 + i))
        shadow = [d * s + (1 - d) * p.detach() for s, p in zip(shadow, model.parameters(), strict=True)]
        ema.update(model)
    for s, p in zip(shadow, ema.module.parameters(), strict=True):
        torch.testing.assert_close(p, s)
    assert ema.updates == 30 and ema.current_decay() == pytest.approx(31 / 40)


def test_ema_checkpoint_round_trip():
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, 0.99)
    ema.update(model)
    other = EMA(torch.nn.Linear(3, 2), 0.99)
    other.load_state_dict(ema.state_dict(), ema.updates)
    for a, b in zip(ema.module.parameters(), other.module.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert other.current_decay() == ema.current_decay()


def test_adamw_is_fused_on_the_cpu_and_steps_as_the_reference_loop():
    """The fused kernel is what runs on the CPU, and it computes torch's for-loop AdamW (decay groups
    included)."""
    torch.manual_seed(0)
    model = create_model(TINY)
    reference = create_model(TINY)
    reference.load_state_dict(model.state_dict())
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    assert opt.defaults["fused"] is True
    groups = param_groups(reference, cfg.weight_decay)
    ref_opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)
    for _ in range(5):
        grads = [torch.randn_like(p) for p in model.parameters()]
        for m, o in ((model, opt), (reference, ref_opt)):
            for p, g in zip(m.parameters(), grads, strict=True):
                p.grad = g.clone()
            o.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
