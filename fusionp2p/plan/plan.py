"""The planner's output: a frozen :class:`Plan`, its wire form and its hash.

A plan is what every member of a job agrees on by hash (jobs/election.py), so the hash covers
exactly the *decisions* — job, epoch, snapshot hash, algorithm, seed, micro-batches (and, when the
pipelines differ in speed, each one's count), stage ranges, replicas, and per-fence kept ratios
(quantised to 1e-4) — and not the predicted times, which are
floating-point forecasts that may differ in the last bit between machines.

Timing fields (seconds per micro-batch unless stated):

* ``Stage.compute_s``: throughput-equivalent compute of the stage (replicas share micro-batches);
* ``Fence.time_s`` / ``dense_time_s``: the link's time with / without the chosen compression,
  activations forward plus gradients backward; ``Fence.bandwidth_bps`` / ``latency_s``: the link
  (between the two replica groups) the ratio was chosen for: a ratio below 1 means the dense time
  exceeded the plan's compute bottleneck on that link (``predict.choose_ratios``);
* ``bottleneck_s``: max over stages and fences; throughput in steady state is ``1 / bottleneck_s``;
* ``step_time_s``: one GPipe step of M micro-batches,
  ``(M - 1) * bottleneck_s + sum(stage compute) + sum(fence time)`` — the first micro-batch
  crosses every pipeline element once (fill and drain) and the other M-1 leave one bottleneck
  interval apart.

``Plan.how`` and ``Plan.considered`` say how the plan was chosen (plan/joint.py): which candidate
layout won and the predicted step time of every candidate the planner scored. Like the predictions,
they travel with the plan but are not hashed.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.wire.check import U63, as_int, as_str
from fusionp2p.wire.limits import DEFAULT_LIMITS
from fusionp2p.wire.msg import expect_map, packb, typed_field, unpackb

PLAN_VERSION = 1
MAX_PLAN_BYTES = DEFAULT_LIMITS.max_control_frame
MAX_STAGES = 4096
MAX_MICRO_RATIO = 4  # most / fewest micro-batches of two pipelines (the averager refuses weights further apart)
MAX_MICRO_PERIOD = 64  # steps over which the micro-batches per pipeline repeat (Plan.micro_period)
MAX_DEALT = 4096       # micro-batches split_by_speed deals per period at most (deal_period)
RHO_GRID = 10_000  # kept ratios are multiples of 1/RHO_GRID, so that they hash identically everywhere


def quantize_rho(rho: float) -> float:
    """Round a kept fraction *down* to the 1e-4 grid (never above the exact value, so never slower)."""
    if rho >= 1.0:
        return 1.0
    return max(1, math.floor(rho * RHO_GRID)) / RHO_GRID


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    start: int                      # first unit (inclusive)
    end: int                        # last unit (exclusive)
    replicas: tuple[str, ...]       # peers serving the stage; replica r of consecutive stages form pipeline r
    compute_s: float = 0.0          # predicted seconds per micro-batch (throughput-equivalent)
    memory_bytes: float = 0.0       # predicted bytes per replica

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end):
            raise ValueError(f"stage [{self.start}, {self.end}) is empty or negative")
        if not self.replicas or len(set(self.replicas)) != len(self.replicas):
            raise ValueError("a stage needs distinct replicas")


@dataclass(frozen=True, slots=True, kw_only=True)
class Fence:
    """The boundary between stage ``index`` and ``index + 1`` (before unit ``unit``)."""

    index: int
    unit: int
    dense_bytes: float              # bytes per micro-batch crossing the fence, uncompressed
    rho: float                      # AdaTopK kept fraction, 1.0 = no compression
    time_s: float = 0.0
    dense_time_s: float = 0.0
    bandwidth_bps: float = 0.0      # the link the ratio was chosen for (bytes/s; 0 = not recorded)
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.rho <= 1.0):
            raise ValueError(f"fence {self.index}: rho must be in (0, 1], got {self.rho}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One layout the planner scored: replicas per stage, stages, how it was built, predicted step time."""

    replicas: int
    stages: int
    how: str
    step_time_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    job: str
    epoch: int
    snapshot_hash: str
    algorithm: str                  # "op-fence" | "even-layers" | "even-flops"
    seed: int
    n_units: int
    micro_batches: int
    stages: tuple[Stage, ...]
    fences: tuple[Fence, ...]
    bottleneck_s: float = 0.0
    step_time_s: float = 0.0
    how: str = ""                                   # which candidate won (plan/joint.py), "" for other planners
    considered: tuple[Candidate, ...] = ()          # every candidate scored, best first
    # Micro-batches of each pipeline (replica index r) per ``micro_period`` steps, in proportion to its
    # speed; () = every pipeline runs ``micro_batches`` (lockstep). They sum to ``micro_batches x replicas
    # x micro_period``, and every step deals out ``micro_batches x replicas`` of them (:meth:`micro_at`), so
    # a step sees the same samples either way, and the averages weigh each replica by its share. A period
    # above 1 gives a replica a fractional number per step (4.75 = 5, 5, 5, 4), which whole micro-batches
    # per step cannot (a step of 16 among 4 replicas is split in 16ths of it, the speeds are not).
    micro: tuple[int, ...] = ()
    micro_period: int = 1

    MAX_CANDIDATES: ClassVar[int] = 64
    MAX_MICRO_RATIO: ClassVar[int] = MAX_MICRO_RATIO
    MAX_MICRO_PERIOD: ClassVar[int] = MAX_MICRO_PERIOD

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a plan needs at least one stage")
        if self.stages[0].start != 0 or self.stages[-1].end != self.n_units:
            raise ValueError("stages must cover every unit")
        for a, b in zip(self.stages, self.stages[1:]):
            if a.end != b.start:
                raise ValueError("stages must be contiguous and in order")
        if len(self.fences) != len(self.stages) - 1:
            raise ValueError("a plan has one fence between consecutive stages")
        for k, f in enumerate(self.fences):
            if f.index != k or f.unit != self.stages[k].end:
                raise ValueError(f"fence {k} is not at the end of stage {k}")
        seen: set[str] = set()
        for s in self.stages:
            if seen.intersection(s.replicas):
                raise ValueError("a peer serves at most one stage")
            seen.update(s.replicas)
        if self.micro_batches < 1:
            raise ValueError("micro_batches must be >= 1")
        if not 1 <= self.micro_period <= self.MAX_MICRO_PERIOD or (self.micro_period > 1 and not self.micro):
            raise ValueError(f"micro_period must be in [1, {self.MAX_MICRO_PERIOD}], and 1 without micro")
        if self.micro:
            r, p = len(self.stages[0].replicas), self.micro_period
            if any(len(st.replicas) != r for st in self.stages):
                raise ValueError("micro-batches per pipeline need the same replica count on every stage")
            if len(self.micro) != r or min(self.micro) < p or sum(self.micro) != self.micro_batches * r * p:
                raise ValueError(f"micro-batches per pipeline must be {r} counts >= {p} summing to "
                                 f"{self.micro_batches * r * p}")
            if max(self.micro) > self.MAX_MICRO_RATIO * min(self.micro):
                raise ValueError(f"micro-batches per pipeline differ by more than {self.MAX_MICRO_RATIO}x")

    # -- derived ---------------------------------------------------------------------------------
    @property
    def throughput(self) -> float:
        """Micro-batches per second over a whole step (M / step_time)."""
        return self.micro_batches / self.step_time_s if self.step_time_s > 0 else math.inf

    def micro_at(self, step: int) -> tuple[int, ...]:
        """Micro-batches of each pipeline at *step* (() when in lockstep): :func:`micro_schedule`."""
        return micro_schedule(self.micro, self.micro_period, step)

    @property
    def micro_share(self) -> tuple[float, ...]:
        """Micro-batches of each pipeline per step on average (() when in lockstep)."""
        return tuple(m / self.micro_period for m in self.micro)

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(sorted(p for s in self.stages for p in s.replicas))

    def stage_of(self, peer: str) -> int | None:
        for k, s in enumerate(self.stages):
            if peer in s.replicas:
                return k
        return None

    # -- hash and wire ---------------------------------------------------------------------------
    def _decision(self) -> dict[str, Any]:
        return {
            "v": PLAN_VERSION, "job": self.job, "epoch": int(self.epoch), "snapshot": self.snapshot_hash,
            "algorithm": self.algorithm, "seed": int(self.seed), "n_units": int(self.n_units),
            "micro_batches": int(self.micro_batches),
            "stages": [[s.start, s.end, list(s.replicas)] for s in self.stages],
            "rho": [round(f.rho * RHO_GRID) for f in self.fences],
            **({"micro": [int(m) for m in self.micro]} if self.micro else {}),   # absent: lockstep (same hash as before)
            **({"micro_period": int(self.micro_period)} if self.micro_period > 1 else {}),
        }

    def plan_hash(self) -> str:
        """Hex sha256 of the canonical encoding of the decisions (not of the predictions)."""
        return hashlib.sha256(packb(self._decision())).hexdigest()

    def to_wire(self) -> bytes:
        m = self._decision()
        m["pred"] = {
            "stage": [[float(s.compute_s), float(s.memory_bytes)] for s in self.stages],
            "fence": [[float(f.dense_bytes), float(f.time_s), float(f.dense_time_s), float(f.bandwidth_bps),
                       float(f.latency_s)] for f in self.fences],
            "bottleneck": float(self.bottleneck_s), "step": float(self.step_time_s),
            "how": self.how,
            "considered": [[c.replicas, c.stages, c.how, float(c.step_time_s)] for c in self.considered],
        }
        return packb(m)

    @classmethod
    def from_wire(cls, data: bytes, *, max_size: int = MAX_PLAN_BYTES) -> Plan:
        """Decode and validate; anything malformed raises RemoteProtocolError."""
        what = "plan"
        m = expect_map(unpackb(data, max_size=max_size), what)
        if typed_field(m, "v", int, what) != PLAN_VERSION:
            raise RemoteProtocolError("plan: unsupported version")
        raw_stages = typed_field(m, "stages", list, what)
        rhos = typed_field(m, "rho", list, what)
        pred = expect_map(typed_field(m, "pred", dict, what), "plan.pred")
        pst = typed_field(pred, "stage", list, what)
        pfe = typed_field(pred, "fence", list, what)
        if not (0 < len(raw_stages) <= MAX_STAGES) or len(rhos) != len(raw_stages) - 1:
            raise RemoteProtocolError("plan: bad number of stages or ratios")
        if len(pst) != len(raw_stages) or len(pfe) != len(rhos):
            raise RemoteProtocolError("plan: predictions do not match the stages")
        try:
            stages = []
            for (start, end, reps), (comp, mem) in zip(raw_stages, pst):
                if not isinstance(reps, list) or not all(isinstance(r, str) for r in reps):
                    raise TypeError("replicas must be strings")
                stages.append(Stage(start=_int(start), end=_int(end), replicas=tuple(reps),
                                    compute_s=_flt(comp), memory_bytes=_flt(mem)))
            fences = []
            for k, (q, pf) in enumerate(zip(rhos, pfe)):
                qi = _int(q)
                if not (0 < qi <= RHO_GRID):
                    raise ValueError("rho out of range")
                if not isinstance(pf, list) or len(pf) not in (3, 5):   # 3: plans of nodes before the link fields
                    raise TypeError("a fence prediction is 3 or 5 numbers")
                nb, t, dt, bw, lat = (*pf, 0.0, 0.0) if len(pf) == 3 else pf
                fences.append(Fence(index=k, unit=stages[k].end, dense_bytes=_flt(nb), rho=qi / RHO_GRID,
                                    time_s=_flt(t), dense_time_s=_flt(dt), bandwidth_bps=_flt(bw), latency_s=_flt(lat)))
            how = pred.get("how", "")
            raw_cand = pred.get("considered", [])
            if not isinstance(how, str) or len(how) > 64 or not isinstance(raw_cand, list) \
                    or len(raw_cand) > cls.MAX_CANDIDATES:
                raise TypeError("bad plan rationale")
            considered = []
            for c in raw_cand:
                if not isinstance(c, list) or len(c) != 4 or not isinstance(c[2], str) or len(c[2]) > 64:
                    raise TypeError("bad plan candidate")
                considered.append(Candidate(replicas=_int(c[0]), stages=_int(c[1]), how=c[2], step_time_s=_flt(c[3])))
            raw_micro = m.get("micro", [])
            if not isinstance(raw_micro, list) or len(raw_micro) > len(stages[0].replicas):
                raise TypeError("bad micro-batches per pipeline")
            return cls(
                micro=tuple(_int(x) for x in raw_micro), micro_period=_int(m.get("micro_period", 1)),
                job=as_str(m.get("job"), "plan job"), epoch=as_int(m.get("epoch"), "plan epoch", lo=0, hi=U63),
                snapshot_hash=as_str(m.get("snapshot"), "plan snapshot"), algorithm=as_str(m.get("algorithm"), "plan algorithm"),
                seed=as_int(m.get("seed"), "plan seed"), n_units=as_int(m.get("n_units"), "plan n_units", lo=1, hi=1 << 24),
                micro_batches=as_int(m.get("micro_batches"), "plan micro_batches", lo=1, hi=1 << 24), stages=tuple(stages),
                fences=tuple(fences),
                bottleneck_s=_flt(typed_field(pred, "bottleneck", float, what)), step_time_s=_flt(typed_field(pred, "step", float, what)),
                how=how, considered=tuple(considered),
            )
        except (ValueError, TypeError, OverflowError, AttributeError) as exc:
            raise RemoteProtocolError(f"plan: invalid content: {exc}") from exc


def split_by_speed(speed: Sequence[float], micro_batches: int, period: int = 1) -> tuple[int, ...]:
    """Micro-batches per pipeline per *period* steps for pipelines of relative *speed* (micro-batches a
    second, all positive): the ``M x r x period`` of those steps given one at a time to the pipeline that
    would finish it first (earliest finish: the shortest makespan for equal jobs on machines of
    different speeds), each at least one a step and at most ``MAX_MICRO_RATIO`` x the fewest."""
    r, p = len(speed), period
    counts = [p] * r
    heap = [((p + 1) / speed[k], k) for k in range(r)]
    heapq.heapify(heap)
    for _ in range((micro_batches - 1) * r * p):
        held: list[tuple[float, int]] = []
        while True:
            t, k = heapq.heappop(heap)
            if counts[k] + 1 <= MAX_MICRO_RATIO * min(counts):
                break
            held.append((t, k))
        counts[k] += 1
        heapq.heappush(heap, ((counts[k] + 1) / speed[k], k))
        for item in held:
            heapq.heappush(heap, item)
    return tuple(counts)


def deal_period(period: int, micro_batches: int, replicas: int) -> int:
    """*period*, halved while a period's ``M x r x period`` micro-batches exceed ``MAX_DEALT`` (dealing
    them one at a time costs that many heap steps per candidate plan; with that many a step the
    fraction matters little)."""
    while period > 1 and micro_batches * replicas * period > MAX_DEALT:
        period //= 2
    return period


def lowest_terms(micro: Sequence[int], period: int) -> tuple[tuple[int, ...], int]:
    """*micro* per *period* steps in lowest terms: (16, 16, 48, 48) over 8 steps is (2, 2, 6, 6) over 1."""
    g = math.gcd(period, *micro)
    return tuple(m // g for m in micro), period // g


def deal_by_speed(speed: Sequence[float], micro_batches: int, period: int) -> tuple[tuple[int, ...], int]:
    """``(micro, micro_period)`` of a plan for pipelines of relative *speed*: :func:`split_by_speed` over
    *period* steps (:func:`deal_period` bounds it), in lowest terms."""
    p = deal_period(period, micro_batches, len(speed))
    return lowest_terms(split_by_speed(speed, micro_batches, p), p)


def micro_schedule(micro: tuple[int, ...], period: int, step: int) -> tuple[int, ...]:
    """Micro-batches of each pipeline at *step*, from their counts *micro* per *period* steps (sum
    ``M x r x period``, each at least *period*): every pipeline runs ``micro[k] // period`` and the step's
    other micro-batches go to the pipelines with the most credit, each pipeline earning ``micro[k] %
    period`` a step and paying ``period`` for a micro-batch (a smooth weighted round robin, ties to the
    lower index). Every step deals out the same total; over each *period* steps from a multiple of it a
    pipeline runs exactly ``micro[k]``, and at no step is it more than one micro-batch from its share.
    The same on every member: a pure function of the plan and the step. () for ().
    """
    if not micro:
        return ()
    if period == 1:
        return micro
    base = [m // period for m in micro]
    frac = [m % period for m in micro]
    extra = sum(frac) // period
    credit = [0] * len(micro)
    picked: list[int] = []
    for _ in range(step % period + 1):
        credit = [c + f for c, f in zip(credit, frac)]
        picked = sorted(range(len(micro)), key=lambda k: (-credit[k], k))[:extra]
        for k in picked:
            credit[k] -= period
    return tuple(b + (k in picked) for k, b in enumerate(base))


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    return v


def _flt(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"expected a number, got {type(v).__name__}")
    f = float(v)
    if not math.isfinite(f) or f < 0:
        raise ValueError("predictions must be finite and non-negative")
    return f
