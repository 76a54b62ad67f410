"""The hybrid of Sec. 3.1: a BiT-style ResNet whose feature map, cut into 1x1 "patches", feeds the transformer.

The ResNet is the one of Google's R50+ViT-B/16 and R26+ViT-S/32 (and timm's `vit_base_r50_s16_*`,
`vit_small_r26_s32_*`): Big Transfer's ResNet with weight-standardised convolutions and GroupNorm(32), but
*not* pre-activation (conv -> GroupNorm -> ReLU, the ResNet v1.5 bottleneck with the stride on the 3x3
convolution), TensorFlow 'SAME' padding everywhere, and no final norm or head. R50 keeps three stages of
(3, 4, 9) units (the 4th stage removed, the 3rd extended), so its output has stride 16; R26 has four stages
of two units, stride 32.

Parameter names are timm's (`backbone.stem.conv`, `backbone.stages.{i}.blocks.{j}.conv1`, ..., `proj`), so a
timm hybrid state dict maps onto ours key for key.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import HYBRID_GROUPS, ViTConfig
from .init import lecun_normal_

# The normalisation constants, by ViTConfig.hybrid_norm. timm builds these hybrids' convolutions with
# `StdConv2dSame(eps=1e-8)`, w / sqrt(var + 1e-8), and GroupNorms of eps 1e-5 (torch's default); Google's Flax
# code, which trained the .npz hybrids, divides by (std + 1e-5) and normalises groups with eps 1e-6. For trained
# kernels (std ~ 1e-2) the two differ by ~1e-3 relative in the kernels.
STD_CONV_EPS = {"timm": 1e-8, "flax": 1e-5}
GN_EPS = {"timm": 1e-5, "flax": 1e-6}
GROUPS = HYBRID_GROUPS  # GroupNorm groups, as BiT


def same_padding(size: int, kernel: int, stride: int, dilation: int = 1) -> tuple[int, int]:
    """TensorFlow's 'SAME' padding along one axis: (before, after), the odd pixel going after.

    The output has ceil(size / stride) positions; e.g. a 3x3, stride-2 convolution over an even size pads
    (0, 1), which no symmetric PyTorch padding reproduces.
    """
    total = max((math.ceil(size / stride) - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def pad_same(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    """Pad a (B, C, H, W) tensor for a 'SAME' convolution or pooling with a square kernel."""
    top, bottom = same_padding(x.shape[-2], kernel, stride)
    left, right = same_padding(x.shape[-1], kernel, stride)
    if top == bottom == left == right == 0:
        return x
    return F.pad(x, (left, right, top, bottom), value=value)


def standardize_weight(w: torch.Tensor, norm: str = "timm") -> torch.Tensor:
    """Weight standardisation: each output filter shifted to mean 0 and scaled to variance 1 (biased
    variance over its input channels and kernel positions): by sqrt(var + 1e-8) as timm ("timm"), or by
    (std + 1e-5) as the Flax code ("flax")."""
    flat = w.reshape(w.shape[0], -1)
    mean = flat.mean(dim=1, keepdim=True)
    var = flat.var(dim=1, unbiased=False, keepdim=True)
    scale = var.sqrt() + STD_CONV_EPS["flax"] if norm == "flax" else torch.sqrt(var + STD_CONV_EPS["timm"])
    return ((flat - mean) / scale).reshape_as(w)


def group_norm(channels: int, norm: str) -> nn.GroupNorm:
    """The ResNet's GroupNorm (GROUPS groups) with the eps of `norm`."""
    return nn.GroupNorm(GROUPS, channels, eps=GN_EPS[norm])


class StdConv2d(nn.Conv2d):
    """A bias-free convolution with a weight-standardised kernel and TensorFlow 'SAME' padding."""

    def __init__(self, in_chans: int, out_chans: int, kernel_size: int, stride: int = 1, norm: str = "timm"):
        super().__init__(in_chans, out_chans, kernel_size, stride=stride, padding=0, bias=False)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = pad_same(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, standardize_weight(self.weight, self.norm), None, self.stride)


class Stem(nn.Module):
    """The root block: a 7x7 stride-2 convolution, GroupNorm, ReLU, then a 3x3 stride-2 'SAME' max-pool."""

    def __init__(self, in_chans: int, width: int, norm: str = "timm"):
        super().__init__()
        self.conv = StdConv2d(in_chans, width, 7, stride=2, norm=norm)
        self.norm = group_norm(width, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.conv(x)))  # (B, width, H/2, W/2)
        # 'SAME' max-pooling pads with -inf, so the padding never wins the max.
        return F.max_pool2d(pad_same(x, 3, 2, value=-math.inf), 3, 2)  # (B, width, H/4, W/4)


class Downsample(nn.Module):
    """The projection shortcut of a stage's first unit: a strided 1x1 convolution and GroupNorm."""

    def __init__(self, in_chans: int, out_chans: int, stride: int, norm: str = "timm"):
        super().__init__()
        self.conv = StdConv2d(in_chans, out_chans, 1, stride=stride, norm=norm)
        self.norm = group_norm(out_chans, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """A bottleneck unit, post-activation: 1x1 -> 3x3 (strided) -> 1x1, each followed by GroupNorm, ReLU
    after the first two and after the residual sum."""

    def __init__(self, in_chans: int, out_chans: int, stride: int, project: bool, norm: str = "timm"):
        super().__init__()
        mid = out_chans // 4
        self.downsample = Downsample(in_chans, out_chans, stride, norm) if project else None
        self.conv1 = StdConv2d(in_chans, mid, 1, norm=norm)
        self.norm1 = group_norm(mid, norm)
        self.conv2 = StdConv2d(mid, mid, 3, stride=stride, norm=norm)
        self.norm2 = group_norm(mid, norm)
        self.conv3 = StdConv2d(mid, out_chans, 1, norm=norm)
        self.norm3 = group_norm(out_chans, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = self.downsample(x) if self.downsample is not None else x
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        return F.relu(y + shortcut)


class Stage(nn.Module):
    """`depth` bottleneck units; the first projects the shortcut and carries the stride."""

    def __init__(self, in_chans: int, out_chans: int, depth: int, stride: int, norm: str = "timm"):
        super().__init__()
        self.blocks = nn.ModuleList(
            Bottleneck(in_chans if i == 0 else out_chans, out_chans, stride if i == 0 else 1, project=i == 0,
                       norm=norm)
            for i in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def stage_widths(width: int, num_stages: int) -> list[int]:
    """Output channels of each stage: 4 x width, doubling per stage (256, 512, 1024, 2048 for width 64)."""
    return [4 * width * 2**i for i in range(num_stages)]


class ResNetBackbone(nn.Module):
    """The stem and the stages; stride 4 after the stem, then 2 more in every stage after the first."""

    def __init__(self, in_chans: int, layers: tuple[int, ...], width: int, norm: str = "timm"):
        super().__init__()
        if width % GROUPS:
            raise ValueError(f"hybrid_width={width} must be a multiple of the {GROUPS} GroupNorm groups")
        self.stem = Stem(in_chans, width, norm)
        widths = stage_widths(width, len(layers))
        chans = [width, *widths]
        self.stages = nn.ModuleList(
            Stage(chans[i], chans[i + 1], depth, stride=1 if i == 0 else 2, norm=norm)
            for i, depth in enumerate(layers)
        )
        self.num_features = widths[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return x  # (B, num_features, H / stride, W / stride)


class HybridEmbed(nn.Module):
    """The hybrid's patch embedding: the ResNet's feature map, then the projection E as a PxP convolution
    (P = cfg.patch_size, 1 in the paper's hybrids) to cfg.dim channels, flattened to tokens."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        if not cfg.hybrid_layers:
            raise ValueError("HybridEmbed needs cfg.hybrid_layers (units per ResNet stage)")
        self.backbone = ResNetBackbone(cfg.in_chans, cfg.hybrid_layers, cfg.hybrid_width, cfg.hybrid_norm)
        self.proj = nn.Conv2d(self.backbone.num_features, cfg.dim, kernel_size=cfg.patch_size,
                              stride=cfg.patch_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He (fan-out) normal for the ResNet's convolutions; unit-scale GroupNorms except the last of each
        bottleneck unit, which starts at zero so that every unit starts as its shortcut (the official
        models_resnet.py's gn3, timm's zero_init_last); LeCun normal for the projection E (as the plain ViT's
        patch projection). On the meta device (shapes only) there are no values to set."""

        if self.proj.weight.is_meta:
            return
        for m in self.backbone.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for m in self.backbone.modules():
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.norm3.weight)
        lecun_normal_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.backbone(x)  # (B, C, gh * P, gw * P)
        x = self.proj(x)  # (B, D, gh, gw)
        return x.flatten(2).transpose(1, 2)  # (B, N, D), raster order
