"""Plan election: every member computes the plan from the same snapshot and the swarm agrees by hash.

Theory of operation
-------------------
For a (job, epoch) each member publishes a signed :class:`Vote` ``{job, epoch, plan_hash,
snapshot_hash, peer}`` on the jobs topic (``TOPIC_JOBS``; a ``"t": "plan-vote"`` field tells
votes apart from the topic's other messages), optionally carrying the plan's wire form so that a
node that computed something else can still adopt the winner.

:class:`Election` is the sans-IO core (events in, decisions out; no trio, no clock):

* a vote that is unsigned, forged, from a non-member, for another election, or whose attached plan
  does not hash to the signed ``plan_hash`` is dropped and counted;
* each member counts once (its first vote; a later different vote is counted as equivocation);
* a hash backed by a **quorum** (a strict majority of the snapshot's members) is adopted at once.
  Two hashes cannot both reach a majority while members vote once, so every node that adopts by
  quorum adopts the same hash;
* when every member has voted and no hash has a majority, the tie is broken deterministically:
  the largest group wins, and among equal groups the one containing the lowest peer id. Every
  node that saw all votes computes the same winner;
* otherwise the shell's deadline ends the election with :class:`Failed`; the caller takes a new
  snapshot and opens the next epoch (as it does on any membership change).
Disagreement is logged with the differing snapshot hashes, which is how diverging inputs are found.

:class:`PlanElector` is the thin trio shell: ``async with open_elector(transport) as el:
outcome = await el.elect(snapshot, plan)``. It subscribes on entry (so votes published while this
node is still planning are queued), buffers votes for future epochs, republishes its own vote
until decided, and bounds every wait with ``move_on_after``. The adopted plan and its quorum of
votes are stored in the DHT under :func:`plan_key` (one key per epoch), so a node that joins late
adopts the epoch's plan with :func:`fetch_adopted`.

A DHT record is anyone's to write. A reader therefore trusts nothing in it but the signed votes,
and replays them against what it knows itself: its own snapshot of the epoch (job, epoch, snapshot
hash, and the member list, whose peer ids are the keys the votes must verify under). A record that
names other members (e.g. only its author, with one self-signed vote and a plan giving it every
stage), another epoch or another snapshot is refused. A writer keeps an existing record only if it
passes the same check; anything else under the epoch's key (a forged record, e.g. one claiming a
huge epoch to keep honest nodes from storing theirs) is overwritten.

The DHT itself keeps the better of two records (:func:`rank_plan_record`, registered on every
node, client and bootstrap by ``jobs/records.py``): a record must elect its plan among the members it
lists, and one with two or more voters outranks any single-voter record, whatever epoch that claims.
Without a ranking the DHT kept the first (py-libp2p) or the newest-claimed value, and a forger who
watches the first vote on gossip always writes first: a member that had missed the winners' votes
then found only the forgery and failed its election.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from fusionp2p.errors import ConfigError, FusionError, RemoteProtocolError
from fusionp2p.net.identity import verify
from fusionp2p.net.transport import GossipMessage, Transport
from fusionp2p.plan.plan import Plan
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.types import short_peer
from fusionp2p.wire.check import U63, as_int
from fusionp2p.wire.limits import DEFAULT_LIMITS
from fusionp2p.wire.msg import expect_map, packb, typed_field, unpackb
from fusionp2p.wire.protocols import TOPIC_JOBS

log = logging.getLogger(__name__)

VOTE_KIND = "plan-vote"
MAX_VOTE_BYTES = DEFAULT_LIMITS.max_gossip
MAX_RECORD_BYTES = DEFAULT_LIMITS.max_control_frame
Verifier = Callable[[str, bytes, bytes], bool]


PLAN_PREFIX = "/fusionp2p/plan/"


def plan_key(job: str, epoch: int) -> str:
    """DHT key of a job's adopted plan record for one epoch."""
    return f"{PLAN_PREFIX}{job}/{epoch}"


def latest_key(job: str) -> str:
    """DHT key of the job's latest adopted plan, for a reader without a snapshot (:func:`fetch_latest`)."""
    return f"{PLAN_PREFIX}{job}"


# -- votes --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Vote:
    job: str
    epoch: int
    plan_hash: str
    snapshot_hash: str
    peer: str
    signature: bytes = b""
    plan: bytes = b""               # optional Plan.to_wire(); checked against plan_hash, not signed

    def signed_bytes(self) -> bytes:
        """The canonical bytes the signature covers."""
        return packb({"t": VOTE_KIND, "job": self.job, "epoch": self.epoch, "plan": self.plan_hash,
                      "snapshot": self.snapshot_hash, "peer": self.peer})

    @classmethod
    def make(cls, *, job: str, epoch: int, plan_hash: str, snapshot_hash: str, peer: str,
             sign: Callable[[bytes], bytes], plan: bytes = b"") -> Vote:
        unsigned = cls(job=job, epoch=epoch, plan_hash=plan_hash, snapshot_hash=snapshot_hash, peer=peer)
        return cls(job=job, epoch=epoch, plan_hash=plan_hash, snapshot_hash=snapshot_hash, peer=peer,
                   signature=sign(unsigned.signed_bytes()), plan=plan)

    def encode(self) -> bytes:
        return packb({"t": VOTE_KIND, "job": self.job, "epoch": self.epoch, "plan": self.plan_hash,
                      "snapshot": self.snapshot_hash, "peer": self.peer, "sig": self.signature,
                      "body": self.plan})

    @classmethod
    def decode(cls, data: bytes, *, max_size: int = MAX_VOTE_BYTES) -> Vote | None:
        """A vote, None for another kind of message, RemoteProtocolError for a malformed vote."""
        m = expect_map(unpackb(data, max_size=max_size), "gossip")
        if m.get("t") != VOTE_KIND:
            return None
        w = "plan vote"
        epoch = as_int(typed_field(m, "epoch", int, w), "plan vote epoch", lo=0, hi=U63)
        return cls(job=typed_field(m, "job", str, w), epoch=epoch, plan_hash=typed_field(m, "plan", str, w),
                   snapshot_hash=typed_field(m, "snapshot", str, w), peer=typed_field(m, "peer", str, w),
                   signature=typed_field(m, "sig", bytes, w), plan=typed_field(m, "body", bytes, w))


# -- decisions ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Adopted:
    job: str
    epoch: int
    plan_hash: str
    voters: tuple[str, ...]         # members that voted for the adopted hash
    by: str                         # "quorum" | "tiebreak"
    dissent: tuple[tuple[str, str, tuple[str, ...]], ...] = ()  # (plan_hash, snapshot_hash, peers) of others


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed:
    job: str
    epoch: int
    reason: str


Decision = Adopted | Failed


@dataclass(slots=True)
class ElectionStats:
    accepted: int = 0
    forged: int = 0                 # unsigned or bad signature, or attached plan not matching its hash
    non_member: int = 0
    other_election: int = 0
    duplicates: int = 0
    equivocations: int = 0


class Election:
    """The sans-IO core of one (job, epoch) election; see the module docstring for the rules."""

    def __init__(self, *, job: str, epoch: int, members: Iterable[str], verifier: Verifier = verify) -> None:
        self.job = job
        self.epoch = epoch
        self.members = tuple(sorted(set(members)))
        if not self.members:
            raise ConfigError("an election needs members")
        self.quorum = len(self.members) // 2 + 1
        self._verify = verifier
        self.votes: dict[str, Vote] = {}
        self.plans: dict[str, bytes] = {}   # plan_hash -> verified plan bytes
        self.stats = ElectionStats()
        self.decision: Decision | None = None

    def on_vote(self, vote: Vote) -> Decision | None:
        """Record *vote*; returns the decision when this vote completes one (only once)."""
        if vote.job != self.job or vote.epoch != self.epoch:
            self.stats.other_election += 1
            return None
        if vote.peer not in self.members:
            self.stats.non_member += 1
            return None
        if not self._verify(vote.peer, vote.signed_bytes(), vote.signature) or not self._plan_ok(vote):
            self.stats.forged += 1
            log.debug("election %s/%d: dropped a forged vote claiming %s", self.job, self.epoch, vote.peer)
            return None
        prev = self.votes.get(vote.peer)
        if prev is not None:
            if (prev.plan_hash, prev.snapshot_hash) == (vote.plan_hash, vote.snapshot_hash):
                self.stats.duplicates += 1
            else:
                self.stats.equivocations += 1
                log.warning("election %s/%d: %s voted twice differently; keeping its first vote",
                            self.job, self.epoch, vote.peer)
            return None
        self.stats.accepted += 1
        self.votes[vote.peer] = vote
        if vote.plan:
            self.plans.setdefault(vote.plan_hash, vote.plan)
        if self.decision is not None:
            return None
        return self._decide(final=False)

    def on_deadline(self) -> Decision:
        """The shell's deadline passed: the decision, or Failed when there is none."""
        if self.decision is None:
            self.decision = self._decide(final=True)
        assert self.decision is not None  # _decide(final=True) always decides
        return self.decision

    def _plan_ok(self, vote: Vote) -> bool:
        if not vote.plan:
            return True
        try:
            plan = Plan.from_wire(vote.plan)
        except RemoteProtocolError:
            return False
        return plan.plan_hash() == vote.plan_hash and plan.job == self.job and plan.epoch == self.epoch

    def _groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for peer in sorted(self.votes):
            groups.setdefault(self.votes[peer].plan_hash, []).append(peer)
        return groups

    def _decide(self, *, final: bool) -> Decision | None:
        groups = self._groups()
        winner: str | None = None
        by = "quorum"
        for h, peers in groups.items():
            if len(peers) >= self.quorum:
                winner = h
        if winner is None and len(self.votes) == len(self.members):
            # Everyone voted, nobody has a majority: largest group, then the lowest peer id.
            winner = min(groups, key=lambda h: (-len(groups[h]), groups[h][0]))
            by = "tiebreak"
        if winner is None:
            if not final:
                return None
            self.decision = Failed(job=self.job, epoch=self.epoch, reason=(
                f"no quorum before the deadline: {len(self.votes)}/{len(self.members)} votes, "
                f"largest group {max((len(p) for p in groups.values()), default=0)}, quorum {self.quorum}"))
            self._log_dissent(None, groups)
            return self.decision
        dissent = tuple(
            (h, self.votes[p[0]].snapshot_hash, tuple(p)) for h, p in sorted(groups.items()) if h != winner
        )
        self._log_dissent(winner, groups)
        self.decision = Adopted(job=self.job, epoch=self.epoch, plan_hash=winner, voters=tuple(groups[winner]),
                                by=by, dissent=dissent)
        return self.decision

    def _log_dissent(self, winner: str | None, groups: dict[str, list[str]]) -> None:
        if len(groups) <= 1:
            return
        detail = "; ".join(
            f"plan {h[:12]} from snapshots {sorted({self.votes[p].snapshot_hash[:12] for p in peers})} by {peers}"
            for h, peers in sorted(groups.items()))
        log.warning("election %s/%d: members disagree (adopted %s): %s", self.job, self.epoch,
                    short_peer(winner) if winner else "none", detail)


# -- trio shell ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ElectionConfig:
    timeout_s: float = 30.0             # deadline of one election
    republish_s: float = 2.0            # re-send our vote this often until decided (gossip may drop)
    record_poll_s: float = 1.0          # read the adopted-plan record from the DHT this often until decided
    topic: str = TOPIC_JOBS
    attach_plan: bool = True            # carry the plan in our vote (when it fits a gossip message)
    max_future_votes: int = 4096        # votes buffered for epochs we have not opened yet

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.republish_s <= 0 or self.record_poll_s <= 0:
            raise ConfigError("election timeout_s, republish_s and record_poll_s must be positive")
        if self.max_future_votes < 0:
            raise ConfigError("max_future_votes must be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    decision: Decision
    plan: Plan | None                   # the adopted plan when known (ours, or attached to a vote)
    stats: ElectionStats = field(default_factory=ElectionStats)


class PlanElector:
    """Runs elections for one node. Create with :func:`open_elector`."""

    def __init__(self, transport: Transport, config: ElectionConfig, inbox: trio.MemoryReceiveChannel[GossipMessage]) -> None:
        self._transport = transport
        self._cfg = config
        self._inbox = inbox
        self._future: list[Vote] = []
        self.dropped_malformed = 0

    async def elect(self, snapshot: Snapshot, plan: Plan) -> Outcome:
        """Vote for *plan* (computed from *snapshot*) and wait, at most ``timeout_s``, for a decision."""
        if plan.job != snapshot.job or plan.epoch != snapshot.epoch or plan.snapshot_hash != snapshot.snapshot_hash():
            raise ConfigError("the plan was not computed from this snapshot")
        core = Election(job=snapshot.job, epoch=snapshot.epoch, members=snapshot.peers)
        body = plan.to_wire() if self._cfg.attach_plan else b""
        mine = Vote.make(job=snapshot.job, epoch=snapshot.epoch, plan_hash=plan.plan_hash(),
                         snapshot_hash=plan.snapshot_hash, peer=self._transport.peer_id, sign=self._transport.sign, plan=body)
        data = mine.encode()
        if len(data) > MAX_VOTE_BYTES:
            mine = Vote.make(job=mine.job, epoch=mine.epoch, plan_hash=mine.plan_hash,
                             snapshot_hash=mine.snapshot_hash, peer=mine.peer, sign=self._transport.sign)
            data = mine.encode()
        decision: Decision | None = None
        pending, self._future = self._future, []
        for v in pending:
            decision = self._feed(core, v) or decision
        voting = self._transport.peer_id in core.members
        async with trio.open_nursery() as nursery:
            if voting:
                await self._transport.publish(self._cfg.topic, data)
                nursery.start_soon(self._republish, data)
            with trio.move_on_after(self._cfg.timeout_s) as waiting:
                if decision is None:
                    nursery.start_soon(self._poll_record, core, waiting)
                while decision is None and core.decision is None:
                    msg = await self._inbox.receive()
                    vote = self._decode(msg)
                    if vote is not None:
                        decision = self._feed(core, vote)
            nursery.cancel_scope.cancel()
        decision = decision or core.decision
        if decision is None:
            decision = core.on_deadline()
        adopted_plan: Plan | None = None
        if isinstance(decision, Adopted):
            if decision.plan_hash == plan.plan_hash():
                adopted_plan = plan
            elif decision.plan_hash in core.plans:
                adopted_plan = Plan.from_wire(core.plans[decision.plan_hash])
            if adopted_plan is not None and voting:
                await self._store(decision, adopted_plan, core)
        return Outcome(decision=decision, plan=adopted_plan, stats=core.stats)

    def _decode(self, msg: GossipMessage) -> Vote | None:
        try:
            vote = Vote.decode(msg.data)
        except RemoteProtocolError:
            self.dropped_malformed += 1
            return None
        # Gossip authenticates the publisher; a vote relayed under another sender is still fine
        # because the signature, not the sender, proves who voted.
        return vote

    def _feed(self, core: Election, vote: Vote) -> Decision | None:
        if vote.job == core.job and vote.epoch > core.epoch:
            if len(self._future) < self._cfg.max_future_votes:
                self._future.append(vote)
            return None
        return core.on_vote(vote)

    async def _poll_record(self, core: Election, waiting: trio.CancelScope) -> None:
        """Feed the votes of the adopted-plan record (DHT) into *core* until it decides.

        Gossip sometimes leaves a member short of votes after the others decided and stopped
        republishing; the winners store the plan with its quorum of signed votes, so such a member
        decides from that record a second or two later instead of waiting for the deadline (it waited
        ``timeout_s``, 10 s, in about half of the 4-process e2e runs). The votes are checked exactly as
        gossiped ones; a record of another epoch or a malformed one is ignored."""
        while core.decision is None:
            await trio.sleep(self._cfg.record_poll_s)
            try:
                data = await self._transport.dht_get(plan_key(core.job, core.epoch))
            except (FusionError, OSError, trio.BrokenResourceError) as exc:  # best effort: gossip may still decide
                log.debug("plan record of %s not read: %s", core.job, exc)
                continue
            if data is None:
                continue
            try:
                _, plan_bytes, plan, votes = _read_record(data)
            except RemoteProtocolError as exc:
                log.debug("ignoring the plan record of %s: %s", core.job, exc)
                continue
            if plan.job != core.job or plan.epoch != core.epoch:
                continue  # an older epoch's record
            core.plans.setdefault(plan.plan_hash(), plan_bytes)  # adopted only if a quorum voted for its hash
            for vote in votes:
                self._feed(core, vote)
        waiting.cancel()

    async def _republish(self, data: bytes) -> None:
        while True:
            await trio.sleep(self._cfg.republish_s)
            await self._transport.publish(self._cfg.topic, data)

    async def _store(self, decision: Adopted, plan: Plan, core: Election) -> None:
        """Publish the adopted plan with its votes for late joiners, unless the epoch's key already holds
        a record that verifies against this election (a forged or malformed one is overwritten)."""
        key = plan_key(decision.job, decision.epoch)
        old = await self._transport.dht_get(key)
        if old is not None:
            try:
                _verified(old, job=core.job, epoch=core.epoch, members=core.members,
                          snapshot_hash=plan.snapshot_hash, verifier=core._verify)
                return
            except RemoteProtocolError as exc:
                log.info("plan record of %s/%d replaced: %s", decision.job, decision.epoch, exc)
        # Every vote goes in, so that a reader can replay the election (quorum or tie-break).
        record = packb({"job": decision.job, "epoch": decision.epoch, "members": list(core.members),
                        "plan": plan.to_wire(), "votes": [_strip(v).encode() for _, v in sorted(core.votes.items())]})
        if len(record) > MAX_RECORD_BYTES:
            return
        await self._transport.dht_put(key, record)
        if not await self._newer_latest(core):
            await self._transport.dht_put(latest_key(decision.job), record)

    async def _newer_latest(self, core: Election) -> bool:
        """Whether the job's latest-plan record is of this epoch or a later one, elected (among the members
        it lists) by voters at least one of whom is a member of ours; a record no member of ours voted for
        (e.g. one claiming epoch 2**62, to keep honest nodes from storing theirs) is replaced."""
        old = await self._transport.dht_get(latest_key(core.job))
        if old is None:
            return False
        try:
            members, _, plan, votes = _read_record(old)
            elected = _self_elected(members, plan, votes, core._verify)
        except RemoteProtocolError:
            return False
        return plan.job == core.job and plan.epoch >= core.epoch and bool(set(elected) & set(core.members))


def _strip(v: Vote) -> Vote:
    return Vote(job=v.job, epoch=v.epoch, plan_hash=v.plan_hash, snapshot_hash=v.snapshot_hash, peer=v.peer,
                signature=v.signature)


def _read_record(data: bytes) -> tuple[list[str], bytes, Plan, list[Vote]]:
    """The parts of a DHT plan record (members, plan bytes, plan, votes), every field checked; the votes'
    signatures are checked by the Election they are fed to. RemoteProtocolError if malformed."""
    w = "plan record"
    m: dict[str, Any] = expect_map(unpackb(data, max_size=MAX_RECORD_BYTES), w)
    members = typed_field(m, "members", list, w)
    if not members or not all(isinstance(p, str) for p in members):
        raise RemoteProtocolError("plan record: bad members")
    plan_bytes = typed_field(m, "plan", bytes, w)
    votes: list[Vote] = []
    for raw in typed_field(m, "votes", list, w):
        if not isinstance(raw, bytes):
            raise RemoteProtocolError("plan record: a vote is not bytes")
        v = Vote.decode(raw)
        if v is not None:
            votes.append(v)
    return members, plan_bytes, Plan.from_wire(plan_bytes), votes


def _verified(data: bytes, *, job: str, epoch: int, members: Iterable[str], snapshot_hash: str,
              verifier: Verifier) -> Plan:
    """The plan of a DHT record, checked against what the reader knows (see the module docstring):
    RemoteProtocolError unless it is this job's epoch, computed from this snapshot, names exactly
    these members, and a replay of its signed votes among *these* members elects it."""
    rec_members, _, plan, votes = _read_record(data)
    known = sorted(set(members))
    if plan.job != job or plan.epoch != epoch:
        raise RemoteProtocolError(f"plan record: for {plan.job}/{plan.epoch}, not {job}/{epoch}")
    if plan.snapshot_hash != snapshot_hash:
        raise RemoteProtocolError("plan record: its plan was computed from another snapshot")
    if sorted(set(rec_members)) != known:
        raise RemoteProtocolError("plan record: its member list is not the epoch's")
    core = Election(job=job, epoch=epoch, members=known, verifier=verifier)
    for v in votes:
        core.on_vote(v)
    decision = core.decision
    if not isinstance(decision, Adopted) or decision.plan_hash != plan.plan_hash():
        raise RemoteProtocolError("plan record: its votes do not elect its plan")
    return plan


MAX_RECORD_MEMBERS = 1024   # a DHT node replays at most this many signed votes to judge a record


def rank_plan_record(value: bytes) -> tuple[int, ...] | None:
    """The DHT ranking of plan records (``Transport.rank_records``, jobs/records.py): None unless the
    record's votes elect its plan among the members it lists; then (at least two voters, epoch, voters).

    A record with one voter is what a single identity can forge (itself as the only member): any
    record with two or more voters outranks it, whatever epoch it claims (a forged epoch 2**62 used
    to keep honest records out). Among those, the newer epoch, then more voters. Readers still check
    a record against what they know (:func:`fetch_adopted`, :func:`fetch_latest`)."""
    h = hashlib.sha256(value).digest()
    if h in _RANKED:
        return _RANKED[h]
    rank: tuple[int, ...] | None
    try:
        members, _, plan, votes = _read_record(value)
        if len(members) > MAX_RECORD_MEMBERS:
            raise RemoteProtocolError("plan record: too many members")
        voters = _self_elected(members, plan, votes[: len(set(members))], verify)
        rank = (int(len(voters) >= 2), plan.epoch, len(voters))
    except (RemoteProtocolError, ConfigError):
        rank = None
    _RANKED[h] = rank   # the DHT ranks the same few values again and again: their signatures are checked once
    while len(_RANKED) > 256:
        del _RANKED[next(iter(_RANKED))]
    return rank


_RANKED: dict[bytes, tuple[int, ...] | None] = {}


def parse_adopted(data: bytes, snapshot: Snapshot, *, verifier: Verifier = verify) -> tuple[int, Plan]:
    """Check a DHT plan record against the reader's own *snapshot* of the epoch by replaying its
    signed votes among the snapshot's members: (epoch, plan), or RemoteProtocolError."""
    plan = _verified(data, job=snapshot.job, epoch=snapshot.epoch, members=snapshot.peers,
                     snapshot_hash=snapshot.snapshot_hash(), verifier=verifier)
    return plan.epoch, plan


def _self_elected(members: list[str], plan: Plan, votes: list[Vote], verifier: Verifier) -> tuple[str, ...]:
    """Every member (of those a record lists) whose valid vote is for *plan*, when the votes elect it;
    RemoteProtocolError if they do not. Not the decision's voters: a replay decides at the quorum, in the
    record's order (by peer id), and the votes after it were left out: of a record with the votes of all
    three members of an epoch, its highest id was never a voter (a `job attach` that knew only that member,
    the plan's only one, refused the record)."""
    core = Election(job=plan.job, epoch=plan.epoch, members=members, verifier=verifier)
    for v in votes:
        core.on_vote(v)
    decision = core.decision
    if not isinstance(decision, Adopted) or decision.plan_hash != plan.plan_hash():
        raise RemoteProtocolError("plan record: its votes do not elect its plan")
    return tuple(p for p, v in sorted(core.votes.items()) if v.plan_hash == decision.plan_hash)


async def fetch_latest(transport: Transport, job: str, *, known: Iterable[str] = ()) -> tuple[int, Plan] | None:
    """The job's latest adopted plan for a reader that has no snapshot of its epoch: the record's votes
    must elect its plan among the members *it lists*, which a forger lists as it likes; with *known*
    (peers the reader already trusts as members, e.g. a publisher's), at least one of the electing
    voters must be one of them, which a stranger cannot forge. Without *known* (a node asked to join,
    the ops dashboard) this is "a plan its own voters elected", no more (docs/security.md). A node that
    has the epoch's snapshot uses :func:`fetch_adopted`."""
    rec = await fetch_latest_record(transport, job, known=known)
    return (rec[0], rec[1]) if rec is not None else None


async def fetch_latest_record(transport: Transport, job: str, *, known: Iterable[str] = (),
                              epoch: int | None = None) -> tuple[int, Plan, tuple[str, ...]] | None:
    """:func:`fetch_latest` with the members the record lists: every node of the epoch's snapshot, the
    plan's standbys too (what a publisher attaching from elsewhere has no other way to learn). With *epoch*:
    that epoch's record instead of the latest (the latest may be a later epoch that no member we know voted)."""
    data = await transport.dht_get(latest_key(job) if epoch is None else plan_key(job, epoch))
    if data is None:
        return None
    trusted = set(known)
    try:
        members, _, plan, votes = _read_record(data)
        if plan.job != job or (epoch is not None and plan.epoch != epoch):
            raise RemoteProtocolError(f"plan record of job {plan.job} epoch {plan.epoch}, not {job} epoch {epoch}")
        voters = _self_elected(members, plan, votes, verify)
        if trusted and not trusted & set(voters):
            raise RemoteProtocolError(f"plan record: none of its voters ({', '.join(map(short_peer, voters))}; votes "
                                      f"from {', '.join(short_peer(v.peer) for v in votes)}) is a known member "
                                      f"({', '.join(short_peer(p) for p in sorted(trusted)[:8])})")
    except RemoteProtocolError as exc:
        log.warning("ignoring the %s plan record of %s: %s", "latest" if epoch is None else f"epoch {epoch}'s", job,
                    exc)
        return None
    return plan.epoch, plan, tuple(members)


async def fetch_adopted(transport: Transport, snapshot: Snapshot) -> tuple[int, Plan] | None:
    """The adopted plan of *snapshot*'s epoch for a node that joins late (or whose election missed
    votes), or None when there is none (or only a record that does not verify)."""
    data = await transport.dht_get(plan_key(snapshot.job, snapshot.epoch))
    if data is None:
        return None
    try:
        return parse_adopted(data, snapshot)
    except RemoteProtocolError as exc:
        log.warning("ignoring the plan record of %s/%d: %s", snapshot.job, snapshot.epoch, exc)
        return None


@asynccontextmanager
async def open_elector(transport: Transport, config: ElectionConfig | None = None) -> AsyncIterator[PlanElector]:
    """Subscribe to the election topic and yield a :class:`PlanElector`."""
    cfg = config or ElectionConfig()
    inbox = await transport.subscribe(cfg.topic)
    async with inbox:
        yield PlanElector(transport, cfg, inbox)
