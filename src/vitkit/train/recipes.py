"""Training recipes: functions that return a TrainConfig (vitkit.train.settings), and `get_recipe`, which applies
`--set` overrides to one (vitkit.train.overrides).

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
    """Pre-training on ImageNet-21k as in the paper (Sec. 4.1; Appendix B.1, Table 3's ImageNet-21k row): ViT-B/16
    at 224 px with the pre-training head (one tanh hidden layer), Adam (b1 0.9, b2 0.999) with decoupled weight
    decay 0.03 (as Flax's Adam: lr x wd x weight per step), dropout 0.1, batch 4096, learning rate 1e-3 with a
    linear warm-up over 10k steps then linear decay, gradient clipping at global norm 1, 90 epochs. The loss is
    a sigmoid cross-entropy per class with the classifier's bias started at -10, as the authors trained on this
    multi-label dataset (github.com/google-research/vision_transformer/issues/2; big_vision's configs/vit_i21k.py). Batch
    4096 runs as 64 accumulation steps of 64 images (divided among the processes).

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
        data=DataConfig(name="", val_split="val", workers=8),
        augment=AugmentConfig(crop="rrc", hflip=0.5),
        epochs=90.0, batch_size=4096, micro_batch=64, ckpt_every=5000, eval_every=5000,
    )


def finetune() -> TrainConfig:
    """Fine-tuning as in the paper (Sec. 4.1, Appendix B.1.1) and its code (vit_jax): SGD with momentum 0.9, no
    weight decay, gradient clipping at global norm 1, batch 512, 500 warm-up steps then cosine decay, lr 0.003
    (the paper sweeps 0.001-0.03), 10k steps (the CIFAR setting), at 384 px; training crops of 5 % to 100 % of
    the image (vit_jax's `sample_distorted_bounding_box` area range) and flips; the position table resampled
    as vit_jax does (`posemb_interpolation='bilinear-corners'`). Batch 512 runs as accumulation steps of 32
    images. `init` names the pre-trained checkpoint (anything `vitkit.load` reads).

        vitkit train finetune --out runs/ft --set init=path/to/vit_b16 --set data.name=cifar10

    With the ImageNet-21k ViT-B/16 this setting reaches 98.9 % and 99.0 % on CIFAR-10 in the authors' two runs
    (vision_transformer's README); not reproduced with vitkit.
    """
    return TrainConfig(
        recipe="finetune",
        model=get_config("ViT-B/16", image_size=384, num_classes=10),
        optim=OptimConfig(name="sgd", lr=0.003, weight_decay=0.0, momentum=0.9, schedule="cosine",
                          warmup_steps=500, clip_grad_norm=1.0),
        data=DataConfig(name="cifar10", val_split="test", workers=4),
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
    """Our from-scratch pure ViT for Fashion-MNIST within 30 minutes on 2 CPU cores (benchmarks/fashion_mnist.py):
    4x4 patches (49 tokens + class token), width 64, depth 6, 4 heads, MLP 128 (206k parameters), its attention
    initialised mimetically (`model.attn_init`: W_q W_k^T near +I, W_v W_o near -I); in training
    each image keeps a random half of its patch tokens (PatchDropout, `model.patch_dropout` 0.5) except in the
    last epoch, which sees them all (`full_token_epochs`); AdamW lr 4e-3, batch 256, weight decay 0.05, 2
    epochs of warm-up then cosine, label smoothing 0.1; a random crop after 2 pixels of padding, flips and
    random erasing (p 0.25); EMA of the weights; 90 epochs; the test set evaluated every 3 epochs. bf16 autocast
    where the CPU computes bf16 natively (`precision="bf16-native"`: AVX512-BF16 or AMX, as on the AMD EPYC measured below; fp32
    elsewhere), with the attention matrices kept in fp32. Run it as two processes of one thread each
    (`--nproc 2`): on 2 cores that is 1.25-1.35x faster than one process of two threads, whose small matrix
    products parallelise poorly.

        vitkit train fashion-mnist --out runs/fmnist --nproc 2
        .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/fashion_mnist.py --out runs/bench-fmnist

    How the recipe was chosen (benchmarks/fashion_mnist.py, test top-1 on 2 AMD EPYC cores; compute is the
    budget). Every figure below predates the present initialisation of the class token (zeros) and position
    embedding (normal 0.02, not truncated), as the Flax code has them; the runs were not repeated since.
    - 16 tokens overfit: 7x7 patches, width 128, no crop, 25 epochs: 90.25 % in 21.5 min, with the test loss
      rising from epoch 20 on and the training loss still falling.
    - At equal time (about 6 minutes, 2 cores, no crop) small patches need a narrow model: 7x7/width 128
      87.61 %; 4x4/width 64 87.51 %; 4x4/width 96 86.76 %; 4x4/width 128 85.56 % (2.7 epochs).
    - With the crop and erasing, two runs side by side on one core each: 4x4/width 64 was at 88.49 % after
      13 of 28 epochs, 7x7/width 128 at 87.78 % after 16 of 30; the augmented runs start slower (72.9 % and
      61.6 % after one epoch) and keep climbing where the unaugmented one stalls.
    - All 50 tokens, 26 epochs: 90.79 % in 26.7 min; 29 epochs (with the faster attention of the training
      step): 91.11 % in 31.8 min. Tried and dropped: depth 7 (no better per epoch, 1.13x slower); batch 64
      (lr 1.5e-3; no better per epoch, slower per epoch); fine-tuning 2 epochs at 36 px (81 tokens, Sec. 3.2)
      after the 29 epochs: 90.83 %, below the 91.11 % it started from; MLP ratio 4 and GAP: no gain.
    - PatchDropout (lr 2e-3, batch 128, one process): 0.25, 35 epochs: 91.32 % in 29.0 min; 0.5, 45 epochs:
      91.82 % in 26.0 min.
    - 12-epoch runs side by side on one core each (lr 2e-3, PatchDropout 0.5: 86.54 %): sincos-2d positions
      86.34 % (ahead until epoch 9, then behind); all tokens in the last epoch 86.87 %, and with that: no
      random erasing 86.55 %, lr 3e-3 87.39 %; PatchDropout 0.75 for 17 epochs and one with all tokens (about
      the same time) 87.13 %.
    - Two processes of one thread, lr 3e-3, batch 128, 50 epochs (the last with all tokens): 92.23 % in
      24.3 min. Batch 256 is another 1.22x faster per image with two processes (2,900 vs 2,380 img/s).
    - The recipe with PatchDropout 0.75, 90 epochs, the last 2 with all tokens: 91.77 % in 26.4 min (behind the
      recipe at every point in time: 90.82 % vs ~91.5 % after 17 min; the 2 full-token epochs added nothing).

    - With the Flax (Xavier) attention initialisation: 92.48 % in 25.4 min; 85 % after 4.6 min, 90 % after
      11.3 min, 92 % after 20.3 min.
    - Mimetic initialisation, 12-epoch runs side by side (lr 4e-3, batch 256; Xavier 86.81 %): 88.39 %, ahead
      from the fourth epoch on; with the fixed sine-cosine positions 87.89 %; with the learned table started
      at the sine-cosine one 87.60 %; with 2 heads of 32 87.92 %; with lr 6e-3 87.98 %; weight decay 0.1
      88.23 %, random erasing p 0.5 88.42 % (both within the noise).
    - Mimetic, 72 epochs: 92.76 % in 30.3 min (the machine slowed down in the last 10 minutes; 92.68 % after
      69 epochs): no better than 66. Mimetic with lr 3e-3, 66 epochs: 92.45 % (31.3 min in a slow phase of the
      machine; level with lr 4e-3 until epoch 36, then behind).

    - fp32, 66 epochs (the recipe before bf16): 92.76 % test top-1 in 24.6 min; 85 % after 3.6 min, 90 % after
      10.1 min, 92 % after 18.9 min (ahead of the Xavier initialisation at every evaluation: 91.02 vs 90.66 %
      after 36 epochs).
    - bf16 autocast (one core's training step 1.6x faster, 1.24x per epoch with two processes), 12-epoch runs
      side by side (fp32 88.39 %): everything in bf16 87.78 %; the softmax in fp32 87.72 %; the attention's
      logits and softmax in fp32 88.13 % (the model's choice; 1.14x slower than the fp32 softmax alone). All
      bf16 with width 80 and MLP 160: 87.66 % (1.2x slower per step than width 64).

    Measured, the full recipe (`torchrun --standalone --nproc_per_node 2 benchmarks/fashion_mnist.py --set
    precision=bf16-native --set epochs=90`, the recipe's values): 93.29 % test top-1 (93.24 % for the saved model
    evaluated in fp32) in 26.2 min; 85 % after 2.8 min, 90 % after 8.9, 92 % after 17.4, 93 % after 22.5. With
    `--set seed=1`: 93.22 % (93.19 % in fp32) in 28.6 min (the machine slowed down in the last third), 93 % after
    25.0 min. With more time, `--set epochs=150`: 93.59 % (93.61 % in fp32) in 52.7 min (a slow phase of the
    machine throughout, ~2,500 img/s).
    """
    return TrainConfig(
        recipe="fashion-mnist",
        model=fashion_mnist_vit(depth=6, name="vit-fashion-mnist", patch=4, dim=64, mlp_dim=128,
                                patch_dropout=0.5, attn_init="mimetic"),
        optim=OptimConfig(name="adamw", lr=4e-3, weight_decay=0.05, schedule="cosine", warmup_epochs=2.0,
                          clip_grad_norm=1.0, label_smoothing=0.1),
        data=DataConfig(name="fashion-mnist", val_split="test"),
        augment=AugmentConfig(crop="pad-crop", pad=2, hflip=0.5, random_erasing=0.25),
        # eval_every: every 3 epochs of Fashion-MNIST's 60,000 training images at batch 256 (a step count: it
        # is not rescaled when data.limit or batch_size is changed).
        epochs=90.0, full_token_epochs=1.0, batch_size=256, ema=0.999, eval_every=3 * (60_000 // 256),
        log_every=50, precision="bf16-native",
    )


def demo() -> TrainConfig:
    """What `make demo` trains: a small ViT with 7x7 patches (16 tokens), width 128, depth 4, on Fashion-MNIST
    for 6 epochs (2,808 steps of 128): about 5 minutes on 2 free CPU cores, 85 % or more on the test set.
    Flips only: in a run this short a random crop slows learning more than it regularises (73 % vs 78 % after
    the first epoch, 82.2 % vs 84.7 % after the third, in two 5-epoch runs).

        vitkit train demo --out runs/demo

    Measured: `make demo` on a fresh clone, 2 free cores: trained in 173 s (~2,400 img/s), 87.52 % test top-1,
    4.5 min for the whole demo with set-up. (88.39 % in another run, 1 thread on a shared machine, 18.7 min.)
    With the present (Flax) initialisation of the class token and positions, on a slower Intel machine:
    87.72 %, 99.73 % top-5, 2,808 steps in 6.4 min.
    The mimetic attention initialisation that helps the `fashion-mnist` recipe does not help this 4x4 grid of
    tokens: 87.62 % vs 87.96 % with Xavier, two runs side by side on one core each.
    """
    return TrainConfig(
        recipe="demo",
        model=fashion_mnist_vit(depth=4, name="vit-fashion-mnist-demo"),
        optim=OptimConfig(name="adamw", lr=2e-3, weight_decay=0.05, schedule="cosine", warmup_epochs=0.5,
                          clip_grad_norm=1.0, label_smoothing=0.1),
        data=DataConfig(name="fashion-mnist", val_split="test"),
        augment=AugmentConfig(crop="none", hflip=0.5),
        epochs=6.0, batch_size=128, log_every=50,
    )


def _tiny_model(cfg: ViTConfig, image_size: int, patch: int) -> ViTConfig:
    """The same kind of model, shrunk to run in a fraction of a second per step."""
    return cfg.replace(image_size=(image_size, image_size), patch_size=patch, dim=32, depth=2, num_heads=2,
                       mlp_dim=64, representation_size=32 if cfg.representation_size else None,
                       name=(cfg.name or "vit") + "-tiny")


def _tiny(cfg: TrainConfig, image_size: int, patch: int, batch: int = 32, micro: int = 0) -> TrainConfig:
    """A recipe's tiny twin: tiny model, a few hundred images, a few dozen steps, checkpoints every 4 steps."""
    return dataclasses.replace(
        cfg, recipe=cfg.recipe + "-tiny", model=_tiny_model(cfg.model, image_size, patch),
        optim=dataclasses.replace(cfg.optim, warmup_steps=2 if cfg.optim.warmup_steps or cfg.optim.warmup_epochs
                                  else 0, warmup_epochs=0.0),
        data=dataclasses.replace(cfg.data, limit=256, val_limit=128, workers=0, eval_batch_size=128),
        epochs=0.0, steps=16, batch_size=batch, micro_batch=micro, ckpt_every=4, eval_every=8, log_every=4,
        ema=cfg.ema and 0.9,
    )


def pretrain_tiny() -> TrainConfig:
    """pretrain's twin on 16x16 Fashion-MNIST: tiny model, gradient accumulation (batch 32 as 4 x 8)."""
    base = pretrain()
    cfg = _tiny(base, 16, 4, batch=32, micro=8)
    return dataclasses.replace(cfg, model=cfg.model.replace(in_chans=1, num_classes=10),
                               data=dataclasses.replace(cfg.data, name="fashion-mnist", val_split="test"))


def finetune_tiny() -> TrainConfig:
    """finetune's twin: needs `init` (e.g. a tiny checkpoint); batch 16 as 2 x 8 at 16x16."""
    base = finetune()
    cfg = _tiny(base, 16, 4, batch=16, micro=8)
    return dataclasses.replace(cfg, model=cfg.model.replace(in_chans=1, num_classes=10),
                               data=dataclasses.replace(cfg.data, name="fashion-mnist"))


def fashion_mnist_tiny() -> TrainConfig:
    return _tiny(fashion_mnist(), 28, 4)


def demo_tiny() -> TrainConfig:
    return _tiny(demo(), 28, 7)


RECIPES: dict[str, Callable[[], TrainConfig]] = {
    "pretrain": pretrain,
    "finetune": finetune,
    "fashion-mnist": fashion_mnist,
    "demo": demo,
    "pretrain-tiny": pretrain_tiny,
    "finetune-tiny": finetune_tiny,
    "fashion-mnist-tiny": fashion_mnist_tiny,
    "demo-tiny": demo_tiny,
}


# Recipes that fine-tune: without `init` they would train their model from scratch, which they are not made for.
NEEDS_INIT = ("finetune", "finetune-tiny")


def missing_init(cfg: TrainConfig) -> str | None:
    """Why `cfg` cannot run as it is (a fine-tuning recipe without `init`), or None."""
    if cfg.recipe in NEEDS_INIT and not cfg.init:
        return (f"the {cfg.recipe} recipe fine-tunes a pre-trained model: set init=CHECKPOINT (anything vitkit.load "
                "reads, e.g. --set init=ViT-B_16.npz); to train from scratch, use pretrain, fashion-mnist or demo")
    return None


def get_recipe(name: str, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The recipe `name` with `--set key=value` overrides applied."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return apply_overrides(RECIPES[name](), overrides)
