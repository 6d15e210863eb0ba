"""A node's job service over a real swarm: accept, elect, train one stage replica, report.

Theory of operation. :class:`NodeJobService` runs inside ``fusionp2p node`` (installed by
``jobs/service.py``). It serves the JOB control protocol (``jobs/proto.py``):

1. ``offer`` (from the publisher): the signed envelope is verified (the stream's authenticated peer
   must be the spec's publisher), the node checks that it fits, and fetches the DAG, weights and
   data shards by hash from the publisher through :class:`ContentService` (every blob checked
   against its hash). ``ok`` means "accepted, ready to start".
2. ``start``: the publisher proposes a :class:`Snapshot` of the accepting members (their signed
   device profiles and measured links). The node computes the plan from it
   (:func:`plan_for_snapshot`, pure and deterministic) and runs the gossip election of
   ``jobs/election.py``: the plan is adopted once a quorum of members signed the same hash.
3. Training: the node opens the data-plane channels its role needs, one per (pipeline neighbour |
   fellow replica): a :class:`~fusionp2p.net.resilient.ResilientChannel` named ``"<job>/<link>"``
   over the encrypted data plane (``net/bulk.py``). The lower stage (or replica index) dials; the
   service's :class:`~fusionp2p.net.resilient.ResilientAcceptor` takes every incoming channel and
   the job claims it by (authenticated peer, name). Then :class:`StageWorker` trains (1F1B/GPipe,
   AdaTopK on marked fences, CO2 between replicas), the loss stage gossips a
   :class:`StepProgress` per step, replica 0 of each stage saves safetensors checkpoints.
4. ``report`` (to the publisher): DONE with the final evaluation loss and the content hash of the
   final stage checkpoint (the publisher downloads it from us by hash), or FAILED/CANCELLED with the
   reason. A failure never takes the node down: everything is caught at the job's task.

Every wait has a deadline (config below). A lost data-plane connection between two live nodes (a
reset, a cut cable seen as silence > ``dead_after``) is repaired by the channel: it reconnects and
resends what the peer missed, and training goes on with the same messages in the same order (so the
same losses). A neighbour that stays unreachable for ``reconnect_timeout`` (its process died, or the
network stayed down) shows up as PeerUnavailable, or as the worker's ``recv_timeout``, and fails the
job (no re-plan yet).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import trio

from fusionp2p.errors import (
    ConfigError,
    FusionError,
    PeerUnavailable,
    PlanError,
    RemoteProtocolError,
    leaf_errors,
)
from fusionp2p.graph import StageExecutor
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.build import AcceptedJob, NodeJobs, data_fn, plan_for_snapshot, stage_programs
from fusionp2p.jobs.checkpoint import StageCheckpointMeta, save_stage
from fusionp2p.jobs.content import ContentService, ContentStore
from fusionp2p.jobs.election import Adopted, ElectionConfig, fetch_adopted, open_elector
from fusionp2p.jobs.events import CheckpointSaved, ProgressEvent, StepProgress, encode_event
from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.net.bulk import DataPlane, DataPlaneConfig, open_data_plane
from fusionp2p.net.channel import TensorChannel
from fusionp2p.net.resilient import (
    ResilientAcceptor,
    ResilientChannel,
    ResilientConfig,
    open_resilient_acceptor,
    open_resilient_channel,
)
from fusionp2p.plan import Plan
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.swarm.node import SwarmNode
from fusionp2p.train.worker import StageContext, StageReport, StageWorker
from fusionp2p.wire.protocols import JOB, TOPIC_JOBS

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeJobConfig:
    """Deadlines and limits of a node's job service (seconds)."""

    accept_timeout: float = 300.0      # verify + fetch DAG, weights and data
    election_timeout: float = 60.0
    link_timeout: float = 60.0         # all data-plane links of a role set up
    recv_timeout: float = 300.0        # one activation/gradient/averaging message
    report_timeout: float = 15.0
    report_attempts: int = 4
    max_jobs: int = 4                  # offered or running at once
    max_pending_links: int = 64
    data_plane: DataPlaneConfig = field(default_factory=lambda: DataPlaneConfig(keepalive=1.0, dead_after=60.0))
    # How long a lost data-plane connection between two live nodes may take to come back (the channel
    # reconnects, resumes and resends what the peer missed; docs/dataplane.md "Reconnecting channels").
    # Picked against the deadlines above: equal to link_timeout (a link may take as long to come back
    # as it took to come up); a hung link is noticed after data_plane.dead_after (60 s), so the worst
    # case, dead_after + reconnect_timeout = 120 s, stays well inside recv_timeout (300 s), past which
    # the worker gives up anyway. The price: a neighbour whose process died now fails the job this
    # long after its death instead of at once (refused reconnects look like a network outage).
    reconnect_timeout: float = 60.0

    def __post_init__(self) -> None:
        for name in ("accept_timeout", "election_timeout", "link_timeout", "recv_timeout", "report_timeout",
                     "reconnect_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"NodeJobConfig.{name} must be positive")
        if self.report_attempts < 1 or self.max_jobs < 1:
            raise ConfigError("NodeJobConfig.report_attempts and max_jobs must be >= 1")

    def channels(self) -> ResilientConfig:
        """Settings of a job's data-plane channels (both the dialing and the accepting side).

        ``copy_on_send=False``: a sent message's tensors are kept by reference for retransmission, not
        cloned, because nothing the job sends is modified in place after ``send`` returns: StageWorker
        sends the forward outputs of ``StageExecutor.forward`` (fresh results of the stage's operators,
        detached; the partitioner never sends a parameter or buffer), the gradients of received tensors
        (a fresh ``.grad`` per micro-batch, never accumulated into again) or AdaTopK payloads built from
        them, and for ``grad-avg`` a fresh ``torch.cat`` of the gradients; the ReplicaAverager sends
        slices of ``flatten(params)`` (a copy) and anchor shards that ``OuterOptimizer.step`` returns as
        new tensors (the optimizer rebinds, never updates, its anchor). The in-place updates of a step
        (optimizer, CO2 ``_unflat``) touch only parameters and optimizer state. (Even a sent view of a
        parameter would be safe: the optimizer step waits for that tensor's gradient, which the peer
        computes only after receiving it, and a received message is never resent.) Checked by
        tests/integration/test_e2e_local.py::test_sent_tensors_are_never_modified_after_send, which
        compares every tensor a job sent, at its end, with its value when ``send`` returned.
        """
        return ResilientConfig(reconnect_timeout=self.reconnect_timeout, copy_on_send=False)


@dataclass
class _Job:
    accepted: AcceptedJob
    publisher: str
    state: JobState = JobState.PENDING
    reason: str = ""
    scope: trio.CancelScope | None = None
    role: tuple[int, int] | None = None
    members: frozenset[str] | None = None          # of the started snapshot: who may open links to us
    channels: list[ResilientChannel] = field(default_factory=list)   # this job's open data-plane channels
    closed: trio.Event = field(default_factory=trio.Event)            # set once they are closed


def describe(exc: BaseException) -> str:
    """One line for the publisher: the first real error inside (possibly nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)]
        if not inner:
            break
        exc = inner[0]
    return f"{type(exc).__name__}: {exc}"[:2000]


class NodeJobService:
    """Serves JOB requests and runs accepted jobs on one node (see the module docstring)."""

    def __init__(self, swarm: SwarmNode, home: Path, config: NodeJobConfig | None = None) -> None:
        self.swarm = swarm
        self.transport = swarm.transport
        self.home = home
        self.config = config or NodeJobConfig()
        self.content = ContentService(self.transport, ContentStore(home / "content"))
        self.jobs: dict[str, _Job] = {}
        # channels that arrived and wait for their job to claim them, by (job, link name, peer)
        self._arrived: dict[tuple[str, str, str], ResilientChannel] = {}
        self._arrival = trio.Event()
        self._dp: DataPlane | None = None
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Install the JOB and CONTENT handlers, open the data plane, serve until cancelled."""
        dp_cfg = dataclasses.replace(self.config.data_plane, listen_host=self._bulk_host())
        self.content.install()
        gossip = await self.transport.subscribe(TOPIC_JOBS)   # keeps us in the jobs topic's mesh
        # exit order: the jobs' tasks, then the acceptor (goodbye on every accepted channel), then the plane
        async with (open_data_plane(self.transport, config=dp_cfg) as dp,
                    open_resilient_acceptor(config=self.config.channels(), peer_gone=self._peer_gone) as acc,
                    trio.open_nursery() as nursery):
            self._dp, self._nursery = dp, nursery
            await nursery.start(acc.serve, dp.incoming)
            nursery.start_soon(self._route_incoming, acc)
            nursery.start_soon(self._drain, gossip)
            self.transport.set_stream_handler(JOB, job_proto.serve(self._handle))
            log.info("job service ready (data plane %s:%d)", dp.host, dp.port)
            task_status.started()
            await trio.sleep_forever()

    def _bulk_host(self) -> str:
        # Bind the data plane where the transport listens: loopback stays loopback.
        for a in self.transport.listen_addrs():
            parts = a.split("/")
            if len(parts) > 2 and parts[1] == "ip4":
                return parts[2] if parts[2] == "127.0.0.1" else "0.0.0.0"
            if len(parts) > 1 and parts[1] == "memory":
                return "127.0.0.1"     # the embedded swarm (one process)
        return "0.0.0.0"

    async def _provide(self, hashes: list[str]) -> None:
        for h in hashes:
            await self.transport.provide(h)   # bounded by the transport's DHT timeout

    @staticmethod
    async def _drain(ch: trio.MemoryReceiveChannel[Any]) -> None:
        async for _ in ch:
            pass

    # ------------------------------------------------------------------ control protocol
    async def _handle(self, peer: str, req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "offer":
            env = req.get("envelope")
            if not isinstance(env, bytes):
                raise RemoteProtocolError("offer: envelope must be bytes")
            return await self._offer(peer, env)
        job_id = job_proto.str_field(req, "job", op)
        nj = self.jobs.get(job_id)
        if op == "status":
            return {"ok": nj is not None, "state": nj.state.value if nj else "", "reason": nj.reason if nj else "unknown job"}
        if nj is None or nj.publisher != peer:
            return {"ok": False, "error": f"no job {job_id} from this publisher"}
        if op == "cancel":
            if nj.scope is not None:
                nj.scope.cancel()
            elif nj.state is JobState.PENDING:
                self.jobs.pop(job_id, None)
            return {"ok": True}
        if op == "start":
            snap_bytes = req.get("snapshot")
            if not isinstance(snap_bytes, bytes):
                raise RemoteProtocolError("start: snapshot must be bytes")
            snap = Snapshot.from_wire(snap_bytes)
            if snap.job != job_id or self.transport.peer_id not in snap.members:
                return {"ok": False, "error": "the snapshot is for another job or does not name this node"}
            if nj.state is not JobState.PENDING:
                return {"ok": False, "error": f"job already {nj.state.value}"}
            nj.state = JobState.PLANNED
            nj.members = frozenset(snap.members)
            assert self._nursery is not None
            self._nursery.start_soon(self._run, nj, snap)
            return {"ok": True}
        return {"ok": False, "error": f"op {op} is not served by nodes"}

    async def _offer(self, peer: str, envelope: bytes) -> dict[str, Any]:
        if sum(not j.state.terminal for j in self.jobs.values()) >= self.config.max_jobs:
            return {"ok": False, "error": "this node is busy"}
        self._forget_finished()
        profile = self.swarm.profile
        if profile is None:
            return {"ok": False, "error": "this node has no device profile"}
        try:
            intake = NodeJobs(self.content, profile)
            with trio.fail_after(self.config.accept_timeout):
                acc = await intake.accept(envelope, peers=[peer])
        except trio.TooSlowError:
            return {"ok": False, "error": f"fetching the job's content took over {self.config.accept_timeout:.0f} s"}
        except (FusionError, ValueError) as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        if acc.spec.publisher != peer:
            return {"ok": False, "error": "the spec is signed by another publisher than the one offering it"}
        self.jobs.setdefault(acc.spec.job_id, _Job(accepted=acc, publisher=peer))
        assert self._nursery is not None
        self._nursery.start_soon(self._provide, intake.fetched)   # we can serve these blobs to others now
        log.info("accepted job %s from %s", acc.spec.job_id, peer[:12])
        return {"ok": True, "job": acc.spec.job_id}

    def _forget_finished(self, keep: int = 64) -> None:
        """Bound the job table: the oldest finished jobs beyond *keep* are forgotten."""
        done = [k for k, j in self.jobs.items() if j.state.terminal]
        for k in done[: max(0, len(done) - keep)]:
            del self.jobs[k]

    # ------------------------------------------------------------------ running a job
    async def _run(self, nj: _Job, snap: Snapshot) -> None:
        job_id = nj.accepted.spec.job_id
        result: dict[str, Any] = {}
        state, reason = JobState.FAILED, ""
        try:
            with trio.CancelScope() as scope:
                nj.scope = scope
                result = await self._train(nj, snap)
                state = JobState.DONE
        except Exception as exc:   # any failure ends this job, never the node
            # (outside the scope: when the publisher cancels while a task fails, e.g. a send to a peer that
            # already stopped, the scope takes its Cancelled out of the group and raises the rest here)
            log.warning("job %s failed: %s", job_id, describe(exc),
                        exc_info=not all(isinstance(e, FusionError | trio.Cancelled) for e in leaf_errors(exc)))
            reason = describe(exc)
        if scope.cancelled_caught:
            state, reason = JobState.CANCELLED, "cancelled by the publisher"
        nj.state, nj.reason, nj.scope = state, reason, None
        log.info("job %s %s %s", job_id, state.value, reason)
        await self._report(nj, state, reason, result)
        with trio.CancelScope(shield=True):   # channels that arrived for this job and were never claimed
            async with trio.open_nursery() as n:
                for key in [k for k in self._arrived if k[0] == job_id]:
                    n.start_soon(self._arrived.pop(key).aclose)

    async def _report(self, nj: _Job, state: JobState, reason: str, result: Mapping[str, Any]) -> None:
        msg = {"op": "report", "job": nj.accepted.spec.job_id, "state": state.value, "reason": reason, **result}
        for attempt in range(self.config.report_attempts):
            try:
                await job_proto.request(self.transport, nj.publisher, msg, timeout=self.config.report_timeout)
                return
            except (PeerUnavailable, RemoteProtocolError) as exc:
                log.info("report of %s to %s failed (attempt %d): %s", nj.accepted.spec.job_id, nj.publisher[:12],
                         attempt + 1, exc)
                await trio.sleep(0.5 * (attempt + 1))   # backoff between retries, not a readiness wait

    async def _train(self, nj: _Job, snap: Snapshot) -> dict[str, Any]:
        acc = nj.accepted
        spec = acc.spec
        me = self.transport.peer_id
        plan = await self._elect(snap, plan_for_snapshot(spec, acc.dag, snap))
        roles = [(s, r) for s, st in enumerate(plan.stages) for r, p in enumerate(st.replicas) if p == me]
        if not roles:
            return {"stage": -1, "replica": -1}
        if len(roles) > 1:
            raise PlanError(f"the plan gives this node {len(roles)} roles; one is supported")
        s, r = roles[0]
        nj.role = (s, r)
        nj.state = JobState.RUNNING
        programs = stage_programs(acc.dag, plan)
        async with trio.open_nursery() as holders:   # the tasks that hold this job's dialed channels open
            try:
                links, peers = await self._open_links(nj, plan, programs, s, r, holders)
                return await self._train_stage(nj, plan, programs, s, r, links, peers)
            finally:
                await self._close_channels(nj)

    async def _train_stage(self, nj: _Job, plan: Plan, programs: list[Any], s: int, r: int,
                           links: dict[int, TensorChannel], peers: list[TensorChannel]) -> dict[str, Any]:
        acc = nj.accepted
        spec, cfg = acc.spec, acc.spec.config
        me = self.transport.peer_id
        n_st = len(plan.stages)
        rho_out: dict[int, float] = {}
        if cfg.adatopk is not None:
            if s + 1 < n_st:
                rho_out[s + 1] = plan.fences[s].rho
            if s > 0:
                rho_out[-1 - (s - 1)] = plan.fences[s - 1].rho
        final: list[float] = []
        losses: dict[int, float] = {}
        saved: dict[int, Path] = {}
        ckpt_root = self.home / "checkpoints"

        async def report(rep: StageReport) -> None:
            if rep.eval:
                if rep.loss is not None:
                    final.append(rep.loss)
                return
            if rep.loss is None:
                return   # only the loss stage publishes per-step progress (gossip stays small)
            losses[rep.step] = rep.loss
            await self._gossip(StepProgress(job=spec.job_id, step=rep.step, epoch=plan.epoch, stage=s, peer=me,
                                            loss=rep.loss, tokens_per_s=rep.tokens / rep.wall_s if rep.wall_s > 0 else 0.0,
                                            compute_util=min(1.0, rep.compute_s / rep.wall_s) if rep.wall_s > 0 else None,
                                            at=time.time()))

        async def checkpoint(step: int, state: dict[str, torch.Tensor]) -> None:
            meta = StageCheckpointMeta(job=spec.job_id, stage=s, num_stages=n_st, step=step, plan_hash=plan.plan_hash())
            saved[step] = await trio.to_thread.run_sync(lambda: save_stage(ckpt_root, meta, state))
            await self._gossip(CheckpointSaved(job=spec.job_id, step=step, stage=s, peer=me, at=time.time()))

        prog = programs[s]
        ctx = StageContext(job=spec.job_id, executor=StageExecutor(prog), config=cfg, replica=r,
                           replicas=len(plan.stages[s].replicas), links=links, peers=peers, data=data_fn(acc),
                           tokens_per_micro=cfg.micro_batch * spec.dataset.seq_len, rho_out=rho_out, report=report,
                           checkpoint=checkpoint if r == 0 else None, recv_timeout=self.config.recv_timeout)
        await StageWorker(ctx).run()
        # the per-step losses again, in the reliable report: gossip may have lost some of them
        out: dict[str, Any] = {"stage": s, "replica": r, "final_loss": final[0] if final else None,
                               "losses": [losses.get(i) for i in range(cfg.steps)] if losses else []}
        if r == 0 and cfg.steps in saved:
            blob = await trio.to_thread.run_sync(saved[cfg.steps].read_bytes)
            out["checkpoint"] = self.content.store.put(blob)
            out["step"] = cfg.steps
        return out

    async def _elect(self, snap: Snapshot, mine: Plan) -> Plan:
        """The plan adopted by the members' gossip election (jobs/election.py).

        py-libp2p's gossipsub sometimes leaves a member short of votes after the others decided
        (they stop republishing then). Such a member reads the adopted plan, with the quorum of
        signed votes that elected it, from the DHT record the winners store (``fetch_adopted``).
        """
        deadline = trio.current_time() + self.config.election_timeout
        rounds = 0
        async with open_elector(self.transport, ElectionConfig(timeout_s=min(10.0, self.config.election_timeout))) as el:
            while True:
                rounds += 1
                outcome = await el.elect(snap, mine)
                if isinstance(outcome.decision, Adopted) and outcome.plan is not None:
                    return outcome.plan
                rec = await fetch_adopted(self.transport, snap.job)
                if rec is not None and rec[0] == snap.epoch and rec[1].snapshot_hash == snap.snapshot_hash():
                    log.info("job %s: plan %s adopted from the DHT record", snap.job, rec[1].plan_hash()[:12])
                    return rec[1]
                if trio.current_time() >= deadline:
                    raise PlanError(f"no plan adopted for job {snap.job} after {rounds} rounds: {outcome.decision}")

    async def _gossip(self, ev: ProgressEvent) -> None:
        try:
            with trio.move_on_after(5):
                await self.transport.publish(TOPIC_JOBS, encode_event(ev))
        except FusionError as exc:
            log.debug("progress not published: %s", exc)

    # ------------------------------------------------------------------ data-plane links
    async def _open_links(self, nj: _Job, plan: Plan, programs: list[Any], s: int, r: int,
                          holders: trio.Nursery) -> tuple[dict[int, TensorChannel], list[TensorChannel]]:
        """Channels to this pipeline's neighbour stages and to the other replicas of stage *s* (each
        one also goes into ``nj.channels``, which :meth:`_close_channels` closes when the job ends)."""
        dial: list[tuple[str, str, int | None]] = []     # (link name, peer, pipeline stage or None)
        accept: list[tuple[str, str, int | None]] = []
        for p in programs:
            for src in sorted({x.src for x in p.recv if x.src >= 0}):
                name = f"p{r}:{src}-{p.stage}"
                if src == s:
                    dial.append((name, plan.stages[p.stage].replicas[r], p.stage))
                elif p.stage == s:
                    accept.append((name, plan.stages[src].replicas[r], src))
        reps = plan.stages[s].replicas
        for j, peer in enumerate(reps):
            if j != r:
                name = f"s{s}:{min(r, j)}-{max(r, j)}"
                (dial if r < j else accept).append((name, peer, None))
        got: dict[str, TensorChannel] = {}
        with trio.fail_after(self.config.link_timeout):
            async with trio.open_nursery() as nursery:
                for name, peer, _ in dial:
                    nursery.start_soon(self._dial_link, nj, name, peer, got, holders)
                for name, peer, _ in accept:
                    nursery.start_soon(self._claim_link, nj, name, peer, got)
        links = {st: got[name] for name, _, st in [*dial, *accept] if st is not None}
        peers = [got[f"s{s}:{min(r, j)}-{max(r, j)}"] for j in range(len(reps)) if j != r]
        return links, peers

    async def _dial_link(self, nj: _Job, name: str, peer: str, got: dict[str, TensorChannel],
                         holders: trio.Nursery) -> None:
        delay = 0.2
        while True:
            try:
                ch: ResilientChannel = await holders.start(self._hold_channel, nj, name, peer)
                break
            except (PeerUnavailable, BaseExceptionGroup) as exc:
                # open_resilient_channel retried for reconnect_timeout already; try again until link_timeout
                if not all(isinstance(e, PeerUnavailable) for e in leaf_errors(exc)):
                    raise
                log.info("data plane to %s: %s; retrying", peer[:12], describe(exc))
                await trio.sleep(delay)     # retry backoff, bounded by link_timeout
                delay = min(2.0, delay * 2)
        got[name] = ch

    def _peer_gone(self, peer: str) -> bool:
        """A lost link's peer is not waited for once the membership view declares it dead or departed
        (heartbeat timeout, seconds) instead of for the whole reconnect_timeout."""
        view = self.swarm.view
        return peer in view.dead or peer in view.left

    async def _hold_channel(self, nj: _Job, name: str, peer: str, *,
                            task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Dial one channel and keep it open (reconnecting as needed) until the job's channels are closed."""
        assert self._dp is not None
        async with open_resilient_channel(self._dp, peer, name=f"{nj.accepted.spec.job_id}/{name}",
                                          config=self.config.channels(), peer_gone=self._peer_gone) as ch:
            nj.channels.append(ch)
            task_status.started(ch)
            await nj.closed.wait()

    async def _claim_link(self, nj: _Job, name: str, peer: str, got: dict[str, TensorChannel]) -> None:
        # keyed by the authenticated peer: a channel under this name from anyone else is never taken
        key = (nj.accepted.spec.job_id, name, peer)
        while key not in self._arrived:
            await self._arrival.wait()
        ch = self._arrived.pop(key)
        nj.channels.append(ch)
        got[name] = ch

    async def _close_channels(self, nj: _Job) -> None:
        """The job is over: goodbye on each of its channels, all at once (each bounded by close_timeout)."""
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as n:
                for ch in nj.channels:
                    n.start_soon(ch.aclose)
        nj.channels.clear()
        nj.closed.set()   # the holders of dialed channels return (their links close in the background)

    async def _route_incoming(self, acc: ResilientAcceptor) -> None:
        """Take every new channel from the acceptor; park it until its job claims it, or drop it."""
        async with trio.open_nursery() as nursery:
            async for ch in acc.incoming:
                try:
                    self._route_one(ch)
                except RemoteProtocolError as exc:
                    log.info("data-plane channel from %s dropped: %s", ch.remote_peer[:12], exc)
                    nursery.start_soon(ch.aclose)

    def _route_one(self, ch: ResilientChannel) -> None:
        job, _, name = ch.name.rpartition("/")
        nj = self.jobs.get(job)
        if not name or nj is None:
            raise RemoteProtocolError(f"data-plane channel {ch.name[:80]!r} is for no job of this node")
        if nj.members is not None and ch.remote_peer not in nj.members:
            raise RemoteProtocolError(f"data-plane channel {name!r} of job {job} from a non-member")
        key = (job, name, ch.remote_peer)
        if key in self._arrived or len(self._arrived) >= self.config.max_pending_links:
            raise RemoteProtocolError(f"duplicate or too many pending links ({name[:80]})")
        self._arrived[key] = ch
        self._arrival.set()
        self._arrival = trio.Event()


__all__ = ["NodeJobConfig", "NodeJobService", "describe"]
