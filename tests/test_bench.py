"""The benchmark harness: every contender builds the same architecture, the timing loop interleaves in random
order, and the whole harness runs end to end on tiny configs (table, JSON, CLI) in seconds."""

import dataclasses
import json
import random
import statistics
import time

import pytest
import torch
import torch.nn as nn

import vitkit
from vitkit import bench, timing
from vitkit.cli.main import main
from vitkit.cpu import is_accelerated
from vitkit.cpu.private import onednn_packing_available

TINY = vitkit.ViTConfig(image_size=32, patch_size=8, dim=32, depth=1, num_heads=2, mlp_dim=64, num_classes=10)


@pytest.mark.parametrize("name", [*bench.CONTENDERS, "vitkit-plain"])
def test_every_contender_is_the_same_architecture(name):
    """Same parameter count as vitkit's model (so the same FLOPs), and logits of the right shape; "vitkit" is
    the accelerated model (vitkit.accelerate), "vitkit-plain" the model as create_model builds it."""
    model = bench.BUILDERS[name](TINY).eval()
    reference = vitkit.create_model(TINY)
    if name in bench.ANCHORS or name in ("vitkit", "vitkit-plain"):
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters())
    if name in ("vitkit", "vitkit-plain"):
        assert is_accelerated(model) is (name == "vitkit")
    with torch.inference_mode():
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


def test_timm_anchor_is_our_function_with_our_weights():
    """timm's model is the anchor that shares vitkit's parameter names: with vitkit's weights it is vitkit's
    function."""
    ours = bench.build_vitkit(TINY).eval()
    theirs = bench.build_timm(TINY).eval()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(theirs(x), ours(x), rtol=0, atol=1e-5)


def test_interleaved_times_shuffles_rounds_and_skips_warmup():
    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in "abcdef"}
    times = timing.interleaved_times(calls, repeats=6, warmup=2, rng=random.Random(0))
    assert {k: len(v) for k, v in times.items()} == dict.fromkeys("abcdef", 6)
    assert len(order) == 2 * 6 + 6 * 6  # warm-up rounds are called but not timed
    rounds = ["".join(order[12 + 6 * i: 18 + 6 * i]) for i in range(6)]
    assert all(sorted(r) == list("abcdef") for r in rounds)  # every round calls each once
    assert len(set(rounds)) > 1  # in a fresh order


def test_interleaved_times_settles_each_contender_before_timing_it():
    """With settle=2, every timed call comes right after two untimed calls of the same contender, and only
    the timed one is measured: a contender that is slow only when another ran just before it (threads left
    spinning) is timed at its own speed."""
    order, last = [], [None]

    def call(name):
        def fn():
            order.append(name)
            if last[0] not in (None, name):
                time.sleep(0.02)  # slow right after another contender
            last[0] = name
        return fn

    calls = {name: call(name) for name in "abc"}
    times = timing.interleaved_times(calls, repeats=4, warmup=1, rng=random.Random(1), settle=2)
    assert {k: len(v) for k, v in times.items()} == dict.fromkeys("abc", 4)
    timed = order[3:]
    assert len(timed) == 4 * 3 * 3
    runs = ["".join(timed[i: i + 3]) for i in range(0, len(timed), 3)]
    assert all(r == r[0] * 3 for r in runs)  # each contender's settle calls and its timed call together
    assert max(t for v in times.values() for t in v) < 0.01  # no timed call paid for another's
    unsettled = timing.interleaved_times(calls, repeats=4, warmup=0, rng=random.Random(1))
    assert max(t for v in unsettled.values() for t in v) >= 0.02


def test_interleaved_times_pauses_before_each_contender():
    """A contender slow while another's threads still spin (here: for 30 ms after its call ends) is timed
    at its own speed after a pause longer than that."""
    ended = {"at": 0.0, "by": None}

    def call(name):
        def fn():
            if ended["by"] not in (None, name) and time.perf_counter() - ended["at"] < 0.03:
                time.sleep(0.02)
            ended["at"], ended["by"] = time.perf_counter(), name
        return fn

    calls = {name: call(name) for name in "abc"}
    busy = timing.interleaved_times(calls, repeats=3, warmup=0, rng=random.Random(2))
    assert max(t for v in busy.values() for t in v) >= 0.02
    quiet = timing.interleaved_times(calls, repeats=3, warmup=0, rng=random.Random(2), pause=0.04)
    assert max(t for v in quiet.values() for t in v) < 0.01


def test_bench_config_refuses_negative_settle():
    with pytest.raises(ValueError, match="settle=-1"):
        bench.BenchConfig(settle=-1)
    with pytest.raises(ValueError, match="pause_s=-0.1"):
        bench.BenchConfig(pause_s=-0.1)


def test_paired_ratio_survives_busy_and_quiet_phases():
    """A contender 10 % faster than the anchor in every round, while the machine flips between quiet (1 s)
    and busy (2 s) rounds: the paired ratio is 1.1; the ratio of medians is wrong when the two medians land in
    different phases."""
    phase = [1.0, 1.0, 2.0, 2.0, 2.0, 1.0]
    anchor = [p for p in phase]
    ours = [p / 1.1 for p in phase]
    ours[2] = ours[0]  # one round of ours caught a quiet moment
    assert timing.paired_ratio(ours, [anchor]) == pytest.approx(1.1)
    assert statistics.median(anchor) / statistics.median(ours) == pytest.approx(1.65)
    # Against several references, the fastest of each round counts.
    assert timing.paired_ratio([1.0, 1.0, 1.0], [[2.0, 0.5, 2.0], [1.5, 2.0, 1.0]]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="same rounds"):
        timing.paired_ratio([1.0, 2.0], [[1.0]])


def test_sgemm_and_measurement_arithmetic():
    assert bench.sgemm_gflops(2.0, 1000) == pytest.approx(1.0)
    m = bench.Measurement("m", 4, "c", [0.3, 0.1, 0.2], flops_per_image=1e9)
    assert m.median_s == pytest.approx(0.2)
    assert m.images_per_s == pytest.approx(20.0)
    assert m.gflops == pytest.approx(20.0)


def test_harness_end_to_end_on_a_tiny_config(tmp_path):
    config = bench.BenchConfig(models=(TINY,), batch_sizes=(1, 2), repeats=2, warmup=1, sgemm_size=128,
                               threads=1)
    before = torch.get_num_threads()
    seen = []
    report = bench.run(config, on_progress=lambda done, total: seen.append((done, total)))
    assert torch.get_num_threads() == before  # restored
    references = 2 if onednn_packing_available() else 1  # torch.mm, and oneDNN's GEMM where there is one
    assert seen[-1][0] == seen[-1][1] == 2 * 2 * (len(bench.CONTENDERS) + references)
    assert (report["onednn_gemm_gflops"] is not None) == onednn_packing_available()
    rows = report["rows"]
    assert len(rows) == 2 * len(bench.CONTENDERS)
    assert report["machine"]["threads"] == 1
    for row in rows:
        assert row["images_per_s"] > 0 and row["mfu"] > 0 and len(row["seconds"]) == 2
        assert row["best_anchor"] in bench.ANCHORS
        assert row["images_per_s"] == pytest.approx(row["batch"] / (row["latency_ms"] / 1e3))
    for batch in (1, 2):
        cell = [r for r in rows if r["batch"] == batch]
        best = max((r for r in cell if r["contender"] in bench.ANCHORS), key=lambda r: r["images_per_s"])
        assert best["vs_best_anchor_of_medians"] == pytest.approx(1.0)
        assert all(r["best_anchor"] == best["contender"] for r in cell)
        # Paired against the fastest anchor of each round, no anchor beats itself.
        assert all(r["vs_best_anchor"] <= 1.0 + 1e-12 for r in cell if r["contender"] in bench.ANCHORS)
    path = tmp_path / "bench.json"
    bench.write_json(report, path)
    assert json.loads(path.read_text())["rows"][0]["contender"] == rows[0]["contender"]
    from rich.console import Console

    console = Console(width=130, record=True)
    console.print(bench.format_table(report))
    text = console.export_text()
    assert "vitkit-int8" in text and "MFU" in text
    assert len(bench.summarize(report)) == 2 * len(bench.OURS)
    markdown = bench.format_markdown(report).splitlines()
    assert markdown[2].startswith("| model |") and len(markdown) == 4 + len(rows)
    # The CPU's int8 and bf16 features, which decide what optimize(int8) can gain, are recorded and shown.
    from vitkit.cpu.hardware import cpu_has_native_bf16, cpu_has_vnni

    assert report["machine"]["vnni"] == cpu_has_vnni()
    assert report["machine"]["native_bf16"] == cpu_has_native_bf16()
    shown = f"VNNI {'yes' if cpu_has_vnni() else 'no'}"
    assert shown in markdown[0]


def test_cpu_description_names_the_features_and_reads_older_reports():
    info = {"cpu": "Some Xeon", "cpu_capability": "AVX512", "vnni": False, "native_bf16": True, "threads": 2}
    assert bench.describe_cpu(info) == "Some Xeon (AVX512, VNNI no, bf16 yes)"
    # a report from before they were kept
    older = {"cpu": "Some Xeon", "cpu_capability": "AVX2", "threads": 2}
    assert bench.describe_cpu(older) == "Some Xeon (AVX2)"


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="unknown contenders"):
        bench.BenchConfig(contenders=("tensorflow",))
    with pytest.raises(ValueError, match="repeats"):
        bench.BenchConfig(repeats=0)
    with pytest.raises(ValueError, match="batch sizes"):
        bench.BenchConfig(batch_sizes=(0,))


def test_cli_bench_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as e:
        main(["bench", "-m", "ViT-Ti/16", "-b", "1", "-c", "vitkit", "-c", "timm", "-r", "1", "--warmup", "0",
              "-t", "1", "--settle", "0", "--json", str(out)])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "ViT-Ti/16" in text and "timm" in text
    report = json.loads(out.read_text())
    assert {r["contender"] for r in report["rows"]} == {"vitkit", "timm"}
    assert report["config"]["settle"] == 0  # the record says how each call was timed


def test_cli_bench_help_and_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    assert "--quick" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["bench", "-m", "ViT-Q/99"])
    assert e.value.code != 0
    assert capsys.readouterr().err.startswith("error:")
    with pytest.raises(SystemExit) as e:
        main(["bench", "-c", "tensorflow"])
    assert e.value.code != 0
    assert "unknown contenders" in capsys.readouterr().err


def test_cli_bench_quick_keeps_what_the_command_line_chooses(monkeypatch, capsys):
    """`vitkit bench --quick` fills in ViT-S/16, batch 1, 3 repeats and 1 warm-up only where -m, -b, -r and
    --warmup say nothing; without --quick the full run's defaults; an unknown preset fails either way."""
    from vitkit.cli.speed import FULL_RUN, QUICK_RUN

    configs, real_run = [], bench.run

    def fake_run(config, on_progress=None):  # note the configuration, then measure a tiny one instead
        configs.append(config)
        return real_run(dataclasses.replace(config, models=("ViT-Ti/16",), batch_sizes=(1,),
                                            contenders=("vitkit",), repeats=1, warmup=0, threads=1,
                                            sgemm_size=64))

    monkeypatch.setattr(bench, "run", fake_run)
    for argv in (["--quick"], ["--quick", "-m", "ViT-B/32", "-r", "5"], ["-b", "4", "--warmup", "0"], []):
        with pytest.raises(SystemExit) as e:
            main(["bench", *argv])
        assert e.value.code == 0, capsys.readouterr()
    assert [c.settle for c in configs] == [1] * 4  # each timed call after one of its own by default
    got = [(c.models, c.batch_sizes, c.repeats, c.warmup) for c in configs]
    assert got == [
        (tuple(QUICK_RUN["models"]), tuple(QUICK_RUN["batch_sizes"]), QUICK_RUN["repeats"],
         QUICK_RUN["warmup"]),
        (("ViT-B/32",), tuple(QUICK_RUN["batch_sizes"]), 5, QUICK_RUN["warmup"]),
        (tuple(FULL_RUN["models"]), (4,), FULL_RUN["repeats"], 0),
        (tuple(FULL_RUN["models"]), tuple(FULL_RUN["batch_sizes"]), FULL_RUN["repeats"], FULL_RUN["warmup"]),
    ]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["bench", "--quick", "-m", "ViT-Q/99"])  # an unknown preset is an error, not ViT-S/16
    assert e.value.code != 0 and "ViT-Q/99" in capsys.readouterr().err
    assert len(configs) == 4


def test_gpu_benchmark_runs_its_contenders_on_the_cpu(tmp_path):
    """benchmarks/bench_gpu.py (the GPU benchmark) runs for real on the CPU with a
    tiny model: every contender is timed, ratios are paired against timm, and the JSON holds it all."""
    bench_gpu = load_benchmark("bench_gpu")
    out = tmp_path / "gpu.json"
    report = bench_gpu.main(["--device", "cpu", "--tiny", "--no-compile", "--repeats", "2", "--warmup", "1",
                             "--batch", "4", "--train-batch", "4", "--json", str(out)])
    assert json.loads(out.read_text())["model"] == "tiny"
    inference, training = report["inference"], report["training"]
    expected = {"vitkit-fp32", "vitkit-bf16", "timm-bf16"} if bench_gpu.bf16_allowed(torch.device("cpu")) \
        else {"vitkit-fp32", "timm-fp32"}
    assert set(inference["images_per_s"]) == expected
    assert set(training["images_per_s"]) == {"vitkit", "timm"}
    assert (inference["vs_reference"][inference["reference"]] == 1.0
            and training["vs_reference"]["timm"] == 1.0)
    assert all(len(t) == 2 and min(t) > 0 for t in inference["seconds"].values())
    only = bench_gpu.main(["--device", "cpu", "--tiny", "--no-compile", "--repeats", "1", "--warmup", "0",
                           "--batch", "2", "--train-batch", "2", "--only", "training", "--profile", "3"])
    assert "inference" not in only and set(only["training"]["images_per_s"]) == {"vitkit", "timm"}
    # one profiled step per contender: totals and the busiest operators
    profiles = only["training"]["profile"]
    assert set(profiles) == {"vitkit", "timm"}
    assert all(p["wall_ms"] > 0 and p["host_ops_ms"] > 0 for p in profiles.values())
    for p in profiles.values():  # the 3 busiest operators, whichever they are (AdamW's step, a linear, ...)
        lines = p["table"].splitlines()
        assert "Self CPU" in lines[1] and lines[-1].startswith("Self CPU time total")
        assert len([line for line in lines[3:-1] if line.strip() and not line.startswith("-")]) == 3
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):  # a clear error from argparse, not a traceback
            bench_gpu.main(["--device", "cuda"])


def test_gpu_benchmark_compiles_the_training_steps_in_the_mode_asked(monkeypatch):
    """--train-compile-mode reaches torch.compile for both compiled contenders (recorded, not compiled: the
    mode that matters, reduce-overhead, replays CUDA graphs and needs a GPU)."""
    bench_gpu = load_benchmark("bench_gpu")
    modes = []
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: modes.append(mode) or model)
    report = bench_gpu.main(["--device", "cpu", "--tiny", "--repeats", "1", "--warmup", "0", "--train-batch",
                             "2", "--only", "training", "--train-compile-mode", "reduce-overhead"])
    assert modes == ["reduce-overhead", "reduce-overhead"]
    training = report["training"]
    assert training["compile_mode"] == "reduce-overhead"
    assert set(training["images_per_s"]) == {"vitkit", "vitkit-compiled", "timm", "timm-compiled"}


def test_training_benchmark_steps_with_the_trainers_optimizer():
    """benchmarks/bench_training.py gives both contenders the optimizer of vitkit's trainer (fused AdamW,
    weight decay on the weights only) by default, torch's default AdamW with --optimizer torch-default, and
    says which; its record carries the model's config."""
    bench_training = load_benchmark("bench_training")
    cfg = vitkit.get_config("ViT-Ti/16").replace(image_size=(32, 32), patch_size=8, depth=1, num_classes=5)
    for model in (vitkit.create_model(cfg), bench_training.build_timm(cfg)):
        trainer = bench_training.step_optimizer(model, "trainer")
        assert isinstance(trainer, torch.optim.AdamW) and trainer.defaults["fused"]
        decays = {g["weight_decay"]: len(g["params"]) for g in trainer.param_groups}
        # biases, norms, class token, position embedding undecayed
        assert decays[0.05] > 0 and decays[0.0] > 0
        default = bench_training.step_optimizer(model, "torch-default")
        assert not default.defaults["fused"] and [g["weight_decay"] for g in default.param_groups] == [0.05]
    with pytest.raises(ValueError, match="'sgd'"):
        bench_training.step_optimizer(model, "sgd")
    r = bench_training.measure(cfg, batch=2, repeats=1, warmup=0, seed=0, optimizer="torch-default")
    assert r["optimizer"] == "torch-default"
    # the record names the model's settings, not only its name
    assert vitkit.ViTConfig.from_dict(r["config"]) == cfg
    assert bench_training.measure(cfg, batch=2, repeats=1, warmup=0, seed=0)["optimizer"] == "trainer"


def test_training_benchmark_times_each_engine(capsys):
    """benchmarks/bench_training.py with --engines: vitkit as the trainer runs it and once per training
    engine beside timm, each step run under its engine; the headline ratio is that of the trainer's path."""
    from vitkit.cpu import autotune
    from vitkit.cpu.linear import TRAINING_ENGINES, training_engine

    bench_training = load_benchmark("bench_training")
    seen = []

    class Recorder(nn.Module):  # a model that notes the engine its forward runs under
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            seen.append(training_engine())
            return self.fc(x)

    model = Recorder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    for engine in TRAINING_ENGINES:
        bench_training.train_step(model, opt, x, y, engine)()
    bench_training.train_step(model, opt, x, y)()
    assert seen == [*TRAINING_ENGINES, training_engine()]

    cfg = vitkit.get_config("ViT-Ti/16").replace(image_size=(32, 32), patch_size=8, depth=1, num_classes=5)
    r = bench_training.measure(cfg, batch=2, repeats=2, warmup=0, seed=0, engines=TRAINING_ENGINES)
    names = {f"vitkit[{e}]" for e in TRAINING_ENGINES}
    assert set(r["images_per_s"]) == names | {"vitkit", "timm"}
    assert set(r["ratio_over_timm_by_engine"]) == names  # beside the headline: the trainer's own path
    assert r["training_engine"] == ("per shape, timed" if autotune.enabled() else training_engine())
    if autotune.enabled():  # the engine each product shape of the step got
        assert r["training_products"] and set(r["training_products"].values()) <= set(TRAINING_ENGINES)
    else:
        assert "training_products" not in r
    assert r["ratio_vitkit_over_timm"] == timing.paired_ratio(r["seconds"]["vitkit"], [r["seconds"]["timm"]])
    assert all(len(t) == 2 and min(t) > 0 for t in r["seconds"].values())
    plain = bench_training.measure(cfg, batch=2, repeats=1, warmup=0, seed=0)
    assert set(plain["images_per_s"]) == {"vitkit", "timm"} and "ratio_over_timm_by_engine" not in plain
    bench_training.profile(cfg, batch=2, rows=5)  # the operator tables of warmed-up steps, one per contender
    out = capsys.readouterr().out
    assert out.count("top operators by self CPU time") == 2 and "=== vitkit," in out and "=== timm," in out
    assert out.count("Self CPU time total") == 2


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is a folder of scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_benchmark_times_timm_compiled_and_the_trainers_path():
    """With compile on, timm through torch.compile and vitkit's compiled path join the eager contenders, and
    the headline against timm compiled is the path the trainer takes for the cell (compiled where the recipe
    compiles, eager where it does not)."""
    script = load_benchmark("bench_training")
    cfg = vitkit.get_config("ViT-Ti/16").replace(image_size=(32, 32), patch_size=8, depth=1, num_classes=5)
    r = script.measure(cfg, batch=2, repeats=2, warmup=1, seed=0, compile=True, trainer_compiles=True)
    assert set(r["images_per_s"]) == {"vitkit", "timm", "timm-compiled", "vitkit-compiled"}
    seconds = r["seconds"]
    assert all(len(t) == 2 and min(t) > 0 for t in seconds.values())
    assert r["trainer"] == "vitkit-compiled"
    assert r["ratio_trainer_over_timm_compiled"] == timing.paired_ratio(seconds["vitkit-compiled"],
                                                                      [seconds["timm-compiled"]])
    eager = script.measure(cfg, batch=2, repeats=1, warmup=0, seed=0)
    assert set(eager["images_per_s"]) == {"vitkit", "timm"} and "trainer" not in eager
    with pytest.raises(ValueError, match="compile=True"):
        script.measure(cfg, batch=2, repeats=1, warmup=0, seed=0, trainer_compiles=True)
    # the cells know the trainer's choice: the fashion-mnist recipe compiles, a preset by default does not
    assert script.recipe_cell("fashion-mnist")[2] is True
    assert script.default_cell("ViT-S/16", 8)[2] is False


def test_compiled_contenders_train_the_model():
    """A compiled contender's step changes its model's weights as the eager step does (the optimizer holds
    the module's own parameters, not a copy)."""
    script = load_benchmark("bench_training")
    cfg = vitkit.get_config("ViT-Ti/16").replace(image_size=(32, 32), patch_size=8, depth=1, num_classes=5)
    torch.manual_seed(0)
    model = script.build_timm(cfg).train()
    before = [p.detach().clone() for p in model.parameters()]
    opt = script.step_optimizer(model)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 3])
    script.train_step(script.compiled(model, torch.device("cpu")), opt, x, y)()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
               if b.requires_grad)


def test_compare_commits_picks_the_cells_named():
    compare = load_benchmark("compare_commits")
    cells = compare.TRAIN_CELLS + compare.INFER_CELLS
    assert compare.cell_label(("train", "demo", 0)) == "train demo"
    assert [compare.cell_label(c) for c in cells if compare.matches(c, "ViT-S/16 16 int8")] == [
        "infer ViT-S/16 16 int8"]
    assert len([c for c in cells if compare.matches(c, "int8")]) == 4
    # words, not substrings: "1" is batch 1, not the 1 of 16
    assert [compare.cell_label(c) for c in cells if compare.matches(c, "infer ViT-B/16 1 fp32")] == [
        "infer ViT-B/16 1 fp32"]
    assert not [c for c in cells if compare.matches(c, "int4")]


def test_training_throughput_script_alternates_the_models(tmp_path, capsys):
    """benchmarks/train_throughput.py runs for real on a tiny recipe and random images: a rate for vitkit and
    timm in every round, and their paired ratio in the report and the JSON file."""
    throughput = load_benchmark("train_throughput")
    out = tmp_path / "throughput.json"
    report = throughput.main(["--recipe", "fashion-mnist-tiny", "--synthetic", "--rounds", "2", "--steps",
                              "1", "--warmup", "1", "--batch-size", "8", "--json", str(out)])
    assert json.loads(out.read_text())["paired_ratios"] == report["paired_ratios"]
    assert set(report["rounds"]) == {"vitkit", "timm"} and all(len(r) == 2 for r in report["rounds"].values())
    assert report["batch_size"] == 8 and report["paired_ratios"]["vitkit/timm"] > 0
    assert "vitkit / timm" in capsys.readouterr().out
