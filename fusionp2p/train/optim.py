"""A stage's local optimizer (the job's settings, the same on every replica)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusionp2p.train.config import TrainConfig


def make_optimizer(params: Sequence[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The job's local optimizer over a stage's parameters (same settings on every replica); one group, empty
    for a stage that holds none (the loss alone: a plan under tight memory may cut there)."""
    groups = [{"params": list(params)}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


__all__ = ["make_optimizer"]
