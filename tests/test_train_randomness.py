"""Randomness per image (vitkit.streams through the trainer): on two gloo processes no two images share a
drop-path or PatchDropout mask, each image's masks are the ones it gets on one process, and a 2-process run
with every regulariser on ends where the 1-process run ends."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

import vitkit.model
from train_helpers import as_process, fake_data_overrides, free_port, write_fake_fashion_mnist
from vitkit.train import get_recipe, train

# SGD (see test_train_distributed.py: with Adam, float noise in a gradient near 0 is amplified) and every
# regulariser that draws per image: drop-path, PatchDropout, the random crop, flips, RandAugment, random
# erasing, MixUp and CutMix.
EVERY_REGULARISER = ["device=cpu", "threads=1", "optim.name=sgd", "optim.lr=0.05", "batch_size=32", "steps=4",
                     "eval_every=4", "ckpt_every=4", "model.drop_path=0.1", "model.patch_dropout=0.5",
                     "augment.crop=pad-crop", "augment.pad=2", "augment.hflip=0.5", "augment.randaugment=2,9",
                     "augment.random_erasing=0.25", "augment.mixup=0.8", "augment.cutmix=1.0"]


def record_masks() -> list[tuple[str, torch.Tensor]]:
    """From now on in this process, every training-time drop-path mask ((B,): 0 or 1 / (1 - p)) and
    PatchDropout choice ((B, kept) token indices) the model draws, in order."""
    masks: list[tuple[str, torch.Tensor]] = []
    drop_path, patch_dropout = vitkit.model.drop_path, vitkit.model.patch_dropout

    def recorded_drop_path(x, p, training, stream=None):
        if training and p > 0:
            keep = drop_path(torch.ones(x.shape[0], 1, 1), p, training, stream)
            masks.append(("drop_path", keep.flatten()))
        return drop_path(x, p, training, stream)

    def recorded_patch_dropout(x, p, num_prefix, training, stream=None):
        if training and p > 0:
            B, T, _ = x.shape
            coded = torch.arange(T, dtype=torch.float32)[None, :, None].expand(B, T, 1)
            kept = patch_dropout(coded, p, num_prefix, training, stream)
            masks.append(("patch_dropout", kept[..., 0].long()))
        return patch_dropout(x, p, num_prefix, training, stream)

    vitkit.model.drop_path, vitkit.model.patch_dropout = recorded_drop_path, recorded_patch_dropout
    return masks


def _worker(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    as_process(rank, world, port)
    masks = record_masks()
    train(get_recipe("demo-tiny", overrides), out, progress=False)
    torch.save(masks, f"{out}-masks-{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """demo-tiny with every regulariser, 4 steps of 32: one process with the whole batch, and two processes
    of 16 images as two micro-batches of 8; the masks each process drew."""
    tmp = tmp_path_factory.mktemp("randomness")
    data = write_fake_fashion_mnist(tmp / "data", n_train=256, n_test=64)
    overrides = EVERY_REGULARISER + fake_data_overrides(data)
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(vitkit.model, "drop_path", vitkit.model.drop_path)  # put back when the fixture ends
        mp_.setattr(vitkit.model, "patch_dropout", vitkit.model.patch_dropout)
        masks = record_masks()
        train(get_recipe("demo-tiny", overrides), tmp / "one", progress=False)
    mp.spawn(_worker, args=(2, free_port(), overrides + ["micro_batch=8"], str(tmp / "two")), nprocs=2,
             join=True)
    return tmp, masks, [torch.load(tmp / f"two-masks-{r}.pt") for r in range(2)]


def test_two_processes_never_share_a_mask_and_draw_the_masks_of_one(runs):
    _, one, (rank0, rank1) = runs
    kinds = [kind for kind, _ in one[:3]]
    assert kinds == ["patch_dropout", "drop_path", "drop_path"]  # per forward: tokens, then block 1's two
    assert len(one) == 4 * 3 and len(rank0) == len(rank1) == 4 * 2 * 3  # 4 steps, 2 micro-batches each
    for (kind0, m0), (kind1, m1) in zip(rank0, rank1, strict=True):
        assert kind0 == kind1 and m0.shape == m1.shape == (8,) + m0.shape[1:]
        if kind0 == "patch_dropout":  # 8 of 16 tokens: two images' choices coincide once in 12,870
            assert not torch.equal(m0, m1)  # the two processes' images drew differently
    for kind in ("patch_dropout", "drop_path"):  # and over the run
        mine = [torch.cat([m for k, m in rank if k == kind]) for rank in (rank0, rank1)]
        assert not torch.equal(*mine), kind
    for i, (kind, whole) in enumerate(one):
        step, site = divmod(i, 3)
        # the global batch of 32: process 0's micro-batches 0 and 1, then process 1's
        parts = [rank[(2 * step + micro) * 3 + site][1] for rank in (rank0, rank1) for micro in (0, 1)]
        assert torch.equal(whole, torch.cat(parts)), (step, kind)
    drops = torch.cat([m for kind, m in one if kind == "drop_path"])
    assert 0 < int((drops == 0).sum()) < len(drops) // 4  # drop-path 0.1 of block 1 of 2: rate 0.1


def test_two_processes_with_every_regulariser_end_where_one_does(runs):
    tmp, *_ = runs
    a = load_file(str(tmp / "one" / "last" / "model.safetensors"))
    b = load_file(str(tmp / "two" / "last" / "model.safetensors"))
    assert a["head.weight"].abs().sum() > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
