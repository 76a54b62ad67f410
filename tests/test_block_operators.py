"""What the fp32 and bf16 block operators share (csrc/block_operator.h): the same bits whatever the cut into
shares, and the choice between operator and layers timed per shape, the operator by default (the layers for
fp32 on AVX2)."""

import pytest
import torch

import test_bf16_block
import test_fp32_block
from operator_helpers import require_operator
from vitkit.cpu import autotune
from vitkit.cpu import fused_block as fused_block_module
from vitkit.cpu.bf16_block import bf16_block
from vitkit.cpu.fp32_block import fp32_block, fp32_block_default

# precision: (the test module that builds its blocks, the operator, its dtype)
OPERATORS = {"fp32": (test_fp32_block, fp32_block, torch.float32),
             "bf16": (test_bf16_block, bf16_block, torch.bfloat16)}


def operator_of(precision: str):
    """The operator for `precision` and a block readied for it (the test is skipped where it cannot run)."""
    module, operator, dtype = OPERATORS[precision]
    built = module.fp32_block_built if precision == "fp32" else module.bf16_block_built
    require_operator(built, f"{precision} block")
    return operator, module.blocks_of("none")[0], dtype


@pytest.mark.parametrize("precision", list(OPERATORS))
@pytest.mark.parametrize("tokens", [1, 5, 50, 197])
def test_the_cut_into_shares_leaves_the_numbers_as_they_are(precision, tokens, threads):
    """Every output is computed by one thread in one order: 1, 2 and 3 shares, on 1 or 2 threads, give the
    same bits (row counts around the 6-row tile and the MLP's blocks of 48 rows, 96 on AVX2)."""
    threads(2)
    operator, block, dtype = operator_of(precision)
    x = torch.randn(2, tokens, 64).to(dtype)
    with torch.inference_mode():
        outs = [operator(block, x, shares) for shares in (1, 2, 3)]
        threads(1)
        outs.append(operator(block, x, 2))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("precision", list(OPERATORS))
def test_the_choice_is_timed_per_shape_and_the_default_without_timing(precision, monkeypatch, tmp_path):
    """Without timing, the default (the operator; for fp32 on AVX2, the layers); timed, the faster."""
    _, block, dtype = operator_of(precision)
    chosen = getattr(fused_block_module, f"{precision}_block_chosen")
    default = fp32_block_default() if precision == "fp32" else "operator"
    x = torch.randn(1, 17, 64).to(dtype)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    monkeypatch.setenv(autotune.ENV, "0")
    autotune.forget()
    assert chosen(block, x) == (default == "operator")
    assert not chosen(block, x.to(other))  # tokens of the other dtype: the layers say why
    timed = {}
    monkeypatch.setenv(autotune.ENV, "1")
    monkeypatch.setattr(autotune, "time_candidates", lambda calls: timed.update(calls) or
                        {"operator": 2.0, "layers": 1.0})
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path))
    autotune.forget()
    assert not chosen(block, x) and set(timed) == {"operator", "layers"}
    monkeypatch.setattr(autotune, "time_candidates", lambda calls: {"operator": 1.0, "layers": 2.0})
    x = torch.randn(1, 18, 64).to(dtype)  # another shape: timed anew
    assert chosen(block, x)
    autotune.forget()


def test_the_fp32_default_is_the_layers_on_avx2_only(monkeypatch):
    from vitkit.cpu import fp32_block as fp32_block_module

    for isa, default in (("avx512", "operator"), ("avx2", "layers"), ("", "operator")):
        monkeypatch.setattr(fp32_block_module, "cpu_isa", lambda isa=isa: isa)
        assert fp32_block_default() == default
