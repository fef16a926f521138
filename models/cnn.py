"""A ResNet-style CNN: ``x: [B, 3, H, W]`` -> logits ``[B, n_classes]``.

Layout: ``stem`` (3x3 conv + norm + ReLU), ``layers`` (one ``BasicBlock`` per
entry; the first block of each stage after the first halves the resolution)
and ``head`` (global average pool + linear). GroupNorm instead of BatchNorm:
its output does not depend on the other samples of the batch, so a pipeline
that splits the batch into microbatches computes exactly the gradients of the
unsplit batch (and there are no running statistics to keep in sync).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models import init_parameters
from planner.errors import InvalidInputError


@dataclass(frozen=True, slots=True, kw_only=True)
class CNNConfig:
    widths: tuple[int, ...]          # channels of each stage
    blocks: tuple[int, ...]          # residual blocks per stage
    n_classes: int
    image_size: int = 32
    in_channels: int = 3
    norm_groups: int = 8

    def __post_init__(self) -> None:
        if not self.widths or len(self.widths) != len(self.blocks):
            raise InvalidInputError("CNNConfig.widths/blocks", expected="two non-empty tuples of equal length",
                                    found=f"{self.widths} and {self.blocks}")
        if any(w < 1 or w % self.norm_groups for w in self.widths):
            raise InvalidInputError("CNNConfig.widths", expected=f"multiples of norm_groups={self.norm_groups}",
                                    found=str(self.widths))
        if any(b < 1 for b in self.blocks) or min(self.n_classes, self.image_size, self.in_channels) < 1:
            raise InvalidInputError("CNNConfig", expected="blocks, n_classes, image_size, in_channels >= 1",
                                    found=str(self))


def conv_norm(c_in: int, c_out: int, stride: int, groups: int, kernel: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
                         nn.GroupNorm(groups, c_out))


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection (a 1x1 projection when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = conv_norm(c_in, c_out, stride, groups)
        self.conv2 = conv_norm(c_out, c_out, 1, groups)
        self.shortcut = (conv_norm(c_in, c_out, stride, groups, kernel=1)
                         if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))) + self.shortcut(x))


class Stem(nn.Module):
    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        self.conv = conv_norm(cfg.in_channels, cfg.widths[0], 1, cfg.norm_groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class PoolHead(nn.Module):
    def __init__(self, width: int, n_classes: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.mean(dim=(2, 3)))


class CNN(nn.Module):
    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        self.config = cfg
        self.stem = Stem(cfg)
        blocks: list[nn.Module] = []
        c_in = cfg.widths[0]
        for stage, (width, count) in enumerate(zip(cfg.widths, cfg.blocks)):
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(c_in, width, stride, cfg.norm_groups))
                c_in = width
        self.layers = nn.ModuleList(blocks)
        self.head = PoolHead(cfg.widths[-1], cfg.n_classes)

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init keyed by parameter name: Kaiming convs, N(0, 1/fan_in) head."""
        init_parameters(self, seed, linear_std=lambda _n, m: 1.0 / math.sqrt(m.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
