"""One job on one node, across epochs: elect the plan, take its stage's state, train, halt, re-plan.

Theory of operation (docs/jobs.md "Elastic jobs"). A :class:`JobRun` exists from the moment a node
accepts a job. Its main task takes ``start`` requests one epoch at a time: epoch 0 from the publisher,
later epochs from the job's leader (``jobs/replan.py``). For each epoch it

1. computes the plan from the snapshot (deterministic; ``stabilize`` keeps members on the stage they
   held where equal devices allow it) and runs the gossip election (``jobs/election.py``);
2. builds its stage's state: from the published weights at epoch 0 (or after every state was lost),
   otherwise from the stage state blobs named by the resume (content-addressed, fetched from the
   nodes that hold them: a live replica's hand-off, or a replicated checkpoint);
3. opens its data-plane links (names carry the epoch, so channels of two epochs never mix) and runs a
   :class:`~fusionp2p.train.worker.StageWorker` from the resume step;
4. ends the epoch in one of three ways: the last step (the job is done here: the final stage file is
   saved, announced and reported), a halt (the leader asked: at once, or at a step boundary), or a
   neighbour's death (the worker raises ``PeerUnavailable``). After a halt or a death it exports its
   state (parameters, optimizer state, CO2 momentum shard) into its content store, answers the
   leader's ``halt`` with that state's hash, and waits for the next ``start``.

A second task watches the membership view. The leader (lowest live id of the plan, else of its standbys) drives
a re-plan when a member died or left, when its own pipeline broke, or when a node that accepted the
job would get a role; see :meth:`JobRun._lead`. Every state change goes through the lifecycle table
(``jobs/lifecycle.py``). A job fails only when no plan can be made or a stage fails for a reason
other than a lost peer (a NaN, a bug, a malformed tensor), and never takes the node down.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import trio

from fusionp2p.errors import (
    FusionError,
    JobError,
    PeerUnavailable,
    PlanError,
    RemoteProtocolError,
    leaf_errors,
)
from fusionp2p.graph import OpDAG, StageExecutor, coarsen
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.build import (
    AcceptedJob,
    averaging_bf16,
    averaging_lag,
    data_fn,
    eval_data_fn,
    stage_programs,
    unit_names,
)
from fusionp2p.jobs.checkpoint import StageCheckpointMeta, decode_state, state_layout
from fusionp2p.jobs.data_shards import FeedStats, StreamFeed, plan_history, stage_feed
from fusionp2p.jobs.election import Adopted, ElectionConfig, fetch_adopted, open_elector
from fusionp2p.jobs.events import (
    MAX_EARLIER,
    CheckpointSaved,
    EvalProgress,
    JobStateChanged,
    LinksUp,
    PlanChanged,
    ProgressEvent,
    StepProgress,
    StepSkipped,
    encode_event,
)
from fusionp2p.jobs.failures import describe, split_cancelled
from fusionp2p.jobs.host import JobHost
from fusionp2p.jobs.lead import Leading, _Epoch
from fusionp2p.jobs.lifecycle import JobLifecycle, JobState
from fusionp2p.jobs.links import Linking
from fusionp2p.jobs.plan_thread import planned
from fusionp2p.jobs.progress import ProgressBook
from fusionp2p.jobs.rebalance import epoch_speed
from fusionp2p.jobs.replan import Halted, Resume, Source, announcer, leader_of
from fusionp2p.jobs.shadow import Shadows
from fusionp2p.jobs.status import ProgressBatch, StepStats
from fusionp2p.jobs.suspects import Suspects
from fusionp2p.jobs.verified import SPOT_OPS, Arbiter, EpochChecks, tapped_executor
from fusionp2p.jobs.weights import WeightFetches, prepare_stage, stage_fit, stage_recompute
from fusionp2p.net.channel import TensorChannel
from fusionp2p.net.resilient import ResilientChannel
from fusionp2p.plan import Plan
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.train.state import StageState, merge_states
from fusionp2p.train.worker import Halt, StageContext, StageReport, StageWorker
from fusionp2p.wire.jobrecords import StageFile
from fusionp2p.wire.protocols import TOPIC_JOBS
from fusionp2p.wire.stfile import chunks

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class StartRequest:
    """Start epoch ``snapshot.epoch`` with this snapshot, resuming as ``resume`` says."""

    snapshot: Snapshot
    resume: Resume
    previous: Plan | None      # the plan the resume's live sources were trained under (stabilises roles)
    sender: str
    plan_hash: str = ""        # the plan its leader computed from the snapshot (no election when ours agrees)


class JobRun(Leading, Linking):
    """See the module docstring. Created by the node's job service when it accepts a job."""

    def __init__(self, svc: JobHost, accepted: AcceptedJob, publisher: str) -> None:
        self.svc = svc
        self.transport = svc.transport
        self.me = svc.transport.peer_id
        self.accepted = accepted
        self.spec = accepted.spec
        self.job_id = accepted.spec.job_id
        self.publisher = publisher
        self.life = JobLifecycle(self.job_id, now=trio.current_time())
        self.reason = ""
        self.epoch = -1
        self.plan: Plan | None = None
        self.role: tuple[int, int] | None = None
        self.members: frozenset[str] | None = None     # of the newest started snapshot: who may open links
        self.scope: trio.CancelScope | None = None
        self._tasks: trio.Nursery | None = None         # the job's own tasks (run): they outlive an epoch
        self.channels: list[ResilientChannel] = []
        self.closed = trio.Event()
        # step -> (start unit, end unit) -> (stage file hash, nodes holding it)
        self.checkpoints: dict[int, dict[tuple[int, int], tuple[str, list[str]]]] = {}
        self.offered_by = ""            # the member that first offered us the job as a joiner
        self.offerers: set[str] = set()  # every member that offered it (a later leader offers it again)
        self.book = ProgressBook(job=self.job_id, steps=self.spec.config.steps)
        self.suspects = Suspects.of(self.spec)   # allow-list, standing, outlier replicas (jobs/suspects.py)
        self.final: dict[int, tuple[str, tuple[str, ...]]] = {}   # stage -> final state file (hash, holders)
        self.final_losses: dict[int, float] = {}                  # replica -> its final evaluation loss
        self.weights = WeightFetches()                            # the published weight pieces this node fetched
        self.data_history: tuple[tuple[int, int], ...] = ()       # (step, slots) per plan (data/stream.py)
        self.data = FeedStats()                                   # the data shards this node fetched and read
        self.losses: dict[int, float] = {}                        # this node's per-step losses (loss stage)
        self.last: StepStats | None = None                        # this node's latest step (status, metrics)
        self.joiners: set[str] = set()                            # accepted the job, no role yet
        self._joiner_profiles = {}                                # joiner -> the profile its accept carried (lead.py)
        self._offered: dict[str, float] = {}                      # node -> when the leader offered it the job
        self._answered: dict[str, float] = {}                     # member the view calls dead -> when it answered
        self._join_checked: tuple[tuple[int, frozenset[str]], float, float] = ((-1, frozenset()), -math.inf, 0.0)
        self._rebalance_judged = -1                                 # the last epoch judged by measured speeds
        self._rebalances = 0                                        # re-plans this node led for measured speeds
        self._speeds: dict[str, float] = {}                         # member -> measured / start-up speed
        self._speed_typical = 1.0                                   # the same for nodes not measured (median)
        self._starts_send, self._starts = trio.open_memory_channel[StartRequest](16)
        self._started: set[int] = set()
        self._cur = _Epoch()
        self._last: Halted | None = None   # the newest state this node handed over (answers later halts)
        self._worker: StageWorker | None = None
        self.checks: EpochChecks | None = None    # the epoch's verified stages (TrainConfig.spot_rate; jobs/verified.py)
        self._rolled: set[str] = set()            # convicted members a re-plan already rolled back for (jobs/lead.py)
        self.arbiter = Arbiter()                  # the leader's re-judgement of verdicts (jobs/verified.py)
        self._worker_scope: trio.CancelScope | None = None      # the epoch's setup and training
        self._halt = Halt()
        self._broken = False           # our pipeline broke (a neighbour died): a re-plan is needed
        self._led = -1                 # the newest epoch we proposed as leader
        self._led_at = -math.inf
        self._led_with: set[str] = set()   # the peers asked to halt for that proposal
        self._told: tuple[int, str] | None = None
        self._wake = trio.Event()
        self._done_from: dict[tuple[int, int], dict[str, Any]] = {}   # leader: (stage, replica) -> done report
        self._ended_by_leader = False
        self._released: dict[str, Any] | None = None   # progress() once the job ended here and let go (release)
        self._plan_cache: tuple[str, Plan] | None = None   # (snapshot hash, plan) computed leading a re-plan
        self.shadows = Shadows(self, svc.config.shadow)   # background copies of single-replica stages (jobs/shadow.py)

    # ------------------------------------------------------------------ public (called by the service)
    @property
    def state(self) -> JobState:
        return self.life.state

    def to(self, dst: JobState, reason: str = "") -> None:
        if self.life.state is not dst or dst is JobState.PLANNED:
            src = self.life.state
            self.life.to(dst, now=trio.current_time(), reason=reason)
            log.info("job %s: %s -> %s%s", self.job_id, src.value, dst.value, f" ({reason})" if reason else "")
        if dst.terminal:
            self.reason = reason

    def offer_start(self, req: StartRequest) -> str:
        """Queue a start request; '' when taken, else why not (the service answers the sender)."""
        e = req.snapshot.epoch
        if self.life.terminal:
            return f"job already {self.life.state.value}"
        if e <= self.epoch or e in self._started:
            return f"epoch {e} already started (this node is in epoch {self.epoch})"
        if self.me not in req.snapshot.members:
            return "the snapshot does not name this node"
        if unlisted := self.suspects.starting(req.snapshot.members):
            return f"the snapshot names {len(unlisted)} node(s) outside the job's allow-list (TrainConfig.allow_members)"
        if convicted := sorted(set(req.snapshot.members) & set(self.suspects.convicted)):
            # a convicted member (jobs/verified.py) that still thinks it leads cannot bring itself back
            return f"the snapshot names {len(convicted)} member(s) a spot-check convicted"
        try:
            self._starts_send.send_nowait(req)
        except trio.WouldBlock:
            return "too many start requests queued"
        self._started.add(e)
        self.members = frozenset(req.snapshot.members) | (self.members or frozenset())
        self._poke()
        return ""

    async def halt(self, at: int | None, *, timeout: float) -> Halted:
        """Stop the current epoch's training (at once, or before step *at*); say where the state stands."""
        cur = self._cur
        if self.epoch < 0:
            return Halted(peer=self.me, epoch=0, stage=-1, replica=-1, step=0)
        if cur.halted is None and not cur.ended.is_set():
            if at is None:
                self._broken = True
                if self._worker_scope is not None:
                    self._worker_scope.cancel()
            else:
                self._halt.at = at
        with trio.fail_after(timeout):
            await cur.ended.wait()
        if cur.halted is not None:
            return cur.halted
        last = self._last
        if last is not None:   # this epoch never trained here: what we hold is the last epoch's state
            return Halted(peer=self.me, epoch=self.epoch, stage=last.stage, replica=last.replica, step=last.step,
                          state=last.state, start=last.start, end=last.end)
        return Halted(peer=self.me, epoch=self.epoch, stage=-1, replica=-1, step=0)

    def end(self, reason: str) -> None:
        """The job ended elsewhere while this node stood by (no role): finish here too."""
        if self.role is None and not self.life.terminal:
            self.reason = reason
            self._ended_by_leader = True
            if self.scope is not None:
                self.scope.cancel()

    def release(self) -> None:
        """The job ended here: drop its model, optimizer, weights and data; the small record stays (status, halts)."""
        self._released = self.progress()
        self._worker = None
        self.accepted = replace(self.accepted, dag=OpDAG(inputs=(), nodes=(), outputs=()), tokens=None, envelope=b"")

    def progress(self) -> dict[str, Any]:
        if self._released is not None:
            return self._released
        w = self._worker
        out: dict[str, Any] = {"epoch": self.epoch, "step": w.completed if w is not None else -1,
                               "stage": self.role[0] if self.role else -1}
        if w is not None and w.busy_micros > 0:
            # forward + backward seconds per micro-batch this epoch, its own and its replica peers' as measured
            out.update(w.speed_report())   # (the leader re-balances by them; jobs/rebalance.py)
        return out

    def on_event(self, sender: str, ev: ProgressEvent) -> None:
        """A progress event of this job from the jobs topic."""
        now = time.time()
        if isinstance(ev, CheckpointSaved) and ev.hash and ev.peer == sender and 0 <= ev.start < ev.end:
            self._holds(ev.step, (ev.start, ev.end), ev.hash, sender)
        elif isinstance(ev, StepProgress):
            self.book.add(sender, ev, now=now)
        if self.suspects.observe(sender, ev, self.plan, self._leader(self.plan) if self.plan is not None else None,
                                 self._alive):
            self._poke()   # a convicted member: the leader re-plans without it

    def on_done(self, peer: str, msg: dict[str, Any]) -> None:
        """A member's ``done`` report (the leader aggregates them into the final status)."""
        try:
            stage, replica = job_proto.int_field(msg, "stage", "done"), job_proto.int_field(msg, "replica", "done")
        except RemoteProtocolError:
            return
        self._done_from[(stage, replica)] = msg
        self._poke()

    async def on_spot(self, peer: str, req: dict[str, Any]) -> dict[str, Any]:
        """A verified-stage request of a member (jobs/verified.py): claims, a bundle or stamps for the epoch's
        checks; a ``verdict`` for the leader, which convicts on the evidence and re-plans without the stage."""
        checks = self.checks
        if req["op"] == "verdict" and checks is not None:
            return checks.on_verdict(peer, req)   # re-judged before anyone is convicted (jobs/verified.py)
        if checks is None or req["op"] not in SPOT_OPS:
            return {"ok": False, "error": "this node runs no spot-checks now"}
        return await checks.on_request(peer, req)

    def _holds(self, step: int, units: tuple[int, int], h: str, peer: str) -> None:
        h0, holders = self.checkpoints.setdefault(step, {}).get(units, (h, []))
        if h0 == h and peer not in holders:
            holders.append(peer)
        self.checkpoints[step][units] = (h0, holders)

    # ------------------------------------------------------------------ main task
    async def run(self) -> None:
        """Run the job here until it ends; never raises but Cancelled (a failure ends the job, not the node)."""
        state, reason = JobState.FAILED, ""
        try:
            with trio.CancelScope() as scope:
                self.scope = scope
                async with trio.open_nursery() as nursery:
                    self._tasks = nursery
                    nursery.start_soon(self._watch)
                    nursery.start_soon(self._listen)
                    await self._epochs()
                    nursery.cancel_scope.cancel()
                state = JobState.DONE
        except BaseException as exc:   # any failure ends this job, never the node
            cancelled, failure = split_cancelled(exc)
            if failure is None:
                raise
            if trio.current_effective_deadline() == -math.inf:
                # the node itself is stopping (SIGTERM, or its service was cancelled): channels that close
                # under a worker surface as errors; the job goes on elsewhere, nothing to report
                log.info("job %s: stopped with the node (%s)", self.job_id, describe(failure))
                if not self.life.terminal:
                    self.to(JobState.CANCELLED, "this node stopped")
                if cancelled is not None:
                    raise cancelled from None
                return
            reason = describe(failure)
            log.warning("job %s failed: %s", self.job_id, reason,
                        exc_info=not all(isinstance(e, FusionError | trio.Cancelled) for e in leaf_errors(failure)))
        if scope.cancelled_caught:
            state, reason = JobState.CANCELLED, self.reason or "cancelled by the publisher"
            if self._ended_by_leader:
                state = JobState.DONE if self.reason == "done" else JobState.CANCELLED
        if not self.life.terminal:
            self.to(state, reason)
        log.info("job %s %s %s", self.job_id, state.value, reason)
        with trio.CancelScope(shield=True):
            await self._close_channels()
            with trio.move_on_after(self.svc.config.report_timeout):
                await self._gossip(JobStateChanged(job=self.job_id, state=self.life.state.value, reason=self.reason,
                                                   at=time.time()))
            if self.life.state is not JobState.DONE:
                await self._report_end()

    async def _epochs(self) -> None:
        first = True
        while True:
            # a standby (no role) waits for as long as the job runs; a halted member for its leader
            timeout = math.inf if first or self._cur.outcome == "idle" else self.svc.config.start_timeout
            with trio.move_on_after(timeout) as waited:
                req = await self._starts.receive()
            if waited.cancelled_caught:
                raise JobError(f"no new plan within {timeout:.0f} s after epoch {self.epoch} ended")
            first = False
            while True:   # take the newest start queued (a leader retried with a later epoch)
                try:
                    newer = self._starts.receive_nowait()
                except trio.WouldBlock:
                    break
                req = newer if newer.snapshot.epoch > req.snapshot.epoch else req
            if await self._epoch(req):
                return

    async def _epoch(self, req: StartRequest) -> bool:
        """Run one epoch; True when the job is done here."""
        snap = req.snapshot
        self._cur = cur = _Epoch()
        self.epoch = snap.epoch
        self._halt = Halt()
        self._broken = False
        self.to(JobState.PLANNED, f"epoch {snap.epoch}")
        try:
            t0 = trio.current_time()
            mine = self._planned(snap) or await planned(self.spec, self.accepted.dag, snap, self.svc.planning,
                                                        previous=req.previous)
            plan = mine if await self._fast_adopt(req, mine) else await self._elect(snap, mine)
            log.info("job %s epoch %d: plan %s adopted in %.1f s", self.job_id, snap.epoch, plan.plan_hash()[:12],
                     trio.current_time() - t0)
        except PlanError as exc:
            log.warning("job %s epoch %d: %s", self.job_id, snap.epoch, exc)
            cur.outcome = "no plan"
            cur.ended.set()
            return False
        self.plan = plan
        n_st = len(plan.stages)
        self.book.set_plan(plan.epoch, n_st - 1, plan.stages[-1].replicas)
        self.data_history = plan_history(req.resume.data, req.resume.step, plan, self.spec.config.micro_batches)
        # The plan's lowest member writes the status record (a member of the plan it names); the plan event
        # comes from a member the publisher knows (replan.announcer), the standbys listed as idle
        if plan.peers and plan.peers[0] == self.me:
            self.svc.nursery.start_soon(self._put_status, self._status(JobState.RUNNING, plan))
        if announcer(snap.members, req.previous.peers if req.previous is not None else None) == self.me:
            self.svc.nursery.start_soon(self._gossip, PlanChanged.of(plan, at=time.time(), accepted=snap.members))
        roles = [(s, r) for s, st in enumerate(plan.stages) for r, p in enumerate(st.replicas) if p == self.me]
        if not roles:
            self.role = None
            self.to(JobState.RUNNING, "standby: no role in this plan")
            cur.outcome = "idle"
            cur.ended.set()
            return False
        if len(roles) > 1:
            raise PlanError(f"the plan gives this node {len(roles)} roles; one is supported")
        s, r = self.role = roles[0]
        programs = stage_programs(self.accepted.dag, plan)
        worker: StageWorker | None = None
        try:
            with trio.CancelScope() as scope:   # a halt "now" cancels the setup or the training
                self._worker_scope = scope
                if self._broken:
                    scope.cancel()
                t0 = trio.current_time()
                why = stage_fit(self.accepted, plan, snap, s, self.svc.swarm.profile, programs[s])
                if why:   # the plan is ours too, so only a profile changed since: refuse, with the reason
                    raise JobError(f"this node refuses its stage: {why}")
                restore = await self._gather_state(programs[s], req.resume)
                programs[s] = await prepare_stage(self.svc.content, self.accepted, programs[s], restore,
                                                  peers=[self.publisher], fetches=self.weights,
                                                  announce=lambda h: self.svc.nursery.start_soon(self._provide, h))
                log.info("job %s epoch %d: state of stage %d from %d files in %.1f s", self.job_id, plan.epoch, s,
                         len(req.resume.sources), trio.current_time() - t0)
                self.to(JobState.RUNNING, f"epoch {plan.epoch}: stage {s} replica {r} from step {req.resume.step}")
                async with trio.open_nursery() as holders:   # the epoch's tasks (its data feed)
                    try:
                        t0 = trio.current_time()
                        links, peers = await self._open_links(plan, programs, s, r, self._tasks or holders)
                        paths = {ch.remote_peer: self._path(ch) for ch in [*links.values(), *peers]}
                        log.info("job %s epoch %d: %d links up in %.1f s (%s)", self.job_id, plan.epoch,
                                 len(links) + len(peers), trio.current_time() - t0,
                                 ", ".join(f"{p[-8:]} {path}" for p, path in paths.items()) or "none")
                        self.svc.nursery.start_soon(self._gossip, LinksUp(
                            job=self.job_id, epoch=plan.epoch, stage=s, peer=self.me,
                            links=tuple(f"{p}={path}" for p, path in sorted(paths.items())), at=time.time()))
                        checks = self.checks = self._checks(plan, programs, s, r)
                        if checks is not None:   # verified stages: stamped links, the ledger, the checker
                            links = checks.links(links)
                            await holders.start(checks.serve, self.closed)
                        feed = stage_feed(self.svc.content, self.accepted, plan, s, r, self.data_history, programs[s],
                                          peers=[self.publisher], stats=self.data, gossip=self._gossip)
                        if feed is not None:   # a reading stage of a streamed dataset: its shards, a window ahead
                            await holders.start(feed.serve, self.closed)
                        worker = self._worker = StageWorker(self._context(plan, snap, programs, s, r, links, peers,
                                                                          req.resume, restore, feed, checks))
                        async with self.shadows.running(plan, s):
                            await worker.run()
                    finally:
                        self.checks = None
                        await self._close_channels()
        except Exception as exc:
            lost = [e for e in leaf_errors(exc) if not isinstance(e, trio.Cancelled)]
            # a halt cancels the epoch: a worker finishing a compute step then sends into a closed channel
            expected: tuple[type[BaseException], ...] = (PeerUnavailable, trio.EndOfChannel)   # a neighbour left the epoch
            if scope.cancel_called:
                expected += (trio.ClosedResourceError, trio.BrokenResourceError)
            if not lost or not all(isinstance(e, expected) for e in lost):
                raise
            log.info("job %s epoch %d: pipeline broken (%s); waiting for a re-plan", self.job_id, plan.epoch,
                     describe(exc))
            self._broken = True
            self._poke()
        finally:
            self._worker_scope = None
        if worker is not None and worker.completed >= self.spec.config.steps and not self._broken:
            # at the job's end only: its leader's re-plans scale the members' profiles by their announced
            # speeds as well as by what they measured in the job, which would count a figure announced mid-job twice
            self._note_speed(plan, snap, worker)
            await self._finish(plan, s, r, worker)
            cur.outcome = "done"
            cur.ended.set()
            return True
        if worker is None:
            log.info("job %s epoch %d: halted before training", self.job_id, plan.epoch)
            cur.outcome = "halted before training"
            cur.ended.set()
            return False
        st = worker.export_state(copy=False)
        h = await self._store_state(plan, s, st)
        stage = plan.stages[s]
        cur.halted = self._last = Halted(peer=self.me, epoch=plan.epoch, stage=s, replica=r, step=st.step, state=h,
                                         start=stage.start, end=stage.end)
        cur.outcome = "halted"
        cur.ended.set()
        log.info("job %s epoch %d halted at step %d (stage %d replica %d, state %s)", self.job_id, plan.epoch,
                 st.step, s, r, h[:12])
        return False

    def _note_speed(self, plan: Plan, snap: Snapshot, worker: StageWorker) -> None:
        """Announce the speed the job's last epoch trained at against our start-up benchmark, for the plans
        of later jobs of its model (jobs/rebalance.py: :func:`epoch_speed`)."""
        profile = self.svc.swarm.profile
        try:
            f = None if profile is None else epoch_speed(self.spec, self.accepted.dag, plan, snap, self.me, profile,
                                                          worker.busy_s, worker.busy_micros)
        except (PlanError, FusionError, ValueError) as exc:
            log.debug("job %s: no speed figure: %s", self.job_id, exc)
            return
        if f is not None:
            log.info("job %s epoch %d: trained at %.0f ms per micro-batch over %d, %.2fx the speed of the start-up "
                     "benchmark", self.job_id, plan.epoch, 1e3 * worker.busy_s / worker.busy_micros, worker.busy_micros, f)
            self.svc.swarm.note_speed(f, self.spec.model_hash)

    # ------------------------------------------------------------------ state
    async def _gather_state(self, prog: Any, resume: Resume) -> StageState | None:
        """This stage's state for the resume: None at the published weights (epoch 0, or nothing survived)."""
        if resume.initial:
            return None
        want = {spec.name for spec in prog.inputs if spec.kind != "input"}
        states: list[StageState] = []
        got: set[str] = set()
        c = coarsen(self.accepted.dag)
        srcs = [src for src in resume.sources if want & unit_names(c, src.start, src.end)]
        blobs: dict[int, bytes] = {}

        async def fetch(i: int, src: Source) -> None:
            blobs[i] = await self._fetch_state(src)

        async with trio.open_nursery() as nursery:   # all at once: from several holders, each a round trip
            for i, src in enumerate(srcs):
                nursery.start_soon(fetch, i, src)
        for i, src in enumerate(srcs):
            _, st = decode_state(blobs.pop(i), job=self.job_id)
            states.append(st)
            got |= set(st.tensors) & want
            if src.step == resume.step:
                # a re-plan's hand-off is a checkpoint of its step too: its holder and every node that
                # fetched it hold a copy, so it survives the loss of the node that handed it over
                self._holds(src.step, (src.start, src.end), src.state, self.me)
                self.svc.nursery.start_soon(self._gossip, CheckpointSaved(
                    job=self.job_id, step=src.step, stage=-1, peer=self.me, hash=src.state, start=src.start,
                    end=src.end, at=time.time()))
        missing = sorted(want - got)
        if missing:
            raise JobError(f"no handed-over state holds {missing[:5]} (stage of {len(want)} tensors)")
        return merge_states(resume.step, states, want)

    async def _fetch_state(self, src: Source) -> bytes:
        if self.svc.content.store.has(src.state):
            return self.svc.content.store.get(src.state)
        # its holders, then every node known to hold the same file (a keeper, an earlier fetcher), in turn
        known = [p for files in self.checkpoints.values() for h, ps in files.values() if h == src.state for p in ps]
        with trio.fail_after(self.svc.config.accept_timeout):   # announced in the background: the epoch waits
            blob = await self.svc.content.fetch(src.state, max_size=self.svc.config.max_state_bytes, provide=False,
                                                peers=[p for p in dict.fromkeys([*src.holders, *known]) if p != self.me] or None)
        self.svc.nursery.start_soon(self._provide, src.state)
        return blob

    async def _store_state(self, plan: Plan, s: int, st: StageState) -> str:
        meta = StageCheckpointMeta(job=self.job_id, stage=s, num_stages=len(plan.stages), step=st.step,
                                   plan_hash=plan.plan_hash())
        lay = state_layout(meta, st)   # views of the state's tensors, written out without a copy of them
        h = await self.svc.content.put_chunks(chunks(lay), lay.size)
        self.svc.nursery.start_soon(self._provide, h)
        return h

    async def _provide(self, h: str) -> None:
        with trio.move_on_after(30):
            try:
                await self.transport.provide(h)
            except FusionError as exc:
                log.debug("provide %s: %s", h[:12], exc)

    # ------------------------------------------------------------------ training
    def _context(self, plan: Plan, snap: Snapshot, programs: list[Any], s: int, r: int, links: dict[int, TensorChannel],
                 peers: list[TensorChannel], resume: Resume, restore: StageState | None,
                 feed: StreamFeed | None = None, checks: EpochChecks | None = None) -> StageContext:
        cfg = self.spec.config
        n_st = len(plan.stages)
        rho_out: dict[int, float] = {}
        if cfg.adatopk is not None:
            if s + 1 < n_st:
                rho_out[s + 1] = plan.fences[s].rho
            if s > 0:
                rho_out[-1 - (s - 1)] = plan.fences[s - 1].rho

        batch = ProgressBatch(self.svc.config.progress_interval, MAX_EARLIER)   # gossip stays small

        async def report(rep: StageReport) -> None:
            self._cur.trained = True
            if rep.skipped:   # the worker skipped a step with non-finite gradients (train/guard.py): say so
                await self._gossip(StepSkipped(job=self.job_id, step=rep.step, stage=s, peer=self.me,
                                               reason=rep.skipped, at=time.time()))
            for out in self.suspects.mine(self.job_id, rep.step, s, self.me, rep.outliers, self.plan):
                await self._gossip(out)   # replicas this one dropped from its averaging as outliers (jobs/suspects.py)
            if not rep.eval:
                self.last = StepStats(step=rep.step, stage=rep.stage, replica=rep.replica, wall_s=rep.wall_s,
                                      compute_s=rep.compute_s, tokens=rep.tokens, loss=rep.loss, averaging=rep.averaging)
            if rep.eval:
                if rep.loss is not None:
                    if rep.step >= cfg.steps:
                        self.final_losses[r] = rep.loss
                    await self._gossip(EvalProgress(job=self.job_id, step=rep.step, epoch=plan.epoch, peer=self.me,
                                                    loss=rep.loss, at=time.time()))
                return
            if rep.loss is None:
                return   # only the loss stage publishes per-step progress (gossip stays small)
            self.losses[rep.step] = rep.loss
            # the epoch's last step (the job's end or a planned halt) goes out at once, with what is held
            last = rep.step + 1 >= cfg.steps or (self._halt.at is not None and rep.step + 1 >= self._halt.at)
            tps = rep.tokens / rep.wall_s if rep.wall_s > 0 else 0.0
            held = batch.add(rep.step, rep.loss, tps, time.time(), now=trio.current_time(), last=last)
            if held is not None:
                await self._gossip(StepProgress(job=self.job_id, step=rep.step, epoch=plan.epoch, stage=s, peer=self.me,
                                                loss=rep.loss, tokens_per_s=tps, at=time.time(), earlier=held[0],
                                                compute_util=min(1.0, rep.compute_s / rep.wall_s) if rep.wall_s > 0 else None,
                                                earlier_tokens_per_s=held[1], earlier_at=held[2]))

        async def checkpoint(step: int, _: dict[str, torch.Tensor]) -> None:
            if step >= cfg.steps or self._worker is None:
                return   # the final file is saved with the done report
            h = await self._store_state(plan, s, self._worker.export_state(copy=False))
            units = (plan.stages[s].start, plan.stages[s].end)
            self._holds(step, units, h, self.me)
            await self._gossip(CheckpointSaved(job=self.job_id, step=step, stage=s, peer=self.me, hash=h,
                                               start=units[0], end=units[1], at=time.time()))
            self.svc.nursery.start_soon(self.shadows.replicate, plan, s, h, step)

        kw: dict[str, Any] = {"device": self.svc.config.device, "precision": cfg.precision,   # docs/gpu.md
                              "recompute": stage_recompute(self.accepted, plan, snap, s, programs[s])}
        tapped = tapped_executor(self.me, r, programs[s], **kw) if checks is not None else None
        ex = tapped if tapped is not None else StageExecutor(programs[s], **kw)
        programs[s] = ex.program   # holds the executor's tensors: the fetched ones go (jobs/weights.py)
        return StageContext(job=self.job_id, executor=ex, config=cfg, replica=r,
                            replicas=len(plan.stages[s].replicas), links=links, peers=peers,
                            data=feed or data_fn(self.accepted), data_ready=feed.ready if feed else None, tokens_per_micro=cfg.micro_batch * self.spec.dataset.seq_len,
                            rho_out=rho_out, report=report, checkpoint=checkpoint if r == 0 else None,
                            start_step=resume.step, restore=restore, halt=self._halt, boundary=self.shadows.boundary,
                            recv_timeout=self.svc.config.recv_timeout, eval_data=eval_data_fn(self.accepted, feed),
                            micro=plan.micro, micro_period=plan.micro_period,
                            averaging_lag=averaging_lag(self.spec, self.accepted.dag, plan, snap, s),
                            averaging_bf16=averaging_bf16(self.spec, self.accepted.dag, plan, snap, s, r),
                            compute_slowdown=self.svc.config.compute_slowdown, compute_cpus=self.svc.config.compute_cpus,
                            spot=checks.keep_ledger(tapped) if checks is not None and tapped is not None else None)

    def _checks(self, plan: Plan, programs: list[Any], s: int, r: int) -> EpochChecks | None:
        """The epoch's verified-stage checks (None when the job's ``spot_rate`` is 0)."""
        rate = self.spec.config.spot_rate
        if rate <= 0:
            return None
        return EpochChecks(transport=self.transport, content=self.svc.content, job=self.job_id, plan=plan, stage=s,
                           replica=r, programs=programs, rate=rate, micro_batches=self.spec.config.micro_batches,
                           timeout=self.svc.config.report_timeout, max_bundle=self.svc.config.max_state_bytes,
                           suspects=self.suspects, gossip=self._gossip, arbiter=self.arbiter, poke=self._poke,
                           leader=lambda: leader_of(plan.peers, self._alive, standbys=self.members or ()),
                           alive=self._alive)

    async def keep(self, h: str, step: int, stage: int, units: tuple[int, int], holder: str, *,
                   shadow: bool = False, **link: Any) -> None:
        """Hold a copy of another member's stage file (we are its keeper) and announce it (jobs/shadow.py)."""
        await self.shadows.keep(h, step, stage, units, holder, shadow=shadow, **link)

    async def _finish(self, plan: Plan, s: int, r: int, worker: StageWorker) -> None:
        """The last step is done here: save the final stage file (replica 0), report to the leader."""
        steps = self.spec.config.steps
        msg: dict[str, Any] = {"op": "done", "job": self.job_id, "epoch": plan.epoch, "stage": s, "replica": r,
                               "step": steps, "final_loss": self.final_losses.get(r),
                               "losses": [self.losses.get(i) for i in range(steps)] if self.losses else []}
        if r == 0:
            h = await self._store_state(plan, s, worker.export_state(copy=False))
            msg["checkpoint"] = h
            self._holds(steps, (plan.stages[s].start, plan.stages[s].end), h, self.me)
            await self.shadows.replicate(plan, s, h, steps)
        self.to(JobState.DONE, f"stage {s} replica {r} finished {steps} steps")
        lead = leader_of(plan.peers, self._alive) or self.me
        for target in dict.fromkeys([lead, self.publisher]):
            try:
                if target == self.me:
                    self.on_done(self.me, msg)
                else:
                    await job_proto.request(self.transport, target, msg, timeout=self.svc.config.report_timeout)
            except (PeerUnavailable, RemoteProtocolError) as exc:
                log.info("done report of %s to %s: %s", self.job_id, target[:12], exc)
        if lead == self.me:
            await self._conclude(plan)

    async def _conclude(self, plan: Plan) -> None:
        """Leader: wait (bounded) for every stage's done report, then publish the final status."""
        want = {(s, r) for s, st in enumerate(plan.stages) for r in range(len(st.replicas))}
        with trio.move_on_after(self.svc.config.conclude_timeout):
            while not want <= set(self._done_from):
                await self._woken()
        files, finals = [], []
        for (s, r), msg in sorted(self._done_from.items()):
            h = msg.get("checkpoint")
            if r == 0 and isinstance(h, str):
                units = (plan.stages[s].start, plan.stages[s].end)
                holders = self.checkpoints.get(self.spec.config.steps, {}).get(units, (h, [plan.stages[s].replicas[0]]))[1]
                files.append(StageFile(stage=s, hash=h, holders=tuple(holders)))
            fl = msg.get("final_loss")
            if s == len(plan.stages) - 1 and isinstance(fl, float):
                finals.append(fl)
        ok = len(files) == len(plan.stages)
        status = self._status(JobState.DONE if ok else JobState.FAILED, plan,
                              final=tuple(files), final_loss=sum(finals) / len(finals) if finals else None,
                              reason="" if ok else "the final stage files were not all reported")
        report = {"op": "report", "job": self.job_id, "state": status.state, "reason": status.reason,
                  "final_loss": status.final_loss, "files": [[f.stage, f.hash, list(f.holders)] for f in files],
                  "step": self.spec.config.steps, "epoch": plan.epoch}
        async with trio.open_nursery() as nursery:   # the DHT put (seconds under load) does not hold up the report
            nursery.start_soon(self._put_status, status)
            try:
                await job_proto.request(self.transport, self.publisher, report, timeout=self.svc.config.report_timeout)
            except (PeerUnavailable, RemoteProtocolError) as exc:
                log.info("final report of %s to its publisher: %s (it can read the status record)", self.job_id, exc)
        standbys = sorted((self.members or frozenset()) - set(plan.peers) - {self.me})
        await self._ask_all(standbys, {"op": "end", "job": self.job_id, "state": status.state})

    # ------------------------------------------------------------------ status, gossip, wake-ups
    async def _report_end(self) -> None:
        """A failed or cancelled job: the leader (or anyone, when no plan was made) tells the publisher."""
        plan = self.plan
        if plan is not None:
            if leader_of(plan.peers, self._alive, standbys=self.members or ()) != self.me:
                return
            await self._put_status(self._status(self.life.state, plan, reason=self.reason))
        msg = {"op": "report", "job": self.job_id, "state": self.life.state.value, "reason": self.reason}
        try:
            await job_proto.request(self.transport, self.publisher, msg, timeout=self.svc.config.report_timeout)
        except (PeerUnavailable, RemoteProtocolError) as exc:
            log.info("report of %s to its publisher: %s", self.job_id, exc)

    async def _listen(self) -> None:
        ch = self.svc.subscribe_job(self.job_id)
        async for sender, ev in ch:
            self.on_event(sender, ev)

    async def _gossip(self, ev: ProgressEvent) -> None:
        try:
            with trio.move_on_after(5):
                await self.transport.publish(TOPIC_JOBS, encode_event(ev))
        except FusionError as exc:
            log.debug("progress not published: %s", exc)

    # ------------------------------------------------------------------ election
    async def _elect(self, snap: Snapshot, mine: Plan) -> Plan:
        """The plan adopted by the members' gossip election (``jobs/election.py``), or PlanError."""
        deadline = trio.current_time() + self.svc.config.election_timeout
        rounds = 0
        async with open_elector(self.transport, ElectionConfig(timeout_s=min(10.0, self.svc.config.election_timeout))) as el:
            while True:
                rounds += 1
                outcome = await el.elect(snap, mine)
                if isinstance(outcome.decision, Adopted) and outcome.plan is not None:
                    return outcome.plan
                rec = await fetch_adopted(self.transport, snap)   # checked against our snapshot and its members
                if rec is not None and rec[0] == snap.epoch and rec[1].snapshot_hash == snap.snapshot_hash():
                    log.info("job %s: plan %s adopted from the DHT record", snap.job, rec[1].plan_hash()[:12])
                    return rec[1]
                if trio.current_time() >= deadline:
                    raise PlanError(f"no plan adopted for job {snap.job} epoch {snap.epoch} after {rounds} rounds: "
                                    f"{outcome.decision}")


__all__ = ["JobRun", "StartRequest", "describe"]

