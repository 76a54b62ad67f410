"""Training on tar shards: the epoch's plan visits every sample once over processes and DataLoader workers, a
batch is the same whichever worker makes it and from whichever step the epoch starts, and a run of two
processes killed with SIGKILL mid-epoch and resumed trains on every sample of that epoch exactly once."""

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from train_helpers import synthetic_dataset
from vitkit.data.shard_writer import parse_size, shard_pattern, write_shards
from vitkit.data.shards import open_shards
from vitkit.train import get_recipe
from vitkit.train.batches import make_plan, steps_per_epoch
from vitkit.train.checkpoints import list_checkpoints
from vitkit.train.shard_batches import KEY_LOG_ENV, ShardBatches, process_samples, worker_micro_batches

COUNTS = [37, 50, 13, 44, 29]


def epoch_samples(counts, seed, epoch, world, micro, accum, workers):
    """Every (shard, position) the epoch trains on, over all processes and workers, as a list."""
    batch = world * micro * accum
    steps = steps_per_epoch(sum(counts), batch)
    seen = []
    for rank in range(world):
        plan = make_plan(batch, micro, world, rank)
        shards, positions = process_samples(counts, seed, epoch, plan, steps)
        assert len(shards) == steps * plan.per_rank
        for w in range(workers):
            for i in worker_micro_batches(0, steps * accum, w, workers):
                seen += list(zip(shards[i * micro:(i + 1) * micro].tolist(),
                                 positions[i * micro:(i + 1) * micro].tolist(), strict=True))
    return seen


@pytest.mark.parametrize(("world", "micro", "accum", "workers"),
                         [(1, 8, 1, 1), (2, 4, 2, 3), (3, 5, 1, 2), (4, 3, 3, 4)])
def test_every_sample_of_an_epoch_is_visited_once(world, micro, accum, workers):
    seen = epoch_samples(COUNTS, 0, 0, world, micro, accum, workers)
    batch = world * micro * accum
    assert len(seen) == len(set(seen)) == sum(COUNTS) // batch * batch  # only the tail is dropped
    assert all(0 <= j < COUNTS[k] for k, j in seen)


def test_the_order_is_a_function_of_seed_and_epoch():
    def order(seed, epoch):
        return epoch_samples(COUNTS, seed, epoch, 2, 4, 1, 1)

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1) and order(0, 0) != order(1, 0)
    # a shorter last epoch (steps= ending mid-epoch) takes the start of the same sequence
    plan = make_plan(8, 4, 2, 1)
    full, short = process_samples(COUNTS, 0, 0, plan, 21), process_samples(COUNTS, 0, 0, plan, 5)
    assert torch.equal(full[0][:20], short[0]) and torch.equal(full[1][:20], short[1])


def shards_of(tmp_path: Path, n: int = 96) -> str:
    index = write_shards(synthetic_dataset(n, seed=5), tmp_path / "shards", parse_size("6KB"), progress=False)
    assert len(index["shards"]) >= 3
    return shard_pattern(index, tmp_path / "shards")


def test_a_resumed_epoch_makes_the_same_batches_with_any_number_of_workers(tmp_path):
    cfg = get_recipe("demo-tiny", ["augment.random_erasing=0.5"])
    source = ShardBatches(open_shards(shards_of(tmp_path)), cfg.model, cfg.augment, 10, seed=3, workers=0)
    plan = make_plan(16, 8, 1, 0)
    whole = {step: batches for step, batches in source.epoch(1, plan, 0, 6)}
    source.workers = 2
    resumed = dict(source.epoch(1, plan, 4, 6))
    assert sorted(resumed) == [4, 5]
    for step, batches in resumed.items():
        for (x, y, s), (x0, y0, s0) in zip(batches, whole[step], strict=True):
            assert torch.equal(x, x0) and torch.equal(y, y0) and torch.equal(s, s0)
    assert not torch.equal(whole[4][0][0], whole[5][0][0])


def logged_keys(folder: Path) -> list[tuple[int, int, str]]:
    """(epoch, step, key) of every line the processes logged under `folder`."""
    rows = []
    for path in sorted(folder.glob("keys-rank-*.tsv")):
        for line in path.read_text().splitlines():
            epoch, step, key = line.split("\t")
            rows.append((int(epoch), int(step), key))
    return rows


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kill goes through torchrun on Linux")
def test_two_processes_killed_mid_epoch_and_resumed_see_each_sample_once(tmp_path):
    pattern = shards_of(tmp_path, n=200)
    per_epoch = 200 // 16
    sets = ["device=cpu", "threads=1", f"data.name=shards:{pattern}", "data.val_split=", "data.limit=0",
            "batch_size=16", "micro_batch=4", f"steps={per_epoch + 1}", "ckpt_every=2", "log_every=100"]

    def command(workers, *extra):
        args = [a for o in sets + [f"data.workers={workers}"] for a in ("--set", o)]
        return [sys.executable, "-m", "vitkit.cli.main", "train", "demo-tiny", "--nproc", "2", "--out",
                str(tmp_path / "run"), "--no-progress", *args, *extra]

    env = {**os.environ, "PYTHONUNBUFFERED": "1", KEY_LOG_ENV: str(tmp_path / "keys-killed")}
    proc = subprocess.Popen(command(2), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not list_checkpoints(tmp_path / "run") and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed: {err.decode()[-2000:]}"
    time.sleep(1)  # torchrun and its workers end with it
    start = int(list_checkpoints(tmp_path / "run")[-1].name.split("-")[1])
    assert 0 < start < per_epoch, "the kill came after the first epoch"

    env[KEY_LOG_ENV] = str(tmp_path / "keys-resumed")
    resumed = subprocess.run(command(1, "--resume"), env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    before = [(e, s, k) for e, s, k in logged_keys(tmp_path / "keys-killed") if e == 0 and s < start]
    after = [(e, s, k) for e, s, k in logged_keys(tmp_path / "keys-resumed") if e == 0]
    assert {s for _, s, _ in before} == set(range(start)) and {s for _, s, _ in after} == set(
        range(start, per_epoch))
    counts = Counter(k for _, _, k in before + after)
    assert len(counts) == per_epoch * 16 and max(counts.values()) == 1  # none twice, none skipped
    assert {e for e, _, _ in logged_keys(tmp_path / "keys-resumed")} == {0, 1}
