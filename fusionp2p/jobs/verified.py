"""Verified stages between the nodes of a job: stamps, ledgers, checkers, verdicts and what the leader does.

Theory of operation (docs/security.md "Verified stages"). With ``TrainConfig.spot_rate`` = p > 0, every epoch
of every member runs an :class:`EpochChecks`:

* its pipeline links are :class:`~fusionp2p.train.receipts.StampedChannel` s: every activation and gradient
  carries its sender's signed digest, checked on arrival, and both ends keep the stamps (a ``StampBook``);
* its stage runs on a :class:`~fusionp2p.train.spot.TappedExecutor` with a
  :class:`~fusionp2p.train.spot.Ledger`: the state at each step's start is kept and each micro-batch's claim
  signed. The step's claims go to the replica's checker, the next replica of the same stage
  (:func:`checker_of`), in one JOB message ``claims`` (sent in the background: the step never waits on it);
* as a checker, it draws its sample from its own signed seed, asks the stage for each sampled micro-batch's
  bundle (``bundle``: the stage checks the seed and puts the bundle, as large as the stage, into its content
  store; the checker fetches it by hash, bounded by ``max_state_bytes``), asks the stage's pipeline neighbours
  for their stamps of the micro-batch (``stamps``), and recomputes (``train/spot.py`` ``Checker``).

A mismatch is a verdict signed by the checker over the stage's signed claim. A checker's word convicts
nobody: a dishonest checker could sign a verdict against an honest replica of its own stage. The checker
pins the bundle it recomputed in its content store and sends the verdict with the bundle's hash to the job's
leader (``verdict``), which re-judges it (:class:`Arbiter`): it fetches the bundle from the checker (bounded
as a checker bounds it), checks it against the stage's signed claim and recomputes the micro-batch itself
(``verify.arbitrate``, in a worker thread, within a deadline). The leader holds the job's DAG, so it builds
any stage's program, and the bundle carries the stage's whole state: it needs no copy of the stage, and no
third node is asked. When its recomputation agrees with the checker, the stage replica is convicted: the
leader gossips its ruling (a ``StageConvicted`` event sent by the leader; every node's ``Suspects`` takes the
leader's ruling, not a checker's), the convicted member is no longer alive to the leader
(``Suspects.admits``), so its watch re-plans without it at once, and the re-plan rolls back to the newest
complete checkpoint of a step no later than the convicted micro-batch's, held by members (:func:`rollback`),
or, when there is none, goes on from the members' live states and says so in the log. When its
recomputation agrees with the stage's claim, or the checker's evidence is malformed or not the claim's, the
checker is struck (``Suspects.strike``: excluded at the next re-plan, no roll-back) and the stage stays.
What a verdict makes the leader do is bounded: one arbitration at a time per job, one verdict per checker
every ``ARBITRATE_EVERY`` seconds (others are refused at once), a bundle no larger than the stage's own
bound, ``ARBITRATE_TIMEOUT`` seconds in all. A checker that leads convicts on its own recomputation; a
verdict against the leader itself goes to the leader's deputy, the lowest other member that is not the
checker and is alive (``suspects.judge_of``: a dead deputy's place goes to the next in line, and a checker
that cannot reach its judge sends the verdict there, :func:`to_judge`), which re-judges it the same way and
gossips its ruling, on which every node convicts the leader (a re-plan then elects another); a checker's own
word only where there is no third member. A checker the judge finds false is struck, and the strike gossiped
(``CheckerStruck``): every member, the accused leader too, plans without it (docs/security.md).

A stage with one replica has no checker: its ledger is not kept (no cost) and nothing of it is recomputed;
its links are still stamped (its neighbours' checkers compare the stamps with their own stage's claims).
Every request has a deadline (``report_timeout``); a checker that gets no bundle, or no stamps, has no
evidence either way (counted in ``Checker.unverifiable``). The stage-sized work (a bundle's encoding and
decoding, a recomputation) runs in worker threads, one at a time on a node (a limiter of 1), each within
``4 * report_timeout`` seconds (past it: abandoned, no evidence).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, cast

import trio

from fusionp2p.errors import ConfigError, FusionError, IntegrityError, PeerUnavailable, RemoteProtocolError
from fusionp2p.graph.program import StageProgram
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.content import ContentService
from fusionp2p.jobs.events import CheckerStruck, StageConvicted
from fusionp2p.jobs.replan import Checkpoints, Resume, complete_checkpoint
from fusionp2p.jobs.suspects import Suspects, judge_of
from fusionp2p.net.channel import TensorChannel
from fusionp2p.net.transport import Transport
from fusionp2p.plan import Plan
from fusionp2p.train.receipts import Stamp, StampBook, StampedChannel, TensorDigests
from fusionp2p.train.spot import Bundle, Checker, Ledger, Refused, TappedExecutor, in_thread
from fusionp2p.train.spot_wire import (
    MAX_CLAIMS,
    decode_bundle,
    decode_claims,
    decode_stamps,
    encode_bundle,
    encode_claims,
    encode_stamps,
)
from fusionp2p.train.verify import (
    MAX_VERDICT,
    Claim,
    Unverifiable,
    Verdict,
    VerifyConfig,
    arbitrate,
    decode_verdict,
    encode_verdict,
)
from fusionp2p.types import short_peer

log = logging.getLogger(__name__)

SPOT_OPS = ("claims", "bundle", "stamps")   # served by the epoch's EpochChecks; ``verdict`` by the job run
KEEP = 3            # steps of states and transcripts a ledger keeps (a checker asks after the step)
BUNDLES = 8         # bundles served and kept in the content store for their checker to fetch
OUTBOX = 4          # steps of claims waiting to go to the checker (older ones are dropped: no evidence lost)
EVIDENCE = 2        # bundles a checker keeps pinned as the evidence of its verdicts (for the leader to fetch)
# What the checks hold in memory on a replica of a checked stage, in copies of the stage's state: the ledger's
# KEEP states, the checker's own executor of the stage, the bundle it checks (its bytes as fetched, kept as the
# evidence until the next step, and decoded) and the bundle it serves to its own checker (the clone of a kept
# state, waiting for the node's limiter while a check runs); and in steps of boundary tensors, the ledger's
# KEEP transcripts. The planner prices both when spot_rate > 0 (jobs/build.py: planner_config); the bundles
# served and the evidence pinned live in the content store, under its own caps (--disk, its memory cache).
SPOT_STATE_COPIES = KEEP + 4
SPOT_BOUNDARY_STEPS = KEEP
ARBITRATE_EVERY = 30.0     # seconds: the leader re-judges at most one verdict of a checker in that time
ARBITRATE_TIMEOUT = 120.0  # seconds: the leader's fetch, decoding and recomputation of one verdict's bundle
# seconds a checker whose judge could not be reached waits for the membership to declare it dead (its
# dead_timeout) and sends the verdict to the next in line (suspects.judge_of); polled every JUDGE_POLL
JUDGE_DEADLINE = 120.0
JUDGE_POLL = 1.0


def bundle_bound(program: StageProgram, max_bundle: int) -> int:
    """The most bytes a bundle of *program*'s stage may take: its state and one micro-batch's boundary tensors
    both ways (twice that, for slack), and at most *max_bundle* (the job's ``max_state_bytes``)."""
    state = sum(t.numel() * t.element_size() for t in program.tensors.values())
    edge = sum(x.meta.nbytes for x in program.recv) + sum(x.meta.nbytes for x in program.send)
    return min(max_bundle, 2 * (state + 2 * edge) + (1 << 20))


class Arbiter:
    """A job's re-judgement of verdicts by its leader (see the module docstring): one at a time, one verdict of
    each checker every *every* seconds, each within *timeout* seconds. ``refused``: per checker, its verdicts
    whose evidence did not come, was malformed or was not the stage's claim; ``rulings``: (verdict, the peer
    that lied) of each judgement."""

    def __init__(self, *, every: float = ARBITRATE_EVERY, timeout: float = ARBITRATE_TIMEOUT) -> None:
        self.every, self.timeout = every, timeout
        self._one = trio.Lock()                  # one arbitration at a time (fetch and recomputation)
        self._cpu = trio.CapacityLimiter(1)      # held by a thread until it ends, an abandoned one too
        self._last: dict[str, float] = {}
        self.refused: dict[str, int] = {}
        self.rulings: list[tuple[Verdict, str]] = []

    def admit(self, checker: str, now: float) -> str:
        """'' when a verdict of *checker* may be judged at *now* (counted from here), else why not."""
        last = self._last.get(checker)
        if last is not None and now - last < self.every:
            return f"the leader re-judges one verdict of a checker every {self.every:g} s"
        self._last[checker] = now
        return ""

    async def judge(self, v: Verdict, program: StageProgram, fetch: Callable[[int], Awaitable[bytes]], *,
                    max_bundle: int, cfg: VerifyConfig) -> str | None:
        """Re-judge *v* from the bundle *fetch* (max bytes -> the blob) gets from its checker: the peer that lied
        (the stage replica when this recomputation agrees with the checker; the checker when it agrees with
        the stage's claim, or when the evidence is malformed or not the claim's), or None when no evidence came
        in time (nobody is blamed: the checker may be slow or cut off)."""
        async with self._one:
            try:
                with trio.fail_after(self.timeout):
                    # (the blob is dropped once decoded: only one stage-sized copy is held at a time)
                    state, t = await self._run(partial(decode_bundle, await fetch(max_bundle), max_size=max_bundle))
                    liar = cast(str, await self._run(partial(arbitrate, v, program, state, t, cfg)))
            except (RemoteProtocolError, IntegrityError, RuntimeError, ValueError, KeyError, TypeError,
                    IndexError) as exc:
                # malformed, not the claim's (Unverifiable), or not running through the stage's program: an
                # honest checker's own check refuses all of these before it signs a verdict
                self.refused[v.checker] = self.refused.get(v.checker, 0) + 1
                log.warning("job %s: %s's evidence against %s is refused: %s", v.claim.job, short_peer(v.checker),
                            short_peer(v.claim.peer), exc)
                liar = v.checker
            except (PeerUnavailable, ConfigError, trio.TooSlowError) as exc:
                self.refused[v.checker] = self.refused.get(v.checker, 0) + 1
                log.info("job %s: no evidence from %s for its verdict against %s: %s", v.claim.job,
                         short_peer(v.checker), short_peer(v.claim.peer), exc or "deadline")
                return None
        self.rulings.append((v, liar))
        return liar

    async def _run(self, fn: Callable[[], Any]) -> Any:
        return await in_thread(fn, self._cpu)


def checker_of(plan: Plan, stage: int, replica: int) -> str | None:
    """The node that checks replica *replica* of *stage*: the next replica of the stage (None: it has none)."""
    reps = plan.stages[stage].replicas
    return reps[(replica + 1) % len(reps)] if len(reps) > 1 else None


def tapped_executor(me: str, replica: int, *args: Any, **kwargs: Any) -> TappedExecutor:
    """The stage executor of replica *replica* of a checked job on node *me* (a test replaces this, in
    ``jobs.run``, with a lying one)."""
    return TappedExecutor(*args, **kwargs)


def rollback(checkpoints: Checkpoints, n_units: int, alive: Callable[[str], bool], *, before: int,
             reached: int) -> Resume | None:
    """Where a re-plan after a conviction resumes: the newest complete checkpoint of a step <= *before* (the
    convicted micro-batch's step: its state predates that lie) held by live members; None when there is none."""
    ck = complete_checkpoint({s: f for s, f in checkpoints.items() if s <= before}, n_units, alive)
    if ck is None:
        return None
    step, files = ck
    return Resume(step=step, sources=tuple(files), from_checkpoint=True, lost_steps=max(0, reached - step))


class EpochChecks:
    """One epoch's verified-stage machinery on one member (see the module docstring)."""

    def __init__(self, *, transport: Transport, content: ContentService, job: str, plan: Plan, stage: int,
                 replica: int, programs: list[StageProgram], rate: float, micro_batches: int, timeout: float,
                 max_bundle: int, suspects: Suspects, gossip: Callable[[StageConvicted | CheckerStruck], Awaitable[None]],
                 leader: Callable[[], str | None], arbiter: Arbiter | None = None,
                 poke: Callable[[], None] = lambda: None, alive: Callable[[str], bool] | None = None) -> None:
        self.transport, self.content, self.job, self.plan = transport, content, job, plan
        self.stage, self.replica, self.program = stage, replica, programs[stage]
        self.programs = programs   # every stage's (the leader re-judges a verdict of any stage)
        self.me = transport.peer_id
        self.cfg = VerifyConfig(rate=rate)
        # a bundle is bounded by this node's own copy of the same program, and by the job's max_state_bytes
        self.timeout, self.max_state, self.max_bundle = timeout, max_bundle, bundle_bound(self.program, max_bundle)
        self.suspects, self.gossip, self.leader = suspects, gossip, leader
        self.alive = alive   # this node's membership view: a dead deputy's place goes to the next in line
        self.arbiter, self.poke = arbiter if arbiter is not None else Arbiter(), poke
        self._cpu = trio.CapacityLimiter(1)   # the stage-sized work in threads: a bundle's coding, a recomputation
        self._blob: tuple[tuple[str, int, int], bytes] | None = None   # the bundle being checked, as fetched
        self.evidence: list[str] = []          # hashes of the bundles pinned as the evidence of verdicts
        self._nursery: trio.Nursery | None = None
        self.book = StampBook(keep=KEEP, memo=TensorDigests(size=8 * micro_batches))
        self.ledger: Ledger | None = None
        reps = plan.stages[stage].replicas
        # the replica this node checks: the one whose checker_of is this node
        self.checked: str | None = reps[(replica - 1) % len(reps)] if len(reps) > 1 else None
        self.checker = Checker(transport, self.program, self.cfg, job=job, epoch=plan.epoch,
                               on_verdict=self._on_verdict, limiter=self._cpu,
                               timeout=4 * timeout) if self.checked is not None else None
        self._inbox_send, self._inbox = trio.open_memory_channel[list[Claim]](OUTBOX)
        self._outbox_send, self._outbox = trio.open_memory_channel[list[Claim]](OUTBOX)
        self.bundles: list[str] = []      # content hashes of the bundles this node served (dropped at the end)
        self._owner = f"{job}/spot-bundles"
        if self.checker is None:
            log.info("job %s epoch %d: stage %d has one replica: nothing of it is recomputed", job, plan.epoch, stage)

    # ------------------------------------------------------------------ the stage's side
    def links(self, links: Mapping[int, TensorChannel]) -> dict[int, TensorChannel]:
        """The pipeline links, stamped."""
        return {d: StampedChannel(ch, self.transport, epoch=self.plan.epoch, book=self.book) for d, ch in links.items()}

    def keep_ledger(self, executor: TappedExecutor) -> Ledger | None:
        """The stage's ledger (None when the stage has one replica: nobody would ask for its bundles)."""
        checker = checker_of(self.plan, self.stage, self.replica)
        if checker is None:
            return None
        self.ledger = Ledger(self.transport, executor, job=self.job, epoch=self.plan.epoch, replica=self.replica,
                             checkers=[checker], cfg=self.cfg, publish=self._publish, keep=KEEP, memo=self.book.memo)
        return self.ledger

    async def _publish(self, claims: list[Claim]) -> None:
        try:
            self._outbox_send.send_nowait(claims)
        except trio.WouldBlock:
            log.info("job %s: claims of step %d dropped (the checker is %d steps behind)", self.job, claims[0].step,
                     OUTBOX)

    async def serve(self, closed: trio.Event, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Send the claims, run the checks, until the epoch's channels are *closed*."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._send_claims)
            if self.checker is not None:
                nursery.start_soon(self._check)
            task_status.started()
            await closed.wait()
            nursery.cancel_scope.cancel()
        self._nursery = None
        for h in self.bundles:
            self.content.store.discard(self._owner, h)
        for h in self.evidence:
            self.content.store.discard(f"{self.job}/spot-evidence", h)
        self.bundles.clear()
        self.evidence.clear()

    async def _send_claims(self) -> None:
        checker = checker_of(self.plan, self.stage, self.replica)
        async for claims in self._outbox:
            if checker is None:
                continue
            msg = {"op": "claims", "job": self.job, "epoch": self.plan.epoch, "claims": encode_claims(claims)}
            try:
                await job_proto.request(self.transport, checker, msg, timeout=self.timeout)
            except (PeerUnavailable, RemoteProtocolError) as exc:
                log.info("job %s: claims of step %d to %s: %s", self.job, claims[0].step, short_peer(checker), exc)

    # ------------------------------------------------------------------ requests from other members
    async def on_request(self, peer: str, req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if job_proto.int_field(req, "epoch", op) != self.plan.epoch:
            return {"ok": False, "error": f"not in epoch {req['epoch']} (in {self.plan.epoch})"}
        if op == "claims":
            data = req.get("claims")
            if not isinstance(data, bytes):
                raise RemoteProtocolError("claims: 'claims' must be bytes")
            claims = decode_claims(data)
            if peer != self.checked or not claims or any(c.peer != peer for c in claims):
                return {"ok": False, "error": "claims of a stage replica this node does not check"}
            try:
                self._inbox_send.send_nowait(claims)
            except trio.WouldBlock:
                return {"ok": False, "error": "the checker is behind: claims dropped"}
            return {"ok": True}
        step, micro = job_proto.int_field(req, "step", op), job_proto.int_field(req, "micro", op)
        if op == "stamps":
            about = job_proto.str_field(req, "peer", op, limit=128)
            return {"ok": True, "stamps": encode_stamps(self.book.of(about, step, micro))}
        # op == "bundle"
        seed = req.get("seed")
        if not isinstance(seed, bytes) or len(seed) > 64:
            raise RemoteProtocolError("bundle: 'seed' must be a signature")
        if self.ledger is None:
            return {"ok": False, "error": "this stage keeps no ledger"}
        try:
            b = self.ledger.bundle(peer, seed, step, micro)
        except Refused as exc:
            return {"ok": False, "error": str(exc)}
        with trio.fail_after(4 * self.timeout):
            blob = await in_thread(partial(encode_bundle, b), self._cpu)
        store = self.content.store
        try:
            with store.pinned_to(self._owner):   # until the checker fetched it: at most BUNDLES are kept
                h = store.put(blob)
        except FusionError as exc:
            return {"ok": False, "error": f"no room for the bundle: {exc}"[:200]}
        self.bundles.append(h)
        while len(self.bundles) > BUNDLES:
            store.discard(self._owner, self.bundles.pop(0))
        return {"ok": True, "hash": h}

    # ------------------------------------------------------------------ the checker's side
    async def _check(self) -> None:
        assert self.checker is not None
        async for claims in self._inbox:
            await self.checker.step(claims, self._fetch, self._stamps)
            self._blob = None   # a verdict's bundle is pinned by now (_on_verdict); the others are of no use

    async def _fetch(self, c: Claim, seed: bytes) -> Bundle:
        msg = {"op": "bundle", "job": self.job, "epoch": self.plan.epoch, "step": c.step, "micro": c.micro,
               "seed": seed}
        try:
            reply = await job_proto.request(self.transport, c.peer, msg, timeout=self.timeout)
            if not reply.get("ok"):
                raise Unverifiable(f"the stage did not serve its bundle: {str(reply.get('error'))[:200]}")
            h = job_proto.str_field(reply, "hash", "bundle reply", limit=64)
            blob = await self.content.fetch_from(c.peer, h, max_size=self.max_bundle)
            self._blob = ((c.peer, c.step, c.micro), blob)   # the evidence, should the recomputation disagree
            with trio.fail_after(4 * self.timeout):
                return await in_thread(partial(decode_bundle, blob, max_size=self.max_bundle), self._cpu)
        except (PeerUnavailable, RemoteProtocolError, IntegrityError, ConfigError, trio.TooSlowError) as exc:
            raise Unverifiable(f"no bundle from the stage: {exc}"[:200]) from None

    async def _stamps(self, c: Claim) -> list[Stamp]:
        """The stamps the stage replica's pipeline neighbours (the same replica index) hold of the micro-batch."""
        out: list[Stamp] = []
        r = self.plan.stages[c.stage].replicas.index(c.peer) if c.peer in self.plan.stages[c.stage].replicas else -1
        if r < 0:
            return out
        msg = {"op": "stamps", "job": self.job, "epoch": self.plan.epoch, "peer": c.peer, "step": c.step,
               "micro": c.micro}
        for t in self.program.peer_stages:
            reps = self.plan.stages[t].replicas if 0 <= t < len(self.plan.stages) else ()
            if r >= len(reps):
                continue
            try:
                reply = await job_proto.request(self.transport, reps[r], msg, timeout=self.timeout)
                data = reply.get("stamps")
                if reply.get("ok") and isinstance(data, bytes):
                    out += decode_stamps(data)
            except (PeerUnavailable, RemoteProtocolError) as exc:   # no stamps: no evidence either way
                log.info("job %s: stamps of %s from %s: %s", self.job, short_peer(c.peer), short_peer(reps[r]), exc)
        return out

    def _judge_of(self, v: Verdict) -> str | None:
        return judge_of(self.plan.peers, self.leader(), v.claim.peer, v.checker, self.alive)

    async def _on_verdict(self, v: Verdict) -> None:
        judge = self._judge_of(v)
        if judge is None or judge == self.me:
            # this node leads (its own recomputation is the judgement), or there is no judge (no leader, or
            # the leader is accused and no third member can re-judge: every node takes this checker's word)
            ev = self.suspects.verdict(v, self.plan)
            if ev is not None:
                await self.gossip(ev)
                self.poke()
            return
        h = self._pin_evidence(v)
        if h is None:
            log.warning("job %s: the bundle of the verdict against %s is gone: not sent", self.job, short_peer(v.claim.peer))
            return
        msg = {"op": "verdict", "job": self.job, "evidence": encode_verdict(v), "bundle": h}

        async def send(to: str) -> bool:
            try:
                reply = await job_proto.request(self.transport, to, msg, timeout=self.timeout)
                if not reply.get("ok"):
                    log.info("job %s: the judge %s refused the verdict: %s", self.job, short_peer(to),
                             str(reply.get("error"))[:200])
                return bool(reply.get("ok"))
            except (PeerUnavailable, RemoteProtocolError) as exc:
                log.info("job %s: verdict to the judge %s: %s", self.job, short_peer(to), exc)
                return False

        if judge and await send(judge):
            return
        if self._nursery is not None:   # the next in line, once this node's view has the judge dead
            self._nursery.start_soon(partial(to_judge, lambda: self._judge_of(v), send, tried={judge}, me=self.me))

    def _pin_evidence(self, v: Verdict) -> str | None:
        """The content hash of the bundle *v* was found on, pinned for the leader to fetch (None: not kept)."""
        c, got = v.claim, self._blob
        if got is None or got[0] != (c.peer, c.step, c.micro):
            return None
        store, owner = self.content.store, f"{self.job}/spot-evidence"
        try:
            with store.pinned_to(owner):
                h = store.put(got[1])
        except FusionError as exc:
            log.info("job %s: no room for the evidence: %s", self.job, exc)
            return None
        self.evidence.append(h)
        while len(self.evidence) > EVIDENCE:
            store.discard(owner, self.evidence.pop(0))
        return h

    # ------------------------------------------------------------------ the leader's re-judgement
    def on_verdict(self, peer: str, req: dict[str, Any]) -> dict[str, Any]:
        """A checker's ``verdict`` for this node to judge (it leads, or deputises for the accused leader:
        :func:`~fusionp2p.jobs.suspects.judge_of`): admitted, it is re-judged in the background (the reply
        does not wait for it); RemoteProtocolError for a malformed one or one *peer* did not sign."""
        v = read_verdict(req)
        h = job_proto.str_field(req, "bundle", "verdict", limit=64)
        if v.checker != peer:
            raise RemoteProtocolError("verdict: sent by another node than the checker that signed it")
        if self._judge_of(v) != self.me:
            return {"ok": False, "error": "this node does not judge that verdict (neither the leader nor its deputy)"}
        if not self.suspects.admissible(v, self.plan):
            return {"ok": True, "new": False}
        nursery = self._nursery
        if nursery is None:
            return {"ok": False, "error": "this node runs no spot-checks now"}
        if why := self.arbiter.admit(peer, trio.current_time()):
            return {"ok": False, "error": why}
        nursery.start_soon(self._judge, v, h)
        return {"ok": True, "new": True}

    async def _judge(self, v: Verdict, h: str) -> None:
        c = v.claim
        program = self.programs[c.stage]

        async def fetch(max_size: int) -> bytes:
            return await self.content.fetch_from(v.checker, h, max_size=max_size)

        liar = await self.arbiter.judge(v, program, fetch, max_bundle=bundle_bound(program, self.max_state),
                                        cfg=self.cfg)
        if liar is None:
            return
        if liar == c.peer:
            ev = self.suspects.verdict(v, self.plan, by=self.me)
            if ev is not None:
                await self.gossip(ev)
        else:
            struck = self.suspects.struck_by(v, self.me, f"its verdict against {short_peer(c.peer)}'s stage "
                                             f"{c.stage} step {c.step} micro {c.micro} does not hold on the judge's "
                                             "recomputation")
            if struck is None:
                return
            await self.gossip(struck)   # every member strikes it too: the accused leader, a later leader
        self.poke()


async def to_judge(judge: Callable[[], str | None], send: Callable[[str], Awaitable[bool]], *, tried: set[str],
                   me: str, deadline: float = JUDGE_DEADLINE, poll: float = JUDGE_POLL) -> str | None:
    """Send a verdict to its *judge* (as this node sees it now), not one *tried* already, until one takes it
    or *deadline*: a judge that cannot be reached (a dead deputy) is replaced by the next in line when the
    membership declares it dead (``suspects.judge_of``). The judge that took it; None: nobody did (no
    evidence either way), or the verdict is no longer this node's to send (it judges, or nobody judges)."""
    with trio.move_on_after(deadline):
        while True:
            j = judge()
            if j is None or j == me:
                return None
            if j and j not in tried:
                tried.add(j)
                if await send(j):
                    return j
            await trio.sleep(poll)
    return None


def read_verdict(req: dict[str, Any]) -> Verdict:
    """The verdict of a ``verdict`` request (signatures unchecked: ``Suspects.convict``); RemoteProtocolError."""
    data = req.get("evidence")
    if not isinstance(data, bytes) or len(data) > MAX_VERDICT:
        raise RemoteProtocolError("verdict: 'evidence' must be an encoded verdict")
    return decode_verdict(data)


__all__ = ["ARBITRATE_EVERY", "ARBITRATE_TIMEOUT", "JUDGE_DEADLINE", "KEEP", "MAX_CLAIMS", "SPOT_OPS", "Arbiter",
           "EpochChecks", "bundle_bound", "checker_of", "read_verdict", "rollback", "tapped_executor", "to_judge"]
