"""Jobs' progress as the swarm gossips it: loss curves, throughput, checkpoints (bounded, sans-IO).

The loss stage of every job publishes a :class:`~fusionp2p.jobs.events.StepProgress` per step on the
jobs topic, and the stages that save checkpoints a :class:`~fusionp2p.jobs.events.CheckpointSaved`.
Any member (a bootstrap too) that subscribes sees them all, so its dashboard can draw every job's
loss curve, not only those of the jobs it trains in. :class:`LossCurves` keeps them:

* at most ``max_jobs`` jobs (the least recently updated is forgotten first);
* at most ``max_points`` points per curve: when a curve is full, every other point is dropped and
  from then on only every second step is kept (then every fourth, ...), so a curve of any length
  stays an even sample of the whole run in bounded memory;
* the latest held-out loss (:class:`~fusionp2p.jobs.events.EvalProgress`) rides along;
* each step's point is the first replica's report of it (the loss stage's replicas report the same
  step with their pipelines' losses); a report of a newer epoch that goes back (a re-plan resumed
  from a checkpoint) cuts the curve back to that step, and reports of older epochs are dropped;
* an event whose ``peer`` is not the authenticated gossip sender, or that does not decode, is
  refused (counted in :class:`~fusionp2p.net.refusals.Refusals` when one is given) and dropped.

Time (``now``) is passed in: the clock of the refusals, ``trio.current_time()`` in the shell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs.election import VOTE_KIND
from fusionp2p.jobs.events import CheckpointSaved, EvalProgress, StepProgress, event_from_dict, expand_steps
from fusionp2p.net.refusals import Refusals
from fusionp2p.net.transport import GossipMessage
from fusionp2p.types import short_peer
from fusionp2p.wire.limits import DEFAULT_LIMITS
from fusionp2p.wire.msg import unpackb


@dataclass(slots=True)
class JobCurve:
    """What the gossip told about one job."""

    job: str
    points: list[tuple[int, float]] = field(default_factory=list)   # (step, loss), steps increasing
    stride: int = 1                      # keep steps that are multiples of this (doubles when full)
    step: int = -1                       # the latest step reported
    loss: float | None = None            # its loss
    tokens_per_s: float = 0.0
    compute_util: float | None = None
    epoch: int = 0
    checkpoint_step: int = -1
    eval_step: int = -1                  # the latest held-out evaluation (EvalProgress)
    eval_loss: float | None = None
    peers: set[str] = field(default_factory=set)   # who reported (the loss stage's replicas)
    updated: float = 0.0

    def to_json(self, now: float) -> dict[str, Any]:
        return {"job": self.job, "step": self.step, "loss": _finite(self.loss), "tokens_per_s": self.tokens_per_s,
                "compute_util": self.compute_util, "epoch": self.epoch, "checkpoint_step": self.checkpoint_step,
                "eval_step": self.eval_step, "eval_loss": _finite(self.eval_loss),
                "reporters": len(self.peers), "age_s": max(0.0, now - self.updated),
                "curve": [[s, _finite(v)] for s, v in self.points]}


def _finite(v: float | None) -> float | None:
    """JSON has no NaN: a diverged loss is shown as missing."""
    return v if v is not None and math.isfinite(v) else None


@dataclass(slots=True)
class LossCurves:
    """Bounded per-job progress from gossip (see the module docstring)."""

    max_jobs: int = 64
    max_points: int = 1024
    refusals: Refusals | None = None
    jobs: dict[str, JobCurve] = field(default_factory=dict)
    received: int = 0

    def on_gossip(self, msg: GossipMessage, *, now: float) -> None:
        """Take one message of the jobs topic; a bad one is refused and dropped, never raised."""
        try:
            m = unpackb(msg.data, max_size=DEFAULT_LIMITS.max_gossip)
            if isinstance(m, dict) and m.get("t") == VOTE_KIND:
                return   # plan votes share the topic: the election checks them; they are not progress
            ev = event_from_dict(m)
        except RemoteProtocolError as exc:
            self._refuse(msg.sender, "jobs/progress-decode", str(exc), now)
            return
        if isinstance(ev, StepProgress | CheckpointSaved | EvalProgress):
            if ev.peer != msg.sender:
                self._refuse(msg.sender, "jobs/progress-sender", f"{short_peer(ev.peer)} reported by another", now)
                return
            self.received += 1
            for one in expand_steps(ev) if isinstance(ev, StepProgress) else [ev]:
                self._apply(one, now)

    def _apply(self, ev: StepProgress | CheckpointSaved | EvalProgress, now: float) -> None:
        c = self.jobs.get(ev.job)
        if c is None:
            if len(self.jobs) >= self.max_jobs:
                del self.jobs[min(self.jobs.values(), key=lambda j: j.updated).job]
            c = self.jobs[ev.job] = JobCurve(job=ev.job)
        c.updated = now
        if len(c.peers) < 64:
            c.peers.add(ev.peer)
        if isinstance(ev, CheckpointSaved):
            c.checkpoint_step = max(c.checkpoint_step, ev.step)
            return
        if isinstance(ev, EvalProgress):
            if ev.step > c.eval_step:     # the first replica's report of a step; later ones repeat it
                c.eval_step, c.eval_loss = ev.step, ev.loss
            return
        if ev.loss is None or ev.epoch < c.epoch:
            return
        if ev.epoch > c.epoch:   # a re-plan: steps from ev.step on are trained again
            c.points = [p for p in c.points if p[0] < ev.step]
            c.step = -1
        if ev.step >= c.step:
            c.step, c.loss, c.tokens_per_s, c.compute_util, c.epoch = ev.step, ev.loss, ev.tokens_per_s, ev.compute_util, ev.epoch
        if ev.step % c.stride or (c.points and ev.step <= c.points[-1][0]):
            return   # off the stride, a replica's duplicate of a step, or late (gossip reorders)
        c.points.append((ev.step, ev.loss))
        while len(c.points) > self.max_points:
            c.stride *= 2
            c.points = [p for p in c.points if p[0] % c.stride == 0]

    def _refuse(self, peer: str, reason: str, detail: str, now: float) -> None:
        if self.refusals is not None:
            self.refusals.refuse(peer, reason, now=now, detail=detail)


__all__ = ["JobCurve", "LossCurves"]
