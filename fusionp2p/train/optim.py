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
    # fused: one kernel updates each tensor in place. The default (per-tensor) step builds sqrt(v) and its
    # quotient as two new tensors of each parameter's size: twice a stage's largest tensor beyond the state the
    # planner prices (a vocabulary's embedding or head: 188 of the 365 MiB by which a node of 4 x --memory 1GiB
    # peaked over its prediction, benchmarks/model_scale.py). Its updates match the default to float rounding.
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in groups[0]["params"])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=fused or None)


__all__ = ["make_optimizer"]
