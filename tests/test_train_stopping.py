"""Ctrl-C (SIGINT) and SIGTERM stop a run after the step in flight, with a checkpoint there, from which
`--resume` ends bit for bit where an uninterrupted run ends; in one process and under `--nproc 2`."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from train_helpers import fake_data_overrides, synthetic_images, write_fake_fashion_mnist
from vitkit.train import TrainingStopped, get_recipe, loop, train
from vitkit.train.checkpoints import latest_checkpoint, list_checkpoints
from vitkit.train.stopping import StopRequests


def test_a_signal_asks_and_a_second_ctrl_c_stops_at_once():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with StopRequests(announce=False) as stops:
        assert not stops.requested
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs in this thread at the next bytecode
        assert stops.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # already stopping: a repeated SIGTERM changes nothing
        time.sleep(0.01)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_stop_is_announced_on_a_stderr_without_a_file_descriptor(monkeypatch):
    """A notebook's or a test's sys.stderr has no fileno(): the handler writes through it instead, and the
    stop is recorded (it used to raise io.UnsupportedOperation inside the step and lose the checkpoint)."""
    import io

    fake = io.StringIO()
    monkeypatch.setattr("sys.stderr", fake)
    with StopRequests(announce=True) as stops:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stops.signum == signal.SIGTERM
    assert "SIGTERM: stopping after this step" in fake.getvalue()


def test_outside_the_main_thread_nothing_is_installed():
    seen = []

    def run():
        with StopRequests() as stops:
            seen.append((stops.requested, signal.getsignal(signal.SIGTERM)))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [(False, signal.getsignal(signal.SIGTERM))]


def test_dataloader_workers_ignore_the_stop_signals():
    code = ("import os, signal; from vitkit.train.stopping import ignore_stop_signals; "
            "ignore_stop_signals(0); os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), "
            "signal.SIGTERM); print('alive')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "alive"


def test_stopped_run_checkpoints_its_step_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=128, n_test=32)
    cfg = get_recipe("demo-tiny", fake_data_overrides(data) + ["threads=1", "deterministic=true", "steps=12",
                                                               "batch_size=32", "ckpt_every=100", "ema=0.9",
                                                               "log_every=1"])
    ref = train(cfg, tmp_path / "ref", progress=False)

    calls = []
    real_step = loop.optimizer_step

    def signalled_step(*args, **kwargs):  # SIGTERM arrives during step 5's update (0-based 4)
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "optimizer_step", signalled_step)
    with pytest.raises(TrainingStopped) as stopped:
        train(cfg, tmp_path / "run", progress=False)
    monkeypatch.setattr(loop, "optimizer_step", real_step)
    # Seen at step 6's check, after its forward and backward: step 6 completes and is checkpointed.
    e = stopped.value
    assert (e.signum, e.step, e.total, e.exit_code) == (signal.SIGTERM, 6, 12, 143)
    assert e.checkpoint == latest_checkpoint(tmp_path / "run") and e.checkpoint.name == "step-0000006"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are given back
    assert not (tmp_path / "run" / "last").exists()

    done = train(cfg, tmp_path / "run", resume=True, progress=False)
    assert done.steps == 12
    for name in ("model/model.safetensors", "ema.safetensors", "optimizer.safetensors"):
        a = load_file(str(tmp_path / "ref" / "ckpt" / "step-0000012" / name))
        b = load_file(str(tmp_path / "run" / "ckpt" / "step-0000012" / name))
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=f"{name}: {k}")
    def rows(run):  # every column but the time and img/s
        return [r.split(",")[1:6] + r.split(",")[7:]
                for r in (run / "metrics.csv").read_text().splitlines()[1:]]

    assert rows(tmp_path / "run") == rows(ref.run_dir)
    # TensorBoard too: every step once, the one resumed from included (its events were written before the
    # stop).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for run in (ref.run_dir, tmp_path / "run"):
        events = EventAccumulator(str(run / "tb"))
        events.Reload()
        assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 13)), run


def _wait_for_training(out: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until the run has logged a training step (log_every=1)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        metrics = out / "metrics.csv"
        if metrics.is_file() and ",train," in metrics.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"no training step logged in {out}: {proc.poll()}")


def _processes_of(out: Path) -> list[str]:
    """Command lines of the processes still running with `out` in their arguments."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if str(out).encode() in args:
            found.append(" ".join(a.decode(errors="replace") for a in args))
    return found


def test_ctrl_c_on_an_image_folder_run_with_workers(tmp_path):
    """Ctrl-C reaches the terminal's whole process group, DataLoader workers too (forked with the main
    process's handler): the main process alone announces the stop, checkpoints the step in flight, exits 130
    and says how to go on."""
    # Large images, slow to decode: the main process waits for the worker's next batch most of the time, so
    # that is where the signal finds it, and a worker that ended on it would leave that batch unmade.
    images, labels = synthetic_images(32, seed=3, size=1000)
    for i, (img, c) in enumerate(zip(images, labels.tolist(), strict=True)):
        folder = tmp_path / "data" / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img[0].numpy()).save(folder / f"{i}.png", compress_level=1)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "vitkit.cli.main", "train", "demo-tiny", "--out", str(out), "--no-progress",
           *(a for s in [f"data.name={tmp_path / 'data'}", "data.val_split=", "data.workers=1",
                         "batch_size=8",
                         "steps=100000", "threads=1", "model.in_chans=1", "log_every=1", "ckpt_every=100000"]
             for a in ("--set", s))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait_for_training(out, proc)
        os.killpg(proc.pid, signal.SIGINT)  # as the terminal does
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and 0 < int(ckpt.name.split("-")[1]) < 100000
    assert f"stopped by SIGINT at step {int(ckpt.name.split('-')[1])} of 100000" in err
    # bare: the run's config.json has its --set options
    assert f"continue with: vitkit train demo-tiny --out {out} --resume\n" in err
    # said by the main process, not by its worker too
    assert err.count("SIGINT: stopping after this step") == 1
    assert "Traceback" not in err and not _processes_of(out)


def test_sigterm_to_vitkit_train_nproc_stops_every_process_at_one_checkpoint(tmp_path):
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=256, n_test=32)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "vitkit.cli.main", "train", "demo-tiny", "--nproc", "2", "--out", str(out),
           "--no-progress", *(a for s in fake_data_overrides(data) + ["device=cpu", "batch_size=32",
                                                                      "steps=100000",
                                                                      "log_every=1", "ckpt_every=100000"]
                              for a in ("--set", s))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_for_training(out, proc)
        proc.send_signal(signal.SIGTERM)  # the launcher alone, as `kill` or a scheduler would
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    found = list_checkpoints(out)
    # written once, by the main process
    assert len(found) == 1 and 0 < int(found[0].name.split("-")[1]) < 100000
    assert err.count("stopped by SIGTERM") == 1 and "--nproc 2" in err
    assert "Traceback" not in err and "closing signal" not in err
    time.sleep(0.5)
    assert not _processes_of(out)
