"""The CO2 outer optimizer on a flat fp32 vector (pure: no I/O, no clock).

Theory of operation (ALGORITHMS.md §2.2). Replicas run τ local steps from a shared *anchor*
``x̃_t``, snapshot their parameters, and average the snapshots. The outer step turns the averaged
snapshot ``x̄`` into a pseudo-gradient ``Δ`` and applies heavy-ball (or Nesterov) momentum::

    sync  (SlowMo / Local-SGD):  Δ = x̃_t     − x̄_t          (average of this round)
    async (CO2, one-step stale): Δ = x̃_{t-1} − x̄_{t-1}      (average launched one round earlier)
    m  ← β·m + Δ ⊘ Λ_t                     staleness gap penalty Λ_t ≥ 1 (pluggable)
    m  ← clip(m, φ)                         IN PLACE (the reference code's clamp is a no-op)
    x̃_{t+1} = x̃_t − α·(Δ⊘Λ + β·m if nesterov else m)

The optimizer may hold the *whole* vector or only one contiguous shard of it (sharded outer
state, see :mod:`fusionp2p.average.shard`): every operation is element-wise except the two
global norms, which the caller passes in already summed over shards (``gap_sq``) or which are
refused when sharded (global-norm clipping).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fusionp2p.errors import ConfigError

log = logging.getLogger(__name__)

PENALTY_MODES = ("none", "constant", "elementwise", "lr_ratio")
CLIP_MODES = ("none", "elementwise", "global_norm")


@dataclass(frozen=True, slots=True, kw_only=True)
class PenaltyInputs:
    """What a staleness-gap penalty may look at (all tensors are the same shard, fp32).

    ``gap = anchor - prev_anchor`` is the staleness gap ``x̃_t − x̃_{t-1}``; ``gap_sq`` is
    ``‖gap‖²`` over the WHOLE vector (summed over shards by the caller). ``lr_now``/``lr_prev`` are
    the inner learning rates the caller reported at this and the previous round boundary.
    """

    anchor: torch.Tensor
    prev_anchor: torch.Tensor
    avg: torch.Tensor
    gap_sq: float
    lr_now: float | None
    lr_prev: float | None


PenaltyFn = Callable[[PenaltyInputs], "torch.Tensor | float"]


def penalty_none(_: PenaltyInputs) -> float:
    return 1.0


def make_penalty(mode: str | PenaltyFn, value: float) -> PenaltyFn:
    """The penalty function for a mode name, or *mode* itself when it is already callable.

    * ``none``: Λ = 1.
    * ``constant``: Λ = value (the reference code's scalar ``co2_gap_penalty``).
    * ``elementwise`` [reconstructed, ALGORITHMS.md §2.2]: Λ = 1 + value·|gap|/‖gap‖₂.
    * ``lr_ratio``: Λ = max(1, lr_prev/lr_now): shrink updates computed at a larger inner lr.
    """
    if callable(mode):
        return mode
    if mode == "none":
        return penalty_none
    if mode == "constant":
        return lambda _inp: value
    if mode == "elementwise":

        def elementwise(inp: PenaltyInputs) -> torch.Tensor | float:
            norm = math.sqrt(inp.gap_sq)
            if norm == 0.0:  # no gap yet (first rounds): nothing to penalise
                return 1.0
            return 1.0 + (inp.anchor - inp.prev_anchor).abs_().mul_(value / norm)

        return elementwise
    if mode == "lr_ratio":

        def lr_ratio(inp: PenaltyInputs) -> float:
            if not inp.lr_now or not inp.lr_prev:
                return 1.0
            return max(1.0, inp.lr_prev / inp.lr_now)

        return lr_ratio
    raise ConfigError(f"penalty must be one of {PENALTY_MODES} or a callable, got {mode!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class OuterConfig:
    """Configuration of the CO2 outer step (defaults: plain Local-SGD averaging every step).

    ``max_staleness`` (async only): how many rounds a late average may lag before a round boundary
    blocks on it; 1 is strict CO2 (always wait for the previous round's average), 2 lets a boundary
    skip the outer update once and apply it at the next boundary.

    ``stream`` (async only; ignored when ``sync``): the averager cuts the vector into ``tau`` fragments
    and averages one per local step, applied one step late (train/averager.py). Each fragment's outer
    step then uses the fresh average of its own round (the sync form, ``Δ = x̃_t − x̄_t``): the
    staleness is in when the new anchor is applied, not in the pseudo-gradient. Requires
    ``max_staleness == 1``.

    ``lag`` (streaming only): a fragment's round is applied at the boundary ``lag`` local steps after
    its snapshot, which waits for it if it has not finished (1: the next step). A lag of 2 lets a round
    take up to two steps on a slow link before the training loop waits for it; it is fixed for the job,
    so the loss does not depend on timing. At most ``tau`` (a fragment's next snapshot must see its last
    round applied).
    """

    tau: int = 1
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = False
    penalty: str | PenaltyFn = "none"
    penalty_value: float = 1.0
    clip: str = "none"
    clip_threshold: float = math.inf
    sync: bool = True
    max_staleness: int = 1
    stream: bool = False
    lag: int = 1
    penalty_fn: PenaltyFn = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tau < 1:
            raise ConfigError(f"tau must be >= 1, got {self.tau}")
        if not (self.outer_lr > 0 and math.isfinite(self.outer_lr)):
            raise ConfigError(f"outer_lr must be a positive finite number, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.clip not in CLIP_MODES:
            raise ConfigError(f"clip must be one of {CLIP_MODES}, got {self.clip!r}")
        if not self.clip_threshold > 0:
            raise ConfigError(f"clip_threshold must be > 0, got {self.clip_threshold}")
        if self.penalty in ("constant", "elementwise") and not (
            self.penalty_value > 0 and math.isfinite(self.penalty_value)
        ):
            raise ConfigError(f"penalty_value must be positive and finite, got {self.penalty_value}")
        if self.penalty == "constant" and self.penalty_value < 1.0:
            raise ConfigError("a constant staleness penalty must be >= 1 (it divides the update)")
        if self.max_staleness < 1:
            raise ConfigError(f"max_staleness must be >= 1, got {self.max_staleness}")
        if self.stream and not self.sync and self.max_staleness != 1:
            raise ConfigError("streaming averaging waits for every fragment's round: max_staleness must be 1")
        if not 1 <= self.lag <= self.tau:
            raise ConfigError(f"lag must be between 1 and tau ({self.tau}), got {self.lag}")
        object.__setattr__(self, "penalty_fn", make_penalty(self.penalty, self.penalty_value))

    @property
    def streaming(self) -> bool:
        """The streaming (fragmented, one-step-stale) form is in use."""
        return self.stream and not self.sync


def clip_(m: torch.Tensor, mode: str, threshold: float, *, global_sq: float | None = None) -> torch.Tensor:
    """Clip the momentum *m* IN PLACE and return it.

    ``global_sq`` is ``‖m‖²`` over the whole vector when *m* is one shard (defaults to *m*'s own).
    """
    if mode == "elementwise" and math.isfinite(threshold):
        m.clamp_(-threshold, threshold)
    elif mode == "global_norm" and math.isfinite(threshold):
        sq = float(m.pow(2).sum()) if global_sq is None else global_sq
        norm = math.sqrt(sq)
        if norm > threshold:
            m.mul_(threshold / norm)
    return m


@dataclass(slots=True, kw_only=True)
class StepResult:
    """What one outer step produced: the new anchor shard and its ``‖x̃_{t+1} − x̃_t‖²`` part."""

    anchor: torch.Tensor
    gap_sq_part: float


class OuterOptimizer:
    """Outer state (anchor, previous anchor, momentum) for one contiguous shard ``[lo, hi)``.

    ``anchor`` is ``x̃_t``, ``prev_anchor`` is ``x̃_{t-1}``; both start equal to *initial*.
    Not thread-safe: one owner drives it, one step at a time.
    """

    def __init__(self, config: OuterConfig, initial: torch.Tensor, *, lo: int = 0, sharded: bool = False,
                 alloc: Callable[[int], torch.Tensor] | None = None) -> None:
        if initial.dim() != 1:
            raise ValueError("OuterOptimizer works on a flat 1-D vector")
        if sharded and config.clip == "global_norm" and math.isfinite(config.clip_threshold):
            raise ConfigError("global-norm momentum clipping is not supported with sharded outer state; use clip='elementwise'")
        self.config = config
        self.lo = lo
        self.sharded = sharded
        self._needs_gap = config.penalty == "elementwise" or callable(config.penalty)
        self.anchor = initial.detach().to(torch.float32, copy=True)
        self.prev_anchor = self.anchor.clone()
        self.momentum = torch.zeros_like(self.anchor)
        # the step's difference and scaled update live here, not in fresh shard-sized tensors every step: a
        # fresh one faults in its pages (the outer steps of a 25M x 4 round took 18-21k page faults)
        self._scratch: torch.Tensor | None = None
        # where each step's new anchor is written (a flat fp32 vector of n elements, contents undefined): the
        # averager hands out recycled vectors (its pool takes one back once nothing holds it: the anchor a
        # step returns is still being sent to the peers when the next step runs); default a fresh tensor
        self._alloc = alloc
        self.gap_sq = 0.0          # ‖x̃_t − x̃_{t-1}‖² over the whole vector (caller sums shards)
        self.lr_prev: float | None = None
        self.steps = 0

    @property
    def hi(self) -> int:
        return self.lo + self.anchor.numel()

    def step(self, avg: torch.Tensor, *, lr: float | None = None) -> StepResult:
        """Apply one outer step with the averaged snapshot *avg* (this shard) and return x̃_{t+1}.

        In sync mode *avg* is the average of this round's snapshots; in async mode it is the
        average of the PREVIOUS round's snapshots (taken when the anchor was ``prev_anchor``).
        """
        cfg = self.config
        avg = avg.to(torch.float32)
        if avg.shape != self.anchor.shape:
            raise ValueError(f"average shard has shape {tuple(avg.shape)}, expected {tuple(self.anchor.shape)}")
        base = self.anchor if cfg.sync else self.prev_anchor
        if self._scratch is None or self._scratch.shape != self.anchor.shape:
            self._scratch = torch.empty_like(self.anchor)
        delta = torch.sub(base, avg, out=self._scratch)
        lam = cfg.penalty_fn(
            PenaltyInputs(anchor=self.anchor, prev_anchor=self.prev_anchor, avg=avg, gap_sq=self.gap_sq, lr_now=lr, lr_prev=self.lr_prev)
        )
        if isinstance(lam, torch.Tensor) or lam != 1.0:
            delta = delta.div_(lam)
        if cfg.outer_momentum == 0.0:
            # m = 0·m + Δ is Δ (but for the sign of a zero): Δ's buffer becomes the momentum and the old
            # momentum's the scratch, instead of two passes over the shard; the Nesterov term β·m is 0
            self.momentum, self._scratch = delta, self.momentum
            m = update = clip_(delta, cfg.clip, cfg.clip_threshold)
        else:
            m = self.momentum.mul_(cfg.outer_momentum).add_(delta)
            clip_(m, cfg.clip, cfg.clip_threshold)
            update = delta.add_(m, alpha=cfg.outer_momentum) if cfg.nesterov else m   # delta is not read again
        n = self.anchor.numel()
        out = self._alloc(n) if self._alloc is not None else torch.empty(n, dtype=torch.float32)
        if cfg.outer_lr != 1.0:   # α·u; with α = 1 it is u itself, bit for bit
            update = torch.mul(update, cfg.outer_lr, out=self._scratch)
        new = torch.sub(self.anchor, update, out=out)
        # ‖x̃_{t+1} − x̃_t‖² feeds only gap-aware penalties; skip the pass over the vector otherwise
        gap_part = float((new - self.anchor).pow(2).sum(dtype=torch.float64)) if self._needs_gap else 0.0
        self.prev_anchor = self.anchor
        self.anchor = new
        self.lr_prev = lr
        self.steps += 1
        if not self.sharded:  # sharded owners get the whole-vector sum from the all-gather
            self.gap_sq = gap_part
        return StepResult(anchor=new, gap_sq_part=gap_part)

    def hold(self, *, lr: float | None = None) -> StepResult:
        """Advance one round without an average (async warm-up, or a skipped update): x̃_{t+1} = x̃_t."""
        self.prev_anchor = self.anchor.clone()
        self.lr_prev = lr
        self.gap_sq = 0.0
        return StepResult(anchor=self.anchor, gap_sq_part=0.0)

    def reset(self, anchor: torch.Tensor) -> None:
        """Restart from *anchor* with zero momentum (after the replica set changed)."""
        self.anchor = anchor.detach().to(torch.float32, copy=True)
        self.prev_anchor = self.anchor.clone()
        self.momentum = torch.zeros_like(self.anchor)
        self.gap_sq = 0.0


def suggest_tau(t_allreduce: float, t_step: float, *, margin: float = 1.0) -> int:
    """Smallest τ with ``T_allreduce ≤ τ·t_step`` (times in any one unit), scaled by *margin* ≥ 1.

    The full-overlap condition of ALGORITHMS.md §2.3: the averaging launched at one round boundary
    must finish within the τ local steps of the next round.
    """
    if not (t_step > 0 and math.isfinite(t_step)):
        raise ConfigError(f"t_step must be positive and finite, got {t_step}")
    if t_allreduce < 0 or not math.isfinite(t_allreduce):
        raise ConfigError(f"t_allreduce must be >= 0 and finite, got {t_allreduce}")
    if margin < 1.0:
        raise ConfigError(f"margin must be >= 1, got {margin}")
    return max(1, math.ceil(margin * t_allreduce / t_step - 1e-12))


def ring_allreduce_time(n_elems: int, replicas: int, *, bytes_per_s: float, latency_s: float, elem_bytes: int = 4) -> float:
    """Ring/butterfly all-reduce time ``2(n−1)/n · |θ|·b/β + 2(n−1)·α`` (ALGORITHMS.md §2.3)."""
    if replicas <= 1:
        return 0.0
    n = replicas
    return 2 * (n - 1) / n * n_elems * elem_bytes / bytes_per_s + 2 * (n - 1) * latency_s
