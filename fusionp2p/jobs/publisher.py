"""The publisher's side of a job on a real swarm (used by ``Swarm.connect``).

Theory of operation. A :class:`JobDriver` takes one built, signed job through its lifecycle:

1. *Discover*: ask a bootstrap for its view (``swarm.fetch_view``: every record verified) and take the
   live training members with their signed device profiles and bandwidth reports.
2. *Offer*: keep the blobs (DAG, weights, data shards) in our content store, dial every member and
   send it the signed envelope (``job_proto``); each member verifies, fetches the blobs from us by
   hash, checks that it fits and answers. None accepting ends the job FAILED with their reasons.
3. *Start*: propose the snapshot of the accepting members (profiles + measured links). Every member
   plans from it and the members elect the plan over gossip; we compute the same pure plan to know
   who serves what (and emit :class:`PlanChanged`).
4. *Follow*: progress arrives on the jobs gossip topic (the loss stage's replicas each report a step;
   we emit one aggregated :class:`StepProgress` per step), terminal reports arrive over JOB streams.
   One member's failure cancels the others. No news for ``idle_timeout`` seconds fails the job.
5. *Collect*: fetch each stage's final checkpoint by content hash from the replica that saved it and
   lay it out under ``ckpt_root`` so ``checkpoint.assemble`` builds the whole model.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from fusionp2p.errors import ConfigError, FusionError, JobError, PeerUnavailable, RemoteProtocolError
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.build import BuiltJob, plan_for_snapshot
from fusionp2p.jobs.checkpoint import stage_path
from fusionp2p.jobs.content import ContentService
from fusionp2p.jobs.events import (
    CheckpointSaved,
    JobStateChanged,
    PlanChanged,
    ProgressEvent,
    StepProgress,
    decode_event,
)
from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.net.transport import Transport
from fusionp2p.plan import Link, Plan
from fusionp2p.plan.snapshot import snapshot_from_records
from fusionp2p.swarm.node import fetch_view
from fusionp2p.types import DeviceProfile
from fusionp2p.wire.protocols import JOB, TOPIC_JOBS
from fusionp2p.wire.records import BandwidthReport, NodeRecord

log = logging.getLogger(__name__)

Emit = Callable[[ProgressEvent], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class DriverConfig:
    """Deadlines of the publisher's side (seconds)."""

    view_timeout: float = 15.0
    offer_timeout: float = 600.0     # a member verifies and fetches everything within this
    start_timeout: float = 30.0
    idle_timeout: float = 600.0      # longest silence (no progress, no report) while running
    fetch_timeout: float = 300.0     # downloading one stage checkpoint
    max_checkpoint: int = 4 << 30

    def __post_init__(self) -> None:
        for name in ("view_timeout", "offer_timeout", "start_timeout", "idle_timeout", "fetch_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"DriverConfig.{name} must be positive")


@dataclass(frozen=True, slots=True, kw_only=True)
class SwarmView:
    """Live training members (with profiles and dialable addresses) and the measured links."""

    members: dict[str, DeviceProfile]
    addrs: dict[str, tuple[str, ...]]
    links: list[tuple[str, str, Link]]


async def discover(t: Transport, bootstraps: list[str], *, timeout: float) -> SwarmView:
    """The swarm's training members from the first bootstrap that answers (records verified)."""
    last: Exception | None = None
    for peer in bootstraps:
        try:
            view = await fetch_view(t, peer, timeout=timeout)
            break
        except (PeerUnavailable, RemoteProtocolError, trio.TooSlowError) as exc:
            last = exc
    else:
        raise PeerUnavailable(bootstraps[0] if bootstraps else "bootstrap", f"no view ({last})")
    alive = set(view["alive"])
    members: dict[str, DeviceProfile] = {}
    addrs: dict[str, tuple[str, ...]] = {}
    for rec in view["records"]:
        if isinstance(rec, NodeRecord) and rec.role == "node" and rec.peer in alive and not rec.leaving and rec.profile:
            members[rec.peer] = rec.profile
            addrs[rec.peer] = rec.addrs
    links = [(m.src, m.dst, Link(bandwidth_bps=m.bandwidth, latency_s=max(0.0, m.rtt / 2)))
             for r in view["bw"] if isinstance(r, BandwidthReport) for m in r.measurements
             if m.bandwidth > 0 and math.isfinite(m.bandwidth) and math.isfinite(m.rtt)]
    return SwarmView(members=members, addrs=addrs, links=links)


class JobDriver:
    """Drives one job from the publisher (see the module docstring). ``emit`` runs in this trio thread."""

    def __init__(self, t: Transport, content: ContentService, bootstraps: list[str], built: BuiltJob, emit: Emit,
                 ckpt_root: Path, config: DriverConfig | None = None) -> None:
        self.transport = t
        self.content = content
        self.bootstraps = bootstraps
        self.built = built
        self.spec = built.spec
        self.job = built.spec.job_id
        self._emit = emit
        self.ckpt_root = ckpt_root
        self.config = config or DriverConfig()
        self.members: list[str] = []
        self.plan: Plan | None = None
        self._inbox_send, self._inbox = trio.open_memory_channel[tuple[str, Any]](math.inf)
        self._steps: dict[int, dict[str, StepProgress]] = {}
        self._emitted_steps: set[int] = set()
        self._ckpts: set[tuple[int, int]] = set()

    # -- fed by the swarm client ----------------------------------------------------------------------
    def on_progress(self, sender: str, ev: ProgressEvent) -> None:
        self._inbox_send.send_nowait(("progress", (sender, ev)))

    def on_report(self, peer: str, msg: dict[str, Any]) -> None:
        self._inbox_send.send_nowait(("report", (peer, msg)))

    # -- lifecycle ------------------------------------------------------------------------------------
    def _state(self, s: JobState, reason: str = "") -> None:
        self._emit(JobStateChanged(job=self.job, state=s.value, reason=reason, at=time.time()))

    async def run(self) -> None:
        """Run the job to a terminal state (emitted). Cancellation sends ``cancel`` to every member."""
        try:
            await self._drive()
        except trio.Cancelled:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + 15):
                await self._cancel_members()
            raise
        except (FusionError, ValueError, trio.TooSlowError) as exc:
            log.warning("job %s failed: %s", self.job, exc)
            await self._cancel_members()
            self._state(JobState.FAILED, f"{type(exc).__name__}: {exc}")

    async def _drive(self) -> None:
        cfg = self.config
        view = await discover(self.transport, self.bootstraps, timeout=cfg.view_timeout)
        if not view.members:
            raise JobError("the swarm has no live training nodes")
        for blob in self.built.blobs.values():
            self.content.store.put(blob)
        accepted: dict[str, DeviceProfile] = {}
        refused: dict[str, str] = {}

        async def offer(peer: str) -> None:
            try:
                if peer not in self.transport.connected_peers():
                    for a in view.addrs.get(peer, ()):
                        try:
                            await self.transport.connect(f"{a}/p2p/{peer}")
                            break
                        except (PeerUnavailable, FusionError) as exc:
                            log.debug("dial %s at %s: %s", peer[:12], a, exc)
                reply = await job_proto.request(self.transport, peer, {"op": "offer", "envelope": self.built.envelope},
                                                timeout=cfg.offer_timeout)
            except (PeerUnavailable, RemoteProtocolError) as exc:
                refused[peer] = str(exc)
                return
            if reply["ok"]:
                accepted[peer] = view.members[peer]
            else:
                refused[peer] = str(reply.get("error", "refused"))[:500]

        async with trio.open_nursery() as nursery:
            for peer in sorted(view.members):
                nursery.start_soon(offer, peer)
        for peer, why in sorted(refused.items()):
            log.warning("node %s refused job %s: %s", peer[:12], self.job, why)
        if not accepted:
            why = "; ".join(sorted(set(refused.values())))
            raise JobError(f"no node accepted the job ({why})")
        self.members = sorted(accepted)
        snap = snapshot_from_records(self.job, 0, accepted.items(), view.links)
        plan = plan_for_snapshot(self.spec, self.built.dag, snap)
        self.plan = plan
        self._state(JobState.PLANNED, plan.plan_hash())
        self._emit(PlanChanged(job=self.job, epoch=plan.epoch, plan_hash=plan.plan_hash(),
                               stage_sizes=tuple(len(s.replicas) for s in plan.stages),
                               members=tuple(p for s in plan.stages for p in s.replicas), at=time.time()))
        snap_bytes = snap.to_wire()
        failures: list[str] = []

        async def start(peer: str) -> None:
            try:
                reply = await job_proto.request(self.transport, peer, {"op": "start", "job": self.job, "snapshot": snap_bytes},
                                                timeout=cfg.start_timeout)
                if not reply["ok"]:
                    failures.append(f"{peer[:12]}: {reply.get('error')}")
            except (PeerUnavailable, RemoteProtocolError) as exc:
                failures.append(f"{peer[:12]}: {exc}")

        async with trio.open_nursery() as nursery:
            for peer in self.members:
                nursery.start_soon(start, peer)
        if failures:
            raise JobError(f"members refused to start: {'; '.join(failures)}")
        self._state(JobState.RUNNING)
        await self._follow(plan)

    async def _follow(self, plan: Plan) -> None:
        roles = {p for st in plan.stages for p in st.replicas}
        waiting = set(self.members)
        reports: dict[str, dict[str, Any]] = {}
        while waiting:
            with trio.move_on_after(self.config.idle_timeout) as cs:
                kind, item = await self._inbox.receive()
            if cs.cancelled_caught:
                raise JobError(f"no progress from the swarm for {self.config.idle_timeout:.0f} s "
                               f"(waiting for {len(waiting)} members)")
            if kind == "progress":
                self._on_progress(plan, *item)
                continue
            peer, msg = item
            if peer not in waiting:
                continue
            state = msg.get("state")
            if state == JobState.DONE.value:
                waiting.discard(peer)
                reports[peer] = msg
            else:
                raise JobError(f"member {peer[:12]} {state}: {msg.get('reason', '')}")
        last = len(plan.stages) - 1
        self._fill_from_reports(plan, [reports[p] for p in plan.stages[last].replicas if p in reports])
        self._flush_steps(plan, final=True)
        finals = [job_proto.opt_float(reports[p], "final_loss", "report") for p in plan.stages[last].replicas if p in roles]
        losses = [f for f in finals if f is not None]
        for s, st in enumerate(plan.stages):
            rep = reports[st.replicas[0]]
            h = rep.get("checkpoint")
            if not isinstance(h, str):
                raise JobError(f"stage {s} ended without a checkpoint")
            await self._fetch_stage(st.replicas[0], h, s, job_proto.int_field(rep, "step", "report"))
        if losses:
            self._emit(StepProgress(job=self.job, step=self.spec.config.steps, epoch=plan.epoch, stage=last,
                                    loss=sum(losses) / len(losses), at=time.time()))
        self._state(JobState.DONE)

    async def _fetch_stage(self, peer: str, h: str, stage: int, step: int) -> None:
        with trio.fail_after(self.config.fetch_timeout):
            blob = await self.content.fetch_from(peer, h, max_size=self.config.max_checkpoint)
        path = stage_path(self.ckpt_root, self.job, step, stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        await trio.to_thread.run_sync(path.write_bytes, blob)

    # -- progress ---------------------------------------------------------------------------------------
    def _on_progress(self, plan: Plan, sender: str, ev: ProgressEvent) -> None:
        if isinstance(ev, CheckpointSaved):
            if (ev.step, ev.stage) not in self._ckpts and ev.peer == sender:
                self._ckpts.add((ev.step, ev.stage))
                self._emit(ev)
            return
        if not isinstance(ev, StepProgress) or ev.loss is None or ev.peer != sender:
            return
        last = len(plan.stages) - 1
        if ev.stage != last or sender not in plan.stages[last].replicas or ev.step in self._emitted_steps:
            return
        got = self._steps.setdefault(ev.step, {})
        got[sender] = ev
        if len(got) == len(plan.stages[last].replicas):
            self._flush_steps(plan, upto=ev.step)

    def _fill_from_reports(self, plan: Plan, reps: list[dict[str, Any]]) -> None:
        """Steps whose gossip never arrived, rebuilt from the loss replicas' final reports."""
        per_step: dict[int, list[float]] = {}
        for rep in reps:
            vals = rep.get("losses")
            if not isinstance(vals, list) or len(vals) > self.spec.config.steps:
                continue
            for step, v in enumerate(vals):
                if isinstance(v, int | float) and not isinstance(v, bool):
                    per_step.setdefault(step, []).append(float(v))
        missing = [st for st in sorted(per_step) if st not in self._emitted_steps]   # lost or partial on gossip
        if missing:
            log.info("job %s: %d steps recovered from the final reports", self.job, len(missing))
        last = len(plan.stages) - 1
        for step in missing:
            vals = per_step[step]
            self._steps[step] = {"report": StepProgress(job=self.job, step=step, epoch=plan.epoch, stage=last,
                                                        loss=sum(vals) / len(vals), at=time.time())}

    def _flush_steps(self, plan: Plan, *, upto: int | None = None, final: bool = False) -> None:
        """Emit complete steps, and incomplete ones older than *upto* (a lost gossip message)."""
        for step in sorted(self._steps):
            if not final and upto is not None and step > upto:
                break
            got = self._steps.pop(step)
            self._emitted_steps.add(step)
            evs = list(got.values())
            self._emit(StepProgress(job=self.job, step=step, epoch=plan.epoch, stage=len(plan.stages) - 1,
                                    loss=sum(e.loss for e in evs if e.loss is not None) / len(evs),
                                    tokens_per_s=sum(e.tokens_per_s for e in evs),
                                    compute_util=max((e.compute_util for e in evs if e.compute_util is not None), default=None),
                                    at=time.time()))

    async def _cancel_members(self) -> None:
        async def one(peer: str) -> None:
            try:
                await job_proto.request(self.transport, peer, {"op": "cancel", "job": self.job}, timeout=10)
            except (PeerUnavailable, RemoteProtocolError) as exc:
                log.info("cancel of %s on %s: %s", self.job, peer[:12], exc)

        async with trio.open_nursery() as nursery:
            for peer in self.members:
                nursery.start_soon(one, peer)


class Publisher:
    """The publisher's services on its transport: JOB reports in, jobs-topic progress in, drivers out.

    ``await nursery.start(pub.run)`` installs the JOB handler and subscribes to the jobs topic;
    :meth:`run_job` then drives one job (several may run at once).
    """

    def __init__(self, t: Transport, content: ContentService, bootstraps: list[str],
                 config: DriverConfig | None = None) -> None:
        self.transport = t
        self.content = content
        self.bootstraps = bootstraps
        self.config = config or DriverConfig()
        self.drivers: dict[str, JobDriver] = {}

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.content.install()
        self.transport.set_stream_handler(JOB, job_proto.serve(self._on_request))
        ch = await self.transport.subscribe(TOPIC_JOBS)
        task_status.started()
        async for msg in ch:
            try:
                ev = decode_event(msg.data)
            except RemoteProtocolError:
                continue   # plan votes and other traffic of the jobs topic
            driver = self.drivers.get(ev.job)
            if driver is not None:
                driver.on_progress(msg.sender, ev)

    async def _on_request(self, peer: str, req: dict[str, Any]) -> dict[str, Any]:
        job = req.get("job")
        driver = self.drivers.get(job) if isinstance(job, str) else None
        if req["op"] != "report" or driver is None or peer not in driver.members:
            return {"ok": False, "error": "no such job here"}
        driver.on_report(peer, req)
        return {"ok": True}

    async def run_job(self, built: BuiltJob, emit: Emit, ckpt_root: Path) -> None:
        """Drive *built* to a terminal state; every state change goes to *emit* (never raises but Cancelled)."""
        driver = JobDriver(self.transport, self.content, self.bootstraps, built, emit, ckpt_root, self.config)
        self.drivers[driver.job] = driver
        try:
            await driver.run()
        finally:
            del self.drivers[driver.job]


__all__ = ["DriverConfig", "JobDriver", "Publisher", "SwarmView", "discover"]
