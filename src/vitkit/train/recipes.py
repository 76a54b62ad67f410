"""Training recipes: functions that return a TrainConfig (vitkit.train.settings), and `get_recipe`, which
applies `--set` overrides to one (vitkit.train.overrides).

A recipe's docstring gives the command that runs it and the result it reaches. Every recipe has a tiny twin
(`NAME-tiny`) that runs in seconds on a CPU, for tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..config import ViTConfig, get_config
from ..data.augment import AugmentConfig
from .overrides import apply_overrides
from .settings import DataConfig, OptimConfig, TrainConfig


def pretrain() -> TrainConfig:
    """Pre-training on ImageNet-21k as in the paper (Sec. 4.1; Appendix B.1, Table 3's ImageNet-21k row):
    ViT-B/16 at 224 px with the pre-training head (one tanh hidden layer), Adam (b1 0.9, b2 0.999) with
    decoupled weight decay 0.03 (as Flax's Adam: lr x wd x weight per step), dropout 0.1, batch 4096, learning
    rate 1e-3 with a linear warm-up over 10k steps then linear decay, gradient clipping at global norm 1, 90
    epochs. The loss is a sigmoid cross-entropy per class with the classifier's bias started at -10, as the
    authors trained on this multi-label dataset (github.com/google-research/vision_transformer/issues/2;
    big_vision's configs/vit_i21k.py). Batch 4096 runs as 64 accumulation steps of 64 images (divided among
    the processes).

        vitkit train pretrain --out runs/pretrain --set data.name=/data/imagenet21k
        torchrun --nproc_per_node 8 -m vitkit.cli.main train pretrain --out runs/pretrain --set ...

    Needs an ImageNet-sized folder and days of accelerators; fine-tuned on ImageNet at 384 px, the authors'
    code reaches 84.6 % top-1 with such a ViT-B/16 (its README); not reproduced here. Table 3's JFT-300M row
    differs: weight decay 0.1, no dropout, 7 epochs, lr 8e-4.
    """
    return TrainConfig(
        recipe="pretrain",
        model=get_config("ViT-B/16", representation_size=768, num_classes=1000, dropout=0.1),
        optim=OptimConfig(name="adamw", lr=1e-3, weight_decay=0.03, betas=(0.9, 0.999), schedule="linear",
                          warmup_steps=10_000, clip_grad_norm=1.0, loss="sigmoid", head_bias=-10.0),
        data=DataConfig(name="", workers=8),
        augment=AugmentConfig(crop="rrc", hflip=0.5),
        epochs=90.0, batch_size=4096, micro_batch=64, ckpt_every=5000, eval_every=5000,
    )


def finetune() -> TrainConfig:
    """Fine-tuning as in the paper (Sec. 4.1, Appendix B.1.1) and its code (vit_jax): SGD with momentum 0.9,
    no weight decay, gradient clipping at global norm 1, batch 512, 500 warm-up steps then cosine decay, lr
    0.003 (the paper sweeps 0.001-0.03), 10k steps (the CIFAR setting), at 384 px; training crops of 5 % to
    100 % of the image (vit_jax's `sample_distorted_bounding_box` area range) and flips; the position table
    resampled as vit_jax does (`posemb_interpolation='bilinear-corners'`). Batch 512 runs as accumulation
    steps of 32 images. `init` names the pre-trained checkpoint (anything `vitkit.load` reads).

        vitkit train finetune --out runs/ft --set init=path/to/vit_b16 --set data.name=cifar10

    With the ImageNet-21k ViT-B/16 this setting reaches 98.9 % and 99.0 % on CIFAR-10 in the authors' two runs
    (vision_transformer's README); not reproduced with vitkit.
    """
    return TrainConfig(
        recipe="finetune",
        model=get_config("ViT-B/16", image_size=384, num_classes=10),
        optim=OptimConfig(name="sgd", lr=0.003, weight_decay=0.0, momentum=0.9, schedule="cosine",
                          warmup_steps=500, clip_grad_norm=1.0),
        data=DataConfig(name="cifar10", workers=4),
        augment=AugmentConfig(crop="rrc", crop_scale=(0.05, 1.0), hflip=0.5),
        init="", posemb_interpolation="bilinear-corners", steps=10_000, batch_size=512, micro_batch=32,
        ckpt_every=500, eval_every=1000,
    )


def fashion_mnist_vit(depth: int, name: str, patch: int = 7, dim: int = 128, mlp_dim: int = 256,
                      patch_dropout: float = 0.0, attn_init: str = "xavier") -> ViTConfig:
    """The small pure ViT of the Fashion-MNIST recipes: 28x28 grey images cut into `patch` x `patch` patches,
    4 heads, normalised with the training set's mean and std."""
    return ViTConfig(image_size=(28, 28), patch_size=patch, in_chans=1, num_classes=10, dim=dim, depth=depth,
                     num_heads=4, mlp_dim=mlp_dim, patch_dropout=patch_dropout, attn_init=attn_init,
                     mean=(0.2860,), std=(0.3530,),
                     interpolation="bilinear", crop_pct=1.0, name=name)


def fashion_mnist() -> TrainConfig:
    """A pure ViT from scratch on Fashion-MNIST within 30 minutes on 2 CPU cores: 4x4 patches (49 tokens and
    the class token), width 64, depth 6, 4 heads, the paper's MLP of four times the width (256; 305k
    parameters), mimetic attention initialisation, PatchDropout 0.5 except in the last epoch, AdamW lr 4e-3,
    batch 256, weight decay 0.05, label smoothing 0.1, pad-crop, flips and random erasing, an EMA of the
    weights, 90 epochs, bf16 autocast where the CPU computes bf16 natively (fp32 elsewhere), through
    torch.compile. Run it as two processes of one thread each:

        vitkit train fashion-mnist --out runs/fmnist --nproc 2

    It chooses on 5,000 held-out training images and reaches 93.39 ± 0.30 % test top-1 (final weights, seeds
    0-1) in 29.2-29.4 minutes on 2 cores of an AMD EPYC with native bf16 (Zen 4), 93.39 ± 0.22 % (seeds 0-2)
    in 17.7-19.6 minutes on a Zen 5, and 93.42 ± 0.17 % (seeds 2-4, fp32) in 67-77 minutes on 2 cores of an
    AVX2-only AMD EPYC (Zen 3) (benchmarks/results/recipe-fashion-mnist_amd-epyc*_2026-12-0[678]_*seed*.json).
    Why it is built this way: docs/training.md.
    """
    return TrainConfig(
        recipe="fashion-mnist",
        model=fashion_mnist_vit(depth=6, name="vit-fashion-mnist", patch=4, dim=64, mlp_dim=256,
                                patch_dropout=0.5, attn_init="mimetic"),
        optim=OptimConfig(name="adamw", lr=4e-3, weight_decay=0.05, schedule="cosine", warmup_epochs=2.0,
                          clip_grad_norm=1.0, label_smoothing=0.1),
        data=DataConfig(name="fashion-mnist"),
        augment=AugmentConfig(crop="pad-crop", pad=2, hflip=0.5, random_erasing=0.25),
        # eval_every: every 3 epochs of Fashion-MNIST's 60,000 training images at batch 256 (a step count: it
        # is not rescaled when data.limit or batch_size is changed).
        epochs=90.0, full_token_epochs=1.0, batch_size=256, ema=0.999, eval_every=3 * (60_000 // 256),
        log_every=50, precision="bf16-native", compile=True,
    )


def fashion_mnist_long() -> TrainConfig:
    """The strongest from-scratch pure ViT on Fashion-MNIST within about two hours on 2 CPU cores: the
    `fashion-mnist` recipe twice as wide (width 128, MLP 256, 4 heads of 32; 805k parameters) at AdamW 3e-3,
    for 100 epochs. Run it as two processes of one thread each:

        vitkit train fashion-mnist-long --out runs/fmnist-long --nproc 2

    It reaches 93.75 % test top-1 in 104.6 minutes on 2 vCPUs of an Intel Xeon with AMX (Sapphire Rapids)
    (benchmarks/results/recipe-fashion-mnist-long_intel-xeon_2026-12-03.json). Why it is built this way:
    docs/training.md.
    """
    base = fashion_mnist()
    return dataclasses.replace(
        base, recipe="fashion-mnist-long",
        model=base.model.replace(dim=128, mlp_dim=256, name="vit-fashion-mnist-long"),
        optim=dataclasses.replace(base.optim, lr=3e-3),
        epochs=100.0,
    )


def fashion_mnist_teacher() -> TrainConfig:
    """A convolutional teacher for `fashion-mnist-distilled`: vitkit's BiT ResNet (the hybrid's: three stages
    of two bottleneck units, root width 32; weight-standardised convolutions, GroupNorm) on the images resized
    to 32x32, then one transformer block of width 128 over its 2x2 map and global average pooling: a ResNet in
    all but its last layer (1.06 M parameters, 19 MFLOPs an image). The `fashion-mnist` recipe's training
    otherwise (augmentation, label smoothing, EMA, bf16 where native, compiled), at AdamW 2e-3 for 30 epochs:

        vitkit train fashion-mnist-teacher --out runs/fm-teacher --nproc 2

    Results in docs/training.md ("Distillation").
    """
    base = fashion_mnist()
    model = base.model.replace(image_size=(32, 32), patch_size=1, hybrid_layers=(2, 2, 2), hybrid_width=32,
                               dim=128, depth=1, mlp_dim=256, pool="gap", class_token=False,
                               patch_dropout=0.0, attn_init="xavier", name="vit-fashion-mnist-teacher")
    return dataclasses.replace(base, recipe="fashion-mnist-teacher", model=model, epochs=30.0,
                               optim=dataclasses.replace(base.optim, lr=2e-3), full_token_epochs=0.0)


def fashion_mnist_distilled() -> TrainConfig:
    """The `fashion-mnist` recipe with DeiT's distillation token, taught by a teacher's hard labels (half the
    loss; vitkit.train.distill), for example the `fashion-mnist-teacher` recipe's:

        vitkit train fashion-mnist-teacher --out runs/fm-teacher --nproc 2
        vitkit train fashion-mnist-distilled --out runs/fm-distilled --nproc 2 \
            --set teacher=runs/fm-teacher/best

    Results in docs/training.md ("Distillation").
    """
    base = fashion_mnist()
    return dataclasses.replace(base, recipe="fashion-mnist-distilled",
                               model=base.model.replace(distilled=True, name="vit-fashion-mnist-distilled"))


def demo() -> TrainConfig:
    """What `make demo` trains: a small ViT with 7x7 patches (16 tokens), width 128, depth 4, on Fashion-MNIST
    for 6 epochs (2,808 steps of 128), flips only (in a run this short a random crop slows learning more than
    it regularises):

        vitkit train demo --out runs/demo

    About 3-5 minutes on 2 free CPU cores: 87.79 ± 0.14 % test top-1 (final weights, seeds 0-2, chosen on
    5,000 held-out training images) on an AMD EPYC (benchmarks/results/recipe-demo_amd-epyc_2026-12-04_seed*).
    """
    return TrainConfig(
        recipe="demo",
        model=fashion_mnist_vit(depth=4, name="vit-fashion-mnist-demo"),
        optim=OptimConfig(name="adamw", lr=2e-3, weight_decay=0.05, schedule="cosine", warmup_epochs=0.5,
                          clip_grad_norm=1.0, label_smoothing=0.1),
        data=DataConfig(name="fashion-mnist"),
        augment=AugmentConfig(crop="none", hflip=0.5),
        epochs=6.0, batch_size=128, log_every=50,
    )


def _tiny_model(cfg: ViTConfig, image_size: int, patch: int) -> ViTConfig:
    """The same kind of model, shrunk to run in a fraction of a second per step."""
    return cfg.replace(image_size=(image_size, image_size), patch_size=patch, dim=32, depth=2, num_heads=2,
                       mlp_dim=64, representation_size=32 if cfg.representation_size else None,
                       name=(cfg.name or "vit") + "-tiny")


def _tiny(cfg: TrainConfig, image_size: int, patch: int, batch: int = 32, micro: int = 0) -> TrainConfig:
    """A recipe's tiny twin: tiny model, a few hundred images, a few dozen steps, checkpoints every 4
    steps."""
    return dataclasses.replace(
        cfg, recipe=cfg.recipe + "-tiny", model=_tiny_model(cfg.model, image_size, patch),
        optim=dataclasses.replace(cfg.optim,
                                  warmup_steps=2 if cfg.optim.warmup_steps or cfg.optim.warmup_epochs else 0,
                                  warmup_epochs=0.0),
        data=dataclasses.replace(cfg.data, limit=256, val_limit=128, holdout=min(cfg.data.holdout, 32),
                                 workers=0, eval_batch_size=128),
        epochs=0.0, steps=16, batch_size=batch, micro_batch=micro, ckpt_every=4, eval_every=8, log_every=4,
        ema=cfg.ema and 0.9, compile=False,  # a few dozen steps: not worth a compilation
    )


def pretrain_tiny() -> TrainConfig:
    """pretrain's twin on 16x16 Fashion-MNIST: tiny model, gradient accumulation (batch 32 as 4 x 8)."""
    base = pretrain()
    cfg = _tiny(base, 16, 4, batch=32, micro=8)
    return dataclasses.replace(cfg, model=cfg.model.replace(in_chans=1, num_classes=10),
                               data=dataclasses.replace(cfg.data, name="fashion-mnist", val_split="auto"))


def finetune_tiny() -> TrainConfig:
    """finetune's twin: needs `init` (e.g. a tiny checkpoint); batch 16 as 2 x 8 at 16x16."""
    base = finetune()
    cfg = _tiny(base, 16, 4, batch=16, micro=8)
    return dataclasses.replace(cfg, model=cfg.model.replace(in_chans=1, num_classes=10),
                               data=dataclasses.replace(cfg.data, name="fashion-mnist"))


def fashion_mnist_tiny() -> TrainConfig:
    return _tiny(fashion_mnist(), 28, 4)


def fashion_mnist_long_tiny() -> TrainConfig:
    return _tiny(fashion_mnist_long(), 28, 4)


def demo_tiny() -> TrainConfig:
    return _tiny(demo(), 28, 7)


def fashion_mnist_teacher_tiny() -> TrainConfig:
    """The teacher's twin: one bottleneck unit at 16x16 (a 4x4 map), one block of width 32."""
    cfg = _tiny(fashion_mnist_teacher(), 16, 1)
    return dataclasses.replace(cfg, model=cfg.model.replace(hybrid_layers=(1,), depth=1))


def fashion_mnist_distilled_tiny() -> TrainConfig:
    return _tiny(fashion_mnist_distilled(), 28, 4)


RECIPES: dict[str, Callable[[], TrainConfig]] = {
    "pretrain": pretrain,
    "finetune": finetune,
    "fashion-mnist": fashion_mnist,
    "fashion-mnist-long": fashion_mnist_long,
    "demo": demo,
    "fashion-mnist-teacher": fashion_mnist_teacher,
    "fashion-mnist-distilled": fashion_mnist_distilled,
    "pretrain-tiny": pretrain_tiny,
    "finetune-tiny": finetune_tiny,
    "fashion-mnist-tiny": fashion_mnist_tiny,
    "fashion-mnist-long-tiny": fashion_mnist_long_tiny,
    "demo-tiny": demo_tiny,
    "fashion-mnist-teacher-tiny": fashion_mnist_teacher_tiny,
    "fashion-mnist-distilled-tiny": fashion_mnist_distilled_tiny,
}


# Recipes that fine-tune: without `init` they would train their model from scratch, which they are not made
# for.
NEEDS_INIT = ("finetune", "finetune-tiny")
# Recipes that distil: without a teacher the distillation token would learn the labels like the class token.
NEEDS_TEACHER = ("fashion-mnist-distilled", "fashion-mnist-distilled-tiny")


def missing_init(cfg: TrainConfig) -> str | None:
    """Why `cfg` cannot run as it is (a fine-tuning recipe without `init`, a distilling one without
    `teacher`), or None."""
    if cfg.recipe in NEEDS_INIT and not cfg.init:
        return (f"the {cfg.recipe} recipe fine-tunes a pre-trained model: set init=CHECKPOINT (anything "
                "vitkit.load reads, e.g. --set init=ViT-B_16.npz); to train from scratch, use pretrain, "
                "fashion-mnist or demo")
    if cfg.recipe in NEEDS_TEACHER and not cfg.teacher:
        return (f"the {cfg.recipe} recipe learns from a teacher: set teacher=MODEL (a trained classifier of "
                "the same classes, e.g. --set teacher=runs/fm-teacher/best after `vitkit train "
                "fashion-mnist-teacher --out runs/fm-teacher`)")
    return None


def get_recipe(name: str, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The recipe `name` with `--set key=value` overrides applied."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return apply_overrides(RECIPES[name](), overrides)
