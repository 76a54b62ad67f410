"""A run killed with SIGKILL mid-training and resumed ends with the same weights as an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file

from train_helpers import fake_data_overrides, write_fake_fashion_mnist
from vitkit.train import get_recipe, train
from vitkit.train.checkpoints import list_checkpoints

# fashion-mnist-tiny with every kind of state and every random draw: AdamW moments, the EMA, PatchDropout,
# drop-path, dropout, the augmentation, random erasing, MixUp and CutMix.
STEPS = 60


def overrides(data):
    return fake_data_overrides(data) + ["deterministic=true", "threads=1", f"steps={STEPS}", "ckpt_every=5",
                                        "eval_every=30", "keep_last=3", "model.drop_path=0.1",
                                        "model.dropout=0.1", "augment.random_erasing=0.25",
                                        "augment.mixup=0.8", "augment.cutmix=1.0", "ema=0.9"]


def command(data, out, *extra):
    sets = [a for o in overrides(data) for a in ("--set", o)]
    return [sys.executable, "-m", "vitkit.cli.main", "train", "fashion-mnist-tiny", "--out", str(out),
            "--no-progress", *sets, *extra]


def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=256, n_test=64)
    # uninterrupted
    train(get_recipe("fashion-mnist-tiny", overrides(data)), tmp_path / "ref", progress=False)

    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command(data, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not list_checkpoints(out) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, \
        f"the run ended before it could be killed: {err.decode()[-2000:]}"
    done = list_checkpoints(out)
    assert done and int(done[-1].name.split("-")[1]) < STEPS

    resumed = subprocess.run(command(data, out, "--resume"), env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stdout + resumed.stderr
    final = list_checkpoints(out)[-1]
    assert final.name == f"step-{STEPS:07d}"
    for name in ("model/model.safetensors", "ema.safetensors", "optimizer.safetensors"):
        a = load_file(str(tmp_path / "ref" / "ckpt" / final.name / name))
        b = load_file(str(final / name))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=f"{name}: {k}")


def test_resume_of_a_finished_run_and_of_a_different_config(tmp_path):
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=128, n_test=32)
    cfg = get_recipe("demo-tiny", fake_data_overrides(data) + ["threads=1", "steps=4"])
    train(cfg, tmp_path / "run", progress=False)
    before = (tmp_path / "run" / "result.json").read_text()
    again = train(cfg, tmp_path / "run", resume=True, progress=False)  # a finished run: nothing to do
    assert again.steps == 4 and (tmp_path / "run" / "result.json").read_text() == before
    changed = get_recipe("demo-tiny", fake_data_overrides(data) + ["threads=1", "steps=4",
                                                                   "optim.weight_decay=0.3"])
    import pytest

    with pytest.raises(ValueError, match=r"config differs .*: optim.weight_decay=0.3 \(the run has 0.05\)"):
        train(changed, tmp_path / "run", resume=True, progress=False)
    # A lower learning rate and clipping are what a diverged run needs to go on (the message says so).
    calmer = get_recipe("demo-tiny", fake_data_overrides(data) + ["threads=1", "steps=4", "optim.lr=1e-4",
                                                                  "optim.clip_grad_norm=0.5"])
    assert train(calmer, tmp_path / "run", resume=True, progress=False).steps == 4


def test_resuming_a_run_killed_before_its_final_outputs_writes_them(tmp_path):
    """Killed after its final checkpoint but before last/, confusion.png and result.json: `--resume` evaluates
    the final weights and writes what is missing, and names only paths that exist."""
    import json

    import vitkit

    data = write_fake_fashion_mnist(tmp_path / "data", n_train=128, n_test=32)
    sets = fake_data_overrides(data) + ["threads=1", "steps=4"]
    run = tmp_path / "run"
    first = train(get_recipe("demo-tiny", sets), run, progress=False)
    before = json.loads((run / "result.json").read_text())
    for name in ("result.json", "confusion.png"):
        (run / name).unlink()
    import shutil

    shutil.rmtree(run / "last")
    cli = [sys.executable, "-m", "vitkit.cli.main", "train", "demo-tiny", "--out", str(run), "--resume",
           "--no-progress", *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("already complete (4 of 4 steps); writing its missing last, result.json, confusion.png"
            in done.stdout)
    assert (f"test top-1 {100 * first.test.top1:.2f} %" in done.stdout
            and f"last model: {run / 'last'}" in done.stdout)
    after = json.loads((run / "result.json").read_text())
    assert {k: after[k] for k in ("steps", "top1", "top5", "loss", "count")} == \
        {k: before[k] for k in ("steps", "top1", "top5", "loss", "count")}
    assert (run / "confusion.png").stat().st_size > 0
    assert vitkit.load(run / "last").class_names == vitkit.load(first.last_dir).class_names
    torch.testing.assert_close(load_file(str(run / "last" / "model.safetensors")),
                               load_file(str(list_checkpoints(run)[-1] / "model" / "model.safetensors")))


def test_a_second_run_into_a_folder_in_use_is_refused_and_a_killed_run_holds_nothing(tmp_path):
    """A job started twice into one --out would interleave two runs' checkpoints and logs: the second is
    refused while the first holds the folder; the lock goes with the process that held it, however it ends."""
    import pytest

    from vitkit.train.checkpoints import RunFolderBusy, RunFolderLock

    data = write_fake_fashion_mnist(tmp_path / "data", n_train=128, n_test=32)
    cfg = get_recipe("demo-tiny", fake_data_overrides(data) + ["threads=1", "steps=2"])
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom vitkit.train.checkpoints import "
                               "RunFolderLock\nwith RunFolderLock(sys.argv[1]):\n    print('held', "
                               "flush=True)\n    time.sleep(600)\n", str(out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy, match=rf"{out} is in use by another run \(process {holder.pid}\)"):
            train(cfg, out, progress=False)
        assert not (out / "config.json").exists()
    finally:
        holder.kill()
        holder.wait()
    assert train(cfg, out, progress=False).steps == 2  # killed: the lock went with it
    with RunFolderLock(out), pytest.raises(RunFolderBusy):  # and a run holds it while it writes
        train(cfg, out, resume=True, progress=False)


def test_resume_tidies_what_a_kill_between_two_renames_left(tmp_path):
    """save_model_atomically moves the old best/ aside, then the new one in: killed between the two, best/ is
    missing. The next run in the folder puts the old one back and removes every unfinished write."""
    import shutil

    data = write_fake_fashion_mnist(tmp_path / "data", n_train=128, n_test=32)
    cfg = get_recipe("demo-tiny", fake_data_overrides(data) + ["threads=1", "steps=4"])
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    best = (run / "best" / "model.safetensors").read_bytes()
    (run / "best").rename(run / ".old-best-4242")
    shutil.copytree(run / "last", run / ".tmp-best-x1y2")
    (run / "ckpt" / ".tmp-step-0000004-abc").mkdir()
    train(cfg, run, resume=True, progress=False)  # a finished run: only the tidying is left to do
    assert (run / "best" / "model.safetensors").read_bytes() == best
    assert sorted(p.name for p in run.iterdir() if p.name.startswith((".tmp", ".old"))) == []
    assert not list((run / "ckpt").glob(".tmp-*"))


def test_a_damaged_run_folder_is_refused_with_what_to_do(tmp_path):
    """An unreadable newest checkpoint, one without the EMA the run keeps, a config.json gone or cut short:
    each refused with one line naming the file, and (for a checkpoint) the folder to delete to resume from the
    one before it, which then resumes."""
    import shutil

    import pytest

    data = write_fake_fashion_mnist(tmp_path / "data", n_train=128, n_test=32)
    cfg = get_recipe("demo-tiny", fake_data_overrides(data) + ["threads=1", "steps=4", "ckpt_every=2",
                                                                "keep_last=3", "ema=0.9"])
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    first, newest = list_checkpoints(run)
    config = (run / "config.json").read_text()

    (run / "config.json").unlink()
    with pytest.raises(ValueError, match=rf"--resume: {run / 'config.json'} is missing"):
        train(cfg, run, resume=True, progress=False)
    (run / "config.json").write_text(config[: len(config) // 2])  # cut short
    with pytest.raises(ValueError, match=rf"--resume: {run / 'config.json'} is unreadable"):
        train(cfg, run, resume=True, progress=False)
    (run / "config.json").write_text(config)

    ema = (newest / "ema.safetensors").read_bytes()
    (newest / "ema.safetensors").unlink()
    with pytest.raises(ValueError, match=rf"{newest}: no ema.safetensors.*delete {newest} to resume from "
                                         rf"{first.name}, the checkpoint before it"):
        train(cfg, run, resume=True, progress=False)
    (newest / "ema.safetensors").write_bytes(ema)

    optimizer = newest / "optimizer.safetensors"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    with pytest.raises(ValueError,
                       match=rf"{optimizer}: unreadable .*delete {newest} to resume from {first.name}"):
        train(cfg, run, resume=True, progress=False)
    shutil.rmtree(newest)  # as the message says: the run goes on from the checkpoint before it
    assert train(cfg, run, resume=True, progress=False).steps == 4
    assert [p.name for p in list_checkpoints(run)] == [first.name, newest.name]


def test_metrics_of_a_killed_run_keep_their_complete_rows_only(tmp_path):
    """A kill in the middle of a metrics row leaves a line cut short at the end of metrics.csv: the resumed
    run drops it with the rows after its checkpoint, and keeps every complete row up to it."""
    import csv

    from vitkit.train.metrics_log import MetricsLog

    path = tmp_path / "metrics.csv"
    log = MetricsLog(tmp_path, True, 0)
    for step in (1, 2, 3):
        log.write(step, step / 10, "train", loss=1.0 / step, lr=1e-3)
    log.close()
    with path.open("a") as f:
        f.write("1700000000.0,4,0.4,tra")  # killed mid-row
    MetricsLog(tmp_path, True, 2).close()
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2"] and rows[1]["loss"] == "0.5"
    with path.open("a") as f:
        f.write("garbage,not-a-step\n")
    MetricsLog(tmp_path, True, 2).close()
    assert [r["step"] for r in MetricsLog.read_rows(path)] == ["1", "2"]


def test_a_bare_resume_goes_on_with_the_runs_own_config(tmp_path, capsys):
    """`vitkit train RECIPE --out D --resume` continues the run config.json describes, --set options and all;
    the same --set again is accepted, one that changes a value is refused naming it and both values, and so
    is another recipe."""
    import json
    import shutil

    import pytest
    from typer.testing import CliRunner

    from vitkit.cli.main import app

    data = write_fake_fashion_mnist(tmp_path / "data", n_train=128, n_test=32)
    sets = fake_data_overrides(data) + ["threads=1", "steps=4", "ckpt_every=2", "batch_size=32", "seed=3",
                                        "optim.lr=0.003", "model.depth=1"]
    args = ["train", "demo-tiny", "--no-progress", *(a for s in sets for a in ("--set", s))]
    runner = CliRunner()
    assert runner.invoke(app, args + ["--out", str(tmp_path / "ref")]).exit_code == 0
    # the run as a stop after step 2's checkpoint leaves it
    run = tmp_path / "run"
    shutil.copytree(tmp_path / "ref", run)
    shutil.rmtree(list_checkpoints(run)[-1])
    for name in ("last", "best", "result.json", "confusion.png"):
        path = run / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    assert list_checkpoints(run)[-1].name == "step-0000002"

    bare = runner.invoke(app, ["train", "demo-tiny", "--out", str(run), "--resume", "--no-progress"])
    assert bare.exit_code == 0, bare.output
    saved = json.loads((run / "config.json").read_text())
    assert saved["seed"] == 3 and saved["model"]["depth"] == 1 and saved["optim"]["lr"] == 0.003
    a = load_file(str(tmp_path / "ref" / "last" / "model.safetensors"))
    b = load_file(str(run / "last" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)

    same = runner.invoke(app, ["train", "demo-tiny", "--out", str(run), "--resume", "--no-progress", "--set",
                               "seed=3", "--set", "model.depth=1"])
    assert same.exit_code == 0, same.output  # already complete: nothing changes
    from vitkit.cli.main import main

    for argv, said in ((["demo-tiny", "--resume", "--set", "seed=4"], "seed=4 (the run has 3)"),
                       (["demo", "--resume"], "holds a run of the demo-tiny recipe, not demo")):
        with pytest.raises(SystemExit) as e:
            main(["train", argv[0], "--out", str(run), *argv[1:]])
        err = capsys.readouterr().err
        assert e.value.code != 0 and said in err and err.count("error:") == 1 and "Traceback" not in err
