"""ResNet with bottleneck blocks (He et al. 2016; v1.5: stride on the 3x3), from ``ResNetConfig``.

Module paths: ``stem`` (7x7/2 conv, BatchNorm, ReLU, 3x3/2 max-pool), ``stages.{i}.{j}`` (block j
of stage i; the residual add, and the projection shortcut of a stage's first block, live inside
the block, so the chain of blocks is the dataflow), ``head`` (global average pool, fc, loss).
``forward(images, labels)`` returns the loss.

The layers are heterogeneous, which is what makes a memory-balanced pipeline split uneven: stage 0
works on 56x56 maps with 256 channels (activation-heavy, few parameters); stage 3 on 7x7 maps with
2048 channels (over half of the parameters, small activations). Layouts: ResNet-50 (3, 4, 6, 3),
ResNet-101 (3, 4, 23, 3), ResNet-152 (3, 8, 36, 3). resnet-50 comes to 25,557,032 parameters
(torchvision).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.common import check_positive

EXPANSION = 4  # bottleneck output channels = 4 x its inner width


@dataclass(kw_only=True)
class ResNetConfig:
    blocks: tuple[int, ...] = (3, 4, 6, 3)
    """Bottleneck blocks per stage (ResNet-50: 3, 4, 6, 3; ResNet-152: 3, 8, 36, 3)."""
    width: int = 64
    """Stem channels and the inner width of stage 0; stage i's inner width is width * 2^i."""
    num_classes: int = 1000
    """Classifier outputs."""
    image_size: int = 224
    """Side of the square input image, pixels."""
    channels: int = 3
    """Input image channels."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        self.blocks = tuple(self.blocks)
        if not self.blocks:
            raise ValueError(
                f"{name}.blocks is empty; expected blocks per stage, e.g. (3, 4, 6, 3)"
            )
        check_positive(name, **{f"blocks[{i}]": n for i, n in enumerate(self.blocks)})
        check_positive(
            name,
            width=self.width,
            num_classes=self.num_classes,
            image_size=self.image_size,
            channels=self.channels,
        )


def _conv_bn(
    c_in: int, c_out: int, kernel: int, stride: int = 1
) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)
    return conv, nn.BatchNorm2d(c_out)


class Stem(nn.Module):
    def __init__(self, config: ResNetConfig):
        super().__init__()
        self.conv, self.bn = _conv_bn(config.channels, config.width, 7, stride=2)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.pool(F.relu(self.bn(self.conv(images))))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here, v1.5), 1x1 expand; + shortcut (projected when the shape
    changes); ReLU."""

    def __init__(self, c_in: int, mid: int, stride: int):
        super().__init__()
        c_out = EXPANSION * mid
        self.conv1, self.bn1 = _conv_bn(c_in, mid, 1)
        self.conv2, self.bn2 = _conv_bn(mid, mid, 3, stride=stride)
        self.conv3, self.bn3 = _conv_bn(mid, c_out, 1)
        self.shortcut: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(*_conv_bn(c_in, c_out, 1, stride=stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.shortcut is None else self.shortcut(x)
        return F.relu(out + identity)


class Head(nn.Module):
    """Global average pool, fc, fp32 cross-entropy."""

    def __init__(self, features: int, num_classes: int):
        super().__init__()
        self.fc = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.fc(x.mean(dim=(2, 3)))
        return F.cross_entropy(logits.float(), labels)


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig):
        super().__init__()
        self.config = config
        self.stem = Stem(config)
        stages, c_in = [], config.width
        for i, count in enumerate(config.blocks):
            mid = config.width * 2**i
            blocks = [Bottleneck(c_in, mid, 1 if i == 0 else 2)]
            blocks += [Bottleneck(EXPANSION * mid, mid, 1) for _ in range(count - 1)]
            stages.append(nn.Sequential(*blocks))
            c_in = EXPANSION * mid
        self.stages = nn.ModuleList(stages)
        self.head = Head(c_in, config.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for stage in self.stages:
            x = stage(x)
        return self.head(x, labels)


def layer_paths(config: ResNetConfig) -> list[str]:
    blocks = [f"stages.{i}.{j}" for i, count in enumerate(config.blocks) for j in range(count)]
    return ["stem", *blocks, "head"]


def example_inputs(config: ResNetConfig, batch: int, seq: int | None = None) -> tuple:
    """(images, labels): float (batch, channels, image_size, image_size), int64 (batch,)."""
    if seq is not None:
        raise ValueError(
            f"an image model takes no sequence length (got seq={seq}); "
            f"override image_size (now {config.image_size}) instead"
        )
    size = config.image_size
    return (
        torch.randn(batch, config.channels, size, size),
        torch.randint(0, config.num_classes, (batch,)),
    )
