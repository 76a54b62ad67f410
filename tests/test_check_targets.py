"""benchmarks/check_targets.py reads issue 6's targets off recorded benchmark files (docs/speed-runs) and agrees
with what the files say when read directly; benchmarks/target_runs.sh runs the whole measurement and ends in it."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "speed-runs"

spec = importlib.util.spec_from_file_location("check_targets", ROOT / "benchmarks" / "check_targets.py")
check_targets = importlib.util.module_from_spec(spec)
sys.modules["check_targets"] = check_targets
spec.loader.exec_module(check_targets)


def run_files(session: str, run: int) -> str:
    return ",".join(str(RUNS / f"{session}_{kind}{run}{suffix}.json")
                    for kind, suffix in (("run", "_b1"), ("run", "_b16"), ("train", "")))


def rows(session: str, run: int) -> list[dict]:
    return [r for b in ("b1", "b16") for r in json.loads((RUNS / f"{session}_run{run}_{b}.json").read_text())["rows"]]


def by_target(results: list[dict]) -> dict[str, dict]:
    return {r["target"]: r for r in results}


def test_session_12_runs_read_as_the_targets_table_says():
    """Runs 26-28 (the AMD EPYC with VNNI): optimize(fp32) at batch 1 short in two runs, training in one, the
    rest met; each run's weakest cell is the minimum of the files' own figures."""
    results, runs = check_targets.check([run_files("s12", i) for i in (26, 27, 28)])
    t = by_target(results)
    plain, fp32, mfu, int8, agreement, training = (t[x.text] for x in check_targets.TARGETS)
    assert plain["verdict"] == "met" and mfu["verdict"] == "met" and int8["verdict"] == "met"
    assert fp32["verdict"] == "short in 2 of 3 runs"
    assert training["verdict"] == "short in 1 of 3 runs"
    assert agreement["verdict"] == "not measured"
    for res, i in zip(fp32["runs"], (26, 27, 28), strict=True):
        direct = min(r["vs_best_anchor"] for r in rows("s12", i)
                     if r["contender"] == "vitkit-fp32-opt" and r["batch"] == 1)
        assert res["worst"][1] == direct
    for res, i in zip(int8["runs"], (26, 27, 28), strict=True):
        assert res["worst"][1] == min(r["vs_best_anchor"] for r in rows("s12", i) if r["contender"] == "vitkit-int8")
    for res, i in zip(training["runs"], (26, 27, 28), strict=True):
        direct = json.loads((RUNS / f"s12_train{i}.json").read_text())
        assert res["worst"][1] == min(c["ratio_vitkit_over_timm"] for c in direct)
    assert [r["met"] for r in training["runs"]] == [True, True, False]  # 1.118, 1.106, 1.089
    assert "AMD EPYC" in check_targets.machine_line(runs)
    assert check_targets.main(["--run", run_files("s12", 26)]) == 1


def test_a_run_where_every_target_held_exits_0(tmp_path, capsys):
    """Session 11's run 19 met every line; the table and JSON are written."""
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    assert check_targets.main(["--run", run_files("s11", 19), "--markdown", str(md), "--json", str(js)]) == 0
    printed = capsys.readouterr().out
    assert md.read_text() == printed and "**" not in printed.split("\n\n")[1]
    report = json.loads(js.read_text())
    assert {t["verdict"] for t in report["targets"]} == {"met", "not measured"}


def test_without_vnni_int8_is_not_compared_and_agreement_is_read():
    """Session 14's machine has no VNNI: the int8 line says so instead of a shortfall; the demo model's
    agreement file counts as a run's figure (99.42 % >= 99 %)."""
    agreement = RUNS / "s14_agreement_demo.json"
    results, runs = check_targets.check([run_files("s14", 1) + f",{agreement}", run_files("s14", 2)])
    t = by_target(results)
    int8 = t[check_targets.TARGETS[3].text]
    assert int8["verdict"] == "not comparable: no VNNI on this machine"
    agree = t[check_targets.TARGETS[4].text]
    assert agree["verdict"] == "met"
    assert agree["runs"][0]["worst"][1] == pytest.approx(0.9942, abs=1e-6) and agree["runs"][1]["worst"] is None
    assert "VNNI no" in check_targets.machine_line(runs)
    table = check_targets.markdown(results, runs)
    assert "99.4 %" in table and "| - |" in table


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
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "target_runs.sh"), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHON": sys.executable, **env})


def test_target_runs_script_refuses_bad_settings(tmp_path):
    bad = script({"RUNS": "three"}, str(tmp_path / "out"))
    assert bad.returncode == 2 and "RUNS must be a positive whole number, got 'three'" in bad.stderr
    ckpt = tmp_path / "no-such-checkpoint"
    bad = script({"AGREEMENT_CHECKPOINT": str(ckpt)}, str(tmp_path / "out"))
    assert bad.returncode == 2 and str(ckpt) in bad.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_target_runs_script_end_to_end_on_a_tiny_setting(tmp_path):
    """One run of the real commands at the smallest setting (ViT-Ti/32, one round, the demo recipe's step):
    every file written, and the exit status is the checker's verdict on them."""
    out = tmp_path / "targets"
    env = {"RUNS": "1", "MODELS": "ViT-Ti/32", "B1_REPEATS": "1", "B16_REPEATS": "1",
           "TRAIN_ARGS": "--only recipes --recipe demo --repeats 1 --warmup 0"}
    done = script(env, str(out), timeout=600)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    names = {p.name for p in out.iterdir()}
    assert names == {"run1_b1.json", "run1_b16.json", "train1.json", "targets.md", "targets.json"}
    report = json.loads((out / "targets.json").read_text())
    cells = {t["target"]: t["runs"][0]["cells"] for t in report["targets"]}
    assert set(cells[check_targets.TARGETS[0].text]) == {"ViT-Ti/32 b1", "ViT-Ti/32 b16"}
    assert set(cells[check_targets.TARGETS[5].text]) == {"recipe demo b128"}
    assert (0 if check_targets.all_met(report["targets"]) else 1) == done.returncode
    assert "issue 6's targets over 1 run(s)" in done.stdout and (out / "targets.md").read_text() in done.stdout
