"""Replicas the leader leaves out of the next plan because the other replicas of their stage say they lie.

A replica that keeps sending outlying averaging parts is dropped from the averaging by each honest
replica on its own (``average/robust.py``, ``ReplicaAverager.dropped_outliers``), which gossips an
:class:`~fusionp2p.jobs.events.AveragingOutlier`. Every node of the job keeps the reports here; a suspect
reported by more than half of the OTHER replicas of its stage in the plan in force (each reporter for
itself: the event's sender must be its reporter) is excluded: ``Leading._alive`` calls it dead, so it is
no member of the next re-plan, its state is no resume source, and it is not taken back as a joiner. Its
exclusion does not itself start a re-plan (the averaging already runs without it).

The job's allow-list (``TrainConfig.allow_members``, a private swarm's Sybil admission) is kept here too:
``admits`` is what ``Leading._alive`` and the leader's offers to joiners ask, and ``unlisted`` what a member
checks before it starts an epoch (``JobRun.offer_start``); the publisher offers the job to listed nodes only.
An open swarm's admission by reputation (``TrainConfig.min_work``, ``jobs/reputation.py``) is kept here as
well: ``admits`` also asks that a peer's standing was shown to this node (``proven``), or that it is a member
of a snapshot this node accepted to start (``vouch``: the publisher or an elected leader checked it).

A stage replica convicted by a spot-check (``train/verify.py``: a checker recomputed one of its sampled
micro-batches and got other outputs) is excluded at once on the evidence, a :class:`~fusionp2p.train.verify.Verdict`
that carries the stage's signed claim and the checker's signature (:meth:`Suspects.convict`): both must be
members of the plan in force, the stage replica of the claimed stage. The job's leader re-judges a
checker's verdict before anyone acts on it (``jobs/verified.py`` :class:`~fusionp2p.jobs.verified.Arbiter`:
it fetches the bundle from the checker and recomputes it, ``verify.arbitrate``), and gossips its ruling;
the other nodes convict on the leader's ruling (:meth:`Suspects.observe` with the ``leader``), not on a
checker's word; a verdict against the leader itself is re-judged by its deputy, the lowest other member
that is not the checker (:func:`judge_of`), and convicts on the deputy's ruling. A checker whose
verdict the leader's recomputation contradicts, or whose evidence is not the stage's claim, is struck
(:meth:`Suspects.strike`): excluded like a convicted member, with no roll-back (it lied in words, not in
the training state). The judge gossips its strike (:meth:`Suspects.struck_by`, a
:class:`~fusionp2p.jobs.events.CheckerStruck` carrying the checker's signed verdict) and every node of the job
applies it at its next re-plan (:meth:`Suspects.observe`): only from the verdict's judge under the plan in
force, over a verdict the struck checker signed, once per checker; so the leader a deputy ruled for, and a
later leader, plan without the checker too.

Limits: a stage of two replicas cannot tell which one lies (one report is half, not more); colluding
liars that are a majority of a stage can exclude an honest replica; an exclusion lasts for the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs.events import AveragingOutlier, CheckerStruck, ProgressEvent, StageConvicted
from fusionp2p.jobs.reputation import Admission, admission_of
from fusionp2p.jobs.spec import JobSpec
from fusionp2p.plan.plan import Plan
from fusionp2p.train.verify import Verdict, decode_verdict, encode_verdict
from fusionp2p.types import short_peer

log = logging.getLogger(__name__)


def judge_of(members: Iterable[str], leader: str | None, accused: str, checker: str,
             alive: Callable[[str], bool] | None = None) -> str | None:
    """Who re-judges a checker's verdict against *accused*: the job's *leader*, unless the leader is the
    accused; then its deputy, the lowest other member of the plan (*members*) that is neither the leader nor
    the *checker* and is *alive* to this node (a dead deputy's place is taken by the next in line once the
    membership declares it dead: its ``dead_timeout`` is the deadline); "" when every one in line is dead
    (nobody judges: no evidence either way); None when there is nobody in line at all (a verdict's own
    checker is then taken at its word), or without a leader (an in-process pipeline). Every node computes
    the same from the plan in force, the leader and the deaths it sees, so the checker sends its verdict
    there and every other node takes that node's ruling alone."""
    if leader is None:
        return None
    if leader != accused:
        return leader
    line = sorted(p for p in members if p not in (leader, checker))
    if not line:
        return None
    return next((p for p in line if alive is None or alive(p)), "")


class Suspects:
    """Reports of outlying replicas, per suspect, and the suspects excluded (see the module docstring)."""

    def __init__(self, allow: Iterable[str] = (), admission: Admission | None = None) -> None:
        self.reports: dict[str, set[str]] = {}
        self.excluded: set[str] = set()
        self.convicted: dict[str, int] = {}   # stage replica convicted by a spot-check -> the convicted step
        self.struck: set[str] = set()          # checkers whose verdict the leader's recomputation contradicted
        self.allow = frozenset(allow)   # TrainConfig.allow_members: empty = any node
        self.admission = admission or Admission()   # TrainConfig.min_work and the issuers it trusts
        self.standing: dict[str, int] = {}          # the standing each peer showed this node (micro-batches)
        self.vouched: set[str] = set()              # members of the snapshots this node accepted to start

    def admits(self, peer: str) -> bool:
        """Whether *peer* may be a member of the next plan: on the allow-list (if any), of the standing the
        job requires (if any), not excluded."""
        return (not self.allow or peer in self.allow) and self.stands(peer) and peer not in self.excluded

    @classmethod
    def of(cls, spec: JobSpec) -> Suspects:
        """A job's: its allow-list, and its standing requirement with the issuers its publisher trusts."""
        return cls(spec.config.allow_members, admission_of(spec))

    def starting(self, members: Iterable[str]) -> list[str]:
        """The *members* of a snapshot this node is asked to start that are outside the allow-list
        (:meth:`unlisted`); none: the node starts it, and vouches for them (:meth:`vouch`)."""
        members = list(members)
        out = self.unlisted(members)
        if not out:
            self.vouch(members)
        return out

    def eligible(self, peer: str) -> bool:
        """Whether *peer* may be asked to join: on the allow-list (if any), not excluded (its standing is
        asked before the offer: ``reputation.admitted``)."""
        return (not self.allow or peer in self.allow) and peer not in self.excluded

    def stands(self, peer: str) -> bool:
        """Whether *peer* showed the work the job requires (``TrainConfig.min_work``), or was vouched for."""
        return (not self.admission.required or peer in self.vouched
                or self.standing.get(peer, 0) >= self.admission.min_work)

    def proven(self, peer: str, standing: int) -> bool:
        """*peer* showed receipts worth *standing* micro-batches (``reputation.ask_standing``); whether it stands."""
        self.standing[peer] = standing
        return self.stands(peer)

    def vouch(self, members: Iterable[str]) -> None:
        """The members of a snapshot this node accepted to start: admitted by whoever made it."""
        self.vouched.update(members)

    def unlisted(self, members: Iterable[str]) -> list[str]:
        """The *members* (of a snapshot a node is asked to start) outside the allow-list."""
        return sorted(p for p in members if self.allow and p not in self.allow)

    def mine(self, job: str, step: int, stage: int, me: str, suspects: Sequence[str], plan: Plan | None
             ) -> list[AveragingOutlier]:
        """The events for the replicas this node's averager dropped (*suspects*), counted here too (gossip
        does not come back to its sender)."""
        out = [AveragingOutlier(job=job, step=step, stage=stage, peer=me, suspect=p, at=time.time()) for p in suspects]
        for ev in out:
            self.report(me, ev, plan)
        return out

    def observe(self, sender: str, ev: ProgressEvent, plan: Plan | None, leader: str | None = None,
                alive: Callable[[str], bool] | None = None) -> bool:
        """A progress event of the job from *sender*: an outlier report is counted, a conviction judged. True
        when it excludes a member. A conviction counts when it is the ruling of the verdict's judge
        (:func:`judge_of`: *leader*, the leader of *plan* as this node sees it, or its deputy when the leader
        is the accused), who re-judged the checker's verdict; a checker's own verdict only where there is no
        judge (no *leader* given: an in-process pipeline; or a plan of the leader and the checker alone)."""
        if isinstance(ev, AveragingOutlier):
            return self.report(sender, ev, plan)
        if isinstance(ev, CheckerStruck) and ev.peer == sender:
            return self.struck_on(sender, ev, plan, leader, alive)
        if isinstance(ev, StageConvicted) and ev.peer == sender:
            try:
                v = decode_verdict(ev.evidence)
            except RemoteProtocolError:
                return False
            if v.claim.peer != ev.suspect:
                return False
            judge = judge_of(plan.peers if plan is not None else (), leader, ev.suspect, v.checker, alive)
            ruled = judge is not None and sender == judge != ev.suspect
            own = judge is None and v.checker == sender
            if ruled or own:
                return self.convict(v, plan)
        return False

    def verdict(self, v: Verdict, plan: Plan | None, *, by: str | None = None) -> StageConvicted | None:
        """Convict on verdict *v*, this node's own (it is the checker) or one it upheld (*by*: this node, the
        leader): the event to gossip when it convicts (counted here too: gossip does not come back to its
        sender)."""
        if not self.convict(v, plan):
            return None
        c = v.claim
        return StageConvicted(job=c.job, step=c.step, stage=c.stage, peer=by or v.checker, suspect=c.peer,
                              evidence=encode_verdict(v), at=time.time())

    def struck_by(self, v: Verdict, judge: str, why: str) -> CheckerStruck | None:
        """Strike the checker of verdict *v*, which this node (*judge*) found false on its recomputation: the
        event to gossip the first time (counted here: gossip does not come back to its sender)."""
        if not self.strike(v.checker, why):
            return None
        c = v.claim
        return CheckerStruck(job=c.job, step=c.step, stage=c.stage, peer=judge, suspect=v.checker,
                             evidence=encode_verdict(v), at=time.time())

    def struck_on(self, sender: str, ev: CheckerStruck, plan: Plan | None, leader: str | None,
                  alive: Callable[[str], bool] | None = None) -> bool:
        """A gossiped strike (:meth:`struck_by`): applied when *sender* is the judge of its verdict under *plan*
        (:func:`judge_of` with the *leader* this node sees), the verdict is of *plan*'s job and epoch, signed
        by the checker struck (a member), and the claim it accuses by its stage replica. True the first time."""
        try:
            v = decode_verdict(ev.evidence)
        except RemoteProtocolError:
            return False
        c = v.claim
        if (plan is None or v.checker != ev.suspect or c.job != plan.job or c.epoch != plan.epoch
                or v.checker not in plan.peers or sender == v.checker or not v.valid()):
            return False
        if judge_of(plan.peers, leader, c.peer, v.checker, alive) != sender:
            return False   # only the verdict's judge strikes: not another member, not the checker's own side
        return self.strike(v.checker, f"{short_peer(sender)} found its verdict against {short_peer(c.peer)}'s stage "
                                      f"{c.stage} step {c.step} false on its recomputation")

    def strike(self, checker: str, why: str) -> bool:
        """Exclude *checker*, whose verdict the leader's re-judgement found false (``jobs/verified.py``); True
        the first time."""
        if checker in self.struck:
            return False
        self.struck.add(checker)
        self.excluded.add(checker)
        log.warning("%s excluded from the next plan: %s", short_peer(checker), why)
        return True

    def report(self, sender: str, ev: AveragingOutlier, plan: Plan | None) -> bool:
        """Count *sender*'s report; True when it excludes the suspect (the first time)."""
        if plan is None or ev.peer != sender or ev.suspect == sender or ev.suspect in self.excluded:
            return False
        stage = next((s for s in plan.stages if ev.suspect in s.replicas and sender in s.replicas), None)
        if stage is None:
            return False   # not two replicas of one stage in the plan in force: not evidence
        got = self.reports.setdefault(ev.suspect, set())
        got.add(sender)
        others = len(stage.replicas) - 1
        if others < 2 or 2 * len(got & set(stage.replicas)) <= others:   # two replicas: no majority
            return False
        self.excluded.add(ev.suspect)
        log.warning("job %s: %s excluded from the next plan: %d of the %d other replicas of its stage dropped it "
                    "from their averaging as an outlier", ev.job, short_peer(ev.suspect), len(got), others)
        return True

    def admissible(self, v: Verdict, plan: Plan | None) -> bool:
        """Whether verdict *v* is evidence under *plan* (see :meth:`convict`), before any recomputation."""
        c = v.claim
        return not (plan is None or c.job != plan.job or c.epoch != plan.epoch or not 0 <= c.stage < len(plan.stages)
                    or c.peer not in plan.stages[c.stage].replicas or v.checker not in plan.peers
                    or v.checker in self.excluded or c.peer in self.excluded
                    or (v.stamp is not None and v.stamp.signer not in plan.peers) or not v.valid())

    def convict(self, v: Verdict, plan: Plan | None) -> bool:
        """Act on a spot-check verdict: True when it excludes the stage replica it convicts (the first
        time). Evidence only when both signatures hold, the claim is of *plan*'s job and epoch, the stage
        replica serves the claimed stage in *plan*, the checker is another member not excluded, and a stamp
        the verdict carries (``train/receipts.py``) is signed by a member."""
        c = v.claim
        if not self.admissible(v, plan):
            return False
        self.excluded.add(c.peer)
        self.convicted[c.peer] = c.step
        log.warning("job %s: %s excluded from the next plan: %s's spot-check of its stage %d found %s", c.job,
                    short_peer(c.peer), short_peer(v.checker), c.stage, v.reason)
        return True


__all__ = ["Suspects", "judge_of"]
