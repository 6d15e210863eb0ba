"""The publisher's side of a job (used by ``Swarm.connect`` and ``Swarm.local``).

Theory of operation. A :class:`JobDriver` takes one built, signed job through its lifecycle:

1. *Discover*: ask a bootstrap for its view (``swarm.fetch_view``: every record verified) and take the
   live training members with their signed device profiles and bandwidth reports, and those whose record
   has no profile yet (``SwarmView.unmeasured``: a node measures it only when its deferred start-up runs,
   ``swarm/startup.py``, up to ``--defer-startup`` 15 s after it joined).
2. *Offer*: keep the blobs (DAG, weights, data shards) in our content store, announce the spec in the
   DHT (so that the job can be followed from elsewhere), dial the candidates (every member, or in a
   large swarm the ``DriverConfig.candidates`` best by capacity and links: ``jobs/candidates.py``) and
   send each the signed envelope (``job_proto``); each member verifies, fetches the blobs from us by hash, checks that it
   fits and answers. None accepting ends the job FAILED with their reasons. A member without a profile yet
   is offered the job too: the offer starts its start-up (``Startup.early_job``), it answers once its
   device benchmark ran, and its accept carries the profile it measured (``profile``, from the node itself
   over its own authenticated stream), which the plan then uses, with the links read again from the view
   after the offers (its probes ran on meanwhile). A job submitted just after the nodes started ran on
   whichever had measured already (one node of five). ``offer_timeout`` bounds the wait; a node whose
   start-up does not serve within its ``on_demand_timeout`` (120 s) answers no and is left out.
3. *Start*: propose the snapshot of the accepting members (profiles, measured links, estimates elsewhere; the
   estimated pairs a layout hinges on measured first: ``jobs/verify_links.py``) as epoch 0.
   Every member plans from it and the members elect the plan over gossip. From then on the job
   belongs to its members: they re-plan among themselves when members die, leave or join
   (``jobs/run.py``), and we only follow.
4. *Follow*: plans (:class:`PlanChanged`, believed from members we already know), progress (the loss
   stage's replicas each report a step; one aggregated :class:`StepProgress` per step) and
   checkpoints arrive on the jobs gossip topic; the leader's final ``report`` (and each stage's
   ``done``) over JOB streams; the job's signed status record in the DHT is read every
   ``status_poll`` seconds, so a lost report or a publisher that was away never loses the end.
   No news for ``idle_timeout`` seconds fails the job, and so does a swarm's view with none of its members
   alive for ``gone_after`` seconds, unless one answers directly or its last step is done (``jobs/gone.py``).
5. *Collect*: fetch each stage's final state file by content hash from the nodes that hold it and lay
   it out under ``ckpt_root`` so ``checkpoint.assemble`` builds the whole model.

:meth:`JobDriver.attach` follows a job submitted earlier (by this key, from any machine): it starts
at step 4 from the status record.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from fusionp2p.data.file_shards import FileRange
from fusionp2p.errors import ConfigError, FusionError, JobError, PeerUnavailable, RemoteProtocolError
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs import reputation
from fusionp2p.jobs.build import BuiltJob
from fusionp2p.jobs.candidates import accepted_profile, choose_candidates
from fusionp2p.jobs.checkpoint import decode_state, save_stage, stage_path
from fusionp2p.jobs.content import ContentService
from fusionp2p.jobs.election import fetch_latest, fetch_latest_record
from fusionp2p.jobs.events import (
    AveragingOutlier,
    CheckerStruck,
    CheckpointSaved,
    EvalProgress,
    JobStateChanged,
    LinksUp,
    MembersChanged,
    PlanChanged,
    ProgressEvent,
    StageConvicted,
    StepProgress,
    decode_event,
)
from fusionp2p.jobs.gone import GoneCheck
from fusionp2p.jobs.lifecycle import JobLifecycle, JobState
from fusionp2p.jobs.progress import ProgressBook
from fusionp2p.jobs.rebalance import calibrated
from fusionp2p.jobs.records import register_rankers
from fusionp2p.jobs.replan import Resume
from fusionp2p.jobs.reputation import RECEIPT_TIMEOUT
from fusionp2p.jobs.spec import JobSpec, decode_signed
from fusionp2p.jobs.verify_links import BandwidthTable, first_plan, judged_view
from fusionp2p.net.addrs import GLOBAL, LOOPBACK, PRIVATE, peer_dial_addrs
from fusionp2p.net.identity import verify
from fusionp2p.net.transport import Transport
from fusionp2p.plan import Link
from fusionp2p.swarm.node import fetch_view
from fusionp2p.types import DeviceProfile, short_peer
from fusionp2p.wire.jobrecords import (
    MAX_INDEX,
    JobIndex,
    JobStatus,
    StageFile,
    decode_record,
    encode_record,
    index_key,
    spec_key,
    status_key,
)
from fusionp2p.wire.protocols import JOB, TOPIC_JOBS
from fusionp2p.wire.records import NodeRecord

log = logging.getLogger(__name__)

Emit = Callable[[ProgressEvent], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class DriverConfig:
    """Deadlines of the publisher's side (seconds)."""

    view_timeout: float = 15.0
    offer_timeout: float = 600.0     # a member verifies and fetches everything within this
    start_timeout: float = 30.0
    idle_timeout: float = 600.0      # longest silence (no progress, no report) while running
    # none of the job's members alive in the swarm's view (read every view_poll s) this long, and no news from
    # them meanwhile: the job cannot finish, and ends FAILED at once instead of after idle_timeout's silence
    gone_after: float = 45.0
    view_poll: float = 15.0
    # ... unless a member answers directly or the job's last step is done: then its final record is awaited this
    # long (a leader waits up to conclude_timeout, 120 s, for every stage's done report first; jobs/gone.py)
    final_wait: float = 150.0
    fetch_timeout: float = 300.0     # downloading one stage checkpoint
    status_poll: float = 5.0         # read the job's status record this often while following
    done_grace: float = 10.0         # every stage said done: wait this long for the leader's report
    max_checkpoint: int = 4 << 30
    # members the job is offered to at most, chosen by capacity and links (jobs/candidates.py): a big swarm's
    # members do not all verify and fetch it, and the planner and the election see these only
    candidates: int = 64

    def __post_init__(self) -> None:
        if self.candidates < 1:
            raise ConfigError("DriverConfig.candidates must be at least 1")
        for name in ("view_timeout", "offer_timeout", "start_timeout", "idle_timeout", "fetch_timeout",
                     "status_poll", "done_grace", "gone_after", "view_poll", "final_wait"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"DriverConfig.{name} must be positive")


@dataclass(frozen=True, slots=True, kw_only=True)
class SwarmView:
    """Live training members (with profiles, their records and dialable addresses) and the measured links."""

    members: dict[str, DeviceProfile]
    addrs: dict[str, tuple[str, ...]]
    links: list[tuple[str, str, Link]]
    records: dict[str, NodeRecord] = field(default_factory=dict)   # the members' records (their speeds)
    # live training members whose record has no profile yet (their start-up has not measured it: offered the
    # job all the same; the accept carries the profile); their records and addresses are in the fields above
    unmeasured: tuple[str, ...] = ()
    table: BandwidthTable | None = None   # the reports of the view, judged: the estimates of unmeasured pairs


async def discover(t: Transport, bootstraps: list[str], *, timeout: float) -> SwarmView:
    """The swarm's training members from the first bootstrap that answers (records verified), asking them
    in turn again until *timeout*: one failed stream (seen under load: a multiselect handshake whose read
    failed) used to fail the whole job."""
    last: Exception | None = None
    deadline = trio.current_time() + timeout
    delay = 0.2
    view: dict[str, Any] | None = None
    while view is None and bootstraps:
        for peer in bootstraps:
            left = deadline - trio.current_time()
            if left <= 0:
                break
            try:
                view = await fetch_view(t, peer, timeout=left)
                break
            except (PeerUnavailable, RemoteProtocolError, trio.TooSlowError) as exc:
                last = exc
        left = deadline - trio.current_time()
        if view is not None or left <= 0:
            break
        await trio.sleep(min(delay, left))     # retry backoff, bounded by the deadline
        delay = min(2.0, delay * 2)
    if view is None:
        raise PeerUnavailable(bootstraps[0] if bootstraps else "bootstrap", f"no view ({last})")
    alive = set(view["alive"])
    members: dict[str, DeviceProfile] = {}
    records: dict[str, NodeRecord] = {}
    addrs: dict[str, tuple[str, ...]] = {}
    unmeasured: list[str] = []
    for rec in view["records"]:
        if isinstance(rec, NodeRecord) and rec.role == "node" and rec.peer in alive and not rec.leaving:
            if rec.profile:
                members[rec.peer] = rec.profile
            else:
                unmeasured.append(rec.peer)
            records[rec.peer] = rec
            addrs[rec.peer] = rec.addrs
    links, table = judged_view(view)   # a node the bootstrap distrusts: planned from others' measurements of it
    return SwarmView(members=members, addrs=addrs, links=links, records=records, table=table,
                     unmeasured=tuple(sorted(set(unmeasured) - set(members))))


class JobDriver:
    """Drives one job from the publisher (see the module docstring). ``emit`` runs in this trio thread."""

    def __init__(self, t: Transport, content: ContentService, bootstraps: list[str], built: BuiltJob | None,
                 emit: Emit, ckpt_root: Path, config: DriverConfig | None = None, *, job: str = "",
                 steps: int = 0) -> None:
        self.transport = t
        self.content = content
        self.bootstraps = bootstraps
        self.built = built
        self.job = built.spec.job_id if built is not None else job
        self.steps = built.spec.config.steps if built is not None else steps
        self._emit = emit
        self.ckpt_root = ckpt_root
        self.config = config or DriverConfig()
        self.planning = trio.CapacityLimiter(1)   # plans made in a thread, one at a time (jobs/plan_thread.py)
        self.members: set[str] = set()        # every peer we know to have been a member (reports accepted)
        self.current: tuple[str, ...] = ()    # the members of the newest plan we heard of
        self._stages = 0                      # the stages of that plan (0: none heard of)
        self.epoch = -1
        self._behind = -1                     # the newest epoch heard of (its steps) whose plan has not come
        self._next_pull = 0.0                 # when the plan record may be read again (_pull_plan)
        self._pull_every = 1.0                # seconds between reads of it, doubled up to status_poll
        self.book = ProgressBook(job=self.job, steps=self.steps)
        self._inbox_send, self._inbox = trio.open_memory_channel[tuple[str, Any]](math.inf)
        self._ckpts: set[tuple[int, int]] = set()
        self._evals: set[int] = set()         # steps whose held-out loss was shown
        self._done: dict[tuple[int, int], dict[str, Any]] = {}
        self._next_view = trio.current_time() + self.config.view_poll   # when to look for live members (_gone)
        self.gone = GoneCheck(t, self.job, gone_after=self.config.gone_after, final_wait=self.config.final_wait,
                              discover=self._live_nodes, read_status=self.read_status)
        self.life = JobLifecycle(self.job, now=trio.current_time())

    # -- fed by the swarm client ----------------------------------------------------------------------
    def on_progress(self, sender: str, ev: ProgressEvent) -> None:
        self._inbox_send.send_nowait(("progress", (sender, ev)))

    def on_report(self, peer: str, msg: dict[str, Any]) -> None:
        self._inbox_send.send_nowait(("report", (peer, msg)))

    # -- lifecycle ------------------------------------------------------------------------------------
    def _state(self, s: JobState, reason: str = "") -> None:
        if s is self.life.state and s is not JobState.PLANNED:
            return
        self.life.to(s, now=trio.current_time(), reason=reason)
        self._emit(JobStateChanged(job=self.job, state=s.value, reason=reason, at=time.time()))

    async def run(self) -> None:
        """Run the job to a terminal state (emitted). Cancellation sends ``cancel`` to every member."""
        await self._guard(self._drive)

    async def attach(self) -> None:
        """Follow a job started earlier (from its status record) to its end."""
        await self._guard(self._attach)

    async def _guard(self, body: Callable[[], Awaitable[None]]) -> None:
        try:
            await body()
        except trio.Cancelled:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + 15):
                await self._cancel_members()
            raise
        except (FusionError, ValueError, trio.TooSlowError) as exc:
            log.warning("job %s failed: %s", self.job, exc)
            await self._cancel_members()
            if not self.life.terminal:
                self._state(JobState.FAILED, f"{type(exc).__name__}: {exc}")

    async def _drive(self) -> None:
        built = self.built
        assert built is not None
        cfg = self.config
        view = await discover(self.transport, self.bootstraps, timeout=cfg.view_timeout)
        if not view.members and not view.unmeasured:
            raise JobError("the swarm has no live training nodes")
        for h, blob in built.blobs.items():   # weight pieces as views of the module, token shards as ranges of
            if isinstance(blob, FileRange):    # the file: served, not copied
                self.content.store.put_range(h, blob)
            else:
                self.content.store.put_view(h, blob) if isinstance(blob, memoryview) else self.content.store.put(blob)
        accepted: dict[str, DeviceProfile] = {}
        refused: dict[str, str] = {}

        async def offer(peer: str) -> None:
            try:
                if peer not in self.transport.connected_peers():
                    # a member's claim: a few TCP addresses at IPs, never link-local or reserved (net/addrs.py)
                    for a in peer_dial_addrs(view.addrs.get(peer, ()), (GLOBAL, PRIVATE, LOOPBACK)):
                        try:
                            await self.transport.connect(f"{a}/p2p/{peer}")
                            break
                        except (PeerUnavailable, FusionError) as exc:
                            log.debug("dial %s at %s: %s", short_peer(peer), a, exc)
                # an open swarm's admission: the work the node did for publishers we trust (TrainConfig.min_work);
                # a node without a profile answers it once its start-up ran (the question starts it)
                why = await reputation.admitted(self.transport, peer, built.spec, timeout=cfg.start_timeout
                                                if peer in view.members else cfg.offer_timeout)
                if why:
                    refused[peer] = why
                    return
                reply = await job_proto.request(self.transport, peer, {"op": "offer", "envelope": built.envelope},
                                                timeout=cfg.offer_timeout)
                if reply["ok"]:
                    accepted[peer] = accepted_profile(reply, view.members.get(peer))
                else:
                    refused[peer] = str(reply.get("error", "refused"))[:500]
            except (PeerUnavailable, RemoteProtocolError) as exc:
                refused[peer] = str(exc)

        allow = set(built.spec.config.allow_members)   # a private swarm's allow-list (empty: every node)
        pool: dict[str, DeviceProfile | None] = {p: view.members.get(p) for p in (*view.members, *view.unmeasured)
                                                 if not allow or p in allow}
        async with trio.open_nursery() as nursery:
            for peer in choose_candidates(pool, view.links, cfg.candidates):
                nursery.start_soon(offer, peer)
        for peer, why in sorted(refused.items()):
            log.warning("node %s refused job %s: %s", short_peer(peer), self.job, why)
        if not accepted:
            why = "; ".join(sorted(set(refused.values()))) or (f"none of the {len(allow)} nodes of TrainConfig."
                                                              "allow_members is live in the swarm" if allow else "")
            raise JobError(f"no node accepted the job ({why})")
        self.members = set(accepted)
        if set(accepted) & set(view.unmeasured):
            # members that had not run their start-up (swarm/startup.py: it waits for their first probe round)
            # probed on while it ran and we waited: the links measured since, from a second read of the view
            try:
                fresh = await discover(self.transport, self.bootstraps, timeout=cfg.view_timeout)
                view = dataclasses.replace(view, links=fresh.links, table=fresh.table)
            except PeerUnavailable as exc:
                log.info("job %s: planned with the links read before the offers (%s)", self.job, exc)
        # the profiles scaled by the speeds the nodes trained at in earlier jobs of this model (jobs/rebalance.py)
        speeds = {p: r.speed_on(built.spec.model_hash) for p, r in view.records.items()}
        # on measured links, estimates elsewhere; estimated pairs that decide the layout measured first
        snap, plan = await first_plan(self.transport, built, calibrated(accepted, speeds).items(), view.links, view.table,
                                      self.planning)
        self._state(JobState.PLANNED, plan.plan_hash())
        self._on_plan(PlanChanged.of(plan, at=time.time(), accepted=accepted, replicas_hint=built.spec.config.replicas))
        # the plan's hash goes with it: a member that computed the same plan from the snapshot adopts it at
        # once (jobs/lead.py ``_fast_adopt``) instead of waiting on a gossip election, which spread the
        # members' adoptions over 0.7-3.4 s on an idle machine and 2-10 s under load (issue 40)
        start = {"op": "start", "job": self.job, "snapshot": snap.to_wire(),
                 "resume": Resume(step=0, sources=()).to_wire(), "plan": plan.plan_hash()}
        failures: list[str] = []

        async def start_one(peer: str) -> None:
            try:
                reply = await job_proto.request(self.transport, peer, start, timeout=cfg.start_timeout)
                if not reply["ok"]:
                    failures.append(f"{short_peer(peer)}: {reply.get('error')}")
            except (PeerUnavailable, RemoteProtocolError) as exc:
                failures.append(f"{short_peer(peer)}: {exc}")

        async with trio.open_nursery() as nursery:
            for peer in sorted(accepted):
                nursery.start_soon(start_one, peer)
        if len(failures) == len(accepted):
            raise JobError(f"members refused to start: {'; '.join(failures)}")
        if failures:
            log.warning("job %s: some members did not start: %s", self.job, "; ".join(failures))
        self._state(JobState.RUNNING)
        # the spec and index records are for following the job from elsewhere (no member reads them: the offer
        # carries the spec), so they are stored once the members run, not before the offers: each is a DHT walk
        # and the index a read before its write, seconds on the demo's critical path (issue 40). Progress that
        # comes meanwhile waits in the inbox.
        with trio.move_on_after(cfg.start_timeout):
            await self.transport.dht_put(spec_key(self.job), built.envelope)
            await add_to_index(self.transport, self.job, built.spec.name, built.spec.created)
        await self._follow()

    async def _attach(self) -> None:
        st = await self.read_status()
        with trio.move_on_after(self.config.view_timeout):
            while st is None:   # a job that just started: its leader writes the record within seconds
                await trio.sleep(self.config.status_poll)
                st = await self.read_status()
        if st is None:
            raise JobError(f"job {self.job}: no status record in the swarm (unknown job, or never started)")
        # the job's standbys too (one leads it on when the plan's members die; only a known member is believed):
        # the status names them. From an older leader, the epoch's plan record, if a voter is a member we know (often
        # not: its votes are the first quorum its writer got). A DHT walk: view_timeout, not status_poll (1 s in
        # tests: on a starved loop the read timed out, the standbys stayed unknown until idle_timeout)
        self.members = {*st.members, *st.standbys}
        self.current = st.members
        self.epoch = st.epoch
        with trio.move_on_after(self.config.view_timeout):
            rec = await fetch_latest_record(self.transport, self.job, known=self.members)
            if rec is None:   # the latest is a later epoch, voted by the standbys alone: the status's epoch's record
                rec = await fetch_latest_record(self.transport, self.job, known=self.members, epoch=st.epoch)
            if rec is not None:
                self.members |= set(rec[2])
        self.steps = self.steps or st.steps
        self.book.steps = self.steps
        for step, loss in st.losses:
            self._emit(StepProgress(job=self.job, step=step, epoch=st.epoch, loss=loss, at=st.at))
            self.book.history[step] = loss
        self._state(JobState.PLANNED, "attached")
        if st.terminal:
            if st.state == JobState.DONE.value:   # it ran before we attached (planned -> done is no transition)
                self._state(JobState.RUNNING, "attached")
            await self._end(st)
            return
        self._state(JobState.RUNNING)
        await self._follow()

    async def read_status(self) -> JobStatus | None:
        """The job's status record, if one that verifies is stored."""
        data = await self.transport.dht_get(status_key(self.job))
        if data is None:
            return None
        try:
            rec = decode_record(data, verify)
        except RemoteProtocolError as exc:
            log.info("status record of %s ignored: %s", self.job, exc)
            return None
        if not isinstance(rec, JobStatus) or rec.job != self.job or rec.peer not in rec.members:
            return None
        if rec.peer not in self.members:
            # a signer we have not seen in the job: believe it only if the adopted plan (a quorum of the
            # members' signed votes, jobs/election.py) names it
            adopted = await fetch_latest(self.transport, self.job, known=self.members)   # voted by one we know
            if adopted is None or rec.peer not in adopted[1].peers:
                log.info("status record of %s signed by %s, who is no member of its plan: ignored",
                         self.job, short_peer(rec.peer))
                return None
        self.members |= set(rec.standbys)   # vouched for by a signer we believe (see _attach)
        return rec

    async def _follow(self) -> None:
        cfg = self.config
        last_news = trio.current_time()
        next_poll = trio.current_time() + cfg.status_poll
        done_since: float | None = None
        record_step = -1   # the status record's step when it last moved on
        while True:
            if self._behind > self.epoch and trio.current_time() >= self._next_pull:
                await self._pull_plan()
            now = trio.current_time()
            wait = max(0.0, min(next_poll, done_since + cfg.done_grace if done_since is not None else math.inf,
                                self._next_pull if self._behind > self.epoch else math.inf) - now)
            with trio.move_on_after(wait):
                kind, item = await self._inbox.receive()
                last_news = trio.current_time()
                if kind == "progress":
                    self._on_progress(*item)
                else:
                    st = self._on_report(*item)
                    if st is not None:
                        await self._end(st)
                        return
                    if done_since is None and self._all_done():
                        done_since = trio.current_time()
                continue
            now = trio.current_time()
            if done_since is not None and now >= done_since + cfg.done_grace:
                await self._end(self._status_from_dones())
                return
            if now < next_poll:
                continue   # woken to read the plan record (above)
            next_poll = now + cfg.status_poll
            st = await self.read_status()
            if st is not None and st.terminal:
                await self._end(st)
                return
            if st is not None and st.step > max(self.book.reached, record_step):
                last_news = now   # the record's step moved on (one it had all along is no news: no gossip came)
                record_step = st.step
            if st is not None and st.epoch > self.epoch:
                self._heard_of(st.epoch)
            if now - last_news > cfg.idle_timeout:
                raise JobError(f"no progress from the swarm for {cfg.idle_timeout:.0f} s")
            if now >= self._next_view:
                self._next_view = now + cfg.view_poll
                st = await self.gone.check(now, known=self.members | set(self.current), current=self.current,
                                           last_news=last_news, reached=self.book.reached, steps=self.steps)
                if st is not None:
                    await self._end(st)
                    return

    async def _live_nodes(self) -> set[str]:
        """The live training nodes of the swarm's view (the gone check's, jobs/gone.py); PeerUnavailable: no view."""
        view = await discover(self.transport, self.bootstraps, timeout=self.config.view_timeout)
        return {*view.members, *view.unmeasured}

    def _on_report(self, peer: str, msg: dict[str, Any]) -> JobStatus | None:
        if peer not in self.members:
            return None
        if msg.get("op") == "done":
            try:
                key = (job_proto.int_field(msg, "stage", "done"), job_proto.int_field(msg, "replica", "done"))
            except RemoteProtocolError:
                return None
            self._done[key] = msg
            vals = msg.get("losses")
            if isinstance(vals, list) and len(vals) <= self.steps:
                per_step = {i: [float(v)] for i, v in enumerate(vals) if isinstance(v, int | float) and not isinstance(v, bool)}
                for ev in self.book.fill(per_step, now=time.time()):
                    self._emit(ev)
            return None
        state = msg.get("state")
        if state not in ("done", "failed", "cancelled"):
            return None
        ep = msg.get("epoch")   # the leader's last epoch (a report of an older node has none)
        if isinstance(ep, int) and not isinstance(ep, bool) and ep > self.epoch:
            self._heard_of(ep)
        raw = msg.get("files")
        files = [StageFile(stage=f[0], hash=f[1], holders=tuple(h for h in f[2] if isinstance(h, str)))
                 for f in (raw if isinstance(raw, list) else [])
                 if isinstance(f, list) and len(f) == 3 and isinstance(f[0], int) and isinstance(f[1], str)
                 and isinstance(f[2], list)]
        fl = msg.get("final_loss")
        return JobStatus(job=self.job, peer=peer, publisher="", state=str(state), epoch=self.epoch,
                         step=self.steps if state == "done" else self.book.reached, steps=self.steps,
                         members=self.current, final=tuple(files),
                         final_loss=float(fl) if isinstance(fl, int | float) and not isinstance(fl, bool) else None,
                         reason=str(msg.get("reason", ""))[:2000])

    def _all_done(self) -> bool:
        stages = {s for s, _ in self._done}
        if self._stages and stages != set(range(self._stages)):
            return False   # the first stages said done, a later one not yet (the plan says how many there are)
        return bool(stages) and all((s, 0) in self._done and isinstance(self._done[(s, 0)].get("checkpoint"), str)
                                    for s in range(max(stages) + 1)) and len(stages) == max(stages) + 1

    def _status_from_dones(self) -> JobStatus:
        """Every stage said done but no final report came (its leader died at the end)."""
        last = max(s for s, _ in self._done)
        files = tuple(StageFile(stage=s, hash=str(self._done[(s, 0)]["checkpoint"]), holders=(peer,))
                      for s in range(last + 1) for peer in [self._sender_of(s)])
        finals = [m["final_loss"] for (s, _), m in self._done.items() if s == last and isinstance(m.get("final_loss"), float)]
        return JobStatus(job=self.job, peer="", publisher="", state="done", epoch=self.epoch, step=self.steps,
                         steps=self.steps, final=files, final_loss=sum(finals) / len(finals) if finals else None)

    def _sender_of(self, stage: int) -> str:
        return str(self._done[(stage, 0)].get("_peer", ""))

    async def _end(self, st: JobStatus) -> None:
        # the last epoch's plan first, if it never came (that epoch may have ended within a second of its first
        # step, or its steps be in flight behind the report): its record is stored once its members voted
        with trio.move_on_after(self.config.status_poll):
            while self._behind > self.epoch:
                await self._pull_plan()
                if self._behind > self.epoch:
                    await trio.sleep(0.5)   # a bounded wait for the members' votes to be stored
        for ev in self.book.flush(now=time.time()):
            self._emit(ev)
        if st.state != "done":
            raise JobError(f"job {st.state}: {st.reason}")
        if not st.final:
            raise JobError("the job ended without its final stage files")
        for f in st.final:
            await self._fetch_stage(f.holders, f.hash, f.stage, self.steps)
        if st.final_loss is not None:
            # the final weights' held-out loss, averaged over the pipelines (peer "": the job's, no one node's);
            # an EvalProgress, not a StepProgress of a step past the last
            self._emit(EvalProgress(job=self.job, step=self.steps, epoch=st.epoch, loss=st.final_loss, at=time.time()))
        self._state(JobState.DONE)
        if self.built is not None:   # the members' signed work receipts (jobs/reputation.py)
            with trio.move_on_after(RECEIPT_TIMEOUT):
                await reputation.pay(self.transport, self.built.spec, st.members, timeout=RECEIPT_TIMEOUT)

    async def _fetch_stage(self, holders: tuple[str, ...], h: str, stage: int, step: int) -> None:
        with trio.fail_after(self.config.fetch_timeout):
            try:
                if not holders:
                    raise PeerUnavailable(f"holders of {h[:16]}…", "none named")
                blob = await self.content.fetch(h, max_size=self.config.max_checkpoint, peers=list(holders))
            except PeerUnavailable as exc:
                # its named holders are gone (a member died after the report): the DHT's providers and the
                # job's other members (a keeper's copy, a replica that fetched it) in turn
                log.info("job %s: stage %d's file from its holders: %s; asking its providers", self.job, stage, exc)
                blob = await self.content.fetch(h, max_size=self.config.max_checkpoint,
                                                holders=[p for p in self.current if p not in holders])
        meta, st = decode_state(blob, job=self.job)
        if meta.stage != stage:
            raise JobError(f"the final file of stage {stage} holds stage {meta.stage}")
        path = stage_path(self.ckpt_root, self.job, step, stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        m = dataclasses.replace(meta, step=step)
        await trio.to_thread.run_sync(lambda: save_stage(self.ckpt_root, m, dict(st.tensors)))

    # -- progress ---------------------------------------------------------------------------------------
    def _on_progress(self, sender: str, ev: ProgressEvent) -> None:
        if isinstance(ev, PlanChanged):
            if sender in self.members and ev.epoch > self.epoch:
                self._on_plan(ev)
            elif ev.epoch > self.epoch:   # from a member we never heard of: read the plan record instead
                self._heard_of(ev.epoch)
            return
        if isinstance(ev, MembersChanged):
            if sender in self.members:   # a member's leader vouches for the joiners it took in
                self.members |= set(ev.joined)
            return
        if isinstance(ev, StepProgress) and ev.epoch > self.epoch:
            self._heard_of(ev.epoch)   # an epoch whose plan event has not come (yet)
        if isinstance(ev, LinksUp | AveragingOutlier | StageConvicted | CheckerStruck):
            if ev.peer == sender and sender in self.members:
                self._emit(ev)
            return
        if isinstance(ev, CheckpointSaved):
            if ev.stage >= 0 and (ev.step, ev.stage) not in self._ckpts and ev.peer == sender and sender in self.members:
                self._ckpts.add((ev.step, ev.stage))
                self._emit(ev)
            return
        if isinstance(ev, StepProgress):
            for out in self.book.add(sender, ev, now=time.time()):
                self._emit(out)
        if isinstance(ev, EvalProgress) and ev.peer == sender and sender in self.members and ev.step not in self._evals:
            self._evals.add(ev.step)     # every pipeline evaluates the same held-out batch: the first says it
            self._emit(ev)

    def _on_plan(self, ev: PlanChanged) -> None:
        sizes = ev.stage_sizes
        if self.epoch >= 0:
            self._state(JobState.PLANNED, f"re-plan: epoch {ev.epoch}")
        self.epoch = ev.epoch
        self.current = ev.members
        self._stages = len(sizes)
        self.members |= {*ev.members, *ev.idle}   # its standbys too: one may announce a later plan
        self.book.set_plan(ev.epoch, len(sizes) - 1, ev.members[sum(sizes[:-1]):])
        self._emit(ev)
        if self.life.state is JobState.PLANNED and ev.epoch > 0:
            self._state(JobState.RUNNING)

    def _heard_of(self, epoch: int) -> None:
        """Steps (or a status record) of *epoch*, newer than the plan we know: its plan event normally follows
        within moments; the plan record is read if it has not come a second later."""
        if self._behind <= self.epoch:
            self._pull_every = 1.0
            self._next_pull = max(self._next_pull, trio.current_time() + 1.0)
        self._behind = max(self._behind, epoch)

    async def _pull_plan(self) -> None:
        """Steps of an epoch whose plan event has not come (its announcer died, the gossip dropped it, or a
        member we never heard of sent it): take the plan from the job's latest plan record, elected by
        members' signed votes, one of them a member we know (``election.fetch_latest``). A second after the
        first such step, then every 2, 4 ... up to ``status_poll`` seconds until it is there, each read within
        ``status_poll``."""
        self._next_pull = trio.current_time() + self._pull_every
        self._pull_every = min(2 * self._pull_every, self.config.status_poll)
        with trio.move_on_after(self.config.status_poll):
            rec = await fetch_latest_record(self.transport, self.job, known=self.members)
            if rec is not None:
                self.members |= set(rec[2])   # its standbys too (see _attach)
            if rec is not None and rec[0] > self.epoch:
                log.info("job %s: plan of epoch %d read from its plan record (its announcement did not come)",
                         self.job, rec[0])
                self._on_plan(PlanChanged.of(rec[1], at=time.time()))

    async def _cancel_members(self) -> None:
        async def one(peer: str) -> None:
            try:
                await job_proto.request(self.transport, peer, {"op": "cancel", "job": self.job}, timeout=10)
            except (PeerUnavailable, RemoteProtocolError) as exc:
                log.info("cancel of %s on %s: %s", self.job, short_peer(peer), exc)

        async with trio.open_nursery() as nursery:
            for peer in sorted(self.members):
                nursery.start_soon(one, peer)


async def read_index(t: Transport, publisher: str) -> list[tuple[str, str, float]]:
    """The jobs *publisher* submitted, from its signed index record (oldest first; [] if none)."""
    data = await t.dht_get(index_key(publisher))
    if data is None:
        return []
    try:
        rec = decode_record(data, verify)
    except RemoteProtocolError as exc:
        log.info("job index of %s ignored: %s", short_peer(publisher), exc)
        return []
    if not isinstance(rec, JobIndex) or rec.peer != publisher:
        return []
    return list(rec.jobs)


async def add_to_index(t: Transport, job: str, name: str, created: float) -> None:
    """Add *job* to our signed job index (keeps the newest ``MAX_INDEX``)."""
    jobs = [j for j in await read_index(t, t.peer_id) if j[0] != job]
    jobs.append((job, name[:256], float(created)))
    rec = JobIndex(peer=t.peer_id, jobs=tuple(jobs[-MAX_INDEX:]))
    await t.dht_put(index_key(t.peer_id), encode_record(rec, t.sign))


async def read_spec(t: Transport, job: str) -> tuple[JobSpec, bytes] | None:
    """The publisher-signed spec of *job* from the DHT (signature checked), or None."""
    data = await t.dht_get(spec_key(job))
    if data is None:
        return None
    try:
        spec = decode_signed(data)
    except RemoteProtocolError as exc:
        log.info("spec record of %s ignored: %s", job, exc)
        return None
    return (spec, data) if spec.job_id == job else None


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
        self.planning = trio.CapacityLimiter(1)   # shared by its drivers: one plan at a time

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        register_rankers(self.transport)
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
        if req["op"] not in ("report", "done") or driver is None or peer not in driver.members:
            return {"ok": False, "error": "no such job here"}
        driver.on_report(peer, {**req, "_peer": peer})
        return {"ok": True}

    async def run_job(self, built: BuiltJob, emit: Emit, ckpt_root: Path) -> None:
        """Drive *built* to a terminal state; every state change goes to *emit* (never raises but Cancelled)."""
        driver = JobDriver(self.transport, self.content, self.bootstraps, built, emit, ckpt_root, self.config)
        driver.planning = self.planning
        self.drivers[driver.job] = driver
        try:
            await driver.run()
        finally:
            del self.drivers[driver.job]

    async def attach_job(self, job: str, emit: Emit, ckpt_root: Path, *, steps: int = 0) -> None:
        """Follow *job*, submitted earlier by this key, to its end (and collect the model)."""
        driver = JobDriver(self.transport, self.content, self.bootstraps, None, emit, ckpt_root, self.config,
                           job=job, steps=steps)
        self.drivers[job] = driver
        try:
            await driver.attach()
        finally:
            del self.drivers[job]


__all__ = ["DriverConfig", "JobDriver", "Publisher", "SwarmView", "accepted_profile", "add_to_index", "discover",
           "read_index", "read_spec"]
