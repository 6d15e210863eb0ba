"""Reputation for Sybil admission: signed work receipts of finished jobs, and a standing counted from them.

Identities are free, so an open swarm cannot count heads; it can count work done. When a job ends DONE its
publisher signs, for every member that finished it, a :class:`WorkReceipt` (job, member, steps, micro-batches
of work) and hands it to that member (JOB ``receipt``), which keeps the best ones it holds
(:class:`ReceiptBook`: at most ``MAX_KEPT``, the most work first) and shows them to whoever asks (JOB
``receipts``: at most ``MAX_SHOWN``).

A publisher that requires it (``TrainConfig.min_work``) admits a node only when the receipts the node shows
add up to that many micro-batches (:func:`standing`). Only receipts from **issuers the admitting publisher
trusts** count: itself, and the peer ids it lists (``TrainConfig.trust_issuers``). That is the Sybil
resistance: an attacker can mint any number of identities and have them publish jobs to each other, but
it cannot sign as a key it does not hold, so its receipts count for nothing where it is not trusted. Weighing
issuers by their own standing instead (a web of trust, EigenTrust-style) lets a clique that once earned a
little standing vouch for each other without end, and gives no answer to who a newcomer trusts; a list of
trusted issuers is what a publisher can check, and it says exactly whose judgement it takes.

Where it is enforced (with the allow-list, ``jobs/suspects.py``): the publisher asks every node it would
offer the job to for its receipts first and offers it only to those that stand (``jobs/publisher.py``);
a job's leader asks a joiner the same before it offers the job (``jobs/lead.py``), and ``Suspects.admits``
(``Leading._alive``) admits no one whose standing it has not seen, except the members of a snapshot the node
accepted to start (the publisher or an elected leader checked them).

Limits (docs/security.md): a receipt counts work in micro-batches, whatever the model's size; a trusted
publisher vouches for whoever finished its jobs, honestly or not (it cannot tell a member that trained
plausibly wrong values); receipts live in the member's memory only (a restart loses them); a new swarm, or
a publisher that trusts no one who has published, admits no one with ``min_work > 0`` (cold start: use the
allow-list, or ``min_work = 0``); a receipt is not revoked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.spec import JobSpec
from fusionp2p.net.identity import MAX_PEER_ID, verify
from fusionp2p.net.transport import Transport
from fusionp2p.types import short_peer
from fusionp2p.wire.check import as_bytes, as_float, as_int, as_list, as_str, malformed
from fusionp2p.wire.msg import packb, unpackb

log = logging.getLogger(__name__)

_DOMAIN = b"fusionp2p/work-receipt/1"
SIG_LEN = 64
MAX_KEPT = 64              # receipts a node keeps (the most work first)
MAX_SHOWN = 32             # ... and shows when asked (what one answer can make the asker verify)
MAX_RECEIPT = 1024         # bytes of one encoded receipt
MAX_WORK = 1 << 40         # micro-batches one receipt may name
RECEIPT_TIMEOUT = 10.0     # seconds a job's end may wait for its members to take their receipts


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkReceipt:
    """*issuer* (the publisher of job *job*) says that *member* finished the job: *steps* steps and
    *work* micro-batches of the job's training while it was a member."""

    job: str
    member: str
    issuer: str
    steps: int
    work: int
    at: float
    signature: bytes = b""

    def body(self) -> bytes:
        return _DOMAIN + packb([self.job, self.member, self.issuer, self.steps, self.work, self.at])

    def valid(self) -> bool:
        return verify(self.issuer, self.body(), self.signature)

    def encode(self) -> bytes:
        return packb([self.job, self.member, self.issuer, self.steps, self.work, self.at, self.signature])


def issue(transport: Transport, *, job: str, member: str, steps: int, work: int, at: float) -> WorkReceipt:
    """A receipt signed by this node (*transport*'s identity) as the job's publisher."""
    r = WorkReceipt(job=job, member=member, issuer=transport.peer_id, steps=steps, work=min(work, MAX_WORK), at=at)
    return WorkReceipt(job=r.job, member=r.member, issuer=r.issuer, steps=r.steps, work=r.work, at=r.at,
                       signature=transport.sign(r.body()))


def decode_receipt(data: Any, what: str = "work receipt") -> WorkReceipt:
    """A peer's encoded receipt (signature unchecked: :meth:`WorkReceipt.valid`); RemoteProtocolError."""
    with malformed(what):
        f = as_list(unpackb(as_bytes(data, what, max_len=MAX_RECEIPT), max_size=MAX_RECEIPT), what,
                    min_len=7, max_len=7)
        return WorkReceipt(job=as_str(f[0], f"{what} job", max_len=64),
                           member=as_str(f[1], f"{what} member", max_len=MAX_PEER_ID),
                           issuer=as_str(f[2], f"{what} issuer", max_len=MAX_PEER_ID),
                           steps=as_int(f[3], f"{what} steps", lo=0, hi=MAX_WORK),
                           work=as_int(f[4], f"{what} work", lo=0, hi=MAX_WORK),
                           at=as_float(f[5], f"{what} time", lo=0.0),
                           signature=as_bytes(f[6], f"{what} signature", max_len=SIG_LEN))


def standing(receipts: Iterable[WorkReceipt], member: str, trusted: Collection[str]) -> int:
    """The micro-batches of work *member* did in the jobs of *trusted* issuers: the receipts about it, signed
    by one of them, one per (issuer, job), signatures checked."""
    seen: set[tuple[str, str]] = set()
    total = 0
    for r in receipts:
        if r.member != member or r.issuer not in trusted or (r.issuer, r.job) in seen or not r.valid():
            continue
        seen.add((r.issuer, r.job))
        total += r.work
    return total


class ReceiptBook:
    """The receipts this node was given for its own work (at most ``MAX_KEPT``, the most work first)."""

    def __init__(self, me: str) -> None:
        self.me = me
        self._kept: dict[tuple[str, str], WorkReceipt] = {}

    def add(self, r: WorkReceipt) -> bool:
        """Keep *r* if it is about this node and its issuer signed it; whether it was kept."""
        if r.member != self.me or not r.valid():
            return False
        self._kept[(r.issuer, r.job)] = r
        if len(self._kept) > MAX_KEPT:
            del self._kept[min(self._kept, key=lambda k: (self._kept[k].work, self._kept[k].at))]
        return (r.issuer, r.job) in self._kept

    def shown(self) -> list[bytes]:
        """What this node shows when asked: its ``MAX_SHOWN`` receipts of the most work."""
        best = sorted(self._kept.values(), key=lambda r: (-r.work, -r.at))[:MAX_SHOWN]
        return [r.encode() for r in best]


@dataclass(frozen=True, slots=True, kw_only=True)
class Admission:
    """A job's reputation requirement (``TrainConfig.min_work``, ``trust_issuers``) as its publisher set it."""

    min_work: int = 0
    trusted: frozenset[str] = frozenset()   # the issuers whose receipts count: the publisher and its list

    @property
    def required(self) -> bool:
        return self.min_work > 0


def admission_of(spec: JobSpec) -> Admission:
    """A job's requirement: ``min_work`` micro-batches in jobs of its publisher or of ``trust_issuers``."""
    return Admission(min_work=spec.config.min_work, trusted=frozenset((spec.publisher, *spec.config.trust_issuers)))


async def admitted(transport: Transport, peer: str, spec: JobSpec, *, timeout: float) -> str:
    """'' when *peer* stands for *spec* (it requires no standing, or *peer* shows enough), else why not."""
    adm = admission_of(spec)
    if not adm.required:
        return ""
    got = await ask_standing(transport, peer, spec.job_id, adm, timeout=timeout)
    if got is not None and got >= adm.min_work:
        return ""
    return (f"its work receipts from issuers the publisher trusts add up to {got or 0} micro-batches, under "
            f"TrainConfig.min_work {adm.min_work}")


async def pay(transport: Transport, spec: JobSpec, members: Iterable[str], *, timeout: float) -> int:
    """At a job's end (DONE), from its publisher: a receipt for each of *members* (the final plan's, who
    finished it) of the job's ``steps x micro_batches`` micro-batches, handed to it; how many were taken."""
    steps, at = spec.config.steps, time.time()
    got = [issue(transport, job=spec.job_id, member=p, steps=steps, work=steps * spec.config.micro_batches, at=at)
           for p in sorted(set(members))]
    return await hand_out(transport, got, timeout=timeout)


def shown_standing(reply: dict[str, Any], peer: str, adm: Admission) -> int:
    """The standing of *peer* from its answer to JOB ``receipts``; RemoteProtocolError when malformed."""
    raw = as_list(reply.get("receipts"), "receipts", max_len=MAX_SHOWN)
    return standing([decode_receipt(b) for b in raw], peer, adm.trusted)


async def ask_standing(transport: Transport, peer: str, job: str, adm: Admission, *, timeout: float) -> int | None:
    """Ask *peer* for its receipts and count them (:func:`standing`); None when it does not answer well."""
    try:
        reply = await job_proto.request(transport, peer, {"op": "receipts", "job": job}, timeout=timeout)
        return shown_standing(reply, peer, adm)
    except (PeerUnavailable, RemoteProtocolError) as exc:
        log.info("job %s: no receipts from %s: %s", job, short_peer(peer), exc)
        return None


async def hand_out(transport: Transport, receipts: Sequence[WorkReceipt], *, timeout: float) -> int:
    """Give every receipt to its member (JOB ``receipt``), all at once; how many were taken."""
    taken: list[str] = []

    async def one(r: WorkReceipt) -> None:
        try:
            reply = await job_proto.request(transport, r.member, {"op": "receipt", "job": r.job, "receipt": r.encode()},
                                            timeout=timeout)
            if reply.get("ok"):
                taken.append(r.member)
        except (PeerUnavailable, RemoteProtocolError) as exc:
            log.info("job %s: receipt for %s not delivered: %s", r.job, short_peer(r.member), exc)

    async with trio.open_nursery() as nursery:
        for r in receipts:
            nursery.start_soon(one, r)
    return len(taken)


__all__ = ["MAX_KEPT", "MAX_SHOWN", "RECEIPT_TIMEOUT", "Admission", "ReceiptBook", "WorkReceipt", "admission_of", "admitted",
           "ask_standing", "decode_receipt", "hand_out", "issue", "pay", "shown_standing", "standing"]
