"""A small ResNet-family CNN (basic residual blocks), no torchvision.

``ResNet(ResNetConfig(...))`` maps images ``(B, C, H, W)`` to class logits ``(B, num_classes)``.
Layout: ``stem`` (conv-bn-relu), ``blocks`` (an ``nn.ModuleList`` of :class:`BasicBlock`, each with
a skip connection, 1x1 projection when the shape changes), ``head`` (global average pool + linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fusionp2p.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class ResNetConfig:
    """Stage widths and the number of blocks per stage (ResNet-18 is widths (64,128,256,512), depths (2,2,2,2))."""

    in_channels: int = 3
    num_classes: int = 10
    widths: tuple[int, ...] = (16, 32, 64)
    depths: tuple[int, ...] = (1, 1, 1)

    def __post_init__(self) -> None:
        if self.in_channels <= 0 or self.num_classes <= 0:
            raise ConfigError("ResNetConfig: in_channels and num_classes must be positive")
        if not self.widths or len(self.widths) != len(self.depths):
            raise ConfigError("ResNetConfig: widths and depths must be non-empty and of equal length")
        if any(w <= 0 for w in self.widths) or any(d <= 0 for d in self.depths):
            raise ConfigError("ResNetConfig: widths and depths must be positive")


class BasicBlock(nn.Module):
    """relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x_BCHW)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x_BCHW))


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.config = cfg
        w0 = cfg.widths[0]
        self.stem = nn.Sequential(nn.Conv2d(cfg.in_channels, w0, 3, padding=1, bias=False), nn.BatchNorm2d(w0), nn.ReLU())
        blocks: list[nn.Module] = []
        c_in = w0
        for i, (w, d) in enumerate(zip(cfg.widths, cfg.depths)):
            for j in range(d):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(BasicBlock(c_in, w, stride))
                c_in = w
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(c_in, cfg.num_classes)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        x = self.stem(x_BCHW)
        for b in self.blocks:
            x = b(x)
        x_BC = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        out: torch.Tensor = self.head(x_BC)
        return out
