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

A mismatch is a verdict signed by the checker over the stage's signed claim. The checker gossips it (a
``StageConvicted`` event: every node's ``Suspects`` checks it and leaves the stage replica out of later
plans) and sends it to the job's leader (``verdict``), which acts on it: the convicted member is no longer
alive to the leader (``Suspects.admits``), so its watch re-plans without it at once, and the re-plan rolls
back to the newest complete checkpoint of a step no later than the convicted micro-batch's, held by members
(:func:`rollback`), or, when there is none, goes on from the members' live states and says so in the log.

A stage with one replica has no checker: its ledger is not kept (no cost) and nothing of it is recomputed;
its links are still stamped (its neighbours' checkers compare the stamps with their own stage's claims).
Every request has a deadline (``report_timeout``); a checker that gets no bundle, or no stamps, has no
evidence either way (counted in ``Checker.unverifiable``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from fusionp2p.errors import ConfigError, FusionError, IntegrityError, PeerUnavailable, RemoteProtocolError
from fusionp2p.graph.program import StageProgram
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.content import ContentService
from fusionp2p.jobs.events import StageConvicted
from fusionp2p.jobs.replan import Checkpoints, Resume, complete_checkpoint
from fusionp2p.jobs.suspects import Suspects
from fusionp2p.net.channel import TensorChannel
from fusionp2p.net.transport import Transport
from fusionp2p.plan import Plan
from fusionp2p.train.receipts import Stamp, StampBook, StampedChannel, TensorDigests
from fusionp2p.train.spot import Bundle, Checker, Ledger, Refused, TappedExecutor
from fusionp2p.train.spot_wire import (
    MAX_CLAIMS,
    decode_bundle,
    decode_claims,
    decode_stamps,
    encode_bundle,
    encode_claims,
    encode_stamps,
)
from fusionp2p.train.verify import MAX_VERDICT, Claim, Unverifiable, Verdict, VerifyConfig, decode_verdict
from fusionp2p.types import short_peer

log = logging.getLogger(__name__)

SPOT_OPS = ("claims", "bundle", "stamps")   # served by the epoch's EpochChecks; ``verdict`` by the job run
KEEP = 3            # steps of states and transcripts a ledger keeps (a checker asks after the step)
BUNDLES = 8         # bundles served and kept in the content store for their checker to fetch
OUTBOX = 4          # steps of claims waiting to go to the checker (older ones are dropped: no evidence lost)


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
                 max_bundle: int, suspects: Suspects, gossip: Callable[[StageConvicted], Awaitable[None]],
                 leader: Callable[[], str | None]) -> None:
        self.transport, self.content, self.job, self.plan = transport, content, job, plan
        self.stage, self.replica, self.program = stage, replica, programs[stage]
        self.me = transport.peer_id
        self.cfg = VerifyConfig(rate=rate)
        # a bundle is the stage's state and one micro-batch's boundary tensors both ways: bounded by this node's
        # own copy of the same program (twice that, for slack), and by the job's max_state_bytes
        state = sum(t.numel() * t.element_size() for t in self.program.tensors.values())
        edge = sum(x.meta.nbytes for x in self.program.recv) + sum(x.meta.nbytes for x in self.program.send)
        self.timeout, self.max_bundle = timeout, min(max_bundle, 2 * (state + 2 * edge) + (1 << 20))
        self.suspects, self.gossip, self.leader = suspects, gossip, leader
        self.book = StampBook(keep=KEEP, memo=TensorDigests(size=8 * micro_batches))
        self.ledger: Ledger | None = None
        reps = plan.stages[stage].replicas
        # the replica this node checks: the one whose checker_of is this node
        self.checked: str | None = reps[(replica - 1) % len(reps)] if len(reps) > 1 else None
        self.checker = Checker(transport, self.program, self.cfg, job=job, epoch=plan.epoch,
                               on_verdict=self._on_verdict) if self.checked is not None else None
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
            nursery.start_soon(self._send_claims)
            if self.checker is not None:
                nursery.start_soon(self._check)
            task_status.started()
            await closed.wait()
            nursery.cancel_scope.cancel()
        for h in self.bundles:
            self.content.store.discard(self._owner, h)
        self.bundles.clear()

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
        blob = await trio.to_thread.run_sync(encode_bundle, b)
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

    async def _fetch(self, c: Claim, seed: bytes) -> Bundle:
        msg = {"op": "bundle", "job": self.job, "epoch": self.plan.epoch, "step": c.step, "micro": c.micro,
               "seed": seed}
        try:
            reply = await job_proto.request(self.transport, c.peer, msg, timeout=self.timeout)
            if not reply.get("ok"):
                raise Unverifiable(f"the stage did not serve its bundle: {str(reply.get('error'))[:200]}")
            h = job_proto.str_field(reply, "hash", "bundle reply", limit=64)
            blob = await self.content.fetch_from(c.peer, h, max_size=self.max_bundle)
            return await trio.to_thread.run_sync(lambda: decode_bundle(blob, max_size=self.max_bundle))
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

    async def _on_verdict(self, v: Verdict) -> None:
        ev = self.suspects.verdict(v, self.plan)
        if ev is None:
            return
        await self.gossip(ev)
        lead = self.leader()
        if lead is not None and lead != self.me:
            msg = {"op": "verdict", "job": self.job, "evidence": ev.evidence}
            try:
                await job_proto.request(self.transport, lead, msg, timeout=self.timeout)
            except (PeerUnavailable, RemoteProtocolError) as exc:
                log.info("job %s: verdict to the leader %s: %s (the gossip carries it)", self.job, short_peer(lead), exc)


def read_verdict(req: dict[str, Any]) -> Verdict:
    """The verdict of a ``verdict`` request (signatures unchecked: ``Suspects.convict``); RemoteProtocolError."""
    data = req.get("evidence")
    if not isinstance(data, bytes) or len(data) > MAX_VERDICT:
        raise RemoteProtocolError("verdict: 'evidence' must be an encoded verdict")
    return decode_verdict(data)


__all__ = ["KEEP", "MAX_CLAIMS", "SPOT_OPS", "EpochChecks", "checker_of", "read_verdict", "rollback",
           "tapped_executor"]
