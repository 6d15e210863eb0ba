"""The VIEW protocol's wire: a node's answer (the raw signed records and reports it holds, the alive and
dead peer ids) and the client that asks for it (``fusionp2p status``, the publisher's ``discover``, a node
joining through a bootstrap). Moved out of ``swarm/node.py``, which serves it."""

from __future__ import annotations

from typing import Any

import trio

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.identity import verify
from fusionp2p.net.transport import Transport
from fusionp2p.wire.check import as_bytes, as_list, as_map, as_str
from fusionp2p.wire.framing import FrameDecoder
from fusionp2p.wire.limits import DEFAULT_LIMITS
from fusionp2p.wire.msg import unpackb
from fusionp2p.wire.records import MAX_RECORD, decode_signed

VIEW = "/fusionp2p/view/1.0.0"
MAX_VIEW = 4 * 1024 * 1024


async def fetch_view(transport: Transport, peer: str, *, timeout: float = 10.0) -> dict[str, Any]:
    """Ask *peer* for its view; every record in the answer is verified here."""
    with trio.fail_after(timeout):
        m = await fetch_view_raw(transport, peer)
    records = [decode_signed(r, verify) for r in m["records"]]
    bws = [decode_signed(r, verify) for r in m["bw"]]
    return {"records": records, "bw": bws, "alive": m["alive"], "dead": m["dead"], "distrusted": m["distrusted"]}


async def fetch_view_raw(transport: Transport, peer: str) -> dict[str, list[Any]]:
    """*peer*'s view with the signed records still as bytes (not verified yet)."""
    s = await transport.open_stream(peer, VIEW)
    dec = FrameDecoder(max_frame=MAX_VIEW)
    frames: list[bytes] = []
    try:
        while not frames:
            data = await s.receive_some()
            if not data:
                dec.check_eof()
                raise PeerUnavailable(peer, "view stream ended early")
            frames = dec.feed(data)
    finally:
        await s.aclose()
    return decode_view(frames[0])


def decode_view(frame: bytes) -> dict[str, list[Any]]:
    """A VIEW answer: the signed records (bytes, not verified yet), and the alive and dead peer ids; the
    nodes whose capacity claims the answering node distrusts (``swarm/capacity_trust.py``: its strike history,
    which one view of the latest reports cannot show; none from an older node)."""
    m = as_map(unpackb(frame, max_size=MAX_VIEW), "view", required=("records", "bw", "alive", "dead"),
               optional=("distrusted",))
    n = DEFAULT_LIMITS.max_msgpack_items
    distrusted = as_list(m.get("distrusted", []), "view distrusted", max_len=n)
    return {"records": [as_bytes(r, "view record", max_len=MAX_RECORD) for r in as_list(m["records"], "view records", max_len=n)],
            "bw": [as_bytes(r, "view report", max_len=MAX_RECORD) for r in as_list(m["bw"], "view reports", max_len=n)],
            "alive": [as_str(p, "view peer") for p in as_list(m["alive"], "view alive", max_len=n)],
            "dead": [as_str(p, "view peer") for p in as_list(m["dead"], "view dead", max_len=n)],
            "distrusted": [as_str(p, "view peer") for p in distrusted]}


__all__ = ["MAX_VIEW", "VIEW", "decode_view", "fetch_view", "fetch_view_raw"]
