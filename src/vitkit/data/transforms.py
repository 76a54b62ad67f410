"""Image transforms for training and evaluation, in two forms.

* Per sample, with torchvision.transforms.v2 (PIL images or uint8 tensors in, normalised float tensors out):
  `build_train_transform`, `build_eval_transform`. (MixUp and CutMix mix pairs of a batch:
  vitkit.data.mixing.)
* Per batch, for in-memory uint8 datasets (Fashion-MNIST, CIFAR), where a per-sample pipeline in DataLoader
  workers is the bottleneck on a few CPU cores: `augment_batch` (random crop, flip, RandAugment, each with its
  own random draw per image, not one draw for the whole batch as a v2 transform would make),
  `normalize_batch` (resize, scale, normalise, channel count) and `random_erase_batch`; `train_batch` chains
  the three.

Normalisation uses the preprocessing config (`ViTConfig.mean`, `.std`, `.interpolation`, `.crop_pct`,
`.crop_mode`); grey images become the model's channel count (1 -> 3 by repeating, 3 -> 1 by ITU-R 601 luma).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import roi_align
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as TF

from ..config import ViTConfig
from ..streams import Draws
from .augment import AugmentConfig

ERASE_SCALE = (0.02, 1 / 3)  # area fraction of an erased rectangle (Zhong et al. 2020; timm and torchvision)
ERASE_RATIO = (0.3, 3.3)  # its aspect ratio range
RRC_ATTEMPTS = 10  # tries to draw a crop that fits, as torchvision's RandomResizedCrop
LUMA = (0.299, 0.587, 0.114)  # ITU-R 601, what PIL's convert("L") uses

_INTERPOLATIONS = {
    "bicubic": InterpolationMode.BICUBIC,
    "bilinear": InterpolationMode.BILINEAR,
    "nearest": InterpolationMode.NEAREST,
}


def interpolation_mode(name: str) -> InterpolationMode:
    """The torchvision interpolation for a ViTConfig.interpolation name."""
    try:
        return _INTERPOLATIONS[name]
    except KeyError:
        raise ValueError(f"interpolation={name!r}: choose from {', '.join(_INTERPOLATIONS)}") from None


def _channel_transform(in_chans: int) -> nn.Module:
    if in_chans == 3:
        return v2.RGB()  # grey -> 3 equal channels; colour unchanged
    if in_chans == 1:
        return v2.Grayscale(num_output_channels=1)  # colour -> luma; grey unchanged
    raise ValueError(f"in_chans={in_chans}: image transforms support 1 (grey) or 3 (colour) channels")


class ResizeCenterCrop(nn.Module):
    """Evaluation resize: an image larger than `size` is resized (aspect kept) to cover `size / crop_pct`,
    then centre-cropped to `size`, with timm's arithmetic (its `transforms_imagenet_eval`): the scale size is
    floor(size / crop_pct); for a square size the short side becomes it and the long side is truncated, as
    torchvision's Resize(int) does, otherwise both sides scale by the smaller ratio and are rounded (timm's
    ResizeKeepRatio). An image no larger than `size` on both sides (e.g. a 28x28 one for a 32x32 model) is
    resized straight to `size`, as cropping it would only lose content."""

    def __init__(self, size: tuple[int, int], crop_pct: float, interpolation: InterpolationMode):
        super().__init__()
        if not 0 < crop_pct <= 1:
            raise ValueError(f"crop_pct={crop_pct}: need 0 < crop_pct <= 1")
        self.size, self.crop_pct, self.interpolation = tuple(size), crop_pct, interpolation

    def forward(self, img):
        h, w = TF.get_size(img)
        th, tw = self.size
        if h <= th and w <= tw:
            return TF.resize(img, list(self.size), interpolation=self.interpolation, antialias=True)
        sh, sw = math.floor(th / self.crop_pct), math.floor(tw / self.crop_pct)
        if sh == sw:
            long = int(sh * max(h, w) / min(h, w))
            resized = [sh, long] if h <= w else [long, sh]
        else:
            ratio = min(h / sh, w / sw)
            resized = [round(h / ratio), round(w / ratio)]
        resized = [max(th, resized[0]), max(tw, resized[1])]
        img = TF.resize(img, resized, interpolation=self.interpolation, antialias=True)
        return TF.center_crop(img, list(self.size))


def _to_float_normalized(cfg: ViTConfig) -> list[nn.Module]:
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=list(cfg.mean), std=list(cfg.std))]


def build_train_transform(cfg: ViTConfig, aug: AugmentConfig) -> v2.Compose:
    """Per-sample training transform: PIL image or uint8 tensor (C, H, W) -> float32 (cfg.in_chans, *size)."""
    size = list(cfg.image_size)
    interp = interpolation_mode(cfg.interpolation)
    steps: list[nn.Module] = [v2.ToImage(), _channel_transform(cfg.in_chans)]
    if aug.crop == "rrc":
        steps.append(v2.RandomResizedCrop(size, scale=aug.crop_scale, ratio=aug.crop_ratio,
                                          interpolation=interp, antialias=True))
    else:
        steps.append(v2.Resize(size, interpolation=interp, antialias=True))  # a no-op at the model's size
        if aug.crop == "pad-crop" and aug.pad > 0:
            steps.append(v2.RandomCrop(size, padding=aug.pad, fill=0))
    if aug.hflip > 0:
        steps.append(v2.RandomHorizontalFlip(aug.hflip))
    ra = aug.randaugment_ops()
    if ra is not None:
        steps.append(v2.RandAugment(num_ops=ra[0], magnitude=ra[1], interpolation=InterpolationMode.BILINEAR))
    steps += _to_float_normalized(cfg)
    if aug.random_erasing > 0:
        steps.append(v2.RandomErasing(p=aug.random_erasing, scale=ERASE_SCALE, ratio=ERASE_RATIO, value=0.0))
    return v2.Compose(steps)


def build_eval_transform(cfg: ViTConfig) -> v2.Compose:
    """Per-sample evaluation transform: resize and centre crop (see ResizeCenterCrop) or, with
    cfg.crop_mode="squash", resize to the model's size / crop_pct ignoring the aspect ratio and centre-crop
    (at crop_pct 1, straight to the model's size); then normalise."""
    interpolation = interpolation_mode(cfg.interpolation)
    if cfg.crop_mode == "squash":  # as timm: stretch to image_size / crop_pct, then the centre image_size
        h, w = cfg.image_size
        outer = [math.floor(h / cfg.crop_pct), math.floor(w / cfg.crop_pct)]
        fit: nn.Module = v2.Compose([v2.Resize(outer, interpolation=interpolation, antialias=True),
                                     v2.CenterCrop(list(cfg.image_size))])
    else:
        fit = ResizeCenterCrop(cfg.image_size, cfg.crop_pct, interpolation)
    return v2.Compose([v2.ToImage(), _channel_transform(cfg.in_chans), fit, *_to_float_normalized(cfg)])


# build_eval_transform's steps before this index run on each image (to a tensor, the channels); the rest work
# on a batch of images of one size as on each image.
EVAL_PER_IMAGE_STEPS = 2


def eval_batch(transform: v2.Compose, images: Sequence) -> torch.Tensor:
    """build_eval_transform's `transform` of each image (PIL or uint8 tensor), stacked (B, C, H, W): the first
    steps one image at a time, the rest (resize, crop, scaling, normalising) once for each group of images of
    one size. The same values as image by image, for a fraction of the Python work: a server's batch of
    equally sized uploads takes one call of each step instead of one per image."""
    steps = list(transform.transforms)
    each, together = v2.Compose(steps[:EVAL_PER_IMAGE_STEPS]), v2.Compose(steps[EVAL_PER_IMAGE_STEPS:])
    tensors = [each(image).as_subclass(torch.Tensor) for image in images]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(tuple(t.shape), []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for members in groups.values():
        done = together(torch.stack([tensors[i] for i in members]))
        for row, i in enumerate(members):
            out[i] = done[row]
    return torch.stack(out)


# --- whole-batch augmentation of uint8 tensors ------------------------------------------------------------
# Every random draw below is one value (or a few) per image, from `generator`: a torch.Generator (or None:
# torch's global one) draws for the whole batch at once, a vitkit.streams.Draws from each image's own stream,
# so that an image's augmentation does not depend on the other images of its batch.
Source = torch.Generator | Draws | None


def _rand(generator: Source, b: int, *per_image: int, device=None) -> torch.Tensor:
    """Uniform draws in [0, 1), (b, *per_image)."""
    if isinstance(generator, Draws):
        if len(generator) != b:
            raise ValueError(f"{len(generator)} random streams for a batch of {b} images")
        return generator.rand(*per_image).to(device)
    return torch.rand((b, *per_image), generator=generator, device=device)


def _uniform(b: int, per_image: int, lo: float, hi: float, generator: Source, device) -> torch.Tensor:
    return lo + (hi - lo) * _rand(generator, b, per_image, device=device)


def _randint(high: torch.Tensor, generator: Source) -> torch.Tensor:
    """One integer in [0, high[i]) per image (high: (B,), >= 1)."""
    u = _rand(generator, high.shape[0], device=high.device)
    return torch.minimum((u * high).long(), high - 1)


def random_pad_crop_batch(images: torch.Tensor, pad: int,
                          generator: Source = None) -> torch.Tensor:
    """Pad each image with `pad` zeros per side and crop it back to its size at a random offset of its own:
    a random translation by up to `pad` pixels in each direction."""
    if pad == 0:
        return images
    b, c, h, w = images.shape
    padded = F.pad(images, (pad, pad, pad, pad))
    top = _randint(torch.full((b,), 2 * pad + 1, device=images.device), generator)
    left = _randint(torch.full((b,), 2 * pad + 1, device=images.device), generator)
    rows = ((top[:, None] + torch.arange(h, device=images.device))[:, None, :, None]
            .expand(b, c, h, w + 2 * pad))
    picked = padded.gather(2, rows)  # (B, C, H, W+2p)
    cols = (left[:, None] + torch.arange(w, device=images.device))[:, None, None, :].expand(b, c, h, w)
    return picked.gather(3, cols)  # (B, C, H, W)


def _rectangle_draws(b: int, area: int, scale: tuple[float, float], ratio: tuple[float, float],
                     generator: Source, device) -> tuple[torch.Tensor, torch.Tensor]:
    """RRC_ATTEMPTS rectangles per image as torchvision's RandomResizedCrop and RandomErasing draw them: an
    area a = `area` x uniform(`scale`) and a log-uniform aspect ratio r in `ratio`; returns round(sqrt(a r))
    and round(sqrt(a / r)), each (B, RRC_ATTEMPTS) (RandomResizedCrop takes the first as the width,
    RandomErasing as the height)."""
    a = area * _uniform(b, RRC_ATTEMPTS, *scale, generator, device)
    r = torch.exp(_uniform(b, RRC_ATTEMPTS, math.log(ratio[0]), math.log(ratio[1]), generator, device))
    return torch.round(torch.sqrt(a * r)), torch.round(torch.sqrt(a / r))


def _first_fitting(sides: torch.Tensor, fits: torch.Tensor) -> torch.Tensor:
    """Per row of (B, attempts) `sides`, the value of the first attempt that `fits` (of the first if none
    does)."""
    return sides.gather(1, fits.float().argmax(dim=1)[:, None]).squeeze(1)


def random_resized_crop_boxes(
    b: int, h: int, w: int, scale: tuple[float, float], ratio: tuple[float, float],
    generator: Source = None, device=None,
) -> torch.Tensor:
    """Per image a crop box (x1, y1, x2, y2) in pixels, drawn as torchvision's RandomResizedCrop does: area
    fraction uniform in `scale`, log aspect ratio uniform in log `ratio`, the first of RRC_ATTEMPTS draws that
    fits, else the whole image cropped to the nearest allowed ratio. Shape (B, 4), float."""
    cw, ch = _rectangle_draws(b, h * w, scale, ratio, generator, device)
    fits = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
    any_fit = fits.any(dim=1)
    cw, ch = _first_fitting(cw, fits), _first_fitting(ch, fits)
    # Fallback: the central crop of the whole image at the nearest allowed aspect ratio.
    in_ratio = w / h
    if in_ratio < ratio[0]:
        fw, fh = w, round(w / ratio[0])
    elif in_ratio > ratio[1]:
        fw, fh = round(h * ratio[1]), h
    else:
        fw, fh = w, h
    cw = torch.where(any_fit, cw, torch.full_like(cw, fw))
    ch = torch.where(any_fit, ch, torch.full_like(ch, fh))
    top = _randint((h - ch + 1).long().clamp(min=1), generator).float()
    left = _randint((w - cw + 1).long().clamp(min=1), generator).float()
    top = torch.where(any_fit, top, torch.full_like(top, (h - fh) // 2))
    left = torch.where(any_fit, left, torch.full_like(left, (w - fw) // 2))
    return torch.stack([left, top, left + cw, top + ch], dim=1)


def random_resized_crop_batch(
    images: torch.Tensor, scale: tuple[float, float], ratio: tuple[float, float],
    generator: Source = None,
) -> torch.Tensor:
    """RandomResizedCrop per image, back to the input size; bilinear, averaging several samples per output
    pixel when a crop shrinks (torchvision.ops.roi_align with adaptive sampling)."""
    b, c, h, w = images.shape
    boxes = random_resized_crop_boxes(b, h, w, scale, ratio, generator, images.device)
    rois = torch.cat([torch.arange(b, device=images.device, dtype=boxes.dtype)[:, None], boxes], dim=1)
    out = roi_align(images.float(), rois, output_size=(h, w), spatial_scale=1.0, sampling_ratio=-1,
                    aligned=True)
    return out.round_().clamp_(0, 255).to(images.dtype) if images.dtype == torch.uint8 else out


def random_hflip_batch(images: torch.Tensor, p: float,
                       generator: Source = None) -> torch.Tensor:
    """Flip each image left-right with probability p, independently."""
    flip = _rand(generator, images.shape[0], device=images.device) < p
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


# RandAugment's operations (Cubuk et al. 2020, Table 1 / torchvision's op list) with the strength each has at
# magnitude m of 0..30 (31 levels): (name, strength(m, height, width), signed: a random sign per image).
RANDAUGMENT_LEVELS = 30
_RA_OPS: tuple[tuple[str, Callable[[int, int, int], float], bool], ...] = (
    ("identity", lambda m, h, w: 0.0, False),
    ("shear_x", lambda m, h, w: 0.3 * m / RANDAUGMENT_LEVELS, True),
    ("shear_y", lambda m, h, w: 0.3 * m / RANDAUGMENT_LEVELS, True),
    ("translate_x", lambda m, h, w: 150 / 331 * w * m / RANDAUGMENT_LEVELS, True),
    ("translate_y", lambda m, h, w: 150 / 331 * h * m / RANDAUGMENT_LEVELS, True),
    ("rotate", lambda m, h, w: 30.0 * m / RANDAUGMENT_LEVELS, True),
    ("brightness", lambda m, h, w: 0.9 * m / RANDAUGMENT_LEVELS, True),
    ("color", lambda m, h, w: 0.9 * m / RANDAUGMENT_LEVELS, True),
    ("contrast", lambda m, h, w: 0.9 * m / RANDAUGMENT_LEVELS, True),
    ("sharpness", lambda m, h, w: 0.9 * m / RANDAUGMENT_LEVELS, True),
    ("posterize", lambda m, h, w: float(8 - round(m / (RANDAUGMENT_LEVELS / 4))), False),
    ("solarize", lambda m, h, w: 255.0 * (1 - m / RANDAUGMENT_LEVELS), False),
    ("autocontrast", lambda m, h, w: 0.0, False),
    ("equalize", lambda m, h, w: 0.0, False),
)


def _apply_ra_op(x: torch.Tensor, name: str, v: float) -> torch.Tensor:
    """One RandAugment operation of strength v on a uint8 batch (the same v for every image in x), as
    torchvision's v2.RandAugment applies it, which the per-image pipeline runs: the geometric ops with
    fill=None (zeros outside the image, with no blending at its edge, which a given fill of 0 would do) and
    the shears about the top-left corner."""
    bilinear = InterpolationMode.BILINEAR
    if name == "identity":
        return x
    if name in ("shear_x", "shear_y"):
        deg = math.degrees(math.atan(v))
        shear = [deg, 0.0] if name == "shear_x" else [0.0, deg]
        return TF.affine(x, angle=0.0, translate=[0, 0], scale=1.0, shear=shear, interpolation=bilinear,
                         fill=None, center=[0, 0])
    if name in ("translate_x", "translate_y"):
        t = [int(v), 0] if name == "translate_x" else [0, int(v)]
        return TF.affine(x, angle=0.0, translate=t, scale=1.0, shear=[0.0, 0.0], interpolation=bilinear,
                         fill=None)
    if name == "rotate":
        return TF.rotate(x, v, interpolation=bilinear, fill=None)
    if name == "brightness":
        return TF.adjust_brightness(x, 1.0 + v)
    if name == "color":
        return TF.adjust_saturation(x, 1.0 + v) if x.shape[1] == 3 else x  # grey has no colour
    if name == "contrast":
        return TF.adjust_contrast(x, 1.0 + v)
    if name == "sharpness":
        return TF.adjust_sharpness(x, 1.0 + v)
    if name == "posterize":
        return TF.posterize(x, int(v))
    if name == "solarize":
        return TF.solarize(x, v)
    if name == "autocontrast":
        return TF.autocontrast(x)
    if name == "equalize":
        return TF.equalize(x)
    raise ValueError(f"unknown RandAugment op {name!r}")


def randaugment_batch(images: torch.Tensor, num_ops: int, magnitude: int,
                      generator: Source = None) -> torch.Tensor:
    """RandAugment with its own draws per image: `num_ops` rounds, in each every image gets a random op of
    RANDAUGMENT_LEVELS-scaled strength `magnitude` and, for signed ops, a random sign. The images that drew
    the same (op, sign) are transformed together, so a round costs at most 2 x 14 batched calls, not B
    calls."""
    b, _, h, w = images.shape
    out = images.clone()
    for _ in range(num_ops):
        if isinstance(generator, Draws):
            u = _rand(generator, b, device=images.device)
            op = (u * len(_RA_OPS)).long().clamp_(max=len(_RA_OPS) - 1)
        else:
            op = torch.randint(len(_RA_OPS), (b,), generator=generator, device=images.device)
        negative = _rand(generator, b, device=images.device) < 0.5
        for k, (name, strength, signed) in enumerate(_RA_OPS):
            for neg in ((False, True) if signed else (False,)):
                sel = op == k
                if signed:
                    sel = sel & (negative == neg)
                idx = torch.nonzero(sel).flatten()
                if idx.numel() == 0:
                    continue
                v = strength(magnitude, h, w)
                out[idx] = _apply_ra_op(out[idx], name, -v if neg else v)
    return out


def augment_batch(images: torch.Tensor, aug: AugmentConfig,
                  generator: Source = None) -> torch.Tensor:
    """Random crop ('pad-crop' or 'rrc'), horizontal flip and RandAugment of a uint8 batch (B, C, H, W), each
    image with its own random draws, all from `generator` (torch's global one if None; it must live on the
    images' device, so that a batch already on the GPU is augmented there). Returns uint8 of the same shape.
    Random erasing is not done here: it erases to the normalised mean, so it comes after `normalize_batch`
    (`random_erase_batch`; `train_batch` chains all three). MixUp/CutMix: build_batch_transform.
    """
    if images.dtype != torch.uint8 or images.ndim != 4:
        raise ValueError(f"augment_batch expects uint8 (B, C, H, W), got {images.dtype} "
                         f"{tuple(images.shape)}")
    if aug.crop == "pad-crop":
        images = random_pad_crop_batch(images, aug.pad, generator)
    elif aug.crop == "rrc":
        images = random_resized_crop_batch(images, aug.crop_scale, aug.crop_ratio, generator)
    if aug.hflip > 0:
        images = random_hflip_batch(images, aug.hflip, generator)
    ra = aug.randaugment_ops()
    if ra is not None and ra[0] > 0:
        images = randaugment_batch(images, ra[0], ra[1], generator)
    return images


def random_erase_batch(
    x: torch.Tensor, p: float, generator: Source = None,
    scale: tuple[float, float] = ERASE_SCALE, ratio: tuple[float, float] = ERASE_RATIO, value: float = 0.0,
) -> torch.Tensor:
    """Random erasing (Zhong et al. 2020) per image: with probability p, one rectangle of area fraction in
    `scale` and aspect ratio in `ratio` is set to `value` (0: the mean, on normalised images). Draws that do
    not fit leave the image as it is (10 tries, as torchvision)."""
    if p <= 0:
        return x
    b, _, h, w = x.shape
    dev = x.device
    eh, ew = _rectangle_draws(b, h * w, scale, ratio, generator, dev)
    fits = (eh < h) & (ew < w) & (eh > 0) & (ew > 0)
    eh, ew = _first_fitting(eh, fits).long(), _first_fitting(ew, fits).long()
    top = _randint((h - eh + 1).clamp(min=1), generator)
    left = _randint((w - ew + 1).clamp(min=1), generator)
    erase = (_rand(generator, b, device=dev) < p) & fits.any(dim=1)
    ys = torch.arange(h, device=dev)[None, :]
    xs = torch.arange(w, device=dev)[None, :]
    in_rows = (ys >= top[:, None]) & (ys < (top + eh)[:, None])  # (B, H)
    in_cols = (xs >= left[:, None]) & (xs < (left + ew)[:, None])  # (B, W)
    mask = (in_rows[:, :, None] & in_cols[:, None, :] & erase[:, None, None])[:, None]  # (B, 1, H, W)
    return x.masked_fill(mask, value)


def normalize_batch(images: torch.Tensor, cfg: ViTConfig) -> torch.Tensor:
    """uint8 (B, C, H, W) -> float32 (B, cfg.in_chans, *cfg.image_size): resized to the model's size when it
    differs (cfg.interpolation, antialiased), scaled to [0, 1], channel count converted, normalised with
    cfg.mean and cfg.std. For images no larger than the model's this equals build_eval_transform up to
    interpolation rounding (both just resize); larger images are resized, not centre-cropped."""
    if images.dtype != torch.uint8 or images.ndim != 4:
        raise ValueError(f"normalize_batch expects uint8 (B, C, H, W), got {images.dtype} "
                         f"{tuple(images.shape)}")
    x = images.float().div_(255.0)
    size = tuple(cfg.image_size)
    if tuple(x.shape[-2:]) != size:
        mode = cfg.interpolation if cfg.interpolation in ("bicubic", "bilinear") else "nearest"
        x = F.interpolate(x, size=size, mode=mode, antialias=mode != "nearest",
                          align_corners=False if mode != "nearest" else None).clamp_(0.0, 1.0)
    c = x.shape[1]
    if c != cfg.in_chans:
        if c == 1 and cfg.in_chans == 3:
            x = x.expand(-1, 3, -1, -1)
        elif c == 3 and cfg.in_chans == 1:
            x = (x * x.new_tensor(LUMA)[None, :, None, None]).sum(dim=1, keepdim=True)
        else:
            raise ValueError(f"cannot convert {c}-channel images to the model's in_chans={cfg.in_chans}")
    mean = x.new_tensor(cfg.mean)[None, :, None, None]
    std = x.new_tensor(cfg.std)[None, :, None, None]
    return (x - mean) / std


def train_batch(images: torch.Tensor, cfg: ViTConfig, aug: AugmentConfig,
                generator: Source = None) -> torch.Tensor:
    """The whole per-batch training pipeline: augment_batch, normalize_batch, random_erase_batch."""
    x = normalize_batch(augment_batch(images, aug, generator), cfg)
    return random_erase_batch(x, aug.random_erasing, generator)
