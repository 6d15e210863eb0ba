"""Signed boundary messages: what a stage sent, as its neighbours received it (verified stages, issue 46).

A stage's claim (``train/verify.py``) binds it to the tensors it says it received and sent, and a checker
recomputes them; without more, a stage that sends a lie and claims (and serves) the honest tensors passes,
since nothing ties the claim to the bytes its neighbours got. Here each pipeline message (activations
``act``, gradients ``grad``) carries its sender's :class:`Stamp`: an Ed25519 signature over the message's
key (job, epoch, kind, step, micro-batch, name, destination stage) and a BLAKE3 digest of its payload as
encoded for the wire (the codec's meta and the tensors' dtypes, shapes and bytes: :func:`message_digest`).
The receiver checks the stamp on arrival (:class:`StampedChannel`: a message without a valid one is a
protocol error, like any malformed frame) and both ends keep the link's stamps for a few steps
(:class:`StampBook`). A sender cannot later deny what it sent, and a receiver cannot later claim to have
received anything its sender did not sign.

A checker of a stage replica asks the replica's neighbours (each end of a link holds both directions'
stamps) for the stamps of the micro-batch it samples, and compares them with the claimed transcript
(:func:`stamp_mismatch`): each message the stage sent must be the claimed output or input gradient, each
message sent to it the claimed input or received gradient. On a dense link the payload *is* the tensor,
so the comparison is a digest of the claimed tensor; a mismatch is a :class:`~fusionp2p.train.verify.Verdict`
carrying the stamp (signed by the stage for what it sent, by its neighbour for what it received), which
anyone re-judges from the bundle (``verify.arbitrate``).

Limits (docs/security.md): a message on a compressed link (AdaTopK: non-empty meta) is stamped and kept,
but its payload is not compared with the claim (the checker would need the kept fraction and the forward's
mask); a gradient summed from several receivers is compared only when one receiver sent it; ``tied`` and
``eval`` messages are not stamped; a neighbour that does not answer (or colludes) gives no stamps, and
that is no evidence.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import blake3
import torch

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.net.channel import TensorChannel, TensorMessage
from fusionp2p.net.identity import MAX_PEER_ID, verify
from fusionp2p.wire.check import as_bool, as_bytes, as_int, as_list, as_str, malformed
from fusionp2p.wire.msg import packb

_DOMAIN_STAMP = b"fusionp2p/spot-stamp/1"
STAMPED = ("act", "grad")       # the pipeline kinds a stage's claim covers
SIG = "sig"                     # the meta key of a stamped message's signature
SIG_LEN = 64
DIGEST = 32


class Signer(Protocol):
    """Who signs stamps, claims, seeds and verdicts: an :class:`~fusionp2p.net.identity.Identity`, or a node's
    transport (its key stays there: ``Transport.sign``)."""

    @property
    def peer_id(self) -> str: ...

    def sign(self, data: bytes) -> bytes: ...


def tensor_bytes_digest(t: torch.Tensor) -> bytes:
    """BLAKE3 of a tensor's bytes (read in place when it is a contiguous host tensor)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    h = blake3.blake3()
    if t.numel():
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


class TensorDigests:
    """:func:`tensor_bytes_digest` remembered for the last ``size`` tensors, so that a node digests each
    boundary tensor once: its stamp (sent or received) and its claim's transcript read the same tensor. A
    remembered tensor is held (no other tensor takes its memory meanwhile) and its version counter is part
    of the key (an in-place change is a new tensor). ``size``: about one step's boundary tensors (4 a
    micro-batch: its inputs, outputs and the gradients both ways), which the claims read right after the
    step; a stage's tap holds all but the received gradients (it keeps their sum) for longer anyway. Safe
    across threads (the claims are made in a worker thread while the links stamp on the event loop)."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._memo: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, t: torch.Tensor) -> bytes:
        t = t.detach()
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t._version)
        with self._lock:
            got = self._memo.get(key)
            if got is not None:
                self._memo.move_to_end(key)
                return got[1]
        d = tensor_bytes_digest(t)
        with self._lock:
            self._memo[key] = (t, d)
            while len(self._memo) > self.size:
                self._memo.popitem(last=False)
        return d


def message_digest(kind: str, name: str, meta: Mapping[str, Any], tensors: Sequence[torch.Tensor], *,
                   memo: TensorDigests | None = None) -> bytes:
    """BLAKE3 of a message's payload as the wire carries it: kind, name, codec meta, and each tensor's
    dtype, shape and bytes' digest (the bytes already encoded: no copy; *memo* remembers them)."""
    h = blake3.blake3(packb([kind, name, dict(meta)]))
    for t in tensors:
        h.update(packb([str(t.dtype), list(t.shape)]))
        h.update(memo.of(t) if memo is not None else tensor_bytes_digest(t))
    return h.digest()


@dataclass(frozen=True, slots=True, kw_only=True)
class Stamp:
    """A sender's signed digest of one boundary message (see the module docstring)."""

    job: str
    epoch: int
    kind: str              # "act" | "grad"
    step: int
    micro: int
    name: str
    dst: int               # the destination stage
    coded: bool            # compressed (non-empty codec meta): the digest is not the claimed tensor's
    digest: bytes
    signer: str            # the sender's peer id
    signature: bytes = b""

    def body(self) -> bytes:
        return _DOMAIN_STAMP + packb([self.job, self.epoch, self.kind, self.step, self.micro, self.name, self.dst,
                                      self.coded, self.digest, self.signer])

    def valid(self) -> bool:
        return verify(self.signer, self.body(), self.signature)

    def wire(self) -> list[Any]:
        return [self.job, self.epoch, self.kind, self.step, self.micro, self.name, self.dst, self.coded, self.digest,
                self.signer, self.signature]


def decode_stamp(f: Any, what: str = "stamp") -> Stamp:
    """A stamp from its :meth:`Stamp.wire` list (a peer's; signature unchecked); RemoteProtocolError."""
    with malformed(what):
        f = as_list(f, what, min_len=11, max_len=11)
        return Stamp(job=as_str(f[0], f"{what} job"), epoch=as_int(f[1], f"{what} epoch", lo=0),
                     kind=as_str(f[2], f"{what} kind", choices=STAMPED), step=as_int(f[3], f"{what} step", lo=0),
                     micro=as_int(f[4], f"{what} micro", lo=0), name=as_str(f[5], f"{what} name"),
                     dst=as_int(f[6], f"{what} dst", lo=0), coded=as_bool(f[7], f"{what} coded"),
                     digest=as_bytes(f[8], f"{what} digest", min_len=DIGEST, max_len=DIGEST),
                     signer=as_str(f[9], f"{what} signer", max_len=MAX_PEER_ID),
                     signature=as_bytes(f[10], f"{what} signature", max_len=SIG_LEN))


class StampBook:
    """The stamps of one node's pipeline links, both directions, for the last ``keep`` steps: what it sent
    (signed by itself) and what it received (signed by the sender, checked on arrival). ``cpu_s``: thread
    CPU seconds its channels spent digesting, signing and checking."""

    def __init__(self, keep: int = 3, memo: TensorDigests | None = None) -> None:
        self.keep = keep
        self.memo = memo     # shared with the node's ledger (Ledger(memo=)): each boundary tensor digested once
        self.cpu_s = 0.0
        self._by: dict[tuple[int, int], list[tuple[str, Stamp]]] = {}   # (step, micro) -> (the link's peer, stamp)
        self._newest = -1

    def add(self, peer: str, s: Stamp) -> None:
        """*s*, of the link with *peer* (whichever end signed it)."""
        if s.step > self._newest:
            self._newest = s.step
            for k in [k for k in self._by if k[0] <= s.step - self.keep]:
                del self._by[k]
        if s.step > self._newest - self.keep:
            self._by.setdefault((s.step, s.micro), []).append((peer, s))

    def of(self, peer: str, step: int, micro: int) -> list[Stamp]:
        """The stamps of micro-batch *micro* of *step* on the link with *peer* (either direction)."""
        return [s for p, s in self._by.get((step, micro), []) if p == peer]


class StampedChannel:
    """A pipeline link whose ``act`` and ``grad`` messages carry their sender's :class:`Stamp`: ``send``
    signs them, ``receive`` checks them (RemoteProtocolError when missing or not the sender's over what
    arrived) and hands the message on without the signature; both sides are recorded in ``book``. Other
    kinds pass as they are."""

    def __init__(self, inner: TensorChannel, me: Signer, *, epoch: int, book: StampBook) -> None:
        self.inner, self.me, self.epoch, self.book = inner, me, epoch, book

    @property
    def remote_peer(self) -> str:
        return self.inner.remote_peer

    def _stamp(self, msg: TensorMessage, signer: str) -> Stamp:
        return Stamp(job=msg.job, epoch=self.epoch, kind=msg.kind, step=msg.step, micro=msg.micro, name=msg.name,
                     dst=msg.stage, coded=bool(msg.meta), signer=signer,
                     digest=message_digest(msg.kind, msg.name, msg.meta, msg.tensors, memo=self.book.memo))

    async def send(self, msg: TensorMessage) -> None:
        if msg.kind in STAMPED:
            t0 = time.thread_time()
            s = self._stamp(msg, self.me.peer_id)
            s = dataclasses.replace(s, signature=self.me.sign(s.body()))
            self.book.add(self.remote_peer, s)
            msg = dataclasses.replace(msg, meta={**msg.meta, SIG: s.signature})
            self.book.cpu_s += time.thread_time() - t0
        await self.inner.send(msg)

    async def receive(self) -> TensorMessage:
        msg = await self.inner.receive()
        if msg.kind not in STAMPED:
            return msg
        meta = dict(msg.meta)
        sig = meta.pop(SIG, None)
        if not isinstance(sig, bytes) or len(sig) > SIG_LEN:
            raise RemoteProtocolError(f"{msg.kind} {msg.name[:64]!r} of step {msg.step}: no stamp from its sender")
        msg = dataclasses.replace(msg, meta=meta)
        t0 = time.thread_time()
        s = dataclasses.replace(self._stamp(msg, self.remote_peer), signature=sig)
        ok = s.valid()
        self.book.cpu_s += time.thread_time() - t0
        if not ok:
            raise RemoteProtocolError(f"{msg.kind} {msg.name[:64]!r} of step {msg.step}: its stamp is not its "
                                      "sender's signature over what arrived")
        self.book.add(self.remote_peer, s)
        return msg

    async def aclose(self) -> None:
        await self.inner.aclose()
