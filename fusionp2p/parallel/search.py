"""Choosing a 4D configuration: the model's top-k, re-ranked by a short measured trial (§3.4).

The communication model (:func:`fusionp2p.plan.axonn.search`) prunes the factorisations of the
cluster to a few candidates; :func:`choose_config` runs a few training steps of the layers on
each candidate and keeps the fastest, as the AxoNN paper recommends. Every rank must call it
with the same arguments: it creates process groups, and the measured times are all-reduced
(max over ranks), so all ranks pick the same configuration. :func:`measure_bandwidth` fills the
model's bandwidth with one all-reduce micro-benchmark over the whole world.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fusionp2p.errors import ConfigError
from fusionp2p.parallel.comm import ProcessGrid
from fusionp2p.parallel.linear import OverlapConfig, TensorParallel, TensorParallelLinear
from fusionp2p.plan.axonn import GridShape, LinearSpec, RankedConfig, tokens_per_rank

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrialConfig:
    """How long to measure each candidate."""

    steps: int = 3
    warmup: int = 1
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    compute_dtype: torch.dtype | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup < 0:
            raise ConfigError("TrialConfig: steps >= 1 and warmup >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrialResult:
    grid: GridShape
    predicted_s: float
    measured_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_config(shape: GridShape | ProcessGrid, layers: Sequence[LinearSpec], *, global_tokens: int,
                   trial: TrialConfig | None = None, device: torch.device | None = None) -> float:
    """Seconds of one training step (forward, backward, gradient sync) of ``layers`` on ``shape``.

    Each layer gets its own random input in its 4D layout, so any sequence of layers can be
    timed. Every step is timed on its own (after a barrier); a step's time is the maximum over
    ranks and the result is the fastest of ``trial.steps`` steps (robust to other load on a
    shared machine). Identical on every rank. Pass a :class:`ProcessGrid` to reuse its groups.
    """
    trial = trial or TrialConfig()
    device = device or torch.device("cpu")
    grid = shape if isinstance(shape, ProcessGrid) else ProcessGrid(shape)
    tp = TensorParallel(grid, overlap=trial.overlap, compute_dtype=trial.compute_dtype)
    T = tokens_per_rank(grid.shape, global_tokens)
    gen = torch.Generator().manual_seed(trial.seed)
    model = nn.ModuleList()
    inputs, grads = [], []
    for s in layers:
        layer = TensorParallelLinear(tp, s.n_in, s.n_out, bias=s.bias, transposed=s.transposed, device=device)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.02)
        model.append(layer)
        n_in = s.n_in // grid.size(s.in_dim)
        n_out = s.n_out // grid.size(s.out_dim)
        inputs.append(torch.randn(T, n_in, generator=gen).to(device).requires_grad_())
        grads.append(torch.randn(T, n_out, generator=gen).to(device))

    def step() -> None:
        with tp.optimize_communication(model):
            outs = [m(x) for m, x in zip(model, inputs)]
            torch.autograd.backward(outs, grads)
        tp.sync_gradients(model)
        model.zero_grad(set_to_none=True)
        for x in inputs:
            x.grad = None

    for _ in range(trial.warmup):
        step()
    times = torch.zeros(trial.steps, dtype=torch.float64, device=device)   # NCCL reduces device tensors only
    for i in range(trial.steps):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        _sync(device)
        times[i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return float(times.min().item())


def choose_config(candidates: Sequence[RankedConfig], layers: Sequence[LinearSpec], *, global_tokens: int,
                  top: int = 3, trial: TrialConfig | None = None,
                  device: torch.device | None = None) -> tuple[GridShape, list[TrialResult]]:
    """Measure the ``top`` first candidates and return the fastest with every measurement."""
    if not candidates:
        raise ConfigError("no candidate configuration to measure")
    results = []
    for c in candidates[:top]:
        t = measure_config(c.grid, layers, global_tokens=global_tokens, trial=trial, device=device)
        results.append(TrialResult(grid=c.grid, predicted_s=c.predicted_s, measured_s=t))
        log.info("trial %s: predicted %.3g s, measured %.3g s", c.grid.as_tuple(), c.predicted_s, t)
    best = min(results, key=lambda r: (r.measured_s, r.grid.as_tuple()))
    return best.grid, results


def measure_bandwidth(nbytes: int = 1 << 24, *, repeats: int = 3, device: torch.device | None = None) -> float:
    """Bus bandwidth (bytes/s) of an all-reduce over the whole world, in the ring model's terms.

    ``t = 2(p−1)/p · V/β`` solved for β, best of ``repeats``; the same on every rank.
    """
    p = dist.get_world_size()
    if p == 1:
        raise ConfigError("bandwidth needs at least two processes")
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device or torch.device("cpu"))
    dist.all_reduce(buf)                        # warm-up: connections, buffers
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if buf.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    t = torch.tensor([best], dtype=torch.float64, device=buf.device)   # NCCL reduces device tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return 2 * (p - 1) / p * buf.numel() * 4 / float(t.item())
