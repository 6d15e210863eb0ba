"""Messages of the REACH protocol (``swarm/reach.py``): dial-back checks and connection reversal.

One msgpack map per frame, ``{"v": 1, "op": ...}``:

* ``check`` (node -> bootstrap): ``{"p2p": [multiaddr], "data": [multiaddr]}``, the addresses the node
  announces; answered ``{"p2p": bool, "data": bool, "ip": observed IP}``: whether a TCP connection to
  any of them could be opened from the bootstrap.
* ``reverse`` (a peer that cannot dial a target -> bootstrap): ``{"target": peer id}``; the bootstrap
  asks the target to dial the requester (``dial``) and answers ``{"ok": bool, "why": str}``.
* ``dial`` (bootstrap -> target): ``{"peer": peer id, "addrs": [multiaddr]}``; answered ``{"ok": bool,
  "why": str}``.

Every list and string is bounded here, before anything else looks at it.
"""

from __future__ import annotations

from typing import Any

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.wire.msg import expect_map, packb, typed_field, unpackb

VERSION = 1
MAX_MESSAGE = 8 * 1024
MAX_ADDRS = 8
MAX_ADDR = 256
OPS = ("check", "reverse", "dial")


def _addrs(m: dict[str, Any], name: str, what: str) -> list[str]:
    v = typed_field(m, name, list, what)
    if len(v) > MAX_ADDRS or not all(isinstance(a, str) and 0 < len(a) <= MAX_ADDR for a in v):
        raise RemoteProtocolError(f"{what}: {name} must be at most {MAX_ADDRS} addresses of up to {MAX_ADDR} characters")
    return list(v)


def _short(m: dict[str, Any], name: str, what: str, limit: int = MAX_ADDR) -> str:
    v = typed_field(m, name, str, what)
    if len(v) > limit:
        raise RemoteProtocolError(f"{what}: {name} longer than {limit} characters")
    return str(v)


def encode(op: str, **fields: Any) -> bytes:
    assert op in OPS or op == "reply"
    return packb({"v": VERSION, "op": op, **fields})


def decode_request(data: bytes) -> tuple[str, dict[str, Any]]:
    """(op, validated fields) of a request; RemoteProtocolError for anything else."""
    m = expect_map(unpackb(data, max_size=MAX_MESSAGE), "reach request")
    if m.get("v") != VERSION:
        raise RemoteProtocolError("reach request: unsupported version")
    op = m.get("op")
    if op == "check":
        return op, {"p2p": _addrs(m, "p2p", "reach check"), "data": _addrs(m, "data", "reach check")}
    if op == "reverse":
        return op, {"target": _short(m, "target", "reach reverse", 128)}
    if op == "dial":
        return op, {"peer": _short(m, "peer", "reach dial", 128), "addrs": _addrs(m, "addrs", "reach dial")}
    raise RemoteProtocolError(f"reach request: unknown op {str(op)[:32]!r}")


def decode_check_reply(data: bytes) -> tuple[bool, bool, str]:
    """(libp2p address dialable, data-plane address dialable, the IP the server saw us at)."""
    m = expect_map(unpackb(data, max_size=MAX_MESSAGE), "reach reply")
    return (bool(typed_field(m, "p2p", bool, "reach reply")), bool(typed_field(m, "data", bool, "reach reply")),
            _short(m, "ip", "reach reply", 64))


def decode_ok_reply(data: bytes) -> tuple[bool, str]:
    """(ok, why not) of a ``reverse`` or ``dial`` reply."""
    m = expect_map(unpackb(data, max_size=MAX_MESSAGE), "reach reply")
    return bool(typed_field(m, "ok", bool, "reach reply")), _short(m, "why", "reach reply", 512)


__all__ = ["MAX_ADDRS", "decode_check_reply", "decode_ok_reply", "decode_request", "encode"]
