"""Leading a job's re-plans: the part of :class:`~fusionp2p.jobs.run.JobRun` that watches the plan.

Theory of operation (docs/jobs.md "Elastic jobs"). The leader of an epoch is the lowest live peer id of
its plan, else of its standbys (``replan.leader_of``). Every node runs :meth:`Leading._watch`; only the
leader acts. It re-plans (halt the members, gather their state hashes, send the next epoch's ``start``)
when a member died or left, when a member says its pipeline broke, or when the epoch it proposed did not
take off; and, with nothing wrong, it offers the job to live nodes outside the plan and takes them in
at a step boundary when the plan with them is predicted ``JOIN_GAIN`` faster. It also refreshes the
job's signed status record. A non-leader whose pipeline broke tells the leader (``op: replan``).

This mixin holds no state of its own: :class:`JobRun` owns every attribute named below and runs the
epochs; the split keeps the epoch's own run (``jobs/run.py``) apart from the leader's decisions.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from fusionp2p.errors import FusionError, PeerUnavailable, PlanError, RemoteProtocolError
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs import reputation
from fusionp2p.jobs.build import AcceptedJob, plan_for_snapshot
from fusionp2p.jobs.candidates import accepted_profile
from fusionp2p.jobs.election import ElectionConfig, open_elector
from fusionp2p.jobs.events import MembersChanged, encode_event
from fusionp2p.jobs.host import JobHost
from fusionp2p.jobs.lifecycle import JobLifecycle, JobState
from fusionp2p.jobs.plan_thread import off_loop, planned
from fusionp2p.jobs.progress import ProgressBook
from fusionp2p.jobs.rebalance import (
    bounded,
    calibrated,
    rebalanced,
    redeals_in_band,
    same_layout,
    scale_profile,
    typical,
)
from fusionp2p.jobs.replan import (
    Halted,
    Resume,
    complete_checkpoint,
    fill_unmeasured,
    halt_step,
    leader_of,
    plan_resume,
    still_taking_off,
)
from fusionp2p.jobs.spec import JobSpec
from fusionp2p.jobs.suspects import Suspects
from fusionp2p.jobs.verified import rollback
from fusionp2p.jobs.verify_links import checked_plan, job_score, member_ask, member_links
from fusionp2p.net.transport import Transport
from fusionp2p.plan import Plan
from fusionp2p.plan.snapshot import Link, Snapshot, snapshot_from_records
from fusionp2p.plan.verify import Pair
from fusionp2p.train.worker import StageWorker
from fusionp2p.types import DeviceProfile, short_peer
from fusionp2p.wire.jobrecords import JobStatus, StageFile, encode_record, status_key
from fusionp2p.wire.protocols import TOPIC_JOBS

log = logging.getLogger(__name__)

OFFER_AGAIN = 2.0           # seconds before a joiner that could not be reached is offered the job again
JOIN_GAIN = 0.10            # joiners are taken in (a re-plan) only to add nodes, predicted this much faster
# a re-plan by the members' measured speeds (_rebalance) only for a predicted gain this large: equal nodes
# measure speeds apart by some noise, and a halt costs seconds
REBALANCE_GAIN = 0.20


@dataclass
class _Epoch:
    """What one epoch of this node left behind."""

    outcome: str = ""              # "done" | "halted" | "idle"
    halted: Halted | None = None
    trained: bool = False          # a step of the epoch completed here (a break after it is not its take-off's)
    reported: bool = False         # a member said its run of this epoch ended (op: replan naming the epoch)
    ended: trio.Event = field(default_factory=trio.Event)


class Leading:
    """The leader's side of a job run (see the module docstring); mixed into :class:`JobRun`."""

    # owned and initialised by JobRun
    svc: JobHost
    transport: Transport
    me: str
    accepted: AcceptedJob
    spec: JobSpec
    job_id: str
    publisher: str
    life: JobLifecycle
    reason: str
    epoch: int
    plan: Plan | None
    suspects: Suspects
    members: frozenset[str] | None
    checkpoints: dict[int, dict[tuple[int, int], tuple[str, list[str]]]]
    book: ProgressBook
    data_history: tuple[tuple[int, int], ...]
    joiners: set[str]
    _joiner_profiles: dict[str, DeviceProfile]
    _offered: dict[str, float]
    _answered: dict[str, float]
    _join_checked: tuple[tuple[int, frozenset[str]], float, float]
    _rebalance_judged: int
    _rebalances: int
    _speeds: dict[str, float]
    _speed_typical: float
    _cur: _Epoch
    _worker: StageWorker | None
    _broken: bool
    _led: int
    _led_at: float
    _led_with: set[str]
    _told: tuple[int, str] | None
    _wake: trio.Event
    _plan_cache: tuple[str, Plan] | None
    _rolled: set[str]
    _tasks: trio.Nursery | None

    # ------------------------------------------------------------------ leading re-plans
    def _alive(self, peer: str) -> bool:
        view = self.svc.swarm.view
        return peer == self.me or (view.is_alive(peer) and peer not in view.left and self.suspects.admits(peer))

    async def _watch(self) -> None:
        """Lead a re-plan when this node leads the plan and it has to change (see the module docstring)."""
        cfg = self.svc.config
        last_status = -math.inf
        while True:
            await self._woken(cfg.watch_interval)
            plan = self.plan
            if plan is None or self.life.terminal or self._cur.outcome == "done":
                continue
            stalled = self._cur.ended.is_set() and self._cur.outcome in ("no plan", "halted", "halted before training")
            if plan.epoch < self.epoch and not stalled:
                continue   # the new epoch's plan is being elected: judge it, not the old one
            lead = self._leader(plan)
            if lead != self.me:
                if self._broken and lead is not None and self._told != (self.epoch, lead):
                    self._told = (self.epoch, lead)     # tell the leader our pipeline broke
                    self.svc.nursery.start_soon(self._ask_all, [lead], {"op": "replan", "job": self.job_id,
                                                                       "epoch": self.epoch})
                continue
            now = trio.current_time()
            if now - last_status >= cfg.status_interval:
                last_status = now
                self.svc.nursery.start_soon(self._put_status, self._status(self.life.state, plan))
            if self._led > self.epoch:
                continue   # our proposal for the next epoch is under way
            gone = sorted(p for p in plan.peers if not self._alive(p))
            if gone and not self._broken and not stalled:
                gone = await self._confirm_gone(gone)
            if gone or self._broken or stalled:
                # a plan that lost members may need newcomers (too few nodes may be left for it): offer the job
                # to live nodes outside it; one that accepts is in the next proposal
                self._offer_joiners(plan)
                fresh = {p for p in self.joiners if self._alive(p)} - self._led_with
                if still_taking_off(proposed=self._led == self.epoch, since=now - self._led_at, retry=cfg.replan_retry,
                                    stalled=stalled, broken=self._broken, fresh=bool(fresh), gone=bool(gone),
                                    trained=self._cur.trained, reported=self._cur.reported):
                    continue   # the epoch we proposed is still taking off
                why = (f"members gone: {[short_peer(p) for p in gone]}" if gone else
                       "pipeline broken" if self._broken else f"epoch {self.epoch} did not take off")
                await self._lead(plan, at=None, why=why)
            elif self.svc.swarm.config.role == "node" and self._replan_may_pay():
                await self._take_in_joiners(plan)
                if self._led <= self.epoch:
                    await self._rebalance(plan)

    def _leader(self, plan: Plan) -> str | None:
        """The leader of *plan* (``replan.leader_of``), passing over a member whose death a direct question
        confirmed (jobs/liveness.py): a dead leader is replaced at once, not after the view's timeout. Two nodes
        that disagree on it both propose; the election keeps one (see the module docstring of replan.py)."""
        return leader_of(plan.peers, lambda p: self._alive(p) and not self.svc.confirmed_dead(p),
                         standbys=self.members or ())

    def _replan_may_pay(self) -> bool:
        """Whether the job has ``replan_min_saving`` seconds left at the rate this leader's epoch trains: a
        planned re-plan saves at most what is left, so a job nearer its end than that neither offers itself to
        standbys nor weighs plans. In benchmarks.wan's 48-step jobs (12 s) the offers, the joiners' fetches
        from the leader and the plans it weighed took the leader's 0.5-core host long enough that it trained
        its micro-batches 20-45% slower than the other replica (and the other replica waited for it at
        every averaging round); a re-plan could not have paid for itself in any of them."""
        w = self._worker
        left = w.seconds_left() if w is not None else None
        return left is not None and left >= self.svc.config.replan_min_saving

    async def _confirm_gone(self, peers: list[str]) -> list[str]:
        """Of the plan's members the membership view calls dead, those that do not answer a direct question.

        A heartbeat is a few hundred bytes of gossip every second or so; a node on a small CPU share that
        is training, or whose gossip relays are, can miss ``dead_timeout`` and be declared dead while its
        pipeline trains on (seen on benchmarks.wan's 0.165-core hosts: a re-plan halted a healthy job at
        step 8 of 10). A re-plan costs seconds of halted training, so the leader first asks the member
        itself (``op: status``, ``confirm_timeout``). A killed node's connection is closed, so the question
        fails at once; a hung one costs ``confirm_timeout`` more. A member that answered is taken as alive
        for ``confirm_ttl`` seconds. One that announced it is leaving is gone without asking.
        """
        cfg = self.svc.config
        now = trio.current_time()
        # a member that announced it leaves, that a spot-check convicted, or whose verdict the leader found false
        # (jobs/verified.py), is gone without asking
        left = {*self.svc.swarm.view.left, *self.suspects.convicted, *self.suspects.struck}
        ask = [p for p in peers if p not in left and p != self.me and now - self._answered.get(p, -math.inf) > cfg.confirm_ttl]
        if ask:
            answers = await self._ask_all(ask, {"op": "status", "job": self.job_id}, timeout=cfg.confirm_timeout)
            now = trio.current_time()
            for p in answers:
                self._answered[p] = now
                log.info("job %s: member %s is dead to the membership view but answered: no re-plan", self.job_id,
                         short_peer(p))
        return [p for p in peers if p in left or now - self._answered.get(p, -math.inf) > cfg.confirm_ttl]

    def on_replan(self, peer: str, epoch: int) -> None:
        """A member says its pipeline broke in *epoch* (the leader re-plans)."""
        if epoch < self.epoch:
            # stale: that epoch was re-planned already (a member's word arriving after the new epoch began
            # broke the new epoch before it trained, and the next one, every replan_retry)
            log.debug("job %s: replan for epoch %d from %s ignored in epoch %d", self.job_id, epoch, short_peer(peer),
                      self.epoch)
            return
        if self.plan is not None and peer in self.plan.peers:
            self._broken = True
            if epoch == self.epoch and peer != self.me:
                self._cur.reported = True   # its run of this epoch ended: the epoch cannot take off as planned
            lead = self._leader(self.plan)
            if lead is not None and lead != self.me:
                self.svc.suspect(lead)   # told, not leading: the leader may be the dead one; a refusal makes us lead
            self._poke()

    def on_dead(self, peer: str) -> None:
        """A direct question confirmed *peer*'s death (jobs/liveness.py) before the membership view did: if
        the running plan names it, the pipeline is broken (the leader re-plans at once, or is told by
        ``_watch``; its halt asks every member the view calls alive, so a wrong verdict costs a re-plan)."""
        plan = self.plan
        if plan is None or plan.epoch != self.epoch or peer not in plan.peers or peer == self.me:
            return
        self._poke()   # the leader may be the dead one (``_leader`` passes over it now)
        if self._broken:
            return
        log.info("job %s epoch %d: member %s is dead (it refused a direct question): re-planning", self.job_id,
                 self.epoch, short_peer(peer))
        self._broken = True
        self._poke()

    def _offer_joiners(self, plan: Plan) -> None:
        """Offer the job to live nodes outside it (at most once per ``offer_retry`` each).

        Not to a node whose death a direct question confirmed: the view calls a killed member alive for
        ``dead_timeout``, and after the re-plan around it its leader dialled it every ``OFFER_AGAIN`` seconds
        until then (benchmarks.churn: each kill). A standby of an earlier epoch is offered the job again (it
        answers at once: jobs/node.py), not taken as holding it: a node that restarted with the same identity
        holds nothing and is a joiner like any other (docs/jobs.md). A node whose record has no profile yet
        (its deferred start-up not run: swarm/startup.py) is offered the job as the publisher's first offer does:
        the offer starts its start-up and its accept carries the profile it measured (``_offer_to``); it used
        to be passed over until its record had one, up to ``defer`` (15 s) after it joined, or its first
        probe round."""
        view = self.svc.swarm.view
        now = trio.current_time()
        for peer in view.alive(role="node"):
            rec = view.records.get(peer)
            if (peer in plan.peers or peer in self.joiners or rec is None or rec.leaving
                    or not self.suspects.eligible(peer) or self.svc.confirmed_dead(peer)
                    or now - self._offered.get(peer, -math.inf) < self.svc.config.offer_retry):
                continue
            self._offered[peer] = now
            self.svc.nursery.start_soon(self._offer_to, peer)

    async def _take_in_joiners(self, plan: Plan) -> None:
        """Offer the job to live nodes outside it; re-plan at a step boundary if one of them gets a role."""
        self._offer_joiners(plan)
        usable = [p for p in self.joiners if self._alive(p)]
        if not usable:
            return
        # Two plans per look cost the leader real CPU (70 ms each for 6 members with AdaTopK on the 2-core
        # VM; at the watch interval of 1 s that took 40% of a 0.33-core node in benchmarks.wan and slowed its
        # own training 4x): judge the same joiners again only every join_check_interval.
        now = trio.current_time()
        key = (plan.epoch, frozenset(usable))
        # The same joiners found of no use are judged again after twice the interval each time, up to
        # join_check_max: in benchmarks.wan the leader kept judging its four standbys every 5 s through the
        # whole job and trained 1.5x slower per micro-batch than the other replica on an equal host
        seen, when, every = self._join_checked
        if key == seen and now - when < every:
            return
        every = min(2 * every, self.svc.config.join_check_max) if key == seen else self.svc.config.join_check_interval
        self._join_checked = (key, now, every)
        try:
            snap = self._snapshot(sorted({*plan.peers, *usable}), self.epoch + 1)
            trial = await planned(self.spec, self.accepted.dag, snap, self.svc.planning, previous=plan)
        except (PlanError, FusionError) as exc:
            log.info("job %s: a plan with joiners %s fails: %s", self.job_id, usable, exc)
            return
        if set(trial.peers) <= set(plan.peers) or len(trial.peers) <= len(plan.peers):
            # the plan does not need them, or would only swap them for members (chasing a link figure that
            # moved: on one machine under load the probed rates of equal links differ by more than any
            # margin): they stay standbys until a re-plan
            return
        # A halt costs seconds; take joiners in only for a predicted gain, judged against the best plan of the
        # present members under the same fresh measurements (the plan in force was chosen on older ones).
        try:
            base = await planned(self.spec, self.accepted.dag, self._snapshot(list(plan.peers), self.epoch + 1),
                                 self.svc.planning, previous=plan)
        except (PlanError, FusionError):
            base = None   # the present members alone no longer make a plan: the joiners are needed
        predicted = base is not None and base.step_time_s > 0 and trial.step_time_s > 0
        if base is not None and predicted and not trial.throughput > base.throughput * (1.0 + JOIN_GAIN):
            log.debug("job %s: joiners %s would gain under %.0f%% (%.3g vs %.3g micro-batches/s): not re-planning",
                      self.job_id, [short_peer(p) for p in usable], 100 * JOIN_GAIN, trial.throughput, base.throughput)
            return
        w = self._worker
        if w is None:
            return
        left = w.seconds_left()
        if base is not None and predicted and left is not None:
            saved = left * (1.0 - base.throughput / trial.throughput)
            if saved < self.svc.config.replan_min_saving:
                log.debug("job %s: joiners %s would save %.1f s of the %.0f s left, under %.0f s: not re-planning",
                          self.job_id, [short_peer(p) for p in usable], saved, left, self.svc.config.replan_min_saving)
                return
        states = await self._ask_all(list(plan.peers), {"op": "status", "job": self.job_id})
        at = self._planned_halt(plan, w, states)
        if at is not None:
            await self._lead(plan, at=at, why=f"joiners {[short_peer(p) for p in usable]} get a role")

    def _planned_halt(self, plan: Plan, w: StageWorker, states: dict[str, dict[str, Any]]) -> int | None:
        """The step boundary of a planned re-plan (``halt_step``) from the members' ``status`` answers; None
        when the job ends first."""
        steps = [int(m["step"]) for m in states.values() if isinstance(m.get("step"), int)]
        co2 = self.spec.config.co2
        try:
            return halt_step([w.completed, *steps], tau=co2.tau if co2 is not None and len(plan.stages[0].replicas) > 1
                             else 1, steps=self.spec.config.steps)
        except PlanError:
            return None

    async def _rebalance(self, plan: Plan) -> None:
        """Once per epoch, after ``rebalance_after`` steps: re-plan at a step boundary by the speeds the
        members measured while training, when that is predicted ``REBALANCE_GAIN`` faster (jobs/rebalance.py)."""
        cfg, w = self.svc.config, self._worker
        if (w is None or plan.epoch != self.epoch or self._rebalance_judged >= self.epoch
                or self._rebalances >= cfg.rebalance_max or self.spec.config.planner != "opfence"
                or w.completed - w.ctx.start_step < cfg.rebalance_after or len(plan.peers) < 2):
            return
        self._rebalance_judged = self.epoch
        states = await self._ask_all(list(plan.peers), {"op": "status", "job": self.job_id})
        micro_s = {p: float(m["micro_s"]) for p, m in states.items()
                   if m.get("epoch") == self.epoch and isinstance(m.get("micro_s"), float)}
        micro_s, liars = bounded(micro_s, states)   # never a member's own figure over its neighbours' measurement
        if liars:
            log.warning("job %s: %s claim more speed than their replica peers measure: planned by the measured figures",
                        self.job_id, [short_peer(p) for p in liars])
        if set(micro_s) != set(plan.peers):
            log.debug("job %s: %d of %d members measured their speed: not re-balancing", self.job_id,
                      len(micro_s), len(plan.peers))
            return
        try:
            snap = self._snapshot(list(plan.peers), self.epoch + 1)
            factors, trial, new, base = await off_loop(functools.partial(
                rebalanced, self.spec, self.accepted.dag, plan, snap, micro_s), self.svc.planning)
        except (PlanError, FusionError, ValueError) as exc:
            log.info("job %s: no plan by the measured speeds: %s", self.job_id, exc)
            return
        measured = ", ".join(f"{short_peer(p)} {1e3 * t:.0f} ms" for p, t in sorted(micro_s.items()))
        if redeals_in_band(self.spec.config, plan) and same_layout(trial, plan):
            log.info("job %s: measured per micro-batch %s; a plan by them differs only in micro-batches per "
                     "replica, which the replicas re-deal themselves: keeping the plan", self.job_id, measured)
            return
        if not new > base * (1.0 + REBALANCE_GAIN):
            log.info("job %s: measured per micro-batch %s; a plan by them (micro %s) is predicted at %.3g "
                     "micro-batches/s against %.3g, under %.0f%% faster: keeping the plan", self.job_id, measured,
                     list(trial.micro_share) or "even", new, base, 100 * REBALANCE_GAIN)
            return
        at = self._planned_halt(plan, w, states)
        if at is None:
            return
        # a re-plan halts the job for seconds (halt, hand-over, election, links): worth it only when the steps
        # left save more than replan_min_saving at the predicted rates (a 48-step benchmark job lost more to
        # it than the better split gained)
        m = self.spec.config.micro_batches
        saved = (self.spec.config.steps - at) * m * (1.0 / base - 1.0 / new)
        if saved < cfg.replan_min_saving:
            log.info("job %s: measured per micro-batch %s; a plan by them (micro %s) would save %.1f s of the %d "
                     "steps left, under %.0f s: keeping the plan", self.job_id, measured,
                     list(trial.micro_share) or "even", saved, self.spec.config.steps - at, cfg.replan_min_saving)
            return
        # from now on this leader plans every member with its measured speed, and the nodes not measured yet
        # with the members' typical ratio of training to start-up speed
        for p, f in factors.items():
            self._speeds[p] = self._speeds.get(p, self._speed_typical) * f
        self._speed_typical = typical(self._speeds)
        self._rebalances += 1
        await self._lead(plan, at=at, why=f"measured per micro-batch {measured}: predicted {new:.3g} micro-batches/s "
                                          f"against {base:.3g} (micro {list(trial.micro_share) or 'even'})")

    async def _offer_to(self, peer: str) -> None:
        try:
            # an open swarm's admission (TrainConfig.min_work): the joiner shows its standing first
            if why := await reputation.admitted(self.transport, peer, self.spec, timeout=self.svc.config.accept_timeout):
                log.info("job %s: not offered to joiner %s: %s", self.job_id, short_peer(peer), why)
                return
            self.suspects.proven(peer, self.suspects.admission.min_work)
            reply = await job_proto.request(self.transport, peer, {"op": "offer", "envelope": self.accepted.envelope,
                                                                   "via": self.job_id},
                                            timeout=self.svc.config.accept_timeout)
        except (PeerUnavailable, RemoteProtocolError) as exc:
            # not a refusal: a node that just joined may not serve jobs yet; ask again soon
            log.info("offer of %s to joiner %s: %s", self.job_id, short_peer(peer), exc)
            self._offered[peer] = trio.current_time() - self.svc.config.offer_retry + OFFER_AGAIN
            return
        if reply.get("ok"):
            rec = self.svc.swarm.view.records.get(peer)
            try:   # the profile it measured: its record may have none yet (the offer started its start-up)
                self._joiner_profiles[peer] = accepted_profile(reply, rec.profile if rec is not None else None)
            except RemoteProtocolError as exc:
                log.info("job %s: joiner %s accepted without a usable profile: %s", self.job_id, short_peer(peer), exc)
                return
            log.info("job %s: %s accepted as a joiner", self.job_id, short_peer(peer))
            self.joiners.add(peer)
            self.svc.nursery.start_soon(self._tell_joined, peer)
            self._poke()

    async def _tell_joined(self, peer: str) -> None:
        """Vouch for a joiner to the publisher, which believes plans (and plan records) only from members it
        knows: one that gets a role, or leads, before any plan it heard of names it would be a stranger to it
        (benchmarks.churn: every member of an epoch that fresh nodes carried had joined since the last plan
        the publisher saw, and it followed none of that job's later plans)."""
        ev = MembersChanged(job=self.job_id, epoch=self.epoch, joined=(peer,), at=time.time())
        try:
            with trio.move_on_after(5):
                await self.transport.publish(TOPIC_JOBS, encode_event(ev))
        except FusionError as exc:
            log.debug("joiner %s not announced: %s", short_peer(peer), exc)

    async def _lead(self, plan: Plan, *, at: int | None, why: str) -> None:
        """Halt the members (at once, or before step *at*), gather their states, start the next epoch."""
        cfg = self.svc.config
        self._led, self._led_at = self.epoch + 1, trio.current_time()
        # not a member whose death a direct question confirmed (the view still calls it alive for dead_timeout):
        # the halt round waits for every answer, and a dial to a dead node took 1.5 s under load in benchmarks.churn
        live = [p for p in {*plan.peers, *self.joiners, *(self.members or ())}
                if self._alive(p) and (p == self.me or not self.svc.confirmed_dead(p))]
        targets = sorted(live)
        self._led_with = set(targets)
        log.info("job %s: leading a re-plan from epoch %d (%s) with %d members", self.job_id, self.epoch, why,
                 len(targets))
        halt = {"op": "halt", "job": self.job_id, "at": at}
        answers = await self._ask_all(targets, halt, timeout=cfg.halt_timeout if at is None else cfg.recv_timeout)
        halted = []
        for peer, m in answers.items():
            try:
                h = Halted.from_wire(m.get("halted", {}))
            except RemoteProtocolError as exc:
                log.info("job %s: %s's halt answer: %s", self.job_id, short_peer(peer), exc)
                continue
            if h.peer == peer:
                halted.append(h)
        members = sorted(h.peer for h in halted if self._alive(h.peer))
        if not members:
            log.warning("job %s: no member answered the halt; retrying", self.job_id)
            return
        nxt = max([self.epoch, *(h.epoch for h in halted)]) + 1
        self._led = nxt
        resume = dataclasses.replace(plan_resume(plan.n_units, halted, self.checkpoints, self._alive,
                                                 reached=self.book.reached), data=self.data_history)
        resume = self._roll_back(plan, resume)
        if resume.from_checkpoint:
            log.warning("job %s: some units lost every live state; resuming from %s (%d steps lost)", self.job_id,
                        f"the checkpoint of step {resume.step}" if resume.sources else "the published weights",
                        resume.lost_steps)
        snap, estimated = self._snapshot_links(members, nxt, fill=at is None)
        mine: Plan | None = None
        try:   # the plan we compute from it (its deciding estimated pairs measured first: _checked_plan)
            snap, mine = await self._checked_plan(snap, estimated, plan)
        except (PlanError, FusionError) as exc:
            log.info("job %s: no plan for epoch %d here (%s): the members elect one", self.job_id, nxt, exc)
        start = {"op": "start", "job": self.job_id, "snapshot": snap.to_wire(), "resume": resume.to_wire(),
                 "previous": plan.to_wire()}
        if mine is not None:   # members that compute the same plan from the snapshot adopt it without an election
            self._plan_cache = (snap.snapshot_hash(), mine)
            start["plan"] = mine.plan_hash()
            # a plan that leaves live nodes out or moves the fences makes every member fetch state files: say why
            pairs, spare = len(members) * (len(members) - 1) // 2, sorted(set(members) - set(mine.peers))
            log.info("job %s: epoch %d planned %s replicas per stage%s%s; %d of %d member pairs without a link "
                     "figure", self.job_id, nxt, [len(st.replicas) for st in mine.stages],
                     ", fences kept" if [f.unit for f in mine.fences] == [f.unit for f in plan.fences] else "",
                     f", no role for {[short_peer(p) for p in spare]}" if spare else "", pairs - len(snap.links), pairs)
        replies = await self._ask_all(members, start, timeout=cfg.report_timeout)
        refused = {short_peer(p): m.get("error") for p, m in replies.items() if not m.get("ok")}
        if refused or len(replies) < len(members):
            log.warning("job %s: epoch %d start refused or unanswered: %s", self.job_id, nxt, refused)
        self.joiners -= set(members)

    def _roll_back(self, plan: Plan, resume: Resume) -> Resume:
        """After a spot-check conviction, once per convicted member: the newest complete checkpoint no later than
        its convicted step (``jobs/verified.py`` :func:`rollback`), else *resume* (said in the log: the lies
        before the conviction stay in the members' states)."""
        new = {p: step for p, step in self.suspects.convicted.items() if p not in self._rolled}
        if not new:
            return resume
        self._rolled |= set(new)
        before = min(new.values())
        rb = rollback(self.checkpoints, plan.n_units, self._alive, before=before, reached=self.book.reached)
        who = [short_peer(p) for p in new]
        if rb is None:
            log.warning("job %s: %s convicted at step %d; no complete checkpoint of a step <= %d held by members: "
                        "no roll-back, the next epoch goes on from the members' states", self.job_id, who, before, before)
            return resume
        log.warning("job %s: %s convicted at step %d; rolling back to the checkpoint of step %d (%d steps lost)",
                    self.job_id, who, before, rb.step, rb.lost_steps)
        return dataclasses.replace(rb, data=resume.data)

    def _planned(self, snap: Snapshot) -> Plan | None:
        """The plan this node computed for *snap* when it led the re-plan (computed once, not twice)."""
        cached = self._plan_cache
        return cached[1] if cached is not None and cached[0] == snap.snapshot_hash() else None

    async def _fast_adopt(self, req: Any, mine: Plan) -> bool:
        """A re-plan's start names the plan its leader computed, the first epoch's the plan its publisher
        computed; a member that computed the same from the same snapshot adopts it at once instead of holding
        a gossip election (seconds: 2.5-4.6 s in benchmarks.churn on main; the demo's first epoch 0.7-3.4 s
        idle, 2-10 s under load). Only from the leader this node sees (in the first epoch there is none: the
        start came from the publisher or the member that offered the job, ``NodeJobService._start``), so that
        two nodes that both think they lead cannot split the members between two plans. The vote still goes
        out, in the background, for any member that computed otherwise (it can then adopt by quorum) and for
        the DHT's plan record."""
        plan = self.plan
        leader = self._leader(plan) if plan is not None else None
        if plan is not None and leader is not None and req.plan_hash == mine.plan_hash() and req.sender != leader \
                and req.sender in plan.peers and leader < req.sender:
            # the sender passed over the leader we see: its probe found it dead, ours never asked (no link to it).
            # One question settles it (a refusal is immediate; an answer or a timeout leaves the election)
            await self.svc.probe(leader)
            leader = self._leader(plan)
        if not req.plan_hash or req.plan_hash != mine.plan_hash() or req.sender != (leader or req.sender):
            return False
        log.info("job %s epoch %d: plan %s adopted as its %s %s computed it", self.job_id, mine.epoch,
                 mine.plan_hash()[:12], "leader" if plan is not None else "starter", short_peer(req.sender))
        # in the job's own nursery: a vote still under way when the job ends is of no use to anyone and must
        # not outlive it (it held an elector's tasks for up to election_timeout after the job was done)
        (self._tasks or self.svc.nursery).start_soon(self._vote, req.snapshot, mine)
        return True

    async def _vote(self, snap: Snapshot, plan: Plan) -> None:
        with trio.move_on_after(self.svc.config.election_timeout):
            async with open_elector(self.transport, ElectionConfig(timeout_s=min(10.0, self.svc.config.election_timeout))) as el:
                await el.elect(snap, plan)

    async def _checked_plan(self, snap: Snapshot, estimated: dict[Pair, Link], previous: Plan) -> tuple[Snapshot, Plan]:
        """The re-plan of *snap*, checked as the publisher's first plan is (``verify_links.checked_plan``): when the
        plan runs on pairs of *estimated* whose estimate decides its layout, at most ``MAX_PAIRS`` of them are
        measured (``measure``, asked of their ends, this node's own through its handler) within
        ``MEASURE_TIMEOUT`` and the plan made again. Called after the halt: the members are stopped (a re-plan
        after a loss has no pipeline left to run; a planned one has reached its step boundary), so the probes
        read idle links, and the job stays stopped at most ``MEASURE_TIMEOUT`` longer, only when an estimate
        decides. The snapshot returned is the one the members are started with and compute the plan from."""
        spec, dag = self.spec, self.accepted.dag

        async def send(peer: str, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
            got = await self._ask_all([peer], msg, timeout=timeout)
            if peer not in got:
                raise PeerUnavailable(peer, "no answer to measure")
            return got[peer]

        snap, mine, _ = await checked_plan(self.job_id, snap, estimated, self.svc.swarm.bandwidth,
                                           lambda s: plan_for_snapshot(spec, dag, s, previous=previous),
                                           member_ask(None, self.job_id, send), score=job_score(spec, dag),
                                           limiter=self.svc.planning)
        return snap, mine

    def leads(self, peer: str) -> bool:
        """Whether *peer* leads this job's plan as this node sees it (it may ask for links measured: ``measure``)."""
        plan = self.plan
        return plan is not None and self._leader(plan) == peer

    def _snapshot(self, members: list[str], epoch: int, *, fill: bool = False) -> Snapshot:
        """The planner's input for *members* at *epoch* (:meth:`_snapshot_links`)."""
        return self._snapshot_links(members, epoch, fill=fill)[0]

    def _snapshot_links(self, members: list[str], epoch: int, *, fill: bool = False) -> tuple[Snapshot, dict[Pair, Link]]:
        """The planner's input for *members* at *epoch*, and its links that are estimates; with *fill* (a re-plan
        after a loss), a pair without a link figure counts as the slowest measured one
        (``replan.fill_unmeasured``), not as ``missing_link``."""
        view = self.svc.swarm.view
        raw: dict[str, DeviceProfile] = {}
        speeds: dict[str, float] = {}
        for p in members:
            rec = view.records.get(p)
            prof = rec.profile if rec is not None else None
            if p == self.me:
                prof = self.svc.swarm.profile
            elif prof is None:
                prof = self._joiner_profiles.get(p)   # a joiner whose record had none (_offer_to)
            if prof is None:
                raise PlanError(f"no device profile for member {short_peer(p)}")
            raw[p] = prof
            figures = self.svc.swarm if p == self.me else rec
            speeds[p] = figures.speed_on(self.spec.model_hash) if figures is not None else 0.0
        # scaled to the speeds the members announce from their earlier jobs (jobs/rebalance.py), then to the
        # speed each measured in this job, or the members' typical ratio (_rebalance)
        profiles = [(p, scale_profile(prof, self._speeds.get(p, self._speed_typical)))
                    for p, prof in calibrated(raw, speeds).items()]
        # measured, else estimated from the two members' capacities once both have measured links (a node
        # measures a few dozen of its pairs: swarm/prober.py); else the planner's missing_link
        links, estimated = member_links(self.svc.swarm.bandwidth, members)
        if fill:
            links, n = fill_unmeasured(members, links)
            if n:
                log.info("job %s: %d of %d member pairs without a link figure planned at the slowest measured one",
                         self.job_id, n, len(members) * (len(members) - 1) // 2)
        return snapshot_from_records(self.job_id, epoch, profiles, links), estimated

    async def _ask_all(self, peers: list[str], msg: dict[str, Any], *,
                       timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Send *msg* to every peer at once (ourselves through the service's handler); the answers that came."""
        out: dict[str, dict[str, Any]] = {}
        t = timeout if timeout is not None else self.svc.config.report_timeout

        async def one(peer: str) -> None:
            try:
                if peer == self.me:
                    with trio.fail_after(t):
                        out[peer] = await self.svc.handle(self.me, msg)
                else:
                    out[peer] = await job_proto.request(self.transport, peer, msg, timeout=t)
            except (PeerUnavailable, RemoteProtocolError, FusionError, trio.TooSlowError) as exc:
                log.info("job %s: %s to %s: %s", self.job_id, msg.get("op"), short_peer(peer), exc)

        async with trio.open_nursery() as nursery:
            for p in peers:
                nursery.start_soon(one, p)
        return out

    # ------------------------------------------------------------------ status and wake-ups
    def _status(self, state: JobState, plan: Plan, *, final: tuple[StageFile, ...] = (),
                final_loss: float | None = None, reason: str = "") -> JobStatus:
        ck = complete_checkpoint(self.checkpoints, plan.n_units, self._alive)
        return JobStatus(job=self.job_id, peer=self.me, publisher=self.publisher, state=state.value,
                         epoch=plan.epoch, step=self.book.reached, steps=self.spec.config.steps,
                         members=tuple(p for st in plan.stages for p in st.replicas),
                         stage_sizes=tuple(len(st.replicas) for st in plan.stages), losses=self.book.recent(512),
                         checkpoint_step=ck[0] if ck else -1,
                         checkpoint=tuple(StageFile(stage=i, hash=f.state, holders=f.holders)
                                          for i, f in enumerate(ck[1])) if ck else (),
                         final=final, final_loss=final_loss, reason=reason or self.reason, at=time.time(),
                         standbys=tuple(sorted((self.members or frozenset()) - set(plan.peers))))

    async def _put_status(self, status: JobStatus) -> None:
        try:
            with trio.move_on_after(self.svc.config.report_timeout):
                await self.transport.dht_put(status_key(self.job_id), encode_record(status, self.transport.sign))
        except FusionError as exc:
            log.debug("status of %s not stored: %s", self.job_id, exc)

    def _poke(self) -> None:
        self._wake.set()

    def poke(self) -> None:
        """Something the job's leader watches changed (the membership view)."""
        self._poke()

    async def _woken(self, timeout: float = 1.0) -> None:
        with trio.move_on_after(timeout):
            await self._wake.wait()
        self._wake = trio.Event()
