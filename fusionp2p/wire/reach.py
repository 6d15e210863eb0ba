"""Messages of the REACH protocol (``swarm/reach.py``): dial-back checks and connection reversal.

One msgpack map per frame, ``{"v": 1, "op": ...}``:

* ``check`` (node -> bootstrap): ``{"p2p": [multiaddr], "data": [multiaddr]}``, the addresses the node
  announces; answered ``{"p2p": bool, "data": bool, "ip": observed IP}``: whether a TCP connection to
  any of them could be opened from the bootstrap; or refused, ``{"ok": false, "why": str}`` (busy,
  rate-limited, not a bootstrap, the address not seen), which says nothing about reachability.
* ``reverse`` (a peer that cannot dial a target -> bootstrap): ``{"target": peer id}``; the bootstrap
  asks the target to dial the requester (``dial``) and answers ``{"ok": bool, "why": str}``.
* ``dial`` (bootstrap -> target): ``{"peer": peer id, "addrs": [multiaddr]}``; answered ``{"ok": bool,
  "why": str}``.

Every list and string is bounded here (by the generic codec), before anything else looks at it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.wire import codec
from fusionp2p.wire.msg import expect_map, packb, unpackb

VERSION = 1
MAX_MESSAGE = 8 * 1024
MAX_ADDRS = 8
MAX_ADDR = 256
OPS = ("check", "reverse", "dial")

_V = {"wire": {"lo": VERSION, "hi": VERSION}}
_ADDRS = {"wire": {"max_len": MAX_ADDRS, "item": {"min_len": 1, "max_len": MAX_ADDR}}}
_PEER = {"wire": {"max_len": 128}}


# The messages, decoded by the generic codec (wire/codec.py; field order is the byte order of
# ``encode(op, **fields)`` below, and the golden bytes in tests/unit/test_wire_golden.py pin both).
@dataclass(frozen=True, kw_only=True, slots=True)
class CheckRequest:
    v: int = field(metadata=_V)
    op: str = field(metadata={"wire": {"choices": ("check",)}})
    p2p: tuple[str, ...] = field(metadata=_ADDRS)
    data: tuple[str, ...] = field(metadata=_ADDRS)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReverseRequest:
    v: int = field(metadata=_V)
    op: str = field(metadata={"wire": {"choices": ("reverse",)}})
    target: str = field(metadata=_PEER)


@dataclass(frozen=True, kw_only=True, slots=True)
class DialRequest:
    v: int = field(metadata=_V)
    op: str = field(metadata={"wire": {"choices": ("dial",)}})
    peer: str = field(metadata=_PEER)
    addrs: tuple[str, ...] = field(metadata=_ADDRS)


@dataclass(frozen=True, kw_only=True, slots=True)
class Reply:
    """Every reply: a check's ``p2p``/``data``/``ip``, a reverse's or dial's ``ok``/``why``, or a
    refusal that carries both sets (so that either kind of asker reads it)."""

    v: int = field(metadata=_V)
    op: str = field(metadata={"wire": {"choices": ("reply",)}})
    ok: bool | None = field(default=None, metadata={"wire": {"optional": True}})
    why: str | None = field(default=None, metadata={"wire": {"max_len": 512, "optional": True}})
    p2p: bool | None = field(default=None, metadata={"wire": {"optional": True}})
    data: bool | None = field(default=None, metadata={"wire": {"optional": True}})
    ip: str | None = field(default=None, metadata={"wire": {"max_len": 64, "optional": True}})


_REQUESTS: dict[str, type[CheckRequest | ReverseRequest | DialRequest]] = {
    "check": CheckRequest, "reverse": ReverseRequest, "dial": DialRequest}


def encode(op: str, **fields: Any) -> bytes:
    assert op in OPS or op == "reply"
    return packb({"v": VERSION, "op": op, **fields})


def decode_request(data: bytes) -> tuple[str, dict[str, Any]]:
    """(op, validated fields) of a request; RemoteProtocolError for anything else."""
    m = expect_map(unpackb(data, max_size=MAX_MESSAGE), "reach request")
    if m.get("v") != VERSION:
        raise RemoteProtocolError("reach request: unsupported version")
    op = m.get("op")
    cls = _REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise RemoteProtocolError(f"reach request: unknown op {str(op)[:32]!r}")
    r = codec.from_wire(cls, m, f"reach {op}")
    if isinstance(r, CheckRequest):
        return r.op, {"p2p": list(r.p2p), "data": list(r.data)}
    if isinstance(r, ReverseRequest):
        return r.op, {"target": r.target}
    return r.op, {"peer": r.peer, "addrs": list(r.addrs)}


def _reply(data: bytes, *need: str) -> Reply:
    r = codec.decode(Reply, data, max_size=MAX_MESSAGE, what="reach reply")
    missing = [k for k in need if getattr(r, k) is None]
    if missing:
        raise RemoteProtocolError(f"reach reply: missing field {missing[0]!r}")
    return r


class CheckReply(NamedTuple):
    """A check's answer: whether the libp2p and the data-plane addresses could be dialled, the IP the
    server saw us at; or, with ``refused`` set (why), no answer at all: the server was busy,
    rate-limited, not a bootstrap or could not see our address, and nothing was learned."""

    p2p: bool
    data: bool
    ip: str
    refused: str = ""


def decode_check_reply(data: bytes) -> CheckReply:
    """The answer to a ``check``. A refusal (``ok`` false; servers before issue 43 also sent
    ``p2p``/``data`` false beside it) is told apart from an answer that found nothing dialable."""
    r = _reply(data)
    if r.ok is False:
        return CheckReply(False, False, "", str(r.why or "refused"))
    r = _reply(data, "p2p", "data", "ip")
    return CheckReply(bool(r.p2p), bool(r.data), str(r.ip))


def decode_ok_reply(data: bytes) -> tuple[bool, str]:
    """(ok, why not) of a ``reverse`` or ``dial`` reply."""
    r = _reply(data, "ok", "why")
    return bool(r.ok), str(r.why)


__all__ = ["MAX_ADDRS", "CheckReply", "CheckRequest", "DialRequest", "Reply", "ReverseRequest", "decode_check_reply", "decode_ok_reply",
           "decode_request", "encode"]
