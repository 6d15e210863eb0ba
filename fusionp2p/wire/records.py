"""Signed swarm records: node records, departures, bandwidth measurements.

Envelope (msgpack map): ``{"v": 1, "t": TYPE, "b": BODY_BYTES, "s": SIGNATURE}`` where BODY_BYTES
is the canonical msgpack of the body and SIGNATURE is the Ed25519 signature of ``TYPE || 0x00 ||
BODY_BYTES`` by the peer named in the body (``body["peer"]``). Verification is injected
(``verify(peer, data, sig) -> bool``) so that this module stays pure.

A gossip message is either one signed record or a *bundle*: a msgpack array of up to
``MAX_BUNDLE_PARTS`` signed records, each verified on its own. A node gossips one bundle per
heartbeat (its NodeRecord plus its latest BandwidthReport), so the swarm carries one message per
node per period instead of one per record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.types import DeviceProfile
from fusionp2p.wire.msg import expect_map, field, packb, unpackb

VERSION = 1
MAX_RECORD = 16 * 1024
MAX_ADDRS = 16
MAX_MEASUREMENTS = 512
MAX_BUNDLE_PARTS = 4
MAX_BANDWIDTH = 1e13    # bytes/s: a measurement or capacity at or above it is refused (80 Tbit/s)
MAX_RTT = 3600.0        # seconds

# A node's reachability as it learned it (swarm/reach.py): a bootstrap dialled its announced libp2p and
# data-plane addresses back. "public": both answered; "p2p": only the libp2p one (the data port is
# closed: peers use the fallback path); "data": only the data port; "private": neither (peers cannot
# dial it: it dials them); "unknown": not checked (no bootstrap answered, or an older node).
REACH_UNKNOWN, REACH_PUBLIC, REACH_P2P, REACH_DATA, REACH_PRIVATE = "unknown", "public", "p2p", "data", "private"
REACHES = (REACH_UNKNOWN, REACH_PUBLIC, REACH_P2P, REACH_DATA, REACH_PRIVATE)

Signer = Callable[[bytes], bytes]
Verifier = Callable[[str, bytes, bytes], bool]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRecord:
    peer: str
    role: str                     # "node" | "bootstrap"
    addrs: tuple[str, ...]
    profile: DeviceProfile | None
    started: float               # the node's own wall-clock start time (informational)
    seq: int                      # increases with every heartbeat; newer wins
    leaving: bool = False
    period: float = 0.0           # the sender's heartbeat period, seconds (0: not announced)
    data: tuple[str, ...] = ()    # data-plane TCP multiaddrs peers should dial (empty: none, or an older node)
    reach: str = REACH_UNKNOWN    # whether its announced addresses were dialled back from outside (REACHES)

    def body(self) -> dict[str, Any]:
        return {
            "peer": self.peer, "role": self.role, "addrs": list(self.addrs),
            "profile": self.profile.to_wire() if self.profile else None,
            "started": float(self.started), "seq": int(self.seq), "leaving": bool(self.leaving),
            "hb": float(self.period), "data": list(self.data), "reach": self.reach,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    src: str
    dst: str
    bandwidth: float   # bytes / s, EMA
    rtt: float         # seconds, EMA
    samples: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BandwidthReport:
    peer: str                       # the measuring node (== every measurement's src)
    seq: int
    uplink: float                   # estimated capacity, bytes / s (0 = unknown)
    downlink: float
    measurements: tuple[Measurement, ...]

    def body(self) -> dict[str, Any]:
        return {
            "peer": self.peer, "seq": int(self.seq), "up": float(self.uplink), "down": float(self.downlink),
            "m": [[m.dst, float(m.bandwidth), float(m.rtt), int(m.samples)] for m in self.measurements],
        }


Record = NodeRecord | BandwidthReport


def _tag(t: str, body: bytes) -> bytes:
    return t.encode() + b"\x00" + body


def encode_signed(record: Record, sign: Signer) -> bytes:
    t = "node" if isinstance(record, NodeRecord) else "bw"
    body = packb(record.body())
    return packb({"v": VERSION, "t": t, "b": body, "s": sign(_tag(t, body))})


def decode_signed(data: bytes, verify: Verifier) -> Record:
    """Decode and verify a signed record; RemoteProtocolError on anything wrong."""
    env = expect_map(unpackb(data, max_size=MAX_RECORD), "record")
    if env.get("v") != VERSION:
        raise RemoteProtocolError(f"record version {env.get('v')!r} not supported")
    t = field(env, "t", str, "record")
    body_bytes = field(env, "b", bytes, "record")
    sig = field(env, "s", bytes, "record")
    body = expect_map(unpackb(body_bytes, max_size=MAX_RECORD), "record body")
    peer = field(body, "peer", str, "record body")
    if not verify(peer, _tag(t, body_bytes), sig):
        raise RemoteProtocolError(f"bad signature on {t} record claiming to be from {peer[:16]}")
    try:
        if t == "node":
            return _node(body)
        if t == "bw":
            return _bw(body)
    except RemoteProtocolError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"malformed {t} record: {exc}") from None
    raise RemoteProtocolError(f"unknown record type {t!r}")


def encode_bundle(parts: list[bytes]) -> bytes:
    """Several signed records (``encode_signed`` outputs) in one gossip payload."""
    if not 0 < len(parts) <= MAX_BUNDLE_PARTS:
        raise ValueError(f"a bundle holds 1 to {MAX_BUNDLE_PARTS} records")
    return packb(list(parts))


def split_bundle(data: bytes) -> list[bytes]:
    """The signed records in a gossip payload (a bundle, or one bare record); not yet verified."""
    obj = unpackb(data, max_size=MAX_BUNDLE_PARTS * (MAX_RECORD + 16))
    if isinstance(obj, dict):
        if len(data) > MAX_RECORD:
            raise RemoteProtocolError("record too large")
        return [data]
    if not isinstance(obj, list) or not 0 < len(obj) <= MAX_BUNDLE_PARTS:
        raise RemoteProtocolError("malformed record bundle")
    if not all(isinstance(p, bytes) and len(p) <= MAX_RECORD for p in obj):
        raise RemoteProtocolError("malformed record bundle")
    return obj


def _node(b: dict[str, Any]) -> NodeRecord:
    addrs = field(b, "addrs", list, "node record")
    if len(addrs) > MAX_ADDRS or not all(isinstance(a, str) and len(a) < 256 for a in addrs):
        raise RemoteProtocolError("node record: bad addrs")
    role = field(b, "role", str, "node record")
    if role not in ("node", "bootstrap", "client"):
        raise RemoteProtocolError(f"node record: unknown role {role!r}")
    prof = b.get("profile")
    profile = DeviceProfile.from_wire(expect_map(prof, "profile")) if prof is not None else None
    seq = field(b, "seq", int, "node record")
    if seq < 0:
        raise RemoteProtocolError("node record: negative seq")
    period = b.get("hb", 0.0)   # absent in records of older nodes
    if isinstance(period, bool) or not isinstance(period, (int, float)) or not 0 <= period <= 3600:
        raise RemoteProtocolError("node record: heartbeat period out of range")
    data = b.get("data", [])    # absent in records of older nodes
    if (not isinstance(data, list) or len(data) > MAX_ADDRS
            or not all(isinstance(a, str) and len(a) < 256 for a in data)):
        raise RemoteProtocolError("node record: bad data addrs")
    reach = b.get("reach", REACH_UNKNOWN)
    if reach not in REACHES:
        raise RemoteProtocolError("node record: unknown reach")
    return NodeRecord(
        peer=b["peer"], role=role, addrs=tuple(addrs), profile=profile,
        started=field(b, "started", float, "node record"), seq=seq,
        leaving=bool(field(b, "leaving", bool, "node record")), period=float(period),
        data=tuple(data), reach=reach,
    )


def _bw(b: dict[str, Any]) -> BandwidthReport:
    raw = field(b, "m", list, "bandwidth report")
    if len(raw) > MAX_MEASUREMENTS:
        raise RemoteProtocolError("bandwidth report: too many measurements")
    ms = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)):
            raise RemoteProtocolError("bandwidth report: bad measurement")
        bw, rtt, n = float(item[1]), float(item[2]), int(item[3])
        if not (0 <= bw < MAX_BANDWIDTH and 0 <= rtt < MAX_RTT and n >= 0):
            raise RemoteProtocolError("bandwidth report: measurement out of range")
        ms.append(Measurement(src=b["peer"], dst=item[0], bandwidth=bw, rtt=rtt, samples=n))
    up, down = field(b, "up", float, "bandwidth report"), field(b, "down", float, "bandwidth report")
    if not (0 <= up < MAX_BANDWIDTH and 0 <= down < MAX_BANDWIDTH):
        raise RemoteProtocolError("bandwidth report: capacity out of range")
    return BandwidthReport(peer=b["peer"], seq=field(b, "seq", int, "bandwidth report"), uplink=up, downlink=down, measurements=tuple(ms))
