"""Progress events of a job (gossiped to the SDK, shown by the CLI) and the JSON-lines metrics log.

Events are small frozen dataclasses. ``encode_event``/``decode_event`` put them on the jobs gossip
topic as one msgpack map with a ``"type"`` key, bounded by ``Limits.max_gossip``; anything else a
peer sends raises :class:`RemoteProtocolError`. :class:`MetricsWriter` appends the same maps as JSON
lines (one flush per line, so a crash loses at most the line being written) for plotting and for
the benchmark reports.

Times (``at``) are injected by the caller (wall clock in seconds), never read here.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, ClassVar

from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.plan import Plan
from fusionp2p.types import short_peer
from fusionp2p.wire import codec
from fusionp2p.wire.check import as_map, as_str
from fusionp2p.wire.limits import DEFAULT_LIMITS
from fusionp2p.wire.msg import packb, unpackb

# Limits of the fields a peer sends (wire/codec.py): a diverged loss (nan, inf) is news, not an attack;
# every other float is finite; reasons are longer than ids; lists of peers or stage sizes are bounded.
_LOSS: Any = {"wire": {"finite": False}}
_REASON: Any = {"wire": {"max_len": 1024}}
_PEERS: Any = {"wire": {"max_len": 4096}}
MAX_EARLIER = 256     # losses one StepProgress may carry for the steps before it


@dataclass(frozen=True, kw_only=True, slots=True)
class StepProgress:
    """One stage's report for one step. ``loss`` only from the last stage; utilisations in [0, 1].

    ``earlier``: on the jobs topic, the losses of the steps just before ``step`` (``step - len(earlier)``
    to ``step - 1``, oldest first) that the replica did not gossip on their own. A replica gossips at most
    every ``NodeJobConfig.progress_interval`` (jobs/run.py): on a small host every gossip message costs
    every node CPU, and per-step messages slowed training by 7-10% in benchmarks.wan. :func:`expand_steps`
    turns a report into one per step; the events the SDK yields always have ``earlier=()``.
    """

    KIND: ClassVar[str] = "step"
    job: str
    step: int
    epoch: int = 0
    stage: int = 0
    peer: str = ""      # the reporting node; in the SDK's per-step events, the loss replicas averaged (a,b,...)
    loss: float | None = field(default=None, metadata=_LOSS)
    tokens_per_s: float = 0.0
    compute_util: float | None = None
    link_util: float | None = None
    at: float = 0.0
    earlier: tuple[float, ...] = field(default=(), metadata={"wire": {"max_len": MAX_EARLIER, "omit_default": True,
                                                                       "item": {"finite": False}}})
    # each earlier step's own tokens/s and wall time (older senders leave them out: then those steps carry
    # no throughput of their own and the report's time)
    earlier_tokens_per_s: tuple[float, ...] = field(default=(), metadata={"wire": {"max_len": MAX_EARLIER,
                                                                                   "omit_default": True}})
    earlier_at: tuple[float, ...] = field(default=(), metadata={"wire": {"max_len": MAX_EARLIER, "omit_default": True}})

    def __str__(self) -> str:
        """``job 1a2b… step 12 (epoch 0): loss 4.213, 1,450 tokens/s, compute 85% [stage 1 on 9H8u1xWS]``."""
        parts = [f"loss {_loss(self.loss)}" if self.loss is not None else "no loss (not the loss stage)"]
        if self.tokens_per_s > 0:
            parts.append(f"{self.tokens_per_s:,.0f} tokens/s")
        if self.compute_util is not None:
            parts.append(f"compute {100 * self.compute_util:.0f}%")
        if self.link_util is not None:
            parts.append(f"links {100 * self.link_util:.0f}%")
        if self.earlier:
            parts.append(f"+{len(self.earlier)} earlier steps")
        return f"job {self.job} step {self.step} (epoch {self.epoch}): {', '.join(parts)} [{_where(self.stage, self.peer)}]"


def expand_steps(ev: StepProgress) -> list[StepProgress]:
    """A gossiped report as one report per step it carries, oldest first (steps before 0 are dropped)."""
    if not ev.earlier:
        return [ev]
    n = len(ev.earlier)
    # each step keeps its own throughput and time where the sender sent them; an older sender's steps get
    # no throughput (0.0, "not measured") rather than a copy of the last step's
    tps = ev.earlier_tokens_per_s if len(ev.earlier_tokens_per_s) == n else (0.0,) * n
    at = ev.earlier_at if len(ev.earlier_at) == n else (ev.at,) * n
    out = [replace(ev, step=ev.step - n + i, loss=loss, tokens_per_s=tps[i], at=at[i],
                   compute_util=ev.compute_util if tps[i] > 0 else None, earlier=(), earlier_tokens_per_s=(),
                   earlier_at=()) for i, loss in enumerate(ev.earlier) if ev.step - n + i >= 0]
    return [*out, replace(ev, earlier=(), earlier_tokens_per_s=(), earlier_at=())]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanChanged:
    """A new plan was adopted: ``stages[i]`` lists the peers serving stage i (its replicas).

    Per fence (between stage i and i+1) what the planner chose and why: ``rho`` the AdaTopK kept ratio
    (1.0 = dense), ``link_bps`` the bandwidth of the link it was chosen for (bytes/s, the replica pairs
    together), ``fence_s`` / ``dense_s`` the predicted seconds per micro-batch with / without that ratio;
    ``step_s`` the predicted time of a step as the nodes run it, every pipeline its ``M`` micro-batches (``r`` x
    ``Plan.step_time_s``, which is per ``M`` micro-batches of data: :meth:`pipeline_step_s`) and ``how`` the
    layout that won (``fusionp2p.plan.joint``);
    ``micro`` the micro-batches each pipeline runs a step on average when they differ in speed (by speed,
    ``Plan.micro_share``: 4.75 is 5, 5, 5 and 4 over four steps; empty: every pipeline runs the job's
    ``micro_batches``).
    """

    KIND: ClassVar[str] = "plan"
    job: str
    epoch: int
    plan_hash: str
    stage_sizes: tuple[int, ...] = field(default=(), metadata=_PEERS)   # replicas per stage
    members: tuple[str, ...] = field(default=(), metadata=_PEERS)       # peers in stage order, replicas adjacent
    at: float = 0.0
    rho: tuple[float, ...] = field(default=(), metadata=_PEERS)         # per fence
    link_bps: tuple[float, ...] = field(default=(), metadata=_PEERS)
    fence_s: tuple[float, ...] = field(default=(), metadata=_PEERS)
    dense_s: tuple[float, ...] = field(default=(), metadata=_PEERS)
    step_s: float = 0.0
    how: str = field(default="", metadata={"wire": {"max_len": 64}})
    micro: tuple[float, ...] = field(default=(), metadata={"wire": {"max_len": 4096, "omit_default": True}})  # per pipeline
    # members that accepted the job but have no role in this plan, and why (the publisher fills these in for
    # the plan it makes; they stay standbys, used at a re-plan)
    idle: tuple[str, ...] = field(default=(), metadata={"wire": {"max_len": 4096, "omit_default": True}})
    idle_why: str = field(default="", metadata={"wire": {"max_len": 1024, "omit_default": True}})

    @classmethod
    def of(cls, plan: Plan, *, at: float, accepted: Iterable[str] = (), replicas_hint: int | None = None) -> PlanChanged:
        """The event of an adopted *plan*; with the peers that *accepted* the job, those it leaves idle, and why."""
        fs = plan.fences
        used = {p for s in plan.stages for p in s.replicas}
        idle = tuple(sorted(set(accepted) - used))
        return cls(job=plan.job, epoch=plan.epoch, plan_hash=plan.plan_hash(), idle=idle,
                   idle_why=idle_reason(plan, len(used), replicas_hint) if idle else "",
                   stage_sizes=tuple(len(s.replicas) for s in plan.stages),
                   members=tuple(p for s in plan.stages for p in s.replicas), at=at,
                   rho=tuple(f.rho for f in fs), link_bps=tuple(f.bandwidth_bps for f in fs),
                   fence_s=tuple(f.time_s for f in fs), dense_s=tuple(f.dense_time_s for f in fs),
                   step_s=pipeline_step_s(plan), how=plan.how, micro=plan.micro_share)

    def describe(self) -> str:
        """One line per fence: ``fence 0: kept 0.027 on 4.0 MB/s (0.282 s -> 0.034 s per micro-batch)``."""
        lines = []
        for k, rho in enumerate(self.rho):
            bw = f" on {self.link_bps[k] / 1e6:,.1f} MB/s" if k < len(self.link_bps) and self.link_bps[k] > 0 else ""
            t = (f" ({self.dense_s[k]:.3g} s -> {self.fence_s[k]:.3g} s per micro-batch)"
                 if k < min(len(self.dense_s), len(self.fence_s)) else "")
            what = "dense" if rho >= 1.0 else f"AdaTopK keeps {rho:.4g}"
            lines.append(f"fence {k}: {what}{bw}{t}")
        if self.micro:
            lines.append(f"micro-batches per replica a step, by speed: {', '.join(f'{m:g}' for m in self.micro)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        """``job 1a2b… plan 3c4d5e6f (epoch 0): 2 stages x replicas (2, 2) on 4 nodes [9H8u1xWS, MjaB4JeV |
        …], predicted 0.87 s/step (pipeline); fences dense``: one line, peers by :func:`short_peer`, stages
        apart by ``|`` (:meth:`describe` has the fences in full)."""
        stages, k = [], 0
        for n in self.stage_sizes:
            stages.append(", ".join(short_peer(p) for p in self.members[k:k + n]))
            k += n
        layout = " | ".join(stages)
        pred = f", predicted {self.step_s:.3g} s/step" + (f" ({self.how})" if self.how else "") if self.step_s > 0 else ""
        notes = [f"fence {k} AdaTopK keeps {rho:.3g}" + (f" on {self.link_bps[k] / 1e6:,.1f} MB/s"
                                                          if k < len(self.link_bps) and self.link_bps[k] > 0 else "")
                 for k, rho in enumerate(self.rho) if rho < 1.0]
        if self.rho and not notes:
            notes.append("fences dense")
        if self.micro:
            notes.append(f"micro-batches a step by speed {', '.join(f'{m:g}' for m in self.micro)}")
        if self.idle:
            notes.append(f"idle {', '.join(short_peer(p) for p in self.idle)}"
                         + (f" ({self.idle_why})" if self.idle_why else ""))
        return (f"job {self.job} plan {self.plan_hash[:8]} (epoch {self.epoch}): {len(self.stage_sizes)} stage"
                f"{'s' * (len(self.stage_sizes) != 1)} x replicas {tuple(self.stage_sizes)} on {len(set(self.members))} "
                f"nodes [{layout}]{pred}" + "".join(f"; {n}" for n in notes))


@dataclass(frozen=True, kw_only=True, slots=True)
class LinksUp:
    """A member's data-plane links of an epoch are up: ``links[i]`` is ``"<peer id>=<path>"``, the path
    ``direct`` (TCP to the peer's data port), ``libp2p`` (the fallback stream on the libp2p connection,
    slower) or ``relay`` (that stream, on a connection a circuit relay carries; docs/networking.md)."""

    KIND: ClassVar[str] = "links"
    job: str
    epoch: int
    stage: int
    peer: str = ""
    links: tuple[str, ...] = field(default=(), metadata=_PEERS)
    at: float = 0.0

    def paths(self) -> dict[str, str]:
        """peer id -> path."""
        return dict(x.split("=", 1) for x in self.links if "=" in x)

    def __str__(self) -> str:
        links = ", ".join(f"{short_peer(p)} {path}" for p, path in sorted(self.paths().items())) or "none"
        return f"job {self.job} links up (epoch {self.epoch}) [{_where(self.stage, self.peer)}]: {links}"


@dataclass(frozen=True, kw_only=True, slots=True)
class MembersChanged:
    KIND: ClassVar[str] = "members"
    job: str
    epoch: int
    joined: tuple[str, ...] = field(default=(), metadata=_PEERS)
    left: tuple[str, ...] = field(default=(), metadata=_PEERS)
    at: float = 0.0

    def __str__(self) -> str:
        joined = f"joined {', '.join(short_peer(p) for p in self.joined)}" if self.joined else ""
        left = f"left {', '.join(short_peer(p) for p in self.left)}" if self.left else ""
        return f"job {self.job} members (epoch {self.epoch}): {'; '.join(x for x in (joined, left) if x) or 'no change'}"


@dataclass(frozen=True, kw_only=True, slots=True)
class JobStateChanged:
    KIND: ClassVar[str] = "state"
    job: str
    state: str          # a fusionp2p.jobs.lifecycle.JobState value
    reason: str = field(default="", metadata=_REASON)
    at: float = 0.0

    def __str__(self) -> str:
        reason = self.reason
        if _is_hash(reason):
            reason = f"plan {reason[:8]}"   # a leader's PLANNED carries the plan hash: shown as PlanChanged shows it
        return f"job {self.job} {self.state}" + (f": {reason}" if reason else "")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSaved:
    KIND: ClassVar[str] = "checkpoint"
    job: str
    step: int
    stage: int
    peer: str = ""          # a node that holds it (the saver, or a keeper that copied it)
    at: float = 0.0
    hash: str = ""          # content hash of the stage file (fetch it by hash from any holder)
    start: int = -1         # the coarse units the stage file covers: [start, end)
    end: int = -1

    def __str__(self) -> str:
        held = f" [{_where(self.stage, self.peer)}]" if self.peer else f" [stage {self.stage}]"
        return f"job {self.job} checkpoint of step {self.step} saved{held}" + (f", hash {self.hash[:8]}" if self.hash else "")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSkipped:
    """A stage skipped its optimizer step (non-finite gradients: a diverging job, or a peer's NaN)."""

    KIND: ClassVar[str] = "skipped"
    job: str
    step: int
    stage: int
    peer: str = ""
    reason: str = field(default="", metadata=_REASON)
    at: float = 0.0

    def __str__(self) -> str:
        return f"job {self.job} step {self.step}: optimizer step skipped [{_where(self.stage, self.peer)}]: {self.reason}"


@dataclass(frozen=True, kw_only=True, slots=True)
class DataLate:
    """A step of a reading stage waits for a data shard (issue 38): slowed, not failed, until the feed's
    deadline (``jobs/data_shards.py``)."""

    KIND: ClassVar[str] = "data_late"
    job: str
    step: int
    stage: int
    peer: str = ""
    shard: int = 0
    waited_s: float = 0.0
    at: float = 0.0

    def __str__(self) -> str:
        return (f"job {self.job} step {self.step}: waiting {self.waited_s:.1f} s for data shard {self.shard} "
                f"[{_where(self.stage, self.peer)}]")


@dataclass(frozen=True, kw_only=True, slots=True)
class AveragingOutlier:
    """A replica of a stage stopped averaging with another: the other's parts were clipped as outliers in
    too many rounds (``average/robust.py``). The reporter's own observation, not a verdict of the job."""

    KIND: ClassVar[str] = "outlier"
    job: str
    step: int
    stage: int
    peer: str = ""       # the reporting replica's node
    suspect: str = ""    # the replica it dropped
    at: float = 0.0

    def __str__(self) -> str:
        return (f"job {self.job} step {self.step}: replica {short_peer(self.suspect)} of stage {self.stage} sent "
                f"outlying averaging parts too often; averaging without it [{_where(self.stage, self.peer)}]")


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalProgress:
    """The held-out loss of the weights after ``step`` steps (``TrainConfig.eval_every``; at the last
    step, of the final weights: the model that downloads), from the loss stage of one pipeline."""

    KIND: ClassVar[str] = "eval"
    job: str
    step: int
    epoch: int = 0
    peer: str = ""
    loss: float = field(default=0.0, metadata=_LOSS)   # NaN or inf: the weights diverged, which the operator must see
    at: float = 0.0

    def __str__(self) -> str:
        by = f" [on {short_peer(self.peer)}]" if self.peer else ""
        return f"job {self.job} held-out loss {_loss(self.loss)} after step {self.step} (epoch {self.epoch}){by}"


def pipeline_step_s(plan: Plan) -> float:
    """The predicted seconds of one step as a plan's nodes run it: each of its ``r`` pipelines runs the job's
    ``M`` micro-batches a step (``train/deal.py``), and ``Plan.step_time_s`` is throughput-equivalent, the
    time of ``M`` micro-batches of the whole plan's data (plan/plan.py), so a step takes ``r`` times that.
    (Shown as the step time, the bare figure read 2x too short for the demo's 2-replica plans: predicted
    0.0685 s, measured 0.164 s a step, 2026-11-30.)"""
    return plan.step_time_s * (len(plan.stages[0].replicas) if plan.stages else 1)


def idle_reason(plan: Plan, used: int, replicas_hint: int | None) -> str:
    """Why a plan leaves accepted nodes idle, from the layouts the planner scored (``plan.considered``)."""
    bigger = [c for c in plan.considered if c.replicas * c.stages > used and c.step_time_s > 0]
    if bigger:
        best = min(bigger, key=lambda c: c.step_time_s)   # per M micro-batches of data: comparable across r
        return (f"standby: the best plan with more nodes, {best.stages} stage(s) x {best.replicas} replica(s), "
                f"was predicted at {best.step_time_s * best.replicas:.3g} s/step")
    if replicas_hint is not None:
        return f"standby: replicas={replicas_hint} caps the replicas per stage and more stages were not predicted faster"
    return "standby: no plan with more nodes was predicted faster"


@dataclass(frozen=True, kw_only=True, slots=True)
class StageConvicted:
    """A checker recomputed a sampled micro-batch of a stage replica and got other outputs, and the job's leader,
    recomputing it from the checker's bundle, agreed (``jobs/verified.py`` ``Arbiter``): *evidence* is the
    encoded verdict (``train/verify.py``), signed by the checker and carrying the stage replica's signed
    claim; *peer* is the node that ruled: the leader, or its deputy for a verdict against the leader itself (the
    checker where there is no deputy: ``jobs/suspects.py:judge_of``). Every node verifies it and, taken as the
    judge's ruling, leaves *suspect* out of the next plan (``jobs/suspects.py``)."""

    KIND: ClassVar[str] = "convicted"
    job: str
    step: int
    stage: int
    peer: str = ""       # the node that ruled: the leader, or its deputy for a verdict against the leader
    suspect: str = ""    # the stage replica convicted
    evidence: bytes = field(default=b"", metadata={"wire": {"max_len": 4096}})
    at: float = 0.0

    def __str__(self) -> str:
        return (f"job {self.job} step {self.step}: replica {short_peer(self.suspect)} of stage {self.stage} sent "
                f"outputs its parameters do not make (spot-check by {short_peer(self.peer)}); left out of the next plan")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckerStruck:
    """The judge of a spot-check verdict (the job's leader, or its deputy for a verdict against the leader:
    ``jobs/suspects.py:judge_of``) recomputed the disputed micro-batch and found the verdict false: the
    checker that signed it is struck. *evidence* is that verdict (``train/verify.py``), signed by the checker
    *suspect*, so no judge strikes a member that accused nobody; *peer* is the judge. Every node verifies it
    and, taken as the judge's ruling, leaves *suspect* out of its next plan (``jobs/suspects.py``)."""

    KIND: ClassVar[str] = "struck"
    job: str
    step: int
    stage: int
    peer: str = ""       # the judge that ruled: the leader, or its deputy for a verdict against the leader
    suspect: str = ""    # the checker struck
    evidence: bytes = field(default=b"", metadata={"wire": {"max_len": 4096}})
    at: float = 0.0

    def __str__(self) -> str:
        return (f"job {self.job} step {self.step}: checker {short_peer(self.suspect)} accused a replica of stage "
                f"{self.stage} falsely ({short_peer(self.peer)}'s recomputation); left out of the next plan")


def _where(stage: int, peer: str) -> str:
    """``stage 1 on 9H8u1xWS`` (an aggregated step's *peer* lists its loss replicas, comma-separated)."""
    return f"stage {stage} on {', '.join(short_peer(p) for p in peer.split(','))}" if peer else f"stage {stage}"


def _loss(v: float) -> str:
    return f"{v:.4f}" if math.isfinite(v) else f"{v} (diverged)"


def _is_hash(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


ProgressEvent = (StepProgress | PlanChanged | MembersChanged | JobStateChanged | CheckpointSaved | StepSkipped
                 | EvalProgress | LinksUp | DataLate | AveragingOutlier | StageConvicted | CheckerStruck)
EVENT_TYPES: dict[str, type[ProgressEvent]] = {
    c.KIND: c for c in (StepProgress, PlanChanged, MembersChanged, JobStateChanged, CheckpointSaved, StepSkipped,
                        EvalProgress, LinksUp, DataLate, AveragingOutlier, StageConvicted, CheckerStruck)}


def event_to_dict(ev: ProgressEvent) -> dict[str, Any]:
    """``{"type": kind, **fields}`` with tuples as lists (msgpack- and JSON-ready)."""
    return {"type": ev.KIND, **codec.to_wire(ev)}


def event_from_dict(m: Any) -> ProgressEvent:
    """Rebuild an event from a peer's map; RemoteProtocolError for anything unexpected (wire/codec.py:
    unknown fields, wrong types, out-of-range values; fields the sender left out take their defaults)."""
    m = as_map(m, "progress event", required=("type",))
    kind = as_str(m["type"], "progress event type", max_len=32)   # a list here once ended the publisher's loop
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise RemoteProtocolError(f"progress event: unknown type {kind!r}")
    fields = {k: v for k, v in m.items() if k != "type"}
    return codec.from_wire(cls, fields, f"{kind} event", defaults_optional=True)  # type: ignore[return-value]


def encode_event(ev: ProgressEvent) -> bytes:
    return packb(event_to_dict(ev))


def decode_event(data: bytes | bytearray | memoryview) -> ProgressEvent:
    return event_from_dict(unpackb(data, max_size=DEFAULT_LIMITS.max_gossip))


class MetricsWriter:
    """Append events (or plain maps) to a JSON-lines file: ``with MetricsWriter(path) as w: w.write(ev)``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f: IO[str] | None = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot write metrics to {self.path}: {exc.strerror}; choose a writable path") from None

    def write(self, ev: ProgressEvent | dict[str, Any]) -> None:
        if self._f is None:
            raise ValueError("MetricsWriter is closed")
        d = event_to_dict(ev) if not isinstance(ev, dict) else ev
        # allow_nan: a NaN loss is written as NaN (Python's json reads it back) rather than dropped.
        self._f.write(json.dumps(d, sort_keys=True, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete line of a metrics file (a torn last line from a crash is skipped)."""
    out: list[dict[str, Any]] = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            out.append(json.loads(line))
    return out
