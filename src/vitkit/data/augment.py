"""What training-time augmentation a recipe asks for (`AugmentConfig`), checked on creation. A plain
dataclass without torch, so that the recipes (and the CLI's help, which lists them) load without it;
vitkit.data.transforms applies it."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import choice_errors

CROPS = ("rrc", "pad-crop", "none")


@dataclass(frozen=True)
class AugmentConfig:
    """Training-time data augmentation.

    crop: 'rrc' (random-resized-crop, area fraction in `crop_scale`, aspect ratio in `crop_ratio`),
        'pad-crop' (pad `pad` pixels with zeros on each side, then a random crop of the original size),
        or 'none' (resize only).
    hflip: probability of a horizontal flip.
    randaugment: "N,M" for RandAugment with N ops of magnitude M (of 31 levels; Cubuk et al. 2020), or None.
    random_erasing: probability of erasing one random rectangle (to the mean: 0 after normalisation).
    mixup, cutmix: Beta(alpha, alpha) parameters of MixUp and CutMix on batches; 0 turns one off. With both
        on, each batch gets one of the two at random.
    """

    crop: str = "rrc"
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    pad: int = 4
    hflip: float = 0.5
    randaugment: str | None = None
    random_erasing: float = 0.0
    mixup: float = 0.0
    cutmix: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "crop_scale", tuple(float(s) for s in self.crop_scale))
        object.__setattr__(self, "crop_ratio", tuple(float(r) for r in self.crop_ratio))
        if self.randaugment in ("", "none", "None"):
            object.__setattr__(self, "randaugment", None)
        errors = choice_errors(self, {"crop": CROPS})
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            errors.append(f"crop_scale={self.crop_scale} (need 0 < min <= max <= 1)")
        lo, hi = self.crop_ratio
        if not 0 < lo <= hi:
            errors.append(f"crop_ratio={self.crop_ratio} (need 0 < min <= max)")
        if self.pad < 0:
            errors.append(f"pad={self.pad} (need >= 0)")
        for key in ("hflip", "random_erasing"):
            if not 0 <= getattr(self, key) <= 1:
                errors.append(f"{key}={getattr(self, key)} (a probability, 0 to 1)")
        for key in ("mixup", "cutmix"):
            if getattr(self, key) < 0:
                errors.append(f"{key}={getattr(self, key)} (an alpha >= 0; 0 is off)")
        if self.randaugment is not None:
            try:
                self.randaugment_ops()
            except ValueError as e:
                errors.append(str(e))
        if errors:
            raise ValueError("invalid AugmentConfig: " + "; ".join(errors))

    def randaugment_ops(self) -> tuple[int, int] | None:
        """(num_ops, magnitude) from `randaugment` "N,M", or None when off."""
        if self.randaugment is None:
            return None
        parts = str(self.randaugment).split(",")
        try:
            n, m = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"randaugment={self.randaugment!r} (expected 'N,M', e.g. '2,9')") from None
        if n < 0 or not 0 <= m <= 30:
            raise ValueError(f"randaugment={self.randaugment!r} (need N >= 0 and 0 <= M <= 30)")
        return n, m
