"""A node's live state for operators: one bounded, JSON-able picture, read at request time.

:class:`OpsState` reads, never writes, what the node's services hold: the swarm's membership and
bandwidth views (``swarm/node.py``), the transport's traffic meter (``net/traffic.py``), the refused
input counts (``swarm.refusals`` where the swarm has one), the job service's :class:`JobView` list
(nodes only) and the jobs' progress from gossip (:class:`~fusionp2p.ops.curves.LossCurves`).
Its :meth:`OpsState.run` task keeps the book fed and, for jobs this node does not train in, fetches
their adopted plan from the DHT now and then.

Every list in :meth:`OpsState.snapshot` has a cap (:class:`OpsLimits`), so a response has a bound
whatever the swarm's size or a peer's gossip; what was cut is said (``*_truncated``). The dashboard,
``/api/...`` and ``/metrics`` are all built from this one snapshot.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from fusionp2p.errors import ConfigError, FusionError
from fusionp2p.jobs.election import fetch_latest
from fusionp2p.jobs.status import JobView
from fusionp2p.net.refusals import Refusals
from fusionp2p.ops.curves import LossCurves
from fusionp2p.plan.plan import Plan
from fusionp2p.swarm.node import SwarmNode
from fusionp2p.wire.protocols import TOPIC_JOBS

log = logging.getLogger(__name__)

SCHEMA = 1


class JobSource(Protocol):
    """What the ops view needs from a node's job service (``NodeJobService.status``)."""

    def status(self) -> list[JobView]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class OpsLimits:
    """Caps on what one snapshot lists (each keeps a response small whatever the swarm's size)."""

    members: int = 512            # member rows
    matrix: int = 64              # peers in the bandwidth matrix (64 x 64 cells)
    traffic_peers: int = 256      # (peer, plane) rows, the busiest first
    jobs: int = 32
    stages: int = 64              # stages of a plan listed
    replicas: int = 32            # replicas listed per stage
    reasons: int = 64             # refusal reasons
    curve_points: int = 1024      # points per loss curve
    plan_poll: float = 10.0       # seconds between DHT reads of the plans of jobs we do not train in
    plan_fetches: int = 4         # plans fetched per poll at most
    reuse: float = 1.0            # seconds a snapshot is served again: many clients cost one read (measured:
                                  # the 64 x 64 matrix of a fully probed 256-node swarm takes ~75 ms to read)

    def __post_init__(self) -> None:
        for name in ("members", "matrix", "traffic_peers", "jobs", "stages", "replicas", "reasons", "curve_points",
                     "plan_fetches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"OpsLimits.{name} must be at least 1")
        if not self.plan_poll > 0 or self.reuse < 0:
            raise ConfigError("OpsLimits.plan_poll must be positive and reuse not negative")


def plan_json(plan: Plan, limits: OpsLimits) -> dict[str, Any]:
    """The plan as the dashboard draws it: stages with their replicas, fences with their kept ratios."""
    return {
        "epoch": plan.epoch, "plan_hash": plan.plan_hash(), "algorithm": plan.algorithm,
        "micro_batches": plan.micro_batches, "micro": list(plan.micro), "micro_period": plan.micro_period, "step_time_s": plan.step_time_s, "bottleneck_s": plan.bottleneck_s,
        "stages": [{"index": i, "units": [s.start, s.end], "replicas": list(s.replicas[: limits.replicas]),
                    "replicas_total": len(s.replicas), "compute_s": s.compute_s, "memory_bytes": s.memory_bytes}
                   for i, s in enumerate(plan.stages[: limits.stages])],
        "fences": [{"index": f.index, "unit": f.unit, "rho": f.rho, "dense_bytes": f.dense_bytes, "time_s": f.time_s,
                    "dense_time_s": f.dense_time_s, "link_bps": f.bandwidth_bps} for f in plan.fences[: limits.stages]],
        "stages_total": len(plan.stages), "how": plan.how,
    }


@dataclass
class OpsState:
    """Reads a node's services into one snapshot (see the module docstring)."""

    swarm: SwarmNode
    jobs: JobSource | None = None
    limits: OpsLimits = field(default_factory=OpsLimits)
    wall_clock: Callable[[], float] = time.time
    book: LossCurves = field(init=False)
    _plans: dict[str, Plan] = field(init=False, default_factory=dict)
    _started: float = field(init=False, default=0.0)
    _last: tuple[float, dict[str, Any]] | None = field(init=False, default=None)   # (when, snapshot)

    def __post_init__(self) -> None:
        self.book = LossCurves(max_jobs=2 * self.limits.jobs, max_points=self.limits.curve_points,
                                 refusals=self.refusals)
        self._started = self.wall_clock()

    @property
    def refusals(self) -> Refusals | None:
        # swarm.refusals arrives with the hostile-input work; until then there is nothing to read
        r = getattr(self.swarm, "refusals", None)
        return r if isinstance(r, Refusals) else None

    # ------------------------------------------------------------------ the task
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Follow the jobs topic (progress) and poll the DHT for plans, until cancelled."""
        gossip = await self.swarm.transport.subscribe(TOPIC_JOBS)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._poll_plans)
            task_status.started()
            async for msg in gossip:
                self.book.on_gossip(msg, now=trio.current_time())

    async def _poll_plans(self) -> None:
        while True:
            mine = {s.job for s in self._local()}
            wanted = [j for j in sorted(self.book.jobs, key=lambda j: -self.book.jobs[j].updated) if j not in mine]
            for job in wanted[: self.limits.plan_fetches]:
                try:
                    with trio.move_on_after(self.limits.plan_poll):
                        got = await fetch_latest(self.swarm.transport, job)   # display only: the record's own voters
                        if got is not None:
                            self._plans[job] = got[1]
                except FusionError as exc:
                    log.debug("plan of %s not fetched: %s", job, exc)
            for job in [j for j in self._plans if j not in self.book.jobs]:
                del self._plans[job]
            await trio.sleep(self.limits.plan_poll)

    def _local(self) -> list[JobView]:
        return self.jobs.status() if self.jobs is not None else []

    # ------------------------------------------------------------------ the snapshot
    def snapshot(self) -> dict[str, Any]:
        """Everything the dashboard, ``/api`` and ``/metrics`` show, bounded by :attr:`limits` (the same
        object again within ``limits.reuse`` seconds; callers must not modify it)."""
        now = trio.current_time()
        if self._last is not None and now - self._last[0] < self.limits.reuse:
            return self._last[1]
        out: dict[str, Any] = {"schema": SCHEMA, "at": self.wall_clock(), "node": self._node()}
        out.update(self._members(now))
        out["bandwidth"] = self._bandwidth()
        out.update(self._traffic())
        out.update(self._jobs(now))
        out["refusals"] = self._refusals()
        c = self.swarm.counters
        out["counters"] = {"bad_records": c.bad_records, "probes_ok": c.probes_ok, "probes_failed": c.probes_failed,
                           "probes_busy": c.probes_busy, "probes_direct": c.probes_direct, "gossip_dropped": int(getattr(self.swarm.transport, "dropped_gossip", 0)),
                           "progress_received": self.book.received}
        self._last = (now, out)
        return out

    def _node(self) -> dict[str, Any]:
        s = self.swarm
        return {"peer": s.peer_id, "role": s.config.role, "uptime_s": max(0.0, self.wall_clock() - self._started),
                "addrs": s.transport.listen_addrs()[:8], "profile": s.profile.to_wire() if s.profile else None,
                "speed": s.speed or None, "heartbeat_s": s.period()}

    def _members(self, now: float) -> dict[str, Any]:
        view = self.swarm.view
        alive = set(view.last_seen)
        peers = sorted(view.records, key=lambda p: (p not in alive, view.records[p].role != "node", p))
        peers = [p for p in peers if p not in view.left]
        rows = []
        for p in peers[: self.limits.members]:
            rec = view.records[p]
            seen = view.last_seen.get(p)
            rows.append({"peer": p, "role": rec.role, "alive": p in alive, "self": p == self.swarm.peer_id,
                         "last_seen_s": max(0.0, now - seen) if seen is not None else None,
                         "period_s": rec.period, "profile": rec.profile.to_wire() if rec.profile else None,
                         "speed": rec.speed or None})
        by_role: dict[str, int] = {}
        for p in alive:
            role = view.records[p].role
            by_role[role] = by_role.get(role, 0) + 1
        return {"members": rows, "members_truncated": len(peers) > len(rows), "alive_by_role": by_role,
                "dead": len(view.dead)}

    def _bandwidth(self) -> dict[str, Any]:
        nodes = self.swarm.members()
        peers = nodes[: self.limits.matrix]
        table = self.swarm.bandwidth
        bw: list[list[float | None]] = []
        rtt: list[list[float | None]] = []
        measured: list[list[bool]] = []
        for a in peers:
            row_bw, row_rtt, row_m = [], [], []
            for b in peers:
                e = table.estimate(a, b) if a != b else None
                row_bw.append(e.bandwidth if e is not None else None)
                row_rtt.append(e.rtt if e is not None and e.measured else None)
                row_m.append(bool(e is not None and e.measured))
            bw.append(row_bw)
            rtt.append(row_rtt)
            measured.append(row_m)
        return {"peers": peers, "bytes_per_s": bw, "rtt_s": rtt, "measured": measured, "truncated": len(nodes) > len(peers)}

    def _traffic(self) -> dict[str, Any]:
        snap = self.swarm.transport.traffic.snapshot()
        rows = sorted(snap.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
        totals: dict[str, list[int]] = {}
        for (plane, _), (s, r) in rows:
            t = totals.setdefault(plane, [0, 0])
            t[0] += s
            t[1] += r
        return {"traffic": [{"peer": peer, "plane": plane, "sent": s, "received": r}
                            for (plane, peer), (s, r) in rows[: self.limits.traffic_peers]],
                "traffic_truncated": len(rows) > self.limits.traffic_peers,
                "traffic_totals": {plane: {"sent": s, "received": r} for plane, (s, r) in sorted(totals.items())}}

    def _jobs(self, now: float) -> dict[str, Any]:
        local = {s.job: s for s in self._local()}
        curves = self.book.jobs
        # this node's jobs first, then the most recently heard of
        order = sorted(set(local) | set(curves), key=lambda j: (j not in local, -(curves[j].updated if j in curves else math.inf), j))
        rows = []
        for job in order[: self.limits.jobs]:
            st, curve = local.get(job), curves.get(job)
            plan = st.plan if st is not None and st.plan is not None else self._plans.get(job)
            row: dict[str, Any] = {"job": job, "state": st.state if st else "seen", "reason": st.reason[:500] if st else "",
                                   "steps": st.steps if st else None, "publisher": st.publisher if st else None,
                                   "role": list(st.role) if st and st.role else None,
                                   "plan": plan_json(plan, self.limits) if plan is not None else None,
                                   "progress": curve.to_json(now) if curve is not None else None, "local": None}
            if st is not None and st.last is not None:
                last = st.last
                avg = last.averaging
                row["local"] = {"step": last.step, "stage": last.stage, "replica": last.replica, "step_s": last.wall_s,
                                "compute_s": last.compute_s, "tokens_per_s": last.tokens_per_s,
                                "compute_util": last.compute_util,
                                "averaging": None if avg is None else {"rounds": avg.rounds, "skipped": avg.skipped,
                                                                       "seconds": avg.seconds, "last_s": avg.last_s}}
            rows.append(row)
        states: dict[str, int] = {}
        for s in local.values():
            states[s.state] = states.get(s.state, 0) + 1
        return {"jobs": rows, "jobs_truncated": len(order) > len(rows), "jobs_by_state": states}

    def _refusals(self) -> dict[str, Any] | None:
        r = self.refusals
        if r is None:
            return None
        top = r.by_reason.most_common(self.limits.reasons)
        return {"total": r.total(), "by_reason": dict(top), "truncated": len(r.by_reason) > len(top)}


__all__ = ["SCHEMA", "JobSource", "OpsLimits", "OpsState", "plan_json"]
