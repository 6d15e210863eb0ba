"""A plain multi-layer perceptron: Linear -> GELU repeated, then a Linear to the outputs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from fusionp2p.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class MLPConfig:
    in_features: int = 32
    hidden: tuple[int, ...] = (64, 64)
    out_features: int = 10

    def __post_init__(self) -> None:
        if self.in_features <= 0 or self.out_features <= 0 or any(h <= 0 for h in self.hidden):
            raise ConfigError("MLPConfig: every size must be positive")


class MLP(nn.Module):
    """``forward(x: (B, in_features)) -> (B, out_features)``; ``layers`` holds the hidden layers."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.config = cfg
        sizes = (cfg.in_features, *cfg.hidden)
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in itertools.pairwise(sizes)])
        self.out = nn.Linear(sizes[-1], cfg.out_features)

    def forward(self, x_BF: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_BF = torch.nn.functional.gelu(layer(x_BF))
        y: torch.Tensor = self.out(x_BF)
        return y
