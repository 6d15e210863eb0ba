"""The job control protocol (``wire.protocols.JOB``): one request, one reply, per stream.

Both ends speak it. A node serves ``offer`` / ``start`` / ``cancel`` / ``status`` from the publisher,
and from the job's other members ``offer`` (to a joiner), ``start`` (a re-plan's next epoch),
``halt`` (end the epoch and hand over the state), ``keep`` (hold a copy of a stage file) and ``done``
(a stage finished: to the job's leader). The publisher serves ``report`` (the job's terminal state,
its final evaluation loss and the content hashes of the final stage files) and ``done``. Messages are msgpack maps in one length-prefixed
frame each (``fusionp2p.wire``); a request carries ``op``, a reply carries ``ok`` and, when not ok,
``error``. Anything a peer sends that does not parse raises :class:`RemoteProtocolError`.

Progress (loss, tokens/s, plan, checkpoints) does *not* travel here: it is small, frequent and
fire-and-forget, so it goes on the jobs gossip topic (``metrics.encode_event``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.net.refusals import Refusals
from fusionp2p.net.transport import Stream, Transport
from fusionp2p.types import short_peer
from fusionp2p.wire.check import as_map
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.limits import DEFAULT_LIMITS
from fusionp2p.wire.msg import packb, unpackb
from fusionp2p.wire.protocols import JOB

log = logging.getLogger(__name__)

MAX_JOB_FRAME = 8 * 1024 * 1024        # a snapshot of a large swarm fits; blobs never travel here
# claims, bundle, stamps and verdict: verified stages between the members (jobs/verified.py); receipt and receipts:
# work receipts for reputation admission (jobs/reputation.py)
OPS = ("offer", "start", "cancel", "status", "report", "halt", "keep", "done", "replan", "end", "claims", "bundle",
       "stamps", "verdict", "receipt", "receipts", "measure")

Handler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]   # (remote peer, request) -> reply


async def _read_one(stream: Stream, what: str) -> dict[str, Any]:
    dec = FrameDecoder(max_frame=MAX_JOB_FRAME)
    while True:
        data = await stream.receive_some(64 * 1024)
        if not data:
            dec.check_eof()
            raise RemoteProtocolError(f"{what}: stream ended before a message")
        frames = dec.feed(data)
        if frames:
            return decode_message(frames[0], what)


def decode_message(frame: bytes, what: str = "job message") -> dict[str, Any]:
    """One JOB message: a map with string keys (a request's ``op`` and the fields are checked by its handler)."""
    return as_map(unpackb(frame, max_size=MAX_JOB_FRAME, limits=DEFAULT_LIMITS), what, max_len=64)


async def request(transport: Transport, peer: str, msg: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """Send one request to *peer* and return its reply (``ok`` checked by the caller).

    PeerUnavailable when the peer cannot be reached or does not answer within *timeout*;
    RemoteProtocolError when its answer is malformed.
    """
    if msg.get("op") not in OPS:
        raise ValueError(f"unknown job op {msg.get('op')!r}")
    try:
        with trio.fail_after(timeout):
            stream = await transport.open_stream(peer, JOB)
            try:
                await stream.send_all(encode_frame(packb(msg), max_frame=MAX_JOB_FRAME))
                await stream.send_eof()
                reply = await _read_one(stream, f"job reply from {short_peer(peer)}")
            finally:
                with trio.CancelScope(shield=True, deadline=trio.current_time() + 2):
                    await stream.aclose()
    except trio.TooSlowError:
        raise PeerUnavailable(peer, f"no answer to {msg['op']} within {timeout:.0f} s") from None
    if not isinstance(reply.get("ok"), bool):
        raise RemoteProtocolError(f"job reply from {short_peer(peer)} has no ok field")
    return reply


def serve(handler: Handler, *, timeout: float = 30.0, refusals: Refusals | None = None
          ) -> Callable[[Stream], Awaitable[None]]:
    """A stream handler for JOB: read one request, answer with ``handler``'s reply.

    A malformed request, or an exception in the handler, is answered ``ok: False`` with the reason
    (a node never crashes on a publisher's bytes, and the publisher learns why). Requests that do not
    parse, and handlers refusing a request as malformed (RemoteProtocolError), are counted in
    *refusals* (the node's table); a peer banned there is not read.
    """
    table = refusals if refusals is not None else Refusals()

    async def handle(stream: Stream) -> None:
        peer = stream.remote_peer
        if table.banned(peer, now=trio.current_time()):
            return
        try:
            with trio.fail_after(timeout):
                req = await _read_one(stream, f"job request from {short_peer(peer)}")
                op = req.get("op")
                if op not in OPS:
                    raise RemoteProtocolError(f"unknown job op {str(op)[:32]!r}")
                try:
                    reply = await handler(peer, req)
                except RemoteProtocolError as exc:
                    table.refuse(peer, f"job/{op}", now=trio.current_time(), detail=str(exc))
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                except ValueError as exc:
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                except Exception as exc:   # the node keeps running; the publisher gets the reason
                    log.exception("job %s request from %s failed", op, short_peer(peer))
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                await stream.send_all(encode_frame(packb(reply), max_frame=MAX_JOB_FRAME))
                await stream.send_eof()
        except RemoteProtocolError as exc:
            table.refuse(peer, "job/request", now=trio.current_time(), detail=str(exc))
        except (PeerUnavailable, trio.TooSlowError) as exc:
            log.info("job request from %s dropped: %s", short_peer(peer), exc)

    return handle


def str_field(m: dict[str, Any], name: str, what: str, *, limit: int = 4096) -> str:
    v = m.get(name)
    if not isinstance(v, str) or len(v) > limit:
        raise RemoteProtocolError(f"{what}: field {name!r} must be a string")
    return v


def opt_float(m: dict[str, Any], name: str, what: str) -> float | None:
    v = m.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise RemoteProtocolError(f"{what}: field {name!r} must be a number")
    return float(v)


def int_field(m: dict[str, Any], name: str, what: str) -> int:
    v = m.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not -(2**31) < v < 2**31:
        raise RemoteProtocolError(f"{what}: field {name!r} must be an integer")
    return v


__all__ = ["MAX_JOB_FRAME", "decode_message", "int_field", "opt_float", "request", "serve", "str_field"]
