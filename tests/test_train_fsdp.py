"""`parallel=fsdp`: two CPU processes (gloo) with FSDP2 compute the run DDP computes; its sharded checkpoints
resume on another number of processes, and after a SIGKILL end bit for bit where an unbroken run does."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from train_helpers import as_process, fake_data_overrides, free_port, write_fake_fashion_mnist
from vitkit.train import get_recipe, train
from vitkit.train.checkpoints import list_checkpoints
from vitkit.train.dcp_checkpoints import read_full_tensors, read_state

# SGD, no augmentation or drop-path (as test_train_distributed.py): the runs differ only by float summation
# order. Accumulation (micro_batch), clipping, the EMA and PatchDropout (off for the last epoch) are all on.
EQUAL = ["device=cpu", "augment.crop=none", "augment.hflip=0", "model.drop_path=0", "threads=1",
         "optim.name=sgd", "optim.lr=0.05", "batch_size=32", "micro_batch=8", "steps=20", "eval_every=20",
         "ckpt_every=20", "optim.clip_grad_norm=0.5", "ema=0.9", "model.patch_dropout=0.25",
         "full_token_epochs=1"]


def _join(rank: int, world: int, port: int) -> None:
    """Join a gloo group of `world` processes; train() leaves a group it did not start alone, so a worker
    can train several runs in it."""
    as_process(rank, world, port)
    dist.init_process_group("gloo")


def _runs(rank: int, world: int, port: int, runs: list[tuple[str, list[str], str, bool]]) -> None:
    _join(rank, world, port)
    try:
        for recipe, overrides, out, resume in runs:
            train(get_recipe(recipe, overrides), out, resume=resume, progress=False)
    finally:
        dist.destroy_process_group()


def spawn(world: int, runs: list[tuple[list[str], Path, bool]], recipes: list[tuple] = ()) -> None:
    """Train `runs` (overrides, run folder, resume) of demo-tiny, then `recipes` (recipe, overrides, run
    folder), one after the other in `world` processes."""
    todo = [("demo-tiny", o, str(out), r) for o, out, r in runs] + [(n, o, str(out), False)
                                                                   for n, o, out in recipes]
    mp.spawn(_runs, args=(world, free_port(), todo), nprocs=world, join=True)


def assert_relatively_close(a: dict, b: dict, tol: float, what: str) -> None:
    """Every tensor of `a` equals `b`'s within `tol` relative (the norm of the difference over the norm)."""
    assert a.keys() == b.keys(), what
    for k in a:
        if torch.is_tensor(a[k]) and a[k].is_floating_point():
            err = (a[k].double() - b[k].double()).norm() / a[k].double().norm().clamp_min(1e-12)
            assert err <= tol, f"{what} {k}: relative difference {float(err):.2e}"


def final_tensors(run: Path) -> dict:
    return read_full_tensors(list_checkpoints(run)[-1])


def test_fsdp_equals_ddp_on_two_processes(tmp_path):
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=256, n_test=64)
    base = EQUAL + fake_data_overrides(data)
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    # and the other recipes' tiny twins train under FSDP (finetune-tiny from pretrain-tiny's last weights;
    # demo-tiny here, fashion-mnist-tiny in the SIGKILL test below)
    short = fake_data_overrides(data) + ["parallel=fsdp", "steps=2", "threads=1", "device=cpu",
                                         "data.val_split="]
    recipes = [("pretrain-tiny", short, tmp_path / "pretrain-tiny"),
               ("finetune-tiny", short + [f"init={tmp_path / 'pretrain-tiny' / 'last'}", "ema=0",
                                          "optim.layer_decay=0.75", "optim.freeze=patch_embed.*"],
                tmp_path / "finetune-tiny")]
    # FSDP with activation checkpointing: the recomputed blocks unshard again in the backward pass
    spawn(2, [(base, ddp, False), (base + ["parallel=fsdp", "grad_checkpointing=true"], fsdp, False)],
          recipes)
    for name, _, run in recipes:
        assert read_state(list_checkpoints(run)[-1])["step"] == 2, name
        assert (run / "last" / "model.safetensors").is_file(), name
    # frozen under FSDP: the fine-tune's patch embedding is the pre-trained one
    tuned, pretrained = (load_file(str(tmp_path / r / "last" / "model.safetensors"))
                         for r in ("finetune-tiny", "pretrain-tiny"))
    assert torch.equal(tuned["patch_embed.proj.weight"], pretrained["patch_embed.proj.weight"])
    assert not torch.equal(tuned["blocks.0.mlp.fc1.weight"], pretrained["blocks.0.mlp.fc1.weight"])
    ckpt = list_checkpoints(fsdp)[-1]
    assert ckpt.name == "step-0000020" and read_state(ckpt)["processes"] == 2
    # each process wrote its own shards: half the model each
    shards = sorted((ckpt / "dcp").glob("*.distcp"))
    assert len(shards) == 2 and abs(shards[0].stat().st_size / shards[1].stat().st_size - 1) < 0.2
    tensors = final_tensors(fsdp)
    weights = load_file(str(list_checkpoints(ddp)[-1] / "model" / "model.safetensors"))
    assert weights["head.weight"].abs().sum() > 0
    assert_relatively_close(weights, tensors["model"], 1e-5, "weights")
    assert_relatively_close(load_file(str(list_checkpoints(ddp)[-1] / "ema.safetensors")), tensors["ema"],
                            1e-5, "EMA")
    # last/ and best/ are plain vitkit checkpoints of the (gathered) EMA weights
    for name in ("last", "best"):
        assert_relatively_close(load_file(str(ddp / name / "model.safetensors")),
                                load_file(str(fsdp / name / "model.safetensors")), 1e-5, name)


# Momentum SGD with drop-path, flips and random erasing: every draw is keyed by the image's place in the
# global batch, so a resumed run on another number of processes ends where the unbroken one does, to float
# summation order. 24 images a step split over 1, 2 and 3 processes.
RESUMED = ["device=cpu", "augment.crop=none", "augment.hflip=0.5", "augment.random_erasing=0.25",
           "model.drop_path=0.2", "threads=1", "optim.name=sgd", "optim.lr=0.05", "batch_size=24", "steps=4",
           "ckpt_every=2", "data.val_split=", "keep_last=3", "ema=0.9", "parallel=fsdp"]


def cut_back_to_step_2(run: Path, into: Path) -> Path:
    """A copy of a finished run as a kill after step 2's checkpoint would have left it."""
    shutil.copytree(run, into)
    shutil.rmtree(list_checkpoints(into)[-1])
    for name in ("last", "result.json", "confusion.png"):
        path = into / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    assert list_checkpoints(into)[-1].name == "step-0000002"
    return into


def test_resume_on_another_number_of_processes(tmp_path, capsys):
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=96, n_test=24)
    sets = RESUMED + fake_data_overrides(data)
    one = tmp_path / "one"
    train(get_recipe("demo-tiny", sets), one, progress=False)  # one process: plain model, DCP checkpoints
    one_to_two = cut_back_to_step_2(one, tmp_path / "one-to-two")
    two = tmp_path / "two"
    spawn(2, [(sets, two, False), (sets, one_to_two, True)])
    two_to_one = cut_back_to_step_2(two, tmp_path / "two-to-one")
    capsys.readouterr()
    train(get_recipe("demo-tiny", sets), two_to_one, resume=True, progress=False)
    out = capsys.readouterr().out
    assert "resuming" in out and "note:" not in out  # nothing goes on differently
    spawn(3, [(sets, cut_back_to_step_2(two, tmp_path / "two-to-three"), True)])

    reference = {"one": final_tensors(one), "two": final_tensors(two)}
    for run, ref in (("one-to-two", "one"), ("two-to-one", "two"), ("two-to-three", "two")):
        ckpt = list_checkpoints(tmp_path / run)[-1]
        state = read_state(ckpt)
        assert ckpt.name == "step-0000004" and state["step"] == 4 and state["ema_updates"] == 4, run
        assert state["processes"] == {"one-to-two": 2, "two-to-one": 1, "two-to-three": 3}[run]
        got = read_full_tensors(ckpt)
        for part in ("model", "ema"):
            assert_relatively_close(reference[ref][part], got[part], 1e-4, f"{run} {part}")
        buffers = [{k: v["momentum_buffer"] for k, v in tensors["optim"]["state"].items()}
                   for tensors in (reference[ref], got)]
        assert_relatively_close(*buffers, 1e-4, f"{run} momentum")
    assert (tmp_path / "two-to-three" / "last" / "model.safetensors").is_file()


# fashion-mnist-tiny with every kind of state: AdamW moments, the EMA, drop-path and augmentation draws.
STEPS = 12
KILLED = ["deterministic=true", "threads=1", f"steps={STEPS}", "ckpt_every=4", "eval_every=12", "keep_last=3",
          "model.drop_path=0.1", "augment.random_erasing=0.25", "ema=0.9", "parallel=fsdp"]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for torchrun's workers")
def test_sigkill_then_resume_under_fsdp_equals_uninterrupted(tmp_path, capfd, monkeypatch):
    # Kernel autotuning off: the processes of a run that time a new shape at once may each take their own
    # engine for its first call, which is no part of what this test checks.
    monkeypatch.setenv("VITKIT_AUTOTUNE", "0")
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=256, n_test=64)
    sets = KILLED + fake_data_overrides(data)
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "vitkit.cli.main", "train", "fashion-mnist-tiny", "--out", str(out), "--no-progress",
               *(a for o in sets for a in ("--set", o))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # VITKIT_AUTOTUNE=0 included
    torchrun = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not list_checkpoints(out) and torchrun.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    workers = _children(torchrun.pid) if torchrun.poll() is None else []
    for pid in workers:  # the workers first: a SIGKILL of torchrun alone would reach them as a SIGTERM
        os.kill(pid, signal.SIGKILL)
    torchrun.send_signal(signal.SIGKILL)
    _, err = torchrun.communicate(timeout=60)
    assert workers and torchrun.returncode == -signal.SIGKILL, \
        f"the run ended before it could be killed: {err.decode()[-2000:]}"
    done = list_checkpoints(out)
    assert done and read_state(done[-1])["step"] < STEPS

    # the uninterrupted run, then the killed one resumed, in two new processes
    todo = [("fashion-mnist-tiny", sets, str(tmp_path / "ref"), False),
            ("fashion-mnist-tiny", sets, str(out), True)]
    capfd.readouterr()
    mp.spawn(_runs, args=(2, free_port(), todo), nprocs=2, join=True)
    assert f"resuming {out} from {done[-1].name}" in capfd.readouterr().out
    final = list_checkpoints(out)[-1]
    assert final.name == f"step-{STEPS:07d}"
    a, b = read_full_tensors(tmp_path / "ref" / "ckpt" / final.name), read_full_tensors(final)
    for part in ("model", "ema"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            torch.testing.assert_close(a[part][k], b[part][k], rtol=0, atol=0, msg=f"{part}: {k}")
    for k, state in a["optim"]["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(value, b["optim"]["state"][k][name], rtol=0, atol=0, msg=f"{k} {name}")
    torch.testing.assert_close(load_file(str(tmp_path / "ref" / "last" / "model.safetensors")),
                               load_file(str(out / "last" / "model.safetensors")), rtol=0, atol=0)


def test_a_damaged_sharded_checkpoint_is_refused_with_what_to_do(tmp_path):
    """As a damaged checkpoint under DDP: one line naming the file, and the folder to delete to resume from
    the checkpoint before it, which then resumes."""
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=96, n_test=24)
    cfg = get_recipe("demo-tiny", RESUMED + fake_data_overrides(data))
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    first, newest = list_checkpoints(run)[-2:]
    index = newest / "dcp" / ".metadata"
    index.write_bytes(index.read_bytes()[:50])
    with pytest.raises(ValueError, match=rf"{newest / 'dcp'}: unreadable .*delete {newest} to resume from "
                                         rf"{first.name}, the checkpoint before it"):
        train(cfg, run, resume=True, progress=False)
    shutil.rmtree(newest)
    assert train(cfg, run, resume=True, progress=False).steps == 4
    assert read_state(list_checkpoints(run)[-1])["step"] == 4


def _build_worker(rank: int, world: int, port: int, folder: str) -> None:
    """How the trainer builds an FSDP run, in each of `world` processes: which processes initialised a whole
    model, and process 0's check that the shards and the EMA's hold the weights DDP starts from."""
    import dataclasses
    import json

    from train_helpers import synthetic_dataset
    from vitkit.model import VisionTransformer
    from vitkit.train import distributed, loop, prepare

    _join(rank, world, port)
    whole = []  # one entry per VisionTransformer built: whether it was built with values (not on meta)
    init_weights = VisionTransformer.init_weights

    def noted(self):
        whole.append(not self.norm.weight.is_meta)
        init_weights(self)

    VisionTransformer.init_weights = noted
    try:
        cfg = get_recipe("demo-tiny", ["device=cpu", "threads=1", "parallel=fsdp", "ema=0.9"])
        prepare.set_up_process(cfg)
        model, model_cfg = prepare.build_process_model(cfg, 10, rank, world)
        cfg = dataclasses.replace(cfg, model=model_cfg)
        images = synthetic_dataset(64, seed=0)
        data = prepare.RunData(images, None, None, images.classes)
        run = loop.build_run(cfg, Path(folder), distributed.setup("cpu"), data, model, time.time())
        del model
        built = list(whole)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True)
        weights = get_model_state_dict(run.model, options=options)
        ema = get_model_state_dict(run.ema.module, options=options)
        local = sum(p.to_local().numel() for p in run.model.parameters())
        report = {"built": built, "local": local, "total": sum(t.numel() for t in weights.values())}
        if rank == 0:
            prepare.seed_everything(cfg.seed)
            reference = prepare.build_model(cfg, 10).state_dict()  # what DDP starts from
            report["equal"] = all(torch.equal(reference[k], weights[k]) and torch.equal(reference[k], ema[k])
                                  for k in reference) and reference.keys() == weights.keys()
        (Path(folder) / f"rank-{rank}.json").write_text(json.dumps(report))
        dist.barrier()  # process 1 is done first: leaving the group while 0 still works aborts it (gloo)
    finally:
        VisionTransformer.init_weights = init_weights
        dist.destroy_process_group()


def test_fsdp_builds_the_model_whole_on_the_main_process_only(tmp_path):
    """Under FSDP the other processes never hold the model whole: they build on the meta device and receive
    their shards, which (and the EMA's) start at exactly the weights DDP starts from with the same seed."""
    import json

    mp.spawn(_build_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    main, other = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2))
    assert main["built"] == [True, False, False]  # its model whole; the shards and the EMA's on meta
    assert other["built"] == [False, False]
    assert main["equal"]
    for r in (main, other):
        assert abs(r["local"] / r["total"] - 0.5) < 0.1  # each holds about half the parameters
