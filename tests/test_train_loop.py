"""The training loop: it learns, accumulation equals the large batch, logs are written, a step with a
non-finite gradient is skipped and counted, too many in a row stop the run keeping the last good checkpoint,
and the loss is read back only at log steps."""

import csv
import dataclasses
import json

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import vitkit
from train_helpers import fake_data_overrides, synthetic_dataset, synthetic_images, write_fake_fashion_mnist
from vitkit.cpu import build
from vitkit.data import FASHION_MNIST_CLASSES
from vitkit.train import TrainingDiverged, get_recipe, loop, one_step, prepare, train
from vitkit.train.batches import epoch_order, make_plan, rank_indices
from vitkit.train.checkpoints import latest_checkpoint, list_checkpoints, load_train_state
from vitkit.train.metrics_log import MetricsLog


def plain(name: str = "demo-tiny", *overrides: str):
    """A tiny recipe without augmentation or randomness in the model, so runs can be compared exactly."""
    return get_recipe(name, ["augment.crop=none", "augment.hflip=0", "augment.random_erasing=0",
                             "model.drop_path=0", "threads=1", *overrides])


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def one_batch_losses(tmp_path, *overrides: str) -> list[float]:
    """The training losses of 25 steps of demo-tiny on one batch of 32 images, logged at every step."""
    data = synthetic_dataset(32, seed=0)
    cfg = plain("demo-tiny", "batch_size=32", "steps=25", "optim.schedule=constant", "optim.warmup_epochs=0",
                "optim.lr=0.003", "optim.label_smoothing=0", "log_every=1", "ckpt_every=100", *overrides)
    train(cfg, tmp_path / "run", train_set=data, val_set=data, progress=False)
    with (tmp_path / "run" / "metrics.csv").open() as f:
        return [float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "train"]


def test_a_few_steps_on_one_batch_drive_the_loss_down(tmp_path):
    losses = one_batch_losses(tmp_path)
    assert len(losses) == 25
    assert losses[-1] < 0.5 * losses[0], losses


# Three steps that two ways of computing them must agree on to float rounding. SGD, not Adam: the key bias
# gets a gradient of exactly 0 in theory (softmax ignores a constant per row), i.e. float noise, which Adam's
# normalisation blows up to full-size steps in either run. On the CPU: on a GPU the recipes train under bf16
# autocast, whose rounding differs between the two ways.
COMPARABLE_STEPS = ["device=cpu", "batch_size=32", "steps=3", "optim.warmup_epochs=0", "ckpt_every=100",
                    "eval_every=100", "optim.name=sgd", "optim.lr=0.05"]


def assert_same_weights(run_a, run_b) -> None:
    """The last models of two runs hold the same tensors under the same names, to float rounding."""
    a, b = weights(run_a), weights(run_b)
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def test_gradient_accumulation_equals_the_large_batch(tmp_path):
    data = synthetic_dataset(128, seed=1)
    whole = train(plain("demo-tiny", *COMPARABLE_STEPS), tmp_path / "whole", train_set=data, progress=False)
    accum = train(plain("demo-tiny", *COMPARABLE_STEPS, "micro_batch=8"), tmp_path / "accum", train_set=data,
                  progress=False)
    assert weights(whole.last_dir)["head.weight"].abs().sum() > 0
    assert_same_weights(whole.last_dir, accum.last_dir)


@pytest.mark.slow  # inductor compiles C++ for the forward and the backward: about 30 s on 2 busy cores
def test_compiled_training_computes_the_same_run(tmp_path):
    from torch._dynamo.utils import counters

    data = synthetic_dataset(64, seed=4)
    common = [*COMPARABLE_STEPS, "precision=fp32"]
    eager = train(plain("demo-tiny", *common), tmp_path / "eager", train_set=data, val_set=data,
                  progress=False)
    counters.clear()
    compiled = train(plain("demo-tiny", *common, "compile=true"), tmp_path / "compiled", train_set=data,
                     val_set=data, progress=False)
    assert counters["stats"]["unique_graphs"] >= 1  # the model really went through dynamo
    # The checkpoint holds the model's own names, not the compiled wrapper's; inductor only reorders float
    # sums.
    assert_same_weights(eager.last_dir, compiled.last_dir)
    assert compiled.final.loss == pytest.approx(eager.final.loss, rel=1e-4)


def test_compiled_training_drops_only_dynamos_profiler_note():
    """Compiling DDP, dynamo notes once per process that it leaves out DDP's profiler range; `compiled` drops
    that note (from the logger dynamo writes it to) and nothing else."""
    import importlib
    import logging

    if build.cxx_compiler() is None:
        pytest.skip("no C++ compiler: compiled() trains eagerly")
    assert importlib.import_module("torch._dynamo.variables.ctx_manager").log.name == \
        one_step.PROFILER_NOTE_LOGGER  # the logger the note comes from
    logger = logging.getLogger(one_step.PROFILER_NOTE_LOGGER)
    for _ in range(2):
        one_step.compiled(torch.nn.Linear(2, 2), torch.device("cpu"))  # lazy: nothing compiles here
    assert sum(isinstance(f, one_step._WithoutProfilerRangeNote) for f in logger.filters) == 1

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    keep = Keep()
    logger.addHandler(keep)
    try:
        logger.warning("Profiler record function %s will be ignored", "record_function")
        logger.warning("Graph break: something worth knowing")
    finally:
        logger.removeHandler(keep)
    assert seen == ["Graph break: something worth knowing"]


def test_batches_split_the_global_batch_among_processes():
    order = epoch_order(64, seed=3, epoch=2)
    assert torch.equal(order, epoch_order(64, seed=3, epoch=2))  # reproducible from (seed, epoch)
    assert not torch.equal(order, epoch_order(64, seed=3, epoch=3))
    one = rank_indices(order, 1, make_plan(16, 0, world=1, rank=0))
    two = [i for r in range(2) for i in rank_indices(order, 1, make_plan(16, 4, world=2, rank=r))]
    assert len(one) == 1 and len(two) == 4 and all(len(i) == 4 for i in two)
    assert torch.equal(torch.cat(two), one[0])
    with pytest.raises(ValueError, match="multiple of processes"):
        make_plan(16, 3, world=2, rank=0)
    with pytest.raises(ValueError,
                       match=r"batch_size=33 must be a multiple of the number of processes \(2\)$"):
        make_plan(33, 0, world=2, rank=0)  # no micro_batch was asked for: the message names none


def test_run_folder_logs_and_checkpoints(tmp_path):
    data = synthetic_dataset(96, seed=2)
    cfg = get_recipe("fashion-mnist-tiny", ["threads=1", "steps=6", "ckpt_every=2", "eval_every=3",
                                            "log_every=2", "keep_last=2"])
    r = train(cfg, tmp_path / "run", train_set=data, val_set=synthetic_dataset(40, seed=3), progress=False)
    run = tmp_path / "run"
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(x["step"]) for x in rows if x["split"] == "train"] == [2, 4, 6]
    assert [int(x["step"]) for x in rows if x["split"] == "val"] == [3, 6]
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert [p.name for p in list_checkpoints(run)] == ["step-0000004", "step-0000006"]  # keep_last=2
    assert (run / "confusion.png").stat().st_size > 0 and (run / "config.json").is_file()
    model = vitkit.load(r.last_dir)  # the last and best models are plain vitkit checkpoints
    assert model.class_names == FASHION_MNIST_CLASSES
    assert vitkit.load(r.best_dir).cfg == model.cfg
    # A new run may not overwrite an old one.
    with pytest.raises(ValueError, match="already holds a run"):
        train(cfg, run, train_set=data, progress=False)
    # The run folder is not a checkpoint; loading it says where its models are.
    from vitkit.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=rf"a training run folder, not a checkpoint; its models are "
                                              rf"{run / 'last'} and {run / 'best'}"):
        vitkit.load(run)


class PoisonedAt(torch.utils.data.Dataset):
    """Float images, nan for the indices in `bad`: the loss turns nan on the step that draws one."""

    def __init__(self, base, bad):
        self.base, self.bad, self.classes = base, set(bad), base.classes

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        x = x.float() / 255
        return (x * float("nan") if i in self.bad else x), y


def test_a_step_with_a_non_finite_gradient_is_skipped_and_counted(tmp_path):
    """Step 2 (0-based) draws a nan image: its gradient norm is nan, so the weights, the optimizer's state and
    the EMA stay as step 2's checkpoint holds them, metrics.csv counts the step, and the run goes on."""
    base = synthetic_dataset(64, seed=4)
    order = epoch_order(64, seed=0, epoch=0)
    data = PoisonedAt(base, [int(order[40])])  # batch 16: image 40 of the epoch is in step 2
    cfg = plain("demo-tiny", "batch_size=16", "steps=4", "ckpt_every=1", "eval_every=100", "keep_last=5",
                "ema=0.9", "log_every=1", "optim.clip_grad_norm=1.0")
    result = train(cfg, tmp_path / "run", train_set=data, progress=False)
    assert result.steps == 4
    ckpts = [tmp_path / "run" / "ckpt" / f"step-000000{i}" for i in (2, 3)]
    for name in ("model/model.safetensors", "optimizer.safetensors", "ema.safetensors"):
        before, after = (load_file(str(c / name)) for c in ckpts)
        assert before.keys() == after.keys()
        for k in before:
            assert torch.equal(before[k], after[k]), (name, k)
    after = load_train_state(ckpts[1])
    assert after["state"]["skipped_steps"] == 1 and after["state"]["ema_updates"] == 2
    rows = [r for r in MetricsLog.read_rows(tmp_path / "run" / "metrics.csv") if r["split"] == "train"]
    assert [int(r["skipped_steps"]) for r in rows] == [0, 0, 1, 1]
    assert all(torch.isfinite(p).all() for p in vitkit.load(result.last_dir).parameters())
    final = load_train_state(tmp_path / "run" / "ckpt" / "step-0000004")
    assert not torch.equal(final["model"]["head.weight"], after["model"]["head.weight"])  # it went on


def test_steps_skipped_in_a_row_stop_the_run_naming_the_last_checkpoint(tmp_path):
    base = synthetic_dataset(64, seed=4)
    order = epoch_order(64, seed=0, epoch=0)
    data = PoisonedAt(base, [int(order[40]), int(order[50])])  # steps 2 and 3
    cfg = plain("demo-tiny", "batch_size=16", "steps=4", "ckpt_every=1", "eval_every=100", "keep_last=5",
                "max_skipped_steps=2")
    with pytest.raises(TrainingDiverged, match=r"gradient norm was nan or infinite at steps 3 to 4 \(2 in "
                                               r"a row, each skipped; epoch 1.00\).*the last good checkpoint "
                                               r"is .*step-0000003"):
        train(cfg, tmp_path / "run", train_set=data, progress=False)
    model = vitkit.load(latest_checkpoint(tmp_path / "run") / "model")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_non_finite_gradient_before_any_checkpoint_says_to_start_again(tmp_path):
    base = synthetic_dataset(64, seed=4)
    data = PoisonedAt(base, [int(epoch_order(64, seed=0, epoch=0)[0])])  # in the first batch
    cfg = plain("demo-tiny", "batch_size=16", "steps=4", "ckpt_every=100", "eval_every=100",
                "max_skipped_steps=1")
    with pytest.raises(TrainingDiverged,
                       match=r"at step 1 \(1 in a row.*no checkpoint was written yet. Start again with a "
                             r"lower optim.lr .*the same --out will do") as e:
        train(cfg, tmp_path / "run", train_set=data, progress=False)
    assert "--resume" not in str(e.value)


class _Watched(torch.Tensor):
    """A loss tensor that notes every operation on it (reading it back to the host is one)."""

    uses: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        _Watched.uses.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_loss_is_read_back_only_at_log_steps(tmp_path, monkeypatch):
    """Reading the loss back each step would stall a GPU's queue: the trainer touches the step's loss only at
    the steps that log it (every log_every-th and the last)."""
    real = loop.forward_backward
    per_step: list[list[str]] = []

    def watched(*args, **kwargs):
        loss = real(*args, **kwargs).as_subclass(_Watched)
        _Watched.uses = []  # what is done with this step's loss from here on
        per_step.append(_Watched.uses)
        return loss

    monkeypatch.setattr(loop, "forward_backward", watched)
    train(plain("demo-tiny", "steps=7", "log_every=3", "eval_every=100", "ckpt_every=100"),
          tmp_path / "run", train_set=synthetic_dataset(64, seed=0), progress=False)
    assert [i + 1 for i, uses in enumerate(per_step) if uses] == [3, 6, 7]


def test_a_fine_tuning_recipe_without_init_is_refused_before_any_work(tmp_path):
    for name in ("finetune", "finetune-tiny"):
        with pytest.raises(ValueError, match=rf"the {name} recipe fine-tunes a pre-trained model: set init="):
            train(get_recipe(name), tmp_path / name, progress=False)
        assert not (tmp_path / name).exists()


def test_finetune_tiny_from_a_checkpoint(tmp_path):
    data = synthetic_dataset(64, seed=5, size=16)
    source = vitkit.create_model(get_recipe("finetune-tiny").model.replace(num_classes=7, image_size=8,
                                                                          representation_size=32))
    vitkit.save(source, tmp_path / "source")
    cfg = get_recipe("finetune-tiny", [f"init={tmp_path / 'source'}", "threads=1", "steps=2"])
    r = train(cfg, tmp_path / "run", train_set=data, val_set=data, progress=False)
    model = vitkit.load(r.last_dir)
    assert model.cfg.num_classes == 10 and model.cfg.image_size == (16, 16)
    assert model.cfg.representation_size is None
    src = weights(tmp_path / "source")
    got = weights(r.last_dir)
    # The blocks start from the source; the position embedding was resampled from a 2x2 to a 4x4 grid.
    assert got["pos_embed"].shape == (1, 17, 32) and src["pos_embed"].shape == (1, 5, 32)
    assert dataclasses.asdict(model.cfg)["dim"] == 32


def test_a_fine_tune_with_layer_decay_and_frozen_layers_trains_the_rest(tmp_path):
    """`optim.freeze` and `optim.layer_decay` as settings: the frozen patch embedding and first block end as
    the source's, the other blocks move, and a pattern that names no parameter is refused."""
    data = synthetic_dataset(64, seed=5, size=16)
    source = vitkit.create_model(get_recipe("finetune-tiny").model.replace(num_classes=7, image_size=16))
    vitkit.save(source, tmp_path / "source")
    sets = [f"init={tmp_path / 'source'}", "threads=1", "steps=3", "ema=0", "optim.layer_decay=0.75",
            "optim.freeze=patch_embed.*,blocks.0.*"]
    r = train(get_recipe("finetune-tiny", sets), tmp_path / "run", train_set=data, val_set=data,
              progress=False)
    src, got = weights(tmp_path / "source"), weights(r.last_dir)
    for name in src:
        if name.startswith(("patch_embed.", "blocks.0.")):
            assert torch.equal(got[name], src[name]), name
    assert not torch.equal(got["blocks.1.mlp.fc1.weight"], src["blocks.1.mlp.fc1.weight"])
    with pytest.raises(ValueError, match="optim.freeze: 'block.0.\\*' names no parameter"):
        train(get_recipe("finetune-tiny", sets[:-1] + ["optim.freeze=block.0.*"]), tmp_path / "bad",
              train_set=data, val_set=data, progress=False)


def test_finetune_resamples_the_position_table_as_the_recipe_says_and_starts_the_head_bias(tmp_path):
    """build_model: the init's table through `posemb_interpolation` (the paper's recipe: its code's zoom), and
    the new classifier's bias at `optim.head_bias`."""
    from vitkit.posemb import resample_pos_embed
    from vitkit.train.prepare import build_model

    source = vitkit.create_model(get_recipe("finetune-tiny").model.replace(num_classes=7, image_size=12))
    torch.nn.init.normal_(source.pos_embed)
    vitkit.save(source, tmp_path / "source")
    for mode in ("bilinear-corners", "bicubic"):
        cfg = get_recipe("finetune-tiny", [f"init={tmp_path / 'source'}", "image_size=20",
                                           f"posemb_interpolation={mode}", "optim.head_bias=-3"])
        model = build_model(cfg, num_classes=5)
        expected = resample_pos_embed(source.pos_embed.detach(), (3, 3), (5, 5), mode=mode)
        torch.testing.assert_close(model.pos_embed.detach(), expected)
        assert (torch.equal(model.head.bias.detach(), torch.full((5,), -3.0))
                and model.head.weight.abs().sum() == 0)
    scratch = build_model(get_recipe("demo", ["optim.head_bias=-10"]), num_classes=4)
    assert torch.equal(scratch.head.bias.detach(), torch.full((4,), -10.0))


def test_a_run_saved_before_newer_settings_resumes_with_their_defaults(tmp_path):
    """A config.json without the settings added since (here `optim.loss`, `optim.head_bias`,
    `posemb_interpolation`) reads as their defaults, the behaviour the run was started with: no refusal."""
    from vitkit.train.run_folder import config_differences, saved_config

    cfg = get_recipe("demo-tiny")
    old = json.loads(cfg.to_json())
    del old["optim"]["loss"], old["optim"]["head_bias"], old["posemb_interpolation"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert config_differences(old, json.loads(cfg.to_json())) != []
    assert config_differences(saved_config(tmp_path / "config.json"), json.loads(cfg.to_json())) == []
    (tmp_path / "config.json").write_text(json.dumps({**old, "removed_setting": 1}))
    # kept as written: the refusal names it
    assert "removed_setting" in saved_config(tmp_path / "config.json")


def test_a_run_validates_on_held_out_data_and_tests_once_on_the_test_split(tmp_path):
    """Which splits a run trains, validates (chooses best/) and tests on, with no setting: a folder's own val/
    and test/ where it has them, else a fixed part of its training images, each class in its share; the named
    datasets hold 5,000 training images out and test on their test split."""
    write_class_folders(tmp_path / "flat", ["a", "b"], per_class=8)
    data = prepare.load_data(plain("demo-tiny", f"data.name={tmp_path / 'flat'}", "data.holdout=4"))
    assert (data.val_split, data.test_split, len(data.train), len(data.val)) == ("holdout", "", 12, 4)
    assert data.test is None
    assert sorted(int(t) for t in data.val.targets) == [0, 0, 1, 1]  # each class in its share
    again = prepare.load_data(plain("demo-tiny", f"data.name={tmp_path / 'flat'}", "data.holdout=4",
                                    "seed=7"))
    assert again.val.indices == data.val.indices  # the same part for every seed

    for splits, expected in ((["train", "val"], ("val", "")), (["train", "val", "test"], ("val", "test")),
                             (["train"], ("holdout", "")), (["train", "test"], ("holdout", "test"))):
        root = tmp_path / "-".join(splits)
        for split in splits:
            write_class_folders(root / split, ["a", "b"], per_class=4)
        got = prepare.load_data(plain("demo-tiny", f"data.name={root}", "data.holdout=2"))
        assert (got.val_split, got.test_split) == expected, splits
        assert len(got.train) == 8 - 2 * (expected[0] == "holdout")

    named = ("train", "test")  # Fashion-MNIST's, CIFAR's
    assert prepare.plan_splits("auto", "auto", 5000, named) == ("holdout", "test")
    assert prepare.plan_splits("test", "auto", 5000, named) == ("test", "")  # asked for: not tested twice
    assert prepare.plan_splits("auto", "auto", 0, ("train",)) == ("", "")
    with pytest.raises(ValueError, match=r"data.val_split='val', but the data has no val split \(its splits: "
                                         r"train, test\)"):
        prepare.plan_splits("val", "auto", 5000, ("train", "test"))
    with pytest.raises(ValueError, match="set data.holdout between 1 and 15"):
        prepare.load_data(plain("demo-tiny", f"data.name={tmp_path / 'flat'}", "data.holdout=16"))


def test_the_command_line_shows_warnings_as_one_line():
    import warnings

    from vitkit.cli.main import main, warning_line

    with pytest.raises(SystemExit):  # the command line shows warnings as one line each
        main(["--help"])
    assert warnings.formatwarning is warning_line
    assert (warning_line(UserWarning("x has no train/"), UserWarning, "loop.py", 1)
            == "warning: x has no train/\n")


def test_a_run_gives_the_process_its_threads_and_determinism_back(tmp_path):
    threads = torch.get_num_threads()
    cfg = get_recipe("demo-tiny", [f"threads={threads + 1}", "deterministic=true", "steps=1",
                                   "data.val_split=", "batch_size=8"])
    train(cfg, tmp_path / "run", train_set=synthetic_dataset(8, seed=1), progress=False)
    assert torch.get_num_threads() == threads and not torch.are_deterministic_algorithms_enabled()


def test_image_folder_with_a_bad_file(tmp_path):
    """Folders go through per-image transforms; a bad file stops the run naming it, or is skipped and
    counted."""
    images, labels = synthetic_images(40, seed=6)
    for i, (img, c) in enumerate(zip(images, labels.tolist(), strict=True)):
        folder = tmp_path / "data" / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img[0].numpy()).save(folder / f"{i}.png")
    bad = tmp_path / "data" / "class0" / "zz-broken.png"
    bad.write_bytes(b"not an image")
    sets = [f"data.name={tmp_path / 'data'}", "data.val_split=", "batch_size=41", "micro_batch=0", "steps=1",
            "threads=1", "model.in_chans=1"]
    with pytest.raises(ValueError, match="zz-broken.png"):
        train(get_recipe("demo-tiny", sets), tmp_path / "run1", progress=False)
    r = train(get_recipe("demo-tiny", [*sets, "data.skip_bad_images=true"]), tmp_path / "run2",
              progress=False)
    summary = json.loads((r.run_dir / "result.json").read_text())
    assert summary["skipped_images"] == [str(bad)]


@pytest.mark.parametrize("name", ["pretrain-tiny", "demo-tiny", "fashion-mnist-tiny"])
def test_tiny_twins_train(tmp_path, name):
    cfg = get_recipe(name, ["threads=1", "steps=4"])
    size = cfg.model.image_size[0]
    r = train(cfg, tmp_path / "run", train_set=synthetic_dataset(64, 11, size),
              val_set=synthetic_dataset(32, 12, size), progress=False)
    assert r.steps == 4 and r.final.count == 32
    model = vitkit.load(r.last_dir)
    assert model.cfg.representation_size == cfg.model.representation_size


def test_full_token_epochs_turn_patch_dropout_off_for_the_last_steps(tmp_path, monkeypatch):
    """fashion-mnist-tiny keeps 3 of 4 patch tokens (+ the class token) in training; with full_token_epochs
    the last steps see all 5 tokens, and evaluation always does."""

    seen: list[tuple[bool, int]] = []
    build = prepare.build_model

    def build_and_watch(cfg, num_classes):
        model = build(cfg, num_classes)
        model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append((m.training, args[0].shape[1])))
        return model

    monkeypatch.setattr(prepare, "build_model", build_and_watch)
    data = synthetic_dataset(64, seed=4, size=8)
    # 64 images in batches of 32: 2 steps per epoch; 8 steps, the last 1.5 epochs (3 steps) with every token.
    cfg = get_recipe("fashion-mnist-tiny", ["model.image_size=8", "model.patch_size=4",
                                            "model.patch_dropout=0.25",
                                            "batch_size=32", "steps=8", "full_token_epochs=1.5", "threads=1",
                                            "eval_every=100", "ckpt_every=100"])
    train(cfg, tmp_path / "run", train_set=data, val_set=data, progress=False)
    assert [n for training, n in seen if training] == [4] * 5 + [5] * 3
    assert {n for training, n in seen if not training} <= {5}
    with pytest.raises(ValueError, match="full_token_epochs"):
        get_recipe("fashion-mnist", ["full_token_epochs=-1"])
    get_recipe("fashion-mnist", ["model.patch_dropout=0"])  # turning PatchDropout off needs no other change


@pytest.mark.parametrize("native", [True, False])
def test_autocast_dtype_of_each_precision(monkeypatch, native):
    monkeypatch.setattr(one_step, "cpu_has_native_bf16", lambda: native)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert one_step.autocast_dtype("auto", cpu) is None
    assert one_step.autocast_dtype("fp32", cpu) is None and one_step.autocast_dtype("fp32", cuda) is None
    assert one_step.autocast_dtype("auto", cuda) is torch.bfloat16
    assert one_step.autocast_dtype("bf16", cpu) is torch.bfloat16
    assert one_step.autocast_dtype("bf16-native", cuda) is torch.bfloat16
    assert one_step.autocast_dtype("bf16-native", cpu) is (torch.bfloat16 if native else None)


def test_bf16_native_trains_under_autocast_where_the_cpu_has_it(tmp_path, monkeypatch):
    """With 'bf16-native' the forward runs in bf16 on a CPU that has it (faked here, so the test runs on any
    CPU; bf16 is only emulated, slowly, on those without) and the loss still goes down."""
    monkeypatch.setattr(one_step, "cpu_has_native_bf16", lambda: True)
    dtypes = []
    original = vitkit.VisionTransformer.forward_head

    def spy(self, features, pre_logits=False):
        logits = original(self, features, pre_logits)
        dtypes.append(logits.dtype)
        return logits

    monkeypatch.setattr(vitkit.VisionTransformer, "forward_head", spy)
    losses = one_batch_losses(tmp_path, "eval_every=100", "precision=bf16-native")
    assert dtypes and all(d == torch.bfloat16 for d in dtypes), set(dtypes)
    assert losses[-1] < 0.5 * losses[0], losses


def write_class_folders(root, classes, per_class=2, seed=0):
    images, _ = synthetic_images(per_class * len(classes), seed)
    for i, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for j in range(per_class):
            Image.fromarray(images[i * per_class + j, 0].numpy()).save(root / name / f"{j}.png")


def test_val_folder_labels_follow_the_training_classes_by_name(tmp_path):
    """train/{a,b,c} with val/{a,c}: val's c is class 2 (by name), not 1 (its position in val/); a val class
    the training split lacks is refused, named, before any training."""
    write_class_folders(tmp_path / "data" / "train", ["a", "b", "c"])
    write_class_folders(tmp_path / "data" / "val", ["a", "c"])
    cfg = plain("demo-tiny", f"data.name={tmp_path / 'data'}", "model.in_chans=1")
    data = prepare.load_data(cfg)
    val, classes = data.val, data.classes
    assert classes == ["a", "b", "c"] and data.val_split == "val"  # val/ with no setting
    assert val.classes == classes and [val[i][1] for i in range(len(val))] == [0, 0, 2, 2]
    write_class_folders(tmp_path / "data" / "val", ["d"])
    with pytest.raises(ValueError, match=r"the val split has classes that the training split lacks: d \("):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_out_that_is_a_file_is_refused_before_loading_data(tmp_path):
    (tmp_path / "taken").write_text("a file")
    cfg = plain("demo-tiny", f"data.name={tmp_path / 'no-such-data'}")  # loading it would fail differently
    with pytest.raises(ValueError, match=f"--out {tmp_path / 'taken'}: not a folder"):
        train(cfg, tmp_path / "taken", progress=False)
    with pytest.raises(ValueError, match=r"not a folder \(.*taken is a file\)"):
        train(cfg, tmp_path / "taken" / "run", progress=False)
    assert prepare.device_unavailable("cpu") is None
    assert "GPU" in prepare.device_unavailable(f"cuda:{torch.cuda.device_count()}")


def test_result_json_is_valid_json_and_names_the_split(tmp_path):
    """A class with no validation image has accuracy null in result.json (bare NaN is not JSON), and the run
    reports the split it evaluated."""
    data = synthetic_dataset(64, seed=13)
    keep = data.targets != 3
    val = type(data)(data.images[keep], data.targets[keep], data.classes)
    r = train(plain("demo-tiny", "steps=2", "batch_size=32"), tmp_path / "run", train_set=data, val_set=val,
              progress=False)
    text = (tmp_path / "run" / "result.json").read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in result.json"))
    assert summary["per_class"][FASHION_MNIST_CLASSES[3]] is None and summary["skipped"] == 0
    assert r.split == "val"


@pytest.mark.parametrize("workers", [0, 2])
def test_folder_batches_after_a_resume_are_the_ones_an_unbroken_epoch_makes(workers):
    # Per-image augmentation seeded by the image's place in the run: the same in any DataLoader worker, so a
    # run resumed mid-epoch (start_step) sees bit for bit the batches it would have seen.
    from vitkit.data import TransformedDataset
    from vitkit.data.transforms import AugmentConfig
    from vitkit.train.batches import LoaderBatches

    class Plain(torch.utils.data.Dataset):  # not in memory: LoaderBatches' path, with PIL-free tensors
        classes = [str(c) for c in range(10)]

        def __init__(self):
            self.images, self.labels = synthetic_images(48, seed=8)

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            return self.images[i], int(self.labels[i])

    cfg = get_recipe("demo-tiny").model
    aug = AugmentConfig(crop="rrc", hflip=0.5, random_erasing=0.5)
    source = LoaderBatches(Plain(), cfg, aug, num_classes=10, seed=5, workers=workers)
    assert isinstance(source.dataset, TransformedDataset)
    plan = make_plan(8, 4, 1, 0)
    torch.manual_seed(3)
    whole = {step: b for step, b in source.epoch(1, plan, 0, 6)}
    # The loader leaves the global RNG alone (dropout and drop-path draw from it: a resumed run must see the
    # same draws as an unbroken one, whose loader was made at another point of the RNG's stream).
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(4))
    resumed = {step: b for step, b in source.epoch(1, plan, 3, 6)}
    assert list(resumed) == [3, 4, 5]
    for step, micro_batches in resumed.items():
        for (x, y, s), (x0, y0, s0) in zip(micro_batches, whole[step], strict=True):
            assert torch.equal(x, x0) and torch.equal(y, y0) and torch.equal(s, s0), step
    other_epoch = next(iter(source.epoch(2, plan, 3, 4)))[1][0][0]
    assert not torch.equal(other_epoch, resumed[3][0][0])


def test_compile_without_a_cpp_compiler_warns_and_trains_eagerly(monkeypatch):
    """inductor's CPU kernels need a C++ compiler: without one `compile=true` warns once and keeps the model
    eager instead of failing at the first step."""
    net = torch.nn.Linear(2, 2)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert one_step.compiled(net, torch.device("cpu")) is net
    monkeypatch.setattr(build.shutil, "which", lambda name: "/usr/bin/" + name)
    assert one_step.compiled(net, torch.device("cpu")) is not net


def test_the_fashion_mnist_recipe_compiles_and_its_tiny_twin_does_not():
    assert get_recipe("fashion-mnist").compile
    assert not get_recipe("fashion-mnist-tiny").compile


def test_result_json_holds_the_held_out_choice_and_the_one_test(tmp_path):
    """A run on (fake) Fashion-MNIST validates on its held-out part as it trains and evaluates the test split
    once, with the final weights: result.json's headline is the test's, its `val` the held-out part's."""
    data = write_fake_fashion_mnist(tmp_path / "data", n_train=160, n_test=48)
    cfg = get_recipe("demo-tiny", fake_data_overrides(data) + ["threads=1", "steps=4", "eval_every=2"])
    result = train(cfg, tmp_path / "run", progress=False)
    assert (result.split, result.test_split) == ("holdout", "test")
    assert result.final.count == 32 and result.test.count == 48  # the tiny twin holds 32 images out
    summary = json.loads((tmp_path / "run" / "result.json").read_text())
    assert summary["split"] == "test" and summary["count"] == 48 and summary["top1"] == result.test.top1
    assert summary["val"]["split"] == "holdout" and summary["val"]["count"] == 32
    assert summary["val"]["best_top1"] == result.best_top1 and summary["test"]["count"] == 48
    rows = MetricsLog.read_rows(tmp_path / "run" / "metrics.csv")
    assert [r["split"] for r in rows if r["split"] != "train"] == ["val", "val"]  # steps 2 and 4: held out


def test_eval_and_analyze_default_to_the_split_the_data_has(tmp_path):
    from vitkit.data.datasets import evaluation_split

    write_class_folders(tmp_path / "tv" / "train", ["a", "b"])
    write_class_folders(tmp_path / "tv" / "val", ["a", "b"])
    write_class_folders(tmp_path / "flat", ["a", "b"])
    assert evaluation_split("fashion-mnist", "auto") == "test"
    assert evaluation_split(tmp_path / "tv", "auto") == "val"
    assert evaluation_split(tmp_path / "flat", "auto") == "train"
    assert evaluation_split(tmp_path / "tv", "train") == "train"  # as asked


def test_the_unreadable_files_of_a_held_out_folder_are_reported_as_they_are_found(tmp_path):
    """The training and held-out parts of a folder are views of it: the files skipped while reading either are
    the folder's, seen as they are found, not a list copied when the parts were made."""
    write_class_folders(tmp_path / "flat", ["a", "b"], per_class=8)
    (tmp_path / "flat" / "a" / "bad.png").write_bytes(b"not a png")
    data = prepare.load_data(plain("demo-tiny", f"data.name={tmp_path / 'flat'}", "data.holdout=4",
                                   "data.skip_bad_images=true"))
    assert prepare.skipped_images(data.train) == prepare.skipped_images(data.val) == []
    for part in (data.train, data.val):
        for i in range(len(part)):
            part[i]
    for part in (data.train, data.val):
        assert [p.name for p in prepare.skipped_images(part)] == ["bad.png"]


def test_a_run_without_a_terminal_prints_a_line_at_its_logging_steps(tmp_path, monkeypatch, capsys):
    """With no progress bar (stderr is not a terminal, as under pytest or in a job's log), the main process
    prints the bar's figures at the logging steps, at most one line every LINE_EVERY_S seconds, and at the
    last step; progress=False prints none."""
    from vitkit.train import report

    data = synthetic_dataset(64, seed=0)
    monkeypatch.setattr(report, "LINE_EVERY_S", 0.0)
    train(plain("demo-tiny", "steps=6", "log_every=2", "eval_every=100", "ckpt_every=100"), tmp_path / "a",
          train_set=data, progress=None)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" (")[0] for line in lines] == ["step 2/6", "step 4/6", "step 6/6"]
    assert "loss" in lines[-1] and "images/s" in lines[-1]
    monkeypatch.setattr(report, "LINE_EVERY_S", 3600.0)
    train(plain("demo-tiny", "steps=6", "log_every=2", "eval_every=100", "ckpt_every=100"), tmp_path / "b",
          train_set=data, progress=None)
    assert [line.split(" (")[0] for line in capsys.readouterr().out.splitlines()
            if line.startswith("step ")] == ["step 6/6"]
    train(plain("demo-tiny", "steps=6", "log_every=2", "eval_every=100", "ckpt_every=100"), tmp_path / "c",
          train_set=data, progress=False)
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]


def test_loader_workers_are_at_most_the_cores_there_are(monkeypatch):
    """The finetune recipe asks for 4 DataLoader workers: on 2 cores a run starts 2 (no PyTorch warning)."""
    from vitkit.train.batches import batch_source, loader_workers

    class Items(torch.utils.data.Dataset):  # not held in memory: read through a DataLoader
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(3, 8, 8), 0

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert [loader_workers(n) for n in (0, 1, 2, 4, 8)] == [0, 1, 2, 2, 2]
    cfg = get_recipe("finetune")
    assert cfg.data.workers == 4
    assert batch_source(Items(), cfg.model, cfg.augment, 10, 0, cfg.data.workers).workers == 2
