"""Transforms: the per-sample v2 pipelines and the whole-batch uint8 fast path (per-image randomness, content
kept, determinism given a generator, draws per image from random streams, agreement with the v2 eval
pipeline)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as TF

from vitkit import ViTConfig
from vitkit.data.transforms import (
    AugmentConfig,
    augment_batch,
    build_eval_transform,
    build_train_transform,
    normalize_batch,
    randaugment_batch,
    random_erase_batch,
    random_hflip_batch,
    random_pad_crop_batch,
    random_resized_crop_batch,
    random_resized_crop_boxes,
    train_batch,
)
from vitkit.streams import AUGMENT, Draws, fold_in, image_streams


def tiny_cfg(image_size=(32, 32), in_chans=3, **kw) -> ViTConfig:
    return ViTConfig(image_size=image_size, patch_size=4, in_chans=in_chans, num_classes=10, dim=32, depth=1,
                     num_heads=2, mlp_dim=64, **kw)


def batch(b=16, c=1, h=28, w=28, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, c, h, w), dtype=torch.uint8, generator=g)


def gen(seed=0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- AugmentConfig ----------------------------------------------------------------------------------------
def test_augment_config_validates():
    assert AugmentConfig(randaugment="2,9").randaugment_ops() == (2, 9)
    assert AugmentConfig(randaugment="none").randaugment_ops() is None
    assert AugmentConfig(crop_scale=[0.5, 1]).crop_scale == (0.5, 1.0)  # a JSON list becomes a tuple
    with pytest.raises(ValueError, match="crop='center'.*hflip=2.*randaugment='2'"):
        AugmentConfig(crop="center", randaugment="2", hflip=2)
    with pytest.raises(ValueError, match="mixup=-1"):
        AugmentConfig(mixup=-1)


# --- per-sample v2 pipelines ------------------------------------------------------------------------------
def test_train_transform_shapes_channels_non_square():
    grey_pil = Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8), "L")
    colour = batch(1, 3, 40, 30)[0]
    for aug in (AugmentConfig(), AugmentConfig(crop="pad-crop", randaugment="2,9", random_erasing=1.0),
                AugmentConfig(crop="none", hflip=0.0)):
        for cfg in (tiny_cfg((32, 48), 3), tiny_cfg((16, 24), 1)):
            t = build_train_transform(cfg, aug)
            for image in (grey_pil, colour):
                out = t(image)
                assert out.dtype == torch.float32 and out.shape == (cfg.in_chans, *cfg.image_size)


def test_eval_transform_tiny_images_are_just_resized():
    cfg = tiny_cfg((32, 32), 3)
    image = batch(1, 1, 28, 28)[0]
    out = build_eval_transform(cfg)(image)
    ref = TF.resize(image, [32, 32], interpolation=InterpolationMode.BICUBIC,
                    antialias=True).expand(3, -1, -1)
    torch.testing.assert_close(out, (ref.float() / 255 - 0.5) / 0.5)


def test_eval_transform_resize_then_centre_crop_matches_v2_reference():
    cfg = tiny_cfg((32, 32), 3, crop_pct=0.875)
    image = batch(1, 3, 100, 80)[0]
    ref = v2.Compose([v2.Resize(math.floor(32 / 0.875), interpolation=InterpolationMode.BICUBIC,
                                antialias=True),
                      v2.CenterCrop(32), v2.ToDtype(torch.float32, scale=True),
                      v2.Normalize([0.5] * 3, [0.5] * 3)])
    torch.testing.assert_close(build_eval_transform(cfg)(image), ref(image))


def test_eval_transform_squash_resizes_as_hugging_face_does():
    # ViTImageProcessor stretches every image to the model's size; crop_mode="squash" does the same.
    transformers = pytest.importorskip("transformers")
    rng = np.random.default_rng(0)
    pil = Image.fromarray((rng.random((50, 90, 3)) * 255).astype(np.uint8))
    processor = transformers.ViTImageProcessor(size={"height": 32, "width": 32}, resample=2,
                                               image_mean=[0.5] * 3, image_std=[0.5] * 3)
    ref = torch.from_numpy(processor(pil, return_tensors="np")["pixel_values"][0])
    squash = build_eval_transform(tiny_cfg((32, 32), 3, interpolation="bilinear", crop_pct=1.0,
                                           crop_mode="squash"))(pil)
    centre = build_eval_transform(tiny_cfg((32, 32), 3, interpolation="bilinear", crop_pct=1.0))(pil)
    assert squash.shape == ref.shape == (3, 32, 32)
    torch.testing.assert_close(squash, ref, rtol=0, atol=1e-5)
    assert (centre - ref).abs().max() > 0.5  # cropping instead would see another part of the image


@pytest.mark.parametrize("crop_pct", [1.0, 0.95, 0.9])
def test_eval_transform_squash_matches_timms_squash_at_any_crop(crop_pct):
    timm_data = pytest.importorskip("timm.data")
    rng = np.random.default_rng(1)
    pil = Image.fromarray((rng.random((50, 90, 3)) * 255).astype(np.uint8))
    ref = timm_data.create_transform(input_size=(3, 32, 32), interpolation="bilinear", mean=(0.5,) * 3,
                                     std=(0.5,) * 3, crop_pct=crop_pct, crop_mode="squash")(pil)
    out = build_eval_transform(tiny_cfg((32, 32), 3, interpolation="bilinear", crop_pct=crop_pct,
                                        crop_mode="squash"))(pil)
    torch.testing.assert_close(out, ref, rtol=0, atol=1.01 * 2 / 255)  # one uint8 level (PIL's resize rounds)


@pytest.mark.parametrize("crop_pct", [1.0, 0.9, 0.875])
@pytest.mark.parametrize("size", [(32, 32), (32, 40)])
@pytest.mark.parametrize("shape", [(50, 90), (90, 50), (61, 61)])
def test_eval_transform_centre_crop_matches_timms(crop_pct, size, shape):
    """The same resize arithmetic as timm's eval transform (floor of size / crop_pct; the long side truncated
    for a square size, both sides rounded by timm's ResizeKeepRatio for another): the same pixels to one uint8
    level (PIL's resize rounds), where rounding the scale size instead shifts the crop."""
    timm_data = pytest.importorskip("timm.data")
    rng = np.random.default_rng(2)
    pil = Image.fromarray((rng.random((*shape, 3)) * 255).astype(np.uint8))
    ref = timm_data.create_transform(input_size=(3, *size), interpolation="bilinear", mean=(0.5,) * 3,
                                     std=(0.5,) * 3, crop_pct=crop_pct, crop_mode="center")(pil)
    out = build_eval_transform(tiny_cfg(size, 3, interpolation="bilinear", crop_pct=crop_pct))(pil)
    torch.testing.assert_close(out, ref, rtol=0, atol=1.01 * 2 / 255)


def test_eval_transform_colour_to_grey_normalised_with_config():
    cfg = tiny_cfg((28, 28), 1, mean=(0.25,), std=(0.5,))
    pil = Image.new("RGB", (28, 28), (255, 255, 255))
    out = build_eval_transform(cfg)(pil)
    assert out.shape == (1, 28, 28)
    # torchvision's grey weights sum to 0.9999, so white may come out as 254: one grey level of tolerance.
    torch.testing.assert_close(out, torch.full((1, 28, 28), (1.0 - 0.25) / 0.5), atol=1.01 / 255 / 0.5,
                               rtol=0)


def test_train_batch_with_streams_draws_per_image_whatever_the_batch():
    """With each image's random stream (a Draws), an image's augmentation, erasing included, is the same in
    a batch of 16 as in either half of it: what makes a run's augmentation the same on 1 or 2 processes."""
    images = batch(16, c=1, h=28, w=28)
    aug = AugmentConfig(crop="pad-crop", pad=4, hflip=0.5, randaugment="2,9", random_erasing=0.5)
    cfg = tiny_cfg((28, 28), 1)
    streams = fold_in(image_streams(3, 1, 7, torch.arange(16)), AUGMENT)
    whole = train_batch(images, cfg, aug, Draws(streams))
    halves = torch.cat([train_batch(images[:8], cfg, aug, Draws(streams[:8])),
                        train_batch(images[8:], cfg, aug, Draws(streams[8:]))])
    torch.testing.assert_close(whole, halves, rtol=0, atol=0)
    other = train_batch(images, cfg, aug, Draws(fold_in(image_streams(3, 1, 8, torch.arange(16)), AUGMENT)))
    assert not torch.equal(whole, other)  # another step draws otherwise
    with pytest.raises(ValueError, match="8 random streams for a batch of 16 images"):
        train_batch(images, cfg, aug, Draws(streams[:8]))


# --- the whole-batch fast path ----------------------------------------------------------------------------
def test_hflip_is_per_image():
    x = batch(64)
    out = random_hflip_batch(x, 0.5, gen())
    flipped = torch.tensor([torch.equal(o, i.flip(-1)) for o, i in zip(out, x, strict=True)])
    kept = torch.tensor([torch.equal(o, i) for o, i in zip(out, x, strict=True)])
    assert torch.all(flipped ^ kept)  # every image is either flipped or left, never both (asymmetric noise)
    assert 10 < int(flipped.sum()) < 54  # and both happen in one batch
    assert torch.equal(random_hflip_batch(x, 1.0, gen()), x.flip(-1))
    assert torch.equal(random_hflip_batch(x, 0.0, gen()), x)


def _shift(image: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """The image moved down by dy and right by dx, zeros coming in."""
    out = torch.zeros_like(image)
    h, w = image.shape[-2:]
    out[..., max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
        image[..., max(-dy, 0):h - max(dy, 0), max(-dx, 0):w - max(dx, 0)]
    return out


def test_pad_crop_is_a_per_image_translation_keeping_content():
    pad = 3
    x = batch(40, 2, 12, 10) | 1  # no zero pixels, so a shift is told apart by its zeros
    out = random_pad_crop_batch(x, pad, gen())
    assert out.shape == x.shape and out.dtype == torch.uint8
    shifts = set()
    for o, i in zip(out, x, strict=True):
        found = [(dy, dx) for dy in range(-pad, pad + 1) for dx in range(-pad, pad + 1)
                 if torch.equal(o, _shift(i, dy, dx))]
        assert len(found) == 1
        shifts.add(found[0])
    assert len(shifts) > 10  # the offsets differ between images
    assert {dy for dy, _ in shifts} == set(range(-pad, pad + 1))
    assert torch.equal(random_pad_crop_batch(x, 0, gen()), x)


def test_random_resized_crop_batch():
    x = batch(8, 3, 20, 20)
    # Crops of the whole image at ratio 1 give the image back exactly (roi_align samples the pixel centres).
    assert torch.equal(random_resized_crop_batch(x, (1.0, 1.0), (1.0, 1.0), gen()), x)
    boxes = random_resized_crop_boxes(500, 20, 30, (0.2, 0.6), (0.75, 4 / 3), gen())
    x1, y1, x2, y2 = boxes.unbind(1)
    assert torch.all(x1 >= 0) and torch.all(y1 >= 0) and torch.all(x2 <= 30) and torch.all(y2 <= 20)
    area = (x2 - x1) * (y2 - y1) / 600
    assert area.min() > 0.15 and area.max() < 0.65  # the drawn scale, up to rounding to whole pixels
    assert len(set(x1.tolist())) > 5 and len(set(area.tolist())) > 20  # per-image draws
    out = random_resized_crop_batch(x, (0.08, 1.0), (0.75, 4 / 3), gen())
    assert out.shape == x.shape and out.dtype == torch.uint8


def test_random_erase_batch_per_image():
    x = torch.randn(50, 3, 16, 16) + 10  # no zeros
    out = random_erase_batch(x, 1.0, gen())
    erased = out == 0
    assert torch.equal(erased[:, 0], erased[:, 1])  # all channels of a rectangle
    fraction = erased[:, 0].float().mean(dim=(1, 2))
    assert fraction.max() <= 1 / 3 + 0.05 and int((fraction > 0).sum()) >= 45
    assert len({tuple(e.nonzero()[0].tolist()) for e in erased[:, 0] if e.any()}) > 20  # rectangles differ
    for e in erased[:, 0]:  # each erased region is one rectangle
        if e.any():
            rows, cols = e.any(dim=1).nonzero().flatten(), e.any(dim=0).nonzero().flatten()
            assert int(e.sum()) == len(rows) * len(cols)
            assert rows.max() - rows.min() + 1 == len(rows) and cols.max() - cols.min() + 1 == len(cols)
    assert torch.equal(random_erase_batch(x, 0.0, gen()), x)


def test_randaugment_batch_per_image_and_deterministic():
    one = batch(1, 3, 16, 16)
    x = one.expand(32, -1, -1, -1).contiguous()  # 32 copies of one image
    out = randaugment_batch(x, 1, 9, gen())
    assert out.shape == x.shape and out.dtype == torch.uint8
    assert len({o.numpy().tobytes() for o in out}) > 5  # different ops for different copies
    assert torch.equal(out, randaugment_batch(x, 1, 9, gen()))
    assert randaugment_batch(batch(4, 1, 16, 16), 2, 9, gen()).shape == (4, 1, 16, 16)  # grey works too
    assert torch.equal(randaugment_batch(x, 0, 9, gen()), x)


TORCHVISION_RA_NAMES = {"identity": "Identity", "shear_x": "ShearX", "shear_y": "ShearY",
                        "translate_x": "TranslateX", "translate_y": "TranslateY", "rotate": "Rotate",
                        "brightness": "Brightness", "color": "Color", "contrast": "Contrast",
                        "sharpness": "Sharpness", "posterize": "Posterize",
                        "solarize": "Solarize", "autocontrast": "AutoContrast", "equalize": "Equalize"}


@pytest.mark.parametrize("channels", [3, 1])
def test_randaugment_ops_are_torchvisions(channels):
    """The batched RandAugment's ops, their strength at every magnitude and their sign equal those of
    torchvision's v2.RandAugment, which the per-image pipeline runs (31 magnitude bins), and each op's output
    equals v2's on the same strength, bit for bit."""
    from vitkit.data.transforms import _RA_OPS, RANDAUGMENT_LEVELS, _apply_ra_op

    h, w = 20, 28
    x = batch(4, channels, h, w, seed=5)
    reference = v2.RandAugment(num_magnitude_bins=RANDAUGMENT_LEVELS + 1)
    space = reference._AUGMENTATION_SPACE
    assert [TORCHVISION_RA_NAMES[name] for name, _, _ in _RA_OPS] == list(space)
    for name, strength, signed in _RA_OPS:
        levels_of, tv_signed = space[TORCHVISION_RA_NAMES[name]]
        levels = levels_of(RANDAUGMENT_LEVELS + 1, h, w)
        assert signed == tv_signed, name
        unit = 255.0 if name == "solarize" else 1.0  # v2 gives the threshold as a share of uint8's maximum
        for m in (0, 9, 17, 30):
            expected = float(levels[m]) if levels is not None else 0.0
            assert strength(m, h, w) == pytest.approx(expected * unit, rel=1e-6, abs=1e-6), (name, m)
            for v in ((expected, -expected) if signed else (expected,)):
                tv = reference._apply_image_or_video_transform(x, TORCHVISION_RA_NAMES[name], v,
                                                               InterpolationMode.BILINEAR, reference._fill)
                assert torch.equal(_apply_ra_op(x, name, v * unit), tv), (name, m, v)


def test_augment_batch_deterministic_given_generator():
    x = batch(32)
    aug = AugmentConfig(crop="pad-crop", pad=2, hflip=0.5, randaugment="2,9", random_erasing=0.5)
    a, b, c = augment_batch(x, aug, gen(1)), augment_batch(x, aug, gen(1)), augment_batch(x, aug, gen(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    state = torch.get_rng_state()
    augment_batch(x, AugmentConfig(crop="rrc"), gen(1))
    assert torch.equal(torch.get_rng_state(), state)  # only the given generator is used
    with pytest.raises(ValueError, match="uint8"):
        augment_batch(x.float(), aug)


def test_normalize_batch_matches_eval_transform():
    x = batch(6, 1, 28, 28)
    same = tiny_cfg((28, 28), 1, mean=(0.286,), std=(0.353,))
    ev = build_eval_transform(same)
    torch.testing.assert_close(normalize_batch(x, same), torch.stack([ev(i) for i in x]))
    # Resized to 32x32 with 3 channels, bilinear: v2 rounds its resize to uint8, the batch path does not.
    bigger = tiny_cfg((32, 32), 3, interpolation="bilinear")
    ev = build_eval_transform(bigger)
    torch.testing.assert_close(normalize_batch(x, bigger), torch.stack([ev(i) for i in x]),
                               atol=1.01 / 255 / 0.5, rtol=0)
    # Bicubic: torchvision resizes uint8 with PIL's kernel (a=-0.5) and floats with torch's (a=-0.75); the
    # batch path works in float, so its reference is torchvision's float resize.
    bicubic = tiny_cfg((32, 32), 3)
    ref = TF.resize(x.float() / 255, [32, 32], interpolation=InterpolationMode.BICUBIC, antialias=True)
    torch.testing.assert_close(normalize_batch(x, bicubic),
                               (ref.clamp(0, 1).expand(-1, 3, -1, -1) - 0.5) / 0.5)
    # Colour to grey with the luma weights PIL uses.
    colour = batch(2, 3, 8, 8)
    grey = normalize_batch(colour, tiny_cfg((8, 8), 1, mean=(0.0,), std=(1.0,)))
    pil = [np.asarray(Image.fromarray(c.permute(1, 2, 0).numpy(), "RGB").convert("L")) for c in colour]
    torch.testing.assert_close(grey[:, 0] * 255, torch.from_numpy(np.stack(pil)).float(), atol=1.0, rtol=0)


def test_train_batch_end_to_end():
    cfg = tiny_cfg((32, 32), 3)
    aug = AugmentConfig(crop="pad-crop", random_erasing=0.25)
    out = train_batch(batch(8), cfg, aug, gen())
    assert out.shape == (8, 3, 32, 32) and out.dtype == torch.float32
    assert torch.equal(out, train_batch(batch(8), cfg, aug, gen()))


@pytest.mark.parametrize("overrides", [
    {}, {"crop_mode": "squash", "crop_pct": 0.875}, {"crop_pct": 0.9, "interpolation": "bilinear"},
    {"in_chans": 1, "image_size": 28, "patch_size": 7},
])
def test_eval_batch_is_the_eval_transform_image_by_image(overrides):
    """Images of several sizes and modes (a server's batch): eval_batch gives bit for bit what the eval
    transform gives each image, in the order given, working on the images of one size together."""
    from vitkit.config import get_config
    from vitkit.data.transforms import eval_batch

    rng = np.random.default_rng(0)

    def image(w, h, mode):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)

    cfg = get_config("ViT-S/16", **overrides)
    transform = build_eval_transform(cfg)
    mode = "L" if cfg.in_chans == 1 else "RGB"
    images = [image(300, 200, mode), image(28, 28, mode), image(300, 200, "RGB"), image(300, 200, mode),
              image(640, 427, mode), torch.randint(0, 256, (3, 50, 40), dtype=torch.uint8)]
    assert torch.equal(eval_batch(transform, images), torch.stack([transform(x) for x in images]))
