"""vitkit.cpu.autotune: the fastest candidate is chosen once per shape, kept on disk, and never a slower one
than PyTorch's own; the tuned layers compute what the plain ones do whatever the choice."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import vitkit
from vitkit.cpu import autotune
from vitkit.cpu.attention import IMPLEMENTATIONS, attend, implementation
from vitkit.cpu.build import attention_available
from vitkit.cpu.linear import inference_engine_for, training_engine_for


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh, empty cache folder, and no choices in this process."""
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(autotune.ENV, raising=False)
    autotune.forget()
    yield tmp_path
    autotune.forget()


def _sleeper(seconds: float, calls: list[str], name: str):
    def run():
        calls.append(name)
        time.sleep(seconds)

    return run


def test_the_faster_candidate_is_chosen_timed_once_and_cached_on_disk(cache):
    calls: list[str] = []
    made = []

    def candidates():
        made.append(1)
        return {"plain": _sleeper(0.004, calls, "plain"), "fast": _sleeper(0.0005, calls, "fast")}

    assert autotune.choose("op", (3, 4), candidates, default="plain") == "fast"
    assert calls.count("fast") >= autotune.MIN_ROUNDS and calls.count("plain") >= autotune.MIN_ROUNDS
    calls.clear()
    assert autotune.choose("op", (3, 4), candidates, default="plain") == "fast"
    assert calls == [] and made == [1]  # the second call times nothing and makes no candidates
    stored = json.loads(autotune.cache_path().read_text())
    assert stored["choices"] == {f"op|(3, 4)|t{torch.get_num_threads()}": "fast"}
    assert autotune.chosen("op") == {f"(3, 4)|t{torch.get_num_threads()}": "fast"}
    assert autotune.chosen("other") == {}
    autotune.forget()  # a new process: the choice comes from the file, no candidate is made
    assert autotune.chosen("op") == {}
    assert autotune.choose("op", (3, 4), lambda: pytest.fail("timed again"), default="plain") == "fast"
    assert autotune.chosen("op") == {f"(3, 4)|t{torch.get_num_threads()}": "fast"}  # read counts too


def test_a_lone_candidate_is_taken_untimed_kept_for_the_process_and_named_but_not_stored(cache):
    made = []

    def candidates():
        made.append(1)
        return {"only": lambda: pytest.fail("a lone candidate is timed")}

    assert autotune.choose("op", (5,), candidates, default="other") == "only"
    assert autotune.choose("op", (5,), candidates, default="other") == "only"
    assert made == [1]  # the second call makes no candidates
    assert autotune.chosen("op") == {f"(5,)|t{torch.get_num_threads()}": "only"}
    assert not autotune.cache_path().exists()  # a process where more candidates run may choose otherwise
    autotune.forget()
    assert autotune.chosen("op") == {}


def test_cpus_of_one_model_name_with_other_vector_extensions_keep_their_own_choices(cache, monkeypatch):
    monkeypatch.setattr(autotune, "cpu_model", lambda: "AMD EPYC")
    names = set()
    for isa in ("avx2", "avx512", ""):
        monkeypatch.setattr(autotune, "cpu_isa", lambda isa=isa: isa)
        names.add(autotune.cache_path().name)
    assert names == {f"autotune-amd-epyc{s}-torch{torch.__version__.split('+')[0]}.json"
                     for s in ("-avx2", "-avx512", "")}


def test_the_default_stays_unless_beaten_by_the_margin():
    assert autotune.pick({"plain": 1.0, "fast": 0.99}, default="plain") == "plain"
    assert autotune.pick({"plain": 1.0, "fast": 0.9}, default="plain") == "fast"
    assert autotune.pick({"plain": 1.0, "a": 0.97, "b": 0.8}, default="a") == "b"
    assert autotune.pick({"plain": 0.9, "rule": 1.0}, default="rule") == "plain"  # PyTorch's own, when faster


def test_off_takes_the_default_without_timing(cache, monkeypatch):
    monkeypatch.setenv(autotune.ENV, "0")
    assert autotune.choose("op", 1, lambda: pytest.fail("timed"), default="rule") == "rule"
    assert not autotune.cache_path().exists()


def test_the_key_holds_the_thread_count(cache, threads):
    threads(1)
    autotune.choose("op", 1, lambda: {"a": lambda: None, "b": lambda: None}, default="a")
    threads(2)
    autotune.choose("op", 1, lambda: {"a": lambda: None, "b": lambda: None}, default="a")
    assert set(json.loads(autotune.cache_path().read_text())["choices"]) == {"op|1|t1", "op|1|t2"}


def test_an_unreadable_cache_is_said_and_written_anew(cache):
    autotune.cache_path().parent.mkdir(parents=True, exist_ok=True)
    autotune.cache_path().write_text("{not json")
    with pytest.warns(RuntimeWarning, match="unreadable autotuning cache"):
        autotune.choose("op", 2, lambda: {"a": lambda: None, "b": lambda: None}, default="a")
    assert "op|2|" in autotune.cache_path().read_text()


def test_processes_tuning_at_once_merge_their_choices(cache):
    """Two processes deciding different keys at the same time both find theirs in the file afterwards."""
    script = ("import sys; from vitkit.cpu import autotune\n"
              "for i in range(20): autotune.choose('op', (sys.argv[1], i), lambda: {'a': lambda: None, 'b': "
              "lambda: None}, 'a')\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, name]) for name in ("p", "q")]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    choices = json.loads(autotune.cache_path().read_text())["choices"]
    assert len(choices) == 40


def test_a_choice_written_by_another_process_first_wins(cache):
    """Processes tuning at once (a data-parallel run's) end with one choice each shape: the first written."""
    key = f"op|5|t{torch.get_num_threads()}"
    assert autotune._store(key, "b") == "b"  # another process, first
    assert autotune._store(key, "a") == "b"  # this one timed "a" meanwhile, and takes the stored "b"
    assert json.loads(autotune.cache_path().read_text())["choices"] == {key: "b"}


def test_tuning_leaves_the_global_random_stream_alone(cache):
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    qkv = torch.randn(2, 9, 48)
    torch.manual_seed(7)
    implementation(qkv, 4, 0.1, True)  # times dropout, which draws
    assert torch.equal(torch.rand(3), want)


def test_every_attention_implementation_computes_the_same_function():
    qkv = torch.randn(2, 11, 3 * 32, requires_grad=True)
    grad = torch.randn(2, 11, 32)
    outs = {}
    for how in [h for h in IMPLEMENTATIONS if h != "operator" or attention_available()]:
        out = attend(how, qkv, 4, 8**-0.5)
        outs[how] = (out.detach(), torch.autograd.grad(out, qkv, grad)[0])
    for how in list(outs)[1:]:
        torch.testing.assert_close(outs[how][0], outs["sdpa"][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[how][1], outs["sdpa"][1], rtol=1e-5, atol=1e-5)


def test_a_choice_of_the_operator_is_not_taken_where_it_is_off(cache, monkeypatch):
    """The operator chosen with it available is not reused with VITKIT_KERNELS=0 (it is another key)."""
    qkv = torch.randn(2, 9, 48, requires_grad=True)
    monkeypatch.setattr(autotune, "pick",
                        lambda times, default: "operator" if "operator" in times else default)
    if attention_available():
        assert implementation(qkv, 4, 0.0, True) == "operator"
    monkeypatch.setenv("VITKIT_KERNELS", "0")
    assert implementation(qkv, 4, 0.0, True) != "operator"


def test_the_tuned_choices_are_ones_the_candidates_name(cache):
    x, w, b = (torch.randn(40, 16, requires_grad=True), torch.randn(24, 16, requires_grad=True),
               torch.randn(24))
    assert training_engine_for(x, w, b) in ("mkl", "onednn")
    assert inference_engine_for(x.detach(), w.detach(), b) in ("mkl", "onednn")
    assert implementation(torch.randn(2, 9, 48, requires_grad=True), 4, 0.0, True) in IMPLEMENTATIONS
    keys = json.loads(autotune.cache_path().read_text())["choices"]
    assert {k.split("|")[0] for k in keys} == {"linear-train", "linear-infer", "attention-train"}


def test_optimize_with_tuning_on_and_off_computes_the_same(cache, monkeypatch):
    torch.manual_seed(0)
    model = vitkit.create_model("ViT-Ti/16", image_size=32, patch_size=8, num_classes=5).eval()
    with torch.no_grad():
        model.head.weight.normal_(std=0.1)
        x = torch.randn(4, 3, 32, 32)
        want = model(x)
        tuned = vitkit.optimize(model)(x)
        monkeypatch.setenv(autotune.ENV, "0")
        fixed = vitkit.optimize(model)(x)
    torch.testing.assert_close(tuned, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fixed, want, rtol=1e-4, atol=1e-4)
    assert F.softmax(tuned, -1).argmax(1).tolist() == F.softmax(want, -1).argmax(1).tolist()
