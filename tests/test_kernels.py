"""vitkit.cpu.build and its int8 block operator: built from source here, and computing the int8 block exactly
as the operator-by-operator path does, with the activations quantised per thread's share of the tokens.

Where a C++ compiler is on PATH (and VITKIT_KERNELS is not 0) the operator must build: a test that needs it
fails if it did not (`needs_operator`, tests/operator_helpers.py)."""

import pytest
import torch
import torch.nn.functional as F

from operator_helpers import needs_operator, warnings_of_two_builds
from test_optimize import tiny_model
from vitkit.attention import merge_heads, split_heads
from vitkit.cpu import autotune, build
from vitkit.cpu.convert import int8_block_eligible
from vitkit.cpu.fused_block import FusedBlock
from vitkit.cpu.hardware import cpu_flags, cpu_has_native_bf16
from vitkit.cpu.int8 import (
    bf16_attention,
    bf16_tiles_apply,
    block_linears,
    int8_block,
    int8_block_attention,
    register_tiles_apply,
)
from vitkit.inference import optimize


def int8_block_built() -> bool:
    """The int8 block operator, built: it needs a PyTorch with OpenMP and fbgemm besides a C++ compiler."""
    if not (torch.backends.openmp.is_available() and "fbgemm" in torch.backends.quantized.supported_engines):
        pytest.skip("this PyTorch has no OpenMP or no fbgemm, which the int8 block operator needs")
    return build.int8_block_available()


needs_int8_operator = needs_operator(int8_block_built, "int8 block")


def needs_bf16_tiles(attention: str) -> None:
    """Skip "vitkit-bf16" where it cannot run: a CPU without AVX512-BF16 (the tiny model's heads of 16)."""
    if attention == "vitkit-bf16" and not bf16_tiles_apply(16):
        pytest.skip("vitkit-bf16 attention needs AVX512-BF16")


# the int8 block's attention kernels
ATTENTION = ["vitkit", "sdpa", "sdpa-bf16", "vitkit-bf16"]


def int8_blocks(model, attention: str):
    """The int8 model's blocks that the operator computes, their Python path's attention in bf16 for the bf16
    kernels and in fp32 for the others, and their layers on fbgemm's or oneDNN's products (the per-share
    quantisation tested here; vitkit's own VNNI products: tests/test_int8_vnni.py)."""
    needs_bf16_tiles(attention)
    q = optimize(model, "int8")
    blocks = [b for b in q.blocks if int8_block_eligible(b)]
    for b in blocks:
        b.attention_dtype = torch.bfloat16 if attention.endswith("bf16") else None
        for lin in block_linears(b):
            lin.vnni = None
    return blocks


def reference_block(block: FusedBlock, x: torch.Tensor, parts: int, attention: str) -> torch.Tensor:
    """eq. 2 and 3 with the block's own int8 layers, each called on one share of the rows (tokens of all
    images cut in `parts`) at a time, and the attention on the kernel named `attention` over all pairs at once
    (each kernel computes every pair on its own): what the operator computes with `parts` threads."""
    B, T, D = x.shape
    rows = x.reshape(B * T, D)
    cuts = [len(rows) * i // parts for i in range(parts + 1)]
    shares = [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]
    qkv = torch.cat([block.attn.qkv(block.norm1(rows[a:b])) for a, b in shares]).view(B, T, 3 * D)
    heads, scale = block.attn.num_heads, block.attn.scale
    if attention == "sdpa-bf16":
        y = bf16_attention(qkv, heads, scale)
    elif attention == "vitkit-bf16":
        assert build.attention_available(), "the attention operator did not build (see the warning)"
        y = torch.ops.vitkit.attention_forward_bf16(qkv, heads, scale)
    elif attention == "vitkit":
        assert build.attention_available(), "the attention operator did not build (see the warning)"
        y = torch.ops.vitkit.attention_forward(qkv, heads, scale, False)[0]
    else:
        q, k, v = split_heads(qkv, heads)
        y = merge_heads(F.scaled_dot_product_attention(q, k, v, scale=scale))
    y = y.reshape(B * T, D)
    out = []
    for a, b in shares:
        x2 = block.attn.proj(y[a:b]) + rows[a:b]
        out.append(block.mlp.fc2(F.gelu(block.mlp.fc1(block.norm2(x2)),
                                        approximate=block.mlp.act.approximate)) + x2)
    return torch.cat(out).view(B, T, D)


@needs_int8_operator
def test_the_operator_builds_and_optimize_int8_uses_it():
    assert build.int8_block_available(), "the int8 block operator did not build (see the warning)"
    q = optimize(tiny_model(), "int8")
    assert all(b.int8_kernel for b in q.blocks)


@needs_int8_operator
@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("batch", [1, 3])
def test_one_thread_computes_the_operator_by_operator_block(attention, batch, threads):
    """One thread, one share: the same quantisation as the Python path, so the same numbers."""
    threads(1)
    x = torch.randn(batch, 17, 64)
    for block in int8_blocks(tiny_model(), attention):
        with torch.inference_mode():
            out = int8_block(block, x, attention=attention)
            ref = reference_block(block, x, parts=1, attention=attention)
            block.int8_kernel = False
            python_path, _ = block(x)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        # the Python path's attention may be another kernel: a rounding apart, which can move an int8 step
        torch.testing.assert_close(out, python_path, rtol=0, atol=2e-2)


@needs_int8_operator
@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("gelu", ["exact", "tanh"])
def test_two_threads_quantise_per_share_of_the_tokens(attention, batch, gelu, threads):
    threads(2)
    x = torch.randn(batch, 17, 64)
    for block in int8_blocks(tiny_model(gelu=gelu), attention):
        with torch.inference_mode():
            out = int8_block(block, x, attention=attention)
            ref = reference_block(block, x, parts=2, attention=attention)
            whole = reference_block(block, x, parts=1, attention=attention)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        assert (out - whole).abs().max() > 0  # the shares' scales really differ from the tensor's


@needs_int8_operator
def test_the_int8_model_stays_close_to_fp32_with_the_operator(threads):
    threads(2)
    model = tiny_model()
    q = optimize(model, "int8")
    assert all(b.int8_kernel for b in q.blocks)
    x = torch.randn(16, 3, 32, 32)
    with torch.inference_mode():
        ref, out = model(x), q(x)
        for b in q.blocks:
            b.int8_kernel = False
        by_operator = q(x)
    rel = ((out - ref).norm() / ref.norm()).item()
    rel_by_operator = ((by_operator - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.05 and rel < 1.5 * rel_by_operator, (rel, rel_by_operator)
    for b in q.blocks:  # and on fbgemm's or oneDNN's products
        b.int8_kernel = True
        for lin in block_linears(b):
            lin.vnni = None
    with torch.inference_mode():
        rel_engines = ((q(x) - ref).norm() / ref.norm()).item()
    assert 0 < rel_engines < 0.05, rel_engines


@needs_int8_operator
@pytest.mark.parametrize("shares", [2, 3])
def test_fewer_threads_than_shares_give_the_same_result(shares, threads):
    """On one thread the region works through every share in turn: the same shares, the same numbers."""
    x = torch.randn(2, 17, 64)
    for block in int8_blocks(tiny_model(), "vitkit"):
        with torch.inference_mode():
            threads(1)
            alone = int8_block(block, x, shares, "vitkit")
            threads(2)
            together = int8_block(block, x, shares, "vitkit")
            ref = reference_block(block, x, parts=shares, attention="vitkit")
        torch.testing.assert_close(alone, ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(together, ref, rtol=0, atol=1e-5)


@needs_int8_operator
@pytest.mark.parametrize("heads", [8, 4])  # heads of 8 dims: vitkit's kernel on sgemm; of 16: its tiles too
def test_vitkit_attention_in_the_block_on_either_kernel(heads, threads):
    threads(2)
    x = torch.randn(2, 17, 64)
    assert register_tiles_apply(64 // heads) == (heads == 4 and "avx512f" in cpu_flags())
    for block in int8_blocks(tiny_model(num_heads=heads), "vitkit"):
        with torch.inference_mode():
            out = int8_block(block, x, attention="vitkit")
            ref = reference_block(block, x, parts=2, attention="vitkit")
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@needs_int8_operator
def test_the_block_attention_is_timed_once_per_shape_and_kept(tmp_path, monkeypatch, threads):
    """Tuning on: the first call times the kernels on the whole block, writes the choice to the cache, and
    later calls and processes (the cache read anew) take it; tuning off: the fixed default."""
    threads(2)
    monkeypatch.setenv("VITKIT_CACHE_DIR", str(tmp_path))
    autotune.forget()
    block = int8_blocks(tiny_model(), "sdpa-bf16" if cpu_has_native_bf16() else "sdpa")[0]
    x = torch.randn(1, 17, 64)
    timed = []
    real = autotune.time_candidates

    def time_candidates(calls):  # noting the attention's timings (the int8 layers' engines are timed too)
        if "vitkit" in calls:
            timed.append(sorted(calls))
        return real(calls)

    monkeypatch.setattr(autotune, "time_candidates", time_candidates)
    with torch.inference_mode():
        choice = int8_block_attention(block, x, 2)
        assert int8_block_attention(block, x, 2) == choice
    expected = ["sdpa", "vitkit"] + (["sdpa-bf16"] if cpu_has_native_bf16() else [])
    own_bf16 = cpu_has_native_bf16() and bf16_tiles_apply(16)
    expected += ["vitkit-bf16"] if own_bf16 else []
    assert timed == [sorted(expected)] and choice in expected
    assert choice in autotune.cache_path().read_text()
    autotune.forget()
    with torch.inference_mode():
        assert int8_block_attention(block, x, 2) == choice and len(timed) == 1  # read from the file
    monkeypatch.setenv("VITKIT_AUTOTUNE", "0")
    default = ("vitkit-bf16" if own_bf16 else "vitkit" if register_tiles_apply(16)
               else "sdpa-bf16" if cpu_has_native_bf16() else "sdpa")
    assert int8_block_attention(block, x, 2) == default
    with pytest.raises(ValueError, match="attention='flash'.*one of"):
        int8_block(block, x, attention="flash")
    autotune.forget()


@needs_int8_operator
@pytest.mark.parametrize("shape", [(2, 197, 6, 64), (3, 50, 4, 16), (1, 17, 2, 128), (2, 1, 3, 32),
                                   (1, 33, 5, 48), (1, 96, 2, 80)])
def test_the_bf16_tiles_compute_attention_to_bf16_rounding(shape, threads):
    """The "vitkit-bf16" kernel alone, odd and even token counts, one token, head widths 16 to 128: against
    the attention of q, k and v rounded to bf16 computed in fp64, the error is the softmax's rounding to
    bf16 (within twice SDPA's bf16 kernel's, and nonzero: the products really run in bf16)."""
    needs_bf16_tiles("vitkit-bf16")
    assert build.attention_available(), "the attention operator did not build (see the warning)"
    threads(2)
    B, T, H, Dh = shape
    qkv = torch.randn(B, T, 3 * H * Dh)
    scale = Dh ** -0.5
    with torch.inference_mode():
        out = torch.ops.vitkit.attention_forward_bf16(qkv, H, scale)
        q, k, v = split_heads(qkv.bfloat16().double(), H)
        exact = merge_heads(torch.softmax(((q * scale).bfloat16().double() @ k.transpose(-1, -2)), -1) @ v)
        sdpa = bf16_attention(qkv, H, scale)
    err, sdpa_err = (out - exact).abs().max().item(), (sdpa - exact).abs().max().item()
    # each probability within bf16's half ulp (2^-9 relative) moves the output by at most 2^-9 max |v|
    assert err <= 2**-9 * v.abs().max().item() and err <= 2 * sdpa_err, (err, sdpa_err)
    assert err > 0 or T == 1  # one token: the softmax is 1, exact in bf16, and the output is v


@needs_int8_operator
@pytest.mark.parametrize("shape", [(2, 197, 6, 64), (3, 50, 4, 16), (1, 17, 2, 128), (2, 1, 3, 32),
                                   (1, 96, 2, 80)])
def test_the_bf16_tiles_read_and_write_bf16_as_the_casts_would(shape, threads):
    """A bf16 projection (a bf16 model's) is read and its output written in bf16, k in place: the same bits
    as the fp32 call on the projection cast to fp32 with its output cast back, with two copies of the
    projection's size fewer."""
    needs_bf16_tiles("vitkit-bf16")
    assert build.attention_available(), "the attention operator did not build (see the warning)"
    threads(2)
    B, T, H, Dh = shape
    qkv = torch.randn(B, T, 3 * H * Dh).bfloat16()
    with torch.inference_mode():
        out = torch.ops.vitkit.attention_forward_bf16(qkv, H, Dh ** -0.5)
        through_fp32 = torch.ops.vitkit.attention_forward_bf16(qkv.float(), H, Dh ** -0.5).bfloat16()
    assert out.dtype == torch.bfloat16 and out.shape == (B, T, H * Dh)
    assert torch.equal(out, through_fp32)
    strided = torch.randn(B, T, 2 * 3 * H * Dh).bfloat16()[..., ::2]  # not contiguous: copied first
    with torch.inference_mode():
        assert torch.equal(torch.ops.vitkit.attention_forward_bf16(strided, H, 0.3),
                           torch.ops.vitkit.attention_forward_bf16(strided.float(), H, 0.3).bfloat16())


@needs_int8_operator
def test_the_bf16_tiles_give_minus_infinite_scores_no_weight():
    """A score of -inf (a product that overflowed) gets weight 0, as in softmax, not a NaN row."""
    needs_bf16_tiles("vitkit-bf16")
    assert build.attention_available(), "the attention operator did not build (see the warning)"
    H, Dh, T = 2, 16, 20
    qkv = torch.randn(1, T, 3 * H * Dh)
    parts = qkv.view(1, T, 3, H, Dh)  # (image, token, q|k|v, head, dim)
    parts[:, :, 0, :, 0] = 1e30  # every query's first dim
    parts[:, 3, 1, :, 0] = -1e30  # key 3's: q . k = -inf in fp32, the other scores finite
    with torch.inference_mode():
        out = torch.ops.vitkit.attention_forward_bf16(qkv, H, 1.0)
    assert torch.isfinite(out).all()
    keep = [j for j in range(T) if j != 3]
    v = parts[:, keep, 2]  # the other keys' values: the output is a mix of them
    lo, hi = v.amin(1).reshape(1, 1, H * Dh), v.amax(1).reshape(1, 1, H * Dh)
    assert ((out >= lo - 0.05) & (out <= hi + 0.05)).all()


@needs_int8_operator
def test_the_bf16_tiles_refuse_what_they_do_not_compute():
    needs_bf16_tiles("vitkit-bf16")
    assert not bf16_tiles_apply(8) and not bf16_tiles_apply(24) and not bf16_tiles_apply(144)
    assert build.attention_available(), "the attention operator did not build (see the warning)"
    with pytest.raises(RuntimeError, match="heads of 16 to 128 dims"):
        torch.ops.vitkit.attention_forward_bf16(torch.randn(1, 5, 3 * 16), 2, 0.3)
    with pytest.raises(RuntimeError, match="expected fp32 or bf16"):
        torch.ops.vitkit.attention_forward_bf16(torch.randn(1, 5, 3 * 32).half(), 2, 0.3)
    block = int8_blocks(tiny_model(num_heads=8), "vitkit-bf16")[0]  # heads of 8 dims
    with pytest.raises(RuntimeError, match="vitkit-bf16 attention needs"):
        int8_block(block, torch.randn(1, 17, 64), attention="vitkit-bf16")


def test_the_environment_turns_the_operator_off(monkeypatch):
    monkeypatch.setenv("VITKIT_KERNELS", "0")
    assert not build.int8_block_available()
    q = optimize(tiny_model(), "int8")
    assert not any(b.int8_kernel for b in q.blocks)
    with torch.inference_mode():
        assert torch.isfinite(q(torch.randn(2, 3, 32, 32))).all()


def test_a_failed_build_warns_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    missing = tmp_path / "missing.cpp"
    with pytest.warns(RuntimeWarning, match="could not build the operator no_such_operator .*Error"):
        assert not build.build_operator("vitkit_test_missing", [missing], "no_such_operator")


def test_without_a_compiler_it_says_so_once_and_tries_nothing(monkeypatch, capsys):
    """No C++ compiler: one warning per process that says what to install, no 'compiling ...' line and no
    build attempt (whose ninja command line the user cannot act on)."""
    monkeypatch.setattr(build, "cxx_compiler", lambda: None)
    monkeypatch.setattr(build, "_build", lambda *a, **k: pytest.fail("a build was attempted"))
    build.no_compiler.cache_clear()
    said = warnings_of_two_builds()
    assert said == ["vitkit: no C++ compiler (install g++ or set CXX); the plain PyTorch path runs"]
    assert "compiling" not in capsys.readouterr().err
    build.no_compiler.cache_clear()


def test_models_the_operator_does_not_compute_keep_the_python_path():
    q = optimize(tiny_model(), "int8")
    block = q.blocks[0]
    assert int8_block_eligible(block)
    block.mlp.act = torch.nn.ReLU()
    assert not int8_block_eligible(block)
    assert not int8_block_eligible(tiny_model().blocks[0])  # a plain Block
    fp32 = optimize(tiny_model(), "fp32")
    assert not any(getattr(b, "int8_kernel", False) for b in fp32.blocks)
    assert FusedBlock(tiny_model().blocks[0]).int8_kernel is False


def test_installations_of_the_same_sources_share_one_library(monkeypatch, tmp_path):
    """Two installations share torch's extension cache: a library is named by its sources' content and built
    from copies of them in the cache, so that the same sources in another folder (a reinstall, another
    virtual environment) build nothing anew, and a changed source builds a library of its own."""
    built = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_build", lambda name, sources, flags=(): built.append((name, sources)))
    for folder, text in (("a", "int x;"), ("b", "int x;"), ("c", "int y;")):
        csrc = tmp_path / folder / "csrc"
        csrc.mkdir(parents=True)
        (csrc / "op.cpp").write_text('#include "op.h"\n')
        (csrc / "op.h").write_text(text)
        monkeypatch.setattr(build, "CSRC", csrc)
        with pytest.warns(RuntimeWarning, match="could not build the operator no_such_op"):
            assert not build.build_operator("vitkit_test", [csrc / "op.cpp"], "no_such_op")
    (a, a_sources), (b, b_sources), (c, _) = built
    assert a == b != c and all(name.startswith("vitkit_test_") for name, _ in built)
    assert a_sources == b_sources and a_sources[0].parent.parent == tmp_path / "cache" / a
    assert sorted(p.name for p in a_sources[0].parent.iterdir()) == ["op.cpp", "op.h"]
    assert (a_sources[0].parent / "op.h").read_text() == "int x;"
