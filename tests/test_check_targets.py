"""benchmarks/check_targets.py reads the speed targets off benchmark records (small copies of two runs under
tests/fixtures/records) and agrees with what the files say when read directly; benchmarks/target_runs.sh runs
the whole measurement and ends in it."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "tests" / "fixtures" / "records"
AGREEMENT = RECORDS / "int8-agreement_amd-epyc_2026-12-02.json"

spec = importlib.util.spec_from_file_location("check_targets", ROOT / "benchmarks" / "check_targets.py")
check_targets = importlib.util.module_from_spec(spec)
sys.modules["check_targets"] = check_targets
spec.loader.exec_module(check_targets)


def record(what: str, run: int) -> Path:
    return RECORDS / f"{what}_amd-epyc_2026-12-02_run{run}.json"


def run_files(run: int, folder: Path = RECORDS) -> str:
    return ",".join(str(folder / record(what, run).name) for what in ("infer-b1", "infer-b16", "train-step"))


def rows(run: int) -> list[dict]:
    return [r for w in ("infer-b1", "infer-b16") for r in json.loads(record(w, run).read_text())["rows"]]


def by_target(results: list[dict]) -> dict[str, dict]:
    return {r["target"]: r for r in results}


def test_two_runs_read_as_their_files_say():
    """Run 3 (AMD EPYC with VNNI): optimize(fp32) at batch 1 short (1.280x), the rest met; run 4 met every
    target. Each run's weakest cell is the minimum of the files' own figures."""
    results, runs = check_targets.check([run_files(3), run_files(4) + f",{AGREEMENT}"])
    t = by_target(results)
    plain, fp32, mfu, int8, agreement, training = (t[x.text] for x in check_targets.TARGETS[:6])
    assert plain["verdict"] == "met" and mfu["verdict"] == "met" and int8["verdict"] == "met"
    assert training["verdict"] == "met" and agreement["verdict"] == "met"
    assert fp32["verdict"] == "short in 1 of 2 runs"
    assert [r["met"] for r in fp32["runs"]] == [False, True]
    for res, i in zip(fp32["runs"], (3, 4), strict=True):
        direct = min(
            r["vs_best_anchor"] for r in rows(i) if r["contender"] == "vitkit-fp32-opt" and r["batch"] == 1
        )
        assert res["worst"][1] == direct
    for res, i in zip(int8["runs"], (3, 4), strict=True):
        assert res["worst"][1] == min(r["vs_best_anchor"] for r in rows(i) if r["contender"] == "vitkit-int8")
    for res, i in zip(training["runs"], (3, 4), strict=True):
        direct = json.loads(record("train-step", i).read_text())
        assert res["worst"][1] == min(c["ratio_vitkit_over_timm"] for c in direct)
    assert agreement["runs"][0]["worst"] is None
    assert agreement["runs"][1]["worst"][1] == pytest.approx(0.9978, abs=1e-6)
    assert "AMD EPYC" in check_targets.machine_line(runs) and "VNNI yes" in check_targets.machine_line(runs)
    assert check_targets.main(["--run", run_files(3)]) == 1


def test_a_run_where_every_target_held_exits_0(tmp_path, capsys):
    """Run 4 met every line; the table and JSON are written."""
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    assert check_targets.main(["--run", run_files(4), "--markdown", str(md), "--json", str(js)]) == 0
    printed = capsys.readouterr().out
    assert md.read_text() == printed and "**" not in printed.split("\n\n")[1]
    report = json.loads(js.read_text())
    assert {t["verdict"] for t in report["targets"]} == {"met", "not measured"}


def test_without_vnni_int8_is_not_compared_and_agreement_is_read(tmp_path):
    """On a machine without VNNI the int8 line says so instead of a shortfall; the agreement file counts as a
    run's figure (99.78 % >= 99 %)."""
    for what in ("infer-b1", "infer-b16", "train-step"):
        data = json.loads(record(what, 3).read_text())
        if isinstance(data, dict):
            data["machine"]["vnni"] = False
        (tmp_path / record(what, 3).name).write_text(json.dumps(data))
    results, runs = check_targets.check([run_files(3, tmp_path) + f",{AGREEMENT}"])
    t = by_target(results)
    assert t[check_targets.TARGETS[3].text]["verdict"] == "not comparable: no VNNI on this machine"
    agree = t[check_targets.TARGETS[4].text]
    assert agree["verdict"] == "met"
    assert "VNNI no" in check_targets.machine_line(runs)
    table = check_targets.markdown(results, runs)
    assert "99.8 %" in table


def test_values_just_below_a_target_are_not_rounded_onto_it():
    assert check_targets.shown(1.2999339, "x", 1.3) == "1.2999x"
    assert check_targets.shown(1.2999339, "x") == "1.300x"
    assert check_targets.shown(1.31, "x", 1.3) == "1.310x"
    assert check_targets.shown(0.8499, "%", 0.85) == "84.99 %"
    assert check_targets.shown(0.9942, "%", 0.99) == "99.4 %"


def test_bad_files_are_named(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    assert check_targets.main(["--run", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    assert check_targets.main(["--run", str(other)]) == 2
    err = capsys.readouterr().err
    assert str(other) in err and "vitkit bench --json" in err
    rowless = tmp_path / "rowless.json"
    rowless.write_text(json.dumps({"rows": [{"model": "ViT-S/16", "batch": 1}]}))
    assert check_targets.main(["--run", str(rowless)]) == 2
    err = capsys.readouterr().err
    assert str(rowless) in err and "without contender" in err
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert check_targets.main(["--run", str(broken)]) == 2
    assert "cannot read it as JSON" in capsys.readouterr().err


def script(env: dict, *args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "target_runs.sh"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


def test_target_runs_script_refuses_bad_settings(tmp_path):
    bad = script({"RUNS": "three"}, str(tmp_path / "out"))
    assert bad.returncode == 2 and "RUNS must be a positive whole number, got 'three'" in bad.stderr
    ckpt = tmp_path / "no-such-checkpoint"
    bad = script({"AGREEMENT_CHECKPOINT": str(ckpt)}, str(tmp_path / "out"))
    assert bad.returncode == 2 and str(ckpt) in bad.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_target_runs_script_end_to_end_on_a_tiny_setting(tmp_path):
    """One run of the real commands at the smallest setting (ViT-Ti/32, one round, the demo recipe's eager
    step; the runtimes and the compiled steps, minutes of exporting and compiling, left out as the settings
    say; tests/test_bench_runtimes.py and tests/test_bench.py run those): every file written, and
    the exit status is the checker's verdict on them."""
    out = tmp_path / "targets"
    env = {
        "RUNS": "1",
        "RUNTIMES": "0",
        "MODELS": "ViT-Ti/32",
        "B1_REPEATS": "1",
        "B16_REPEATS": "1",
        "TRAIN_ARGS": "--only recipes --recipe demo --repeats 1 --warmup 0 --no-compile",
    }
    done = script(env, str(out), timeout=600)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    names = sorted(p.name for p in out.iterdir())
    assert {n.split("_")[0] for n in names} == {"infer-b1", "infer-b16", "train-step"} and len(names) == 3
    assert all(n.endswith("_run1.json") and n.split("_")[1] == check_targets_where() for n in names)
    results, _ = check_targets.check([",".join(str(out / n) for n in names)])
    cells = {t["target"]: t["runs"][0]["cells"] for t in results}
    assert set(cells[check_targets.TARGETS[0].text]) == {"ViT-Ti/32 b1", "ViT-Ti/32 b16"}
    assert set(cells[check_targets.TARGETS[5].text]) == {"recipe demo b128"}
    assert all(not cells[t.text] for t in check_targets.TARGETS[6:])  # no compiled steps, no runtimes
    assert (0 if check_targets.all_met(results) else 1) == done.returncode
    assert "the speed targets over 1 run(s)" in done.stdout


def check_targets_where() -> str:
    """This machine's CPU slug, as benchmarks/records.py names records."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "records.py"), "where"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


RUNTIMES = RECORDS / "infer-runtimes_amd-epyc_2026-12-04.json"


def test_runtime_and_compiled_training_targets_read_as_the_files_say(tmp_path):
    """A `vitkit bench --runtimes` file feeds the runtime targets (each contender's `vs_best_runtime`), not
    the eager ones (its anchors are others); a training file with compiled steps feeds the torch.compile
    target; files without them leave those targets unmeasured."""
    train = json.loads(record("train-step", 4).read_text())
    for i, cell in enumerate(train):
        cell.update(trainer="vitkit", ratio_trainer_over_timm_compiled=1.2 - 0.15 * i)
    compiled = tmp_path / "train-step_compiled.json"
    compiled.write_text(json.dumps(train))
    results, runs = check_targets.check([f"{record('infer-b1', 4)},{RUNTIMES},{compiled}"])
    t = by_target(results)
    by_contender = {}
    for r in json.loads(RUNTIMES.read_text())["rows"]:
        if r.get("vs_best_runtime") is not None:
            by_contender.setdefault(r["contender"], []).append(r["vs_best_runtime"])
    texts = [x.text for x in check_targets.TARGETS]
    fp32, int8, bf16 = (t[text] for text in texts[-3:])
    for target, contender in ((fp32, "vitkit-fp32-opt"), (int8, "vitkit-int8"), (bf16, "vitkit-bf16")):
        worst = min(by_contender[contender])
        assert target["runs"][0]["worst"][1] == worst
        assert target["verdict"] == ("met" if worst >= target["threshold"] else "short in 1 of 1 runs")
    assert len(runs[0].runtimes) == len(json.loads(RUNTIMES.read_text())["rows"])
    # the eager targets see only the eager file's rows
    plain = t[texts[0]]
    eager = json.loads(record("infer-b1", 4).read_text())["rows"]
    assert plain["runs"][0]["worst"][1] == min(r["vs_best_anchor"] for r in eager
                                               if r["contender"] == "vitkit")
    trained = t[texts[6]]
    assert trained["runs"][0]["worst"][1] == pytest.approx(1.2 - 0.15 * (len(train) - 1))
    assert trained["verdict"] == ("met" if 1.2 - 0.15 * (len(train) - 1) >= 1.1 else "short in 1 of 1 runs")
    results, _ = check_targets.check([run_files(4)])
    assert all(by_target(results)[text]["verdict"] == "not measured" for text in texts[6:])
