"""The reference CNN: a small ResNet-like image classifier, NCHW input.

A conv-bn-relu stem, stages of basic residual blocks (the first block of every stage
after the first downsamples with stride 2 and a 1x1 conv-bn shortcut), global average
pooling and a linear head. It is what a compiler meets in vision code: convolutions,
inference batch norm, relu, residual adds and a reduction over H and W, which is the
graph the layout pass (NCHW -> NHWC regions) is built for. It imports nothing from
graphopt.

Batch-norm running statistics are randomised at construction so that a folded or
skipped batch norm shows up as a numerical difference instead of an identity.
The model is built in eval mode: graphopt optimizes inference graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ResNetConfig:
    image_size: int
    in_channels: int
    stem_channels: int
    stage_channels: tuple[int, ...]  # output channels of each stage; stages after the first halve H and W
    blocks_per_stage: int
    num_classes: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        self.stage_channels = tuple(self.stage_channels)
        for name in ("image_size", "in_channels", "stem_channels", "blocks_per_stage", "num_classes"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"ResNetConfig.{name} must be positive, got {value!r}")
        if not self.stage_channels or any(c <= 0 for c in self.stage_channels):
            raise ValueError(f"ResNetConfig.stage_channels must be a non-empty tuple of positive ints, "
                             f"got {self.stage_channels!r}")
        if self.image_size % (2 ** (len(self.stage_channels) - 1)):
            raise ValueError(f"ResNetConfig.image_size ({self.image_size}) must be divisible by "
                             f"2 ** (number of stages - 1) = {2 ** (len(self.stage_channels) - 1)}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"ResNetConfig.dtype must be a floating-point dtype, got {self.dtype}")

    @classmethod
    def tiny(cls, **overrides) -> ResNetConfig:
        """32x32 RGB images, 16-64 channels, 3 basic blocks (2 downsampling): about 78K parameters."""
        fields = dict(image_size=32, in_channels=3, stem_channels=16, stage_channels=(16, 32, 64),
                      blocks_per_stage=1, num_classes=10)
        return cls(**{**fields, **overrides})


def _randomize_bn(bn: nn.BatchNorm2d) -> None:
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.2)
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 1.5)


class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False, dtype=dtype)
        self.bn = nn.BatchNorm2d(cout, dtype=dtype)
        _randomize_bn(self.bn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.conv1 = ConvBN(cin, cout, 3, stride, dtype)
        self.conv2 = ConvBN(cout, cout, 3, 1, dtype)
        self.shortcut = ConvBN(cin, cout, 1, stride, dtype) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        out = F.relu(self.conv1(x))
        return F.relu(self.conv2(out) + identity)


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        dt = config.dtype
        self.stem = ConvBN(config.in_channels, config.stem_channels, 3, 1, dt)
        blocks, cin = [], config.stem_channels
        for i, cout in enumerate(config.stage_channels):
            for j in range(config.blocks_per_stage):
                blocks.append(BasicBlock(cin, cout, 2 if i > 0 and j == 0 else 1, dt))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, config.num_classes, dtype=dt)
        self.eval()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images``: ``[batch, in_channels, image_size, image_size]`` (NCHW) -> logits ``[batch, num_classes]``."""
        x = F.relu(self.stem(images))
        x = self.blocks(x)
        return self.head(x.mean(dim=(2, 3)))

    def example_input(self, batch: int = 1) -> torch.Tensor:
        c = self.config
        return torch.randn(batch, c.in_channels, c.image_size, c.image_size, dtype=c.dtype)
