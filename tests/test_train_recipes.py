"""Recipes are typed configs; --set overrides are parsed for their field's type and unknown keys rejected."""

import json
import re
import subprocess
import sys

import pytest

import vitkit
from vitkit.config import ViTConfig
from vitkit.counting import count_parameters
from vitkit.train.overrides import apply_overrides, parse_value, valid_keys
from vitkit.train.recipes import RECIPES, get_recipe
from vitkit.train.settings import TrainConfig, device_error


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_builds_and_round_trips_through_json(name):
    cfg = get_recipe(name)
    assert isinstance(cfg.model, ViTConfig)
    assert cfg.recipe == name
    assert TrainConfig.from_dict(json.loads(cfg.to_json())) == cfg


@pytest.mark.parametrize("name", [n for n in RECIPES if not n.endswith("-tiny")])
def test_tiny_twins_are_tiny(name):
    big, tiny = get_recipe(name), get_recipe(name + "-tiny")
    assert count_parameters(tiny.model) < 100_000 < count_parameters(big.model)
    assert tiny.steps <= 32 and tiny.data.limit <= 512
    assert type(tiny.optim) is type(big.optim) and tiny.optim.name == big.optim.name


def test_paper_recipes_follow_the_paper():
    p = get_recipe("pretrain")
    # Table 3's ImageNet-21k row, and the sigmoid loss with a -10 head bias the authors trained it with
    assert ((p.optim.name, p.optim.betas, p.optim.weight_decay, p.batch_size)
            == ("adamw", (0.9, 0.999), 0.03, 4096))
    assert (p.optim.lr, p.optim.schedule, p.optim.warmup_steps, p.epochs) == (1e-3, "linear", 10_000, 90)
    assert ((p.model.dropout, p.model.representation_size, p.optim.loss, p.optim.head_bias)
            == (0.1, 768, "sigmoid", -10))
    assert p.micro_batch < p.batch_size  # gradient accumulation
    f = get_recipe("finetune")
    assert ((f.optim.name, f.optim.momentum, f.optim.weight_decay, f.optim.clip_grad_norm)
            == ("sgd", 0.9, 0.0, 1.0))
    assert (f.batch_size, f.optim.schedule, f.optim.warmup_steps) == (512, "cosine", 500)
    # vit_jax: inception crops of 5-100 % of the image, the position table zoomed bilinearly corner to corner
    assert ((f.augment.crop_scale, f.posemb_interpolation, f.optim.loss)
            == ((0.05, 1.0), "bilinear-corners", "softmax"))


def test_overrides_parse_each_type():
    cfg = apply_overrides(get_recipe("demo"), [
        "optim.lr=0.01", "model.depth=3", "ema=0.99", "deterministic=true", "augment.crop_scale=0.5,1",
        "model.image_size=56", "augment.randaugment=2,9", "data.data_dir=none", "optim.name=sgd",
        "model.representation_size=64", "augment.randaugment=none",
    ])
    assert cfg.optim.lr == 0.01 and cfg.model.depth == 3 and cfg.ema == 0.99 and cfg.deterministic is True
    assert cfg.augment.crop_scale == (0.5, 1.0) and cfg.model.image_size == (56, 56)
    assert cfg.data.data_dir is None and cfg.optim.name == "sgd" and cfg.model.representation_size == 64
    assert cfg.augment.randaugment is None


@pytest.mark.parametrize("item, message", [
    ("optim.lrr=1", "unknown key 'optim.lrr'; valid keys: "),
    ("nope=1", "unknown key 'nope'"),
    ("optim.lr=fast", "expected a number"),
    ("model.depth=2.5", "expected an integer"),
    ("deterministic=maybe", "expected true or false"),
    ("optim.name=lamb", "choose from adamw, sgd"),
    ("model=1", "is a group of settings"),
    ("seed", "expected key=value"),
    ("model.dim=102", "not divisible by num_heads"),  # the dataclass's own validation
    ("batch_size=100", None),
])
def test_bad_overrides_are_rejected_with_a_reason(item, message):
    if message is None:  # a valid one, for contrast
        assert apply_overrides(get_recipe("demo"), [item]).batch_size == 100
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        apply_overrides(get_recipe("demo"), [item])


def test_unknown_key_error_lists_every_valid_key():
    with pytest.raises(ValueError) as e:
        apply_overrides(get_recipe("demo"), ["optim.lrr=1"])
    for key in ("optim.lr", "model.dim", "augment.mixup", "data.name", "ema", "micro_batch"):
        assert key in valid_keys() and key in str(e.value)


def test_parse_value_optional_tuple():
    assert parse_value("3,4,9", tuple[int, ...] | None) == (3, 4, 9)
    assert parse_value("none", tuple[int, ...] | None) is None


def test_cli_show_and_unknown_key(capsys):
    from vitkit.cli.main import main

    def show(*sets: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            main(["train", "demo", "--out", "unused", "--show", *sets])
            code = 0
        except SystemExit as e:
            code = e.code or 0
        return code, *capsys.readouterr()

    code, out, err = show("--set", "optim.lr=0.005")
    assert code == 0, err
    assert json.loads(out)["optim"]["lr"] == 0.005
    code, out, err = show("--set", "optim.lrr=1")
    assert code != 0
    assert err.startswith("error: unknown key 'optim.lrr'") and "Traceback" not in err


def test_finetune_takes_the_init_checkpoints_architecture_and_short_keys(tmp_path):
    """`--set init=CKPT --set image_size=H,W --set data=...` (any order): the model is the checkpoint's, at
    the new size, checked against the checkpoint's patch size rather than the recipe's."""
    import vitkit

    source = vitkit.create_model("ViT-Ti/16", image_size=(28, 28), patch_size=7, in_chans=1, dim=32,
                                 depth=1, num_heads=2, mlp_dim=64, num_classes=3, representation_size=16)
    vitkit.save(source, tmp_path / "src")
    cfg = get_recipe("finetune", ["image_size=56,42", f"init={tmp_path / 'src'}", "data=fashion-mnist",
                                  "lr=0.01"])
    assert cfg.init == str(tmp_path / "src") and cfg.data.name == "fashion-mnist" and cfg.optim.lr == 0.01
    assert cfg.model.image_size == (56, 42)
    assert (cfg.model.patch_size, cfg.model.in_chans, cfg.model.dim) == (7, 1, 32)
    assert cfg.model.representation_size is None  # the pre-training head is dropped
    assert get_recipe("finetune", [f"init={tmp_path / 'src'}"]).model.image_size == (28, 28)
    regularised = get_recipe("finetune", [f"init={tmp_path / 'src'}", "model.patch_dropout=0.25",
                                          "model.drop_path=0.1"])
    assert (regularised.model.patch_dropout, regularised.model.drop_path) == (0.25, 0.1)
    from vitkit.train.prepare import build_model

    model = build_model(regularised, num_classes=3)
    assert (model.cfg.patch_dropout, model.cfg.drop_path) == (0.25, 0.1)
    with pytest.raises(ValueError, match="multiple of the patch stride 7"):
        get_recipe("finetune", [f"init={tmp_path / 'src'}", "image_size=50"])


def test_finetune_uses_every_model_setting_and_refuses_those_the_weights_fix(tmp_path):
    """Next to init=, a `--set model.*` that the weights allow (the normalisation, the pooling) reaches the
    trained model, as --show says; one they fix (depth, width) is refused by name instead of ignored."""
    import vitkit
    from vitkit.train.prepare import build_model

    source = vitkit.create_model("ViT-Ti/16", image_size=(28, 28), patch_size=7, in_chans=1, dim=32,
                                 depth=1, num_heads=2, mlp_dim=64, num_classes=3)
    vitkit.save(source, tmp_path / "src")
    cfg = get_recipe("finetune", [f"init={tmp_path / 'src'}", "model.mean=0.5", "model.std=0.25",
                                  "model.pool=gap", "model.depth=1"])  # depth as the checkpoint's: allowed
    model = build_model(cfg, num_classes=3)
    assert (model.cfg.mean, model.cfg.std, model.cfg.pool, model.cfg.depth) == ((0.5,), (0.25,), "gap", 1)
    assert model.cfg == cfg.model.replace(num_classes=3)
    with pytest.raises(ValueError,
                       match=r"--set model.depth=6, model.dim=64: fine-tuning from init=.* keeps its "
                             r"architecture, whose weights fix .*depth"):
        get_recipe("finetune", [f"init={tmp_path / 'src'}", "model.depth=6", "model.dim=64", "lr=0.1"])


@pytest.mark.parametrize("items", [
    ["model.class_token=false", "model.pool=gap"],
    ["model.num_heads=3", "model.dim=48"],
    ["optim.min_lr=0.01", "optim.lr=0.1"],
])
def test_overrides_are_checked_together_in_any_order(items):
    """Each group checks its fields together, so a valid combination passes whichever `--set` comes first."""
    for order in (items, items[::-1]):
        cfg = get_recipe("demo-tiny", order)
        for item in items:
            key, value = item.split("=")
            group, name = key.split(".")
            assert str(getattr(getattr(cfg, group), name)).lower() == value
    with pytest.raises(ValueError, match=r"--set model.num_heads=5, model.dim=102: .*not divisible"):
        get_recipe("demo-tiny", ["model.num_heads=5", "model.dim=102"])
    assert get_recipe("demo-tiny", ["optim.lr=0.5", "lr=0.25"]).optim.lr == 0.25  # the later one wins


@pytest.mark.parametrize("item, message", [
    ("log_every=0", "log_every=0 (need an integer >= 1)"),
    ("threads=-1", "threads=-1 (need an integer >= 0)"),
    ("device=tpu", "device='tpu' (choose from auto, cpu, cuda, cuda:N"),
    ("device=cuda:x", "device='cuda:x'"),
    ("epochs=inf", "epochs=inf (need a finite number >= 0)"),
    ("epochs=nan", "epochs=nan"),
    ("full_token_epochs=inf", "full_token_epochs=inf"),
    ("steps=-1", "steps=-1"),
    ("seed=-1", "seed=-1"),
    ("eval_every=-2", "eval_every=-2"),
    ("ckpt_every=-1", "ckpt_every=-1"),
    ("keep_last=0", "keep_last=0"),
    ("batch_size=0", "batch_size=0"),
    ("ema=1", "ema=1.0"),
    ("optim.lr=nan", "lr=nan (need a finite number > 0)"),
    ("optim.lr=inf", "lr=inf"),
    ("optim.min_lr=-1", "min_lr=-1.0"),
    ("optim.weight_decay=nan", "weight_decay=nan"),
    ("optim.eps=0", "eps=0.0"),
    ("optim.momentum=-0.5", "momentum=-0.5"),
    ("optim.betas=0.9,1.5", "betas=(0.9, 1.5)"),
    ("optim.warmup_epochs=inf", "warmup_epochs=inf"),
    ("optim.warmup_steps=-3", "warmup_steps=-3"),
    ("optim.clip_grad_norm=nan", "clip_grad_norm=nan"),
    ("optim.label_smoothing=nan", "label_smoothing=nan"),
    ("data.eval_batch_size=0", "eval_batch_size=0 (need an integer >= 1)"),
    ("data.workers=-1", "workers=-1"),
    ("data.limit=-5", "limit=-5"),
    ("data.val_limit=-5", "val_limit=-5"),
    ("augment.mixup=nan", "augment.mixup=nan (need a finite number)"),
])
def test_out_of_range_values_are_refused_naming_the_key(item, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        get_recipe("demo-tiny", [item])
    assert str(e.value).startswith(f"--set {item}: ") and "\n" not in str(e.value)


def test_device_names():
    for name in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        assert device_error(name) is None
    assert device_error("tpu") and device_error("cuda:") and device_error("CPU")


def test_cli_refuses_a_bad_value_before_creating_the_run_folder(tmp_path):
    out = tmp_path / "run"
    bad = subprocess.run([sys.executable, "-m", "vitkit.cli.main", "train", "demo-tiny", "--out", str(out),
                          "--set", "threads=-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and not out.exists()
    assert bad.stderr.startswith("error: --set threads=-1: ") and "Traceback" not in bad.stderr


def test_gap_by_override_drops_the_class_token_as_create_model_does():
    """`--set model.pool=gap` is the paper's GAP (D.3), no class token, as create_model(pool="gap") and the
    README say; with model.class_token=true set too it is timm's GAP that keeps its class token."""
    cfg = apply_overrides(get_recipe("demo"), ["model.pool=gap"])
    assert cfg.model.pool == "gap" and cfg.model.class_token is False
    assert cfg.model == vitkit.create_model(get_recipe("demo").model, pool="gap").cfg
    kept = apply_overrides(get_recipe("demo"), ["model.pool=gap", "model.class_token=true"])
    assert kept.model.pool == "gap" and kept.model.class_token is True
