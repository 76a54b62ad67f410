"""Two CPU processes (DDP over gloo) with the same global batch compute the same run as one process; with
GPUs, each process needs its own."""

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from train_helpers import as_process, fake_data_overrides, free_port, write_fake_fashion_mnist
from vitkit.train import get_recipe, train
from vitkit.train.distributed import pick_device

# SGD, no augmentation or drop-path: the two runs then differ only by float summation order (with Adam the
# key bias, whose gradient is float noise around 0, would be amplified to full-size steps).
COMMON = ["device=cpu", "augment.crop=none", "augment.hflip=0", "model.drop_path=0", "threads=1",
          "optim.name=sgd", "optim.lr=0.05", "batch_size=32", "steps=4", "eval_every=2", "ckpt_every=4"]


def _worker(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    as_process(rank, world, port)
    train(get_recipe("demo-tiny", overrides), out, progress=False)


def test_two_processes_equal_one(tmp_path):
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=256, n_test=64)
    overrides = COMMON + fake_data_overrides(data)
    one = train(get_recipe("demo-tiny", overrides), tmp_path / "one", progress=False)
    # Two processes, each with 16 of the 32 images, as 2 micro-batches of 8 (accumulation under DDP too).
    mp.spawn(_worker, args=(2, free_port(), overrides + ["micro_batch=8"], str(tmp_path / "two")), nprocs=2,
             join=True)
    a = load_file(str(one.last_dir / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "last" / "model.safetensors"))
    assert a["head.weight"].abs().sum() > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    # Evaluation is split between the processes and summed: the same metrics.
    ra = json.loads((tmp_path / "one" / "result.json").read_text())
    rb = json.loads((tmp_path / "two" / "result.json").read_text())
    assert ra["count"] == rb["count"] == 64 and rb["processes"] == 2
    assert abs(ra["top1"] - rb["top1"]) < 1e-9 and abs(ra["loss"] - rb["loss"]) < 1e-4
    # The training loss logged is the mean over the processes (it was the main process's, of its 16 images).
    from vitkit.train.metrics_log import MetricsLog

    def train_losses(run):
        return [float(r["loss"]) for r in MetricsLog.read_rows(run / "metrics.csv") if r["split"] == "train"]

    la, lb = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert la and len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert abs(x - y) <= 1e-4 * max(1.0, abs(x)), (la, lb)


def _slow_main_writer(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    """A worker whose main process takes a while over the end-of-run outputs; every process then checks
    that the run folder is complete when train() returns."""
    from vitkit.train import loop

    if rank == 0:
        write = loop.write_final_outputs

        def slow(*args, **kwargs):
            time.sleep(2.0)
            write(*args, **kwargs)

        loop.write_final_outputs = slow
    _worker(rank, world, port, overrides, out)
    assert (Path(out) / "last" / "model.safetensors").is_file(), f"process {rank}: no last model yet"
    assert (Path(out) / "result.json").is_file(), f"process {rank}: no result.json yet"


def test_every_process_returns_with_the_run_folder_complete(tmp_path):
    """A script that trains on every process and then reads the run (fine-tunes from its `last`, say) finds
    it written, on the processes that did not write it too."""
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=64, n_test=32)
    overrides = COMMON + fake_data_overrides(data) + ["steps=2", "eval_every=2", "ckpt_every=2"]
    mp.spawn(_slow_main_writer, args=(2, free_port(), overrides, str(tmp_path / "run")), nprocs=2, join=True)


def test_the_unreadable_files_every_process_skipped_are_listed(tmp_path):
    """Two processes evaluate a folder with a bad file at each end, one in each process's share: result.json
    lists both (it used to list the main process's only, while counting both)."""
    from PIL import Image

    for split in ("train", "test"):
        for c, name in enumerate(("a", "b")):
            folder = tmp_path / "data" / split / name
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("L", (28, 28), 60 + 120 * c + i).save(folder / f"m{i}.png")
    (tmp_path / "data" / "test" / "a" / "a-first.png").write_bytes(b"")
    (tmp_path / "data" / "test" / "b" / "z-last.png").write_bytes(b"not a png")
    overrides = ["device=cpu", "threads=1", "steps=1", "batch_size=4", f"data.name={tmp_path / 'data'}",
                 "data.skip_bad_images=true", "data.limit=0", "data.val_limit=0", "model.in_chans=1",
                 "data.val_split=test"]
    mp.spawn(_worker, args=(2, free_port(), overrides, str(tmp_path / "run")), nprocs=2, join=True)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["skipped"] == 2 and result["count"] == 8
    assert sorted(Path(p).name for p in result["skipped_images"]) == ["a-first.png", "z-last.png"]


def test_vitkit_train_nproc_starts_torchrun(tmp_path):
    """`vitkit train --nproc 2` runs the recipe as two DDP processes; a failing run gives a failing exit
    code."""
    from typer.testing import CliRunner

    from vitkit.cli.main import app

    data = write_fake_fashion_mnist(tmp_path / "data", n_train=128, n_test=32)
    args = ["train", "demo-tiny", "--nproc", "2", "--out", str(tmp_path / "run"), "--no-progress",
            *(a for o in ["device=cpu", "steps=2", "batch_size=32"] + fake_data_overrides(data)
              for a in ("--set", o))]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / "result.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 2 and summary["count"] == 32
    # the folder holds a run and --resume is not given: the processes fail
    again = CliRunner().invoke(app, args)
    assert again.exit_code != 0


def one_gpu(monkeypatch):
    """Make torch see one CUDA device (nothing runs on it: pick_device only counts devices)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_each_process_needs_its_own_gpu(monkeypatch):
    one_gpu(monkeypatch)
    assert pick_device("auto", 0) == torch.device("cuda", 0) == pick_device("cuda", 0)
    assert pick_device("cpu", 1) == torch.device("cpu")
    for name in ("auto", "cuda"):
        # found on a 1-GPU machine: two processes failed with "invalid device ordinal"
        with pytest.raises(ValueError, match=r"LOCAL_RANK=1 needs GPU cuda:1, but this machine has 1"):
            pick_device(name, 1)


def test_vitkit_train_nproc_refuses_more_processes_than_gpus(monkeypatch, tmp_path, capsys):
    """The error comes before torchrun starts any process, and says what to do."""
    from vitkit.cli.main import main

    one_gpu(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "demo-tiny", "--nproc", "2", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "this machine has 1" in err and "--set device=cpu" in err
    assert not (tmp_path / "run").exists()


def _state(pid: int) -> str | None:
    """The /proc state letter of `pid` (Z: ended, waiting to be reaped), or None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    return next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_worker_ends_when_its_parent_is_killed():
    # torchrun's workers live in sessions of their own: without this they would train on after a SIGKILL.
    code = ("import time; from vitkit.train.distributed import end_with_parent; "
            "print(end_with_parent(), flush=True); time.sleep(120)")
    parent = subprocess.Popen(["bash", "-c", f'"{sys.executable}" -c "{code}" & echo $!; wait'],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "True"
    assert _state(child) in ("S", "R")
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _state(child) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(child) in (None, "Z")


def test_nproc_refuses_a_batch_the_processes_cannot_share_before_starting_them(tmp_path, capsys):
    from vitkit.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["train", "demo-tiny", "--out", str(tmp_path / "run"), "--nproc", "2", "--set", "batch_size=33"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("error:") == 1
    assert ("batch_size=33 must be a multiple of the number of processes (2)\n" in err
            and "Traceback" not in err)
    assert not (tmp_path / "run").exists()


def _worker_with_its_own_folder(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    as_process(rank, world, port)
    train(get_recipe("demo-tiny", overrides), f"{out}-{rank}", progress=False)


def test_processes_that_see_different_run_folders_are_refused_together(tmp_path):
    """Two machines whose --out is not on a shared filesystem would each start from what their own disk holds
    (a resume from step 4 on one, from 0 on the other): every process stops with the reason instead."""
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=256, n_test=64)
    with pytest.raises(Exception,
                       match="--out must be a folder on a filesystem that every machine of the run"):
        mp.spawn(_worker_with_its_own_folder, args=(2, free_port(), COMMON + fake_data_overrides(data),
                                                    str(tmp_path / "run")), nprocs=2, join=True)


class _GradWithStrides(torch.autograd.Function):
    """The identity, whose gradient comes back with the given strides."""

    @staticmethod
    def forward(ctx, w, strides):
        ctx.strides = strides
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.empty_strided(g.shape, ctx.strides).copy_(g), None


def _stride_warnings_worker(_, folder: Path, quiet: bool, shape: tuple, grad_strides: tuple) -> None:
    """In a process of its own (DDP warns once per process): the stride warnings DDP gives on one backward of
    a parameter of `shape` whose gradient comes back with `grad_strides`, inside
    `quiet_same_layout_stride_warnings` or not, written to FOLDER/warnings.json."""
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from vitkit.train.one_step import quiet_same_layout_stride_warnings

    class Projection(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(shape))

        def forward(self, x):
            return (x * _GradWithStrides.apply(self.weight, grad_strides)).sum()

    dist.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=0, world_size=1)
    try:
        model = Projection()
        net = DistributedDataParallel(model)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with quiet_same_layout_stride_warnings(model) if quiet else contextlib.nullcontext():
                net(torch.randn(shape)).backward()
    finally:
        dist.destroy_process_group()
    found = [str(w.message) for w in seen if "Grad strides do not match" in str(w.message)]
    (folder / "warnings.json").write_text(json.dumps(found))


def _ddp_stride_warnings(folder: Path, quiet: bool, shape: tuple, grad_strides: tuple) -> list[str]:
    folder.mkdir()
    mp.spawn(_stride_warnings_worker, args=(folder, quiet, shape, grad_strides), nprocs=1, join=True)
    return json.loads((folder / "warnings.json").read_text())


def test_ddp_stride_warning_is_quiet_where_the_layout_is_the_same(tmp_path):
    """Compiled, a grey image's patch projection [64, 1, 4, 4] gets its gradient with another stride in its
    size-1 input channel dimension; DDP warns of it, though the memory order is the same. The trainer silences
    that warning."""
    grey, odd = (64, 1, 4, 4), (16, 1, 4, 1)
    assert _ddp_stride_warnings(tmp_path / "a", False, grey, odd), "DDP does not warn: the test tests nothing"
    assert _ddp_stride_warnings(tmp_path / "b", True, grey, odd) == []


def test_ddp_stride_warnings_of_another_layout_are_still_reported():
    """Only the same memory order is silenced: strides that differ in a dimension longer than 1, or another
    parameter's shape, still warn."""
    import warnings

    from vitkit.train.one_step import quiet_same_layout_stride_warnings

    def warn(sizes, grad, bucket):
        warnings.warn("Grad strides do not match bucket view strides. This may indicate grad was not "
                      "created according to the gradient layout contract, or that the param's strides "
                      "changed since DDP was constructed.  This is not an error, but may impair performance."
                      f"\ngrad.sizes() = {sizes}, strides() = {grad}\n"
                      f"bucket_view.sizes() = {sizes}, strides() = {bucket} (Triggered internally)",
                      UserWarning, stacklevel=2)

    model = torch.nn.Conv2d(1, 64, 4, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_same_layout_stride_warnings(model):
            warn([64, 1, 4, 4], [16, 1, 4, 1], [16, 16, 4, 1])  # same order
            warn([64, 1, 4, 4], [16, 1, 1, 4], [16, 16, 4, 1])  # transposed
            warn([32, 1, 4, 4], [16, 1, 4, 1], [16, 16, 4, 1])  # not its shape
        warn([64, 1, 4, 4], [16, 1, 4, 1], [16, 16, 4, 1])  # outside the block
    reported = [str(w.message).split("\n")[1] for w in seen]
    assert reported == ["grad.sizes() = [64, 1, 4, 4], strides() = [16, 1, 1, 4]",
                        "grad.sizes() = [32, 1, 4, 4], strides() = [16, 1, 4, 1]",
                        "grad.sizes() = [64, 1, 4, 4], strides() = [16, 1, 4, 1]"]


def _bucket_worker(_, folder: Path) -> None:
    """In a process of its own: how many storages the gradients of a model under `data_parallel` live in,
    after two steps (the second after the trainer's zero_grad(set_to_none=True))."""
    import torch.distributed as dist

    import vitkit
    from vitkit.train.distributed import data_parallel

    dist.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=0, world_size=1)
    try:
        model = vitkit.create_model("ViT-Ti/16", image_size=32, patch_size=8, depth=2, num_classes=5)
        net = data_parallel(model)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            net(torch.randn(2, 3, 32, 32)).sum().backward()
        grads = [p.grad for p in model.parameters()]
        storages = {g.untyped_storage().data_ptr() for g in grads}
        (folder / "grads.json").write_text(json.dumps({"params": len(grads), "storages": len(storages)}))
    finally:
        dist.destroy_process_group()


def test_ddp_gradients_are_views_into_its_buckets(tmp_path):
    """Under the trainer's DDP a process keeps one gradient-sized buffer: every gradient is a view into one
    of DDP's all-reduce buckets, not a tensor of its own beside a bucket it is copied into."""
    mp.spawn(_bucket_worker, args=(tmp_path,), nprocs=1, join=True)
    found = json.loads((tmp_path / "grads.json").read_text())
    assert found["params"] > 10
    assert found["storages"] <= 2, found  # one bucket (25 MB) holds this model's gradients
