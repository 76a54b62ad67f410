"""Two machines, played by two torchrun launches on 127.0.0.1 that meet through the c10d rendezvous, one
process each: a worker killed mid-run is restarted by torchrun (--max-restarts) and the run goes on from its
newest checkpoint, ending where a single process ends (the command of docs/distributed.md)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train_helpers import fake_data_overrides, free_port, write_fake_fashion_mnist
from vitkit.train import get_recipe, train
from vitkit.train.checkpoints import LOCK_NAME, list_checkpoints, step_of
from vitkit.train.metrics_log import MetricsLog

# SGD, no augmentation or drop-path, the plain model (no CPU kernels to build in each process): two processes
# then differ from one only by float summation order (see test_train_distributed.py).
STEPS = 24
SETTINGS = ["device=cpu", "threads=1", "fast=false", "augment.crop=none", "augment.hflip=0",
            "model.drop_path=0", "optim.name=sgd", "optim.lr=0.05", "batch_size=32", f"steps={STEPS}",
            "ckpt_every=2", f"eval_every={STEPS}"]


def node_command(port: int, out: Path, settings: list[str]) -> list[str]:
    """One machine's launch, the same on every machine: torchrun joins the rendezvous at 127.0.0.1:PORT,
    which assigns the node ranks; --resume makes a restarted worker group go on from the newest checkpoint
    (on an empty --out it starts the run)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "multinode-test",
            "--max-restarts", "1", "-m", "vitkit.cli.main", "train", "demo-tiny", "--out", str(out),
            "--resume", "--no-progress", *(a for s in settings for a in ("--set", s))]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers live in sessions of their own, out of its group's
    reach)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow  # four processes start on two cores: about 25 s
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the processes")
def test_two_nodes_restart_a_killed_worker_and_resume(tmp_path):
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=256, n_test=64)
    settings = SETTINGS + fake_data_overrides(data)
    one = train(get_recipe("demo-tiny", settings), tmp_path / "one", progress=False)

    out, port = tmp_path / "two", free_port()
    # As docs/distributed.md says: without this, torchrun's restarted workers may read the addresses of the
    # workers they replace from the store torchrun keeps across restarts, and fail to connect.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [subprocess.Popen(node_command(port, out, settings), env=env, stdout=log.open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True) for log in logs]
    try:
        deadline = time.monotonic() + 120
        while not list_checkpoints(out) and time.monotonic() < deadline:
            assert all(n.poll() is None for n in nodes), [log.read_text()[-2000:] for log in logs]
            time.sleep(0.01)
        assert list_checkpoints(out), "no checkpoint within 120 s"
        main_worker = int((out / LOCK_NAME).read_text())  # the rank-0 process holds the run folder
        os.kill(main_worker, signal.SIGKILL)
        killed_after = step_of(list_checkpoints(out)[-1])
        for node in nodes:
            node.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        kill_all([n for n in nodes if n.poll() is None])
    text = "".join(log.read_text() for log in logs)
    assert [n.returncode for n in nodes] == [0, 0], text[-4000:]
    assert "warning: torchrun --max-restarts" not in text  # each worker group has a store of its own

    # torchrun started both workers again, and they went on from the newest checkpoint before the kill
    resumed = [line for line in text.splitlines() if line.startswith(f"resuming {out} from step-")]
    assert len(resumed) == 1, text[-4000:]
    resumed_at = int(resumed[0].split("step-")[1].split()[0])
    assert 2 <= killed_after <= resumed_at < STEPS
    summary = json.loads((out / "result.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == STEPS

    # the logged steps continue from the checkpoint: each logged once, in order, up to the last
    logged = [int(r["step"]) for r in MetricsLog.read_rows(out / "metrics.csv") if r["split"] == "train"]
    expected = [int(r["step"]) for r in MetricsLog.read_rows(tmp_path / "one" / "metrics.csv")
                if r["split"] == "train"]
    assert logged == expected and logged[-1] == STEPS

    a = load_file(str(one.last_dir / "model.safetensors"))
    b = load_file(str(out / "last" / "model.safetensors"))
    assert a.keys() == b.keys() and a["head.weight"].abs().sum() > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def test_restarts_through_the_shared_store_are_warned_of():
    """torchrun's own environment for its workers: a warning only when it may restart them through the store
    they share with it."""
    from vitkit.train.distributed import shared_store_warning

    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared_store_warning(shared)
    assert "--max-restarts 3" in shared_store_warning(shared)
    assert shared_store_warning({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert shared_store_warning({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert shared_store_warning({}) is None


def test_a_stopped_run_of_several_machines_says_to_launch_them_again():
    """`vitkit train --nproc 4` would start all four processes on one machine: a run of two machines of two
    processes each is continued by each machine's torchrun command."""
    from vitkit.cli.train import continue_hint

    out = Path("runs/x")
    one = continue_hint("demo", out, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert one == "vitkit train demo --out runs/x --resume --nproc 2"  # the run's config.json has the rest
    assert continue_hint("demo", out, {}) == "vitkit train demo --out runs/x --resume"
    several = continue_hint("demo", out, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert several.startswith("the same torchrun command on every machine, with --resume")
