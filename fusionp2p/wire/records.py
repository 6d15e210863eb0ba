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

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.types import DeviceProfile, short_peer
from fusionp2p.wire.check import U63, as_float, as_int, as_pair_list, as_str, malformed
from fusionp2p.wire.codec import from_wire, to_wire
from fusionp2p.wire.msg import expect_map, packb, typed_field, unpackb

VERSION = 1
MAX_RECORD = 16 * 1024
MAX_ADDRS = 16
MAX_MEASUREMENTS = 512
MAX_BUNDLE_PARTS = 4
MAX_BANDWIDTH = 1e13    # bytes/s: a measurement or capacity at or above it is refused (80 Tbit/s)
MAX_RTT = 3600.0        # seconds
MAX_PERIOD = 3600.0     # a heartbeat period, seconds
MAX_GONE = 8            # peers one record may announce dead (NodeRecord.gone)
MAX_SPEED = 64.0        # a node's measured training speed against its benchmark: at most this factor either way

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
    """A node's signed heartbeat (its body is encoded by wire/codec.py, within these limits)."""

    peer: str = field(metadata={"wire": {"max_len": 128}})
    role: str = field(metadata={"wire": {"choices": ("node", "bootstrap", "client")}})
    addrs: tuple[str, ...] = field(metadata={"wire": {"max_len": MAX_ADDRS, "item": {"max_len": 255}}})
    profile: DeviceProfile | None
    started: float               # the node's own wall-clock start time (informational)
    seq: int = field(metadata={"wire": {"lo": 0, "hi": U63}})   # increases with every heartbeat; newer wins
    leaving: bool = False
    # the sender's heartbeat period, seconds (0: not announced; absent in records of older nodes)
    period: float = field(default=0.0, metadata={"wire": {"name": "hb", "lo": 0.0, "hi": MAX_PERIOD, "optional": True}})

    # data-plane TCP multiaddrs peers should dial (empty: none; absent in records of older nodes)
    data: tuple[str, ...] = field(default=(), metadata={"wire": {"max_len": MAX_ADDRS, "item": {"max_len": 255},
                                                                 "optional": True}})
    # whether its announced addresses were dialled back from outside (REACHES)
    reach: str = field(default=REACH_UNKNOWN, metadata={"wire": {"choices": REACHES, "optional": True}})
    # the speed it trained at in its last jobs, as a factor of its profile's (0: not measured yet; jobs/rebalance.py),
    # and the model it was measured on (the jobs' model_hash: the cost model's error differs from model to model)
    speed: float = field(default=0.0, metadata={"wire": {"lo": 0.0, "hi": MAX_SPEED, "omit_default": True}})
    speed_model: str = field(default="", metadata={"wire": {"name": "speed_of", "max_len": 64, "omit_default": True}})
    # the IP a bootstrap's dial-back check saw it at (its NAT's public address when behind one): hole punching
    # (net/holepunch.py) dials a member only at an IP its record names, this one or those of its addrs
    seen: str = field(default="", metadata={"wire": {"max_len": 64, "omit_default": True}})
    # peers this node, one of their watchers, just found dead (swarm/watch.py): a notice that spreads at once
    gone: tuple[str, ...] = field(default=(), metadata={"wire": {"max_len": MAX_GONE, "item": {"max_len": 128},
                                                                 "omit_default": True}})

    def speed_on(self, model: str) -> float:
        """The announced speed if it was measured on *model* (a job's ``model_hash``), else 0 (none)."""
        return speed_on(self.speed, self.speed_model, model)

    def body(self) -> dict[str, Any]:
        return to_wire(self)


def speed_on(speed: float, measured_on: str, model: str) -> float:
    """A training speed figure measured on the model *measured_on*, for a job of *model*: 0 (none) for
    another model (the cost model's error is not the same for every model)."""
    return speed if model and measured_on == model else 0.0


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
    t = typed_field(env, "t", str, "record")
    body_bytes = typed_field(env, "b", bytes, "record")
    sig = typed_field(env, "s", bytes, "record")
    body = expect_map(unpackb(body_bytes, max_size=MAX_RECORD), "record body")
    peer = typed_field(body, "peer", str, "record body")
    if not verify(peer, _tag(t, body_bytes), sig):
        raise RemoteProtocolError(f"bad signature on {t} record claiming to be from {short_peer(peer)}")
    with malformed(f"{t[:16]} record"):
        if t == "node":
            return _node(body)
        if t == "bw":
            return _bw(body)
    raise RemoteProtocolError(f"unknown record type {t[:32]!r}")


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


def decode_profile(obj: Any, what: str = "profile") -> DeviceProfile:
    """A DeviceProfile from a peer's map (in a node record or a snapshot), every field bounded by its
    ``wire`` metadata (fusionp2p/types.py)."""
    return from_wire(DeviceProfile, obj, what)


def _node(b: dict[str, Any]) -> NodeRecord:
    return from_wire(NodeRecord, b, "node record")


def _bw(b: dict[str, Any]) -> BandwidthReport:
    w = "bandwidth report"
    peer = as_str(b["peer"], f"{w} peer")
    raw = typed_field(b, "m", list, w)
    if len(raw) > MAX_MEASUREMENTS:
        raise RemoteProtocolError("bandwidth report: too many measurements")
    ms = []
    for item in as_pair_list(raw, f"{w} measurement", max_len=MAX_MEASUREMENTS, arity=4):
        # bandwidth and rtt in [0, MAX) (the bound excluded), samples a count
        bw = as_float(item[1], f"{w} bandwidth", lo=0.0, hi=math.nextafter(MAX_BANDWIDTH, 0.0))
        rtt = as_float(item[2], f"{w} rtt", lo=0.0, hi=math.nextafter(MAX_RTT, 0.0))
        n = as_int(item[3], f"{w} samples", lo=0, hi=U63)
        ms.append(Measurement(src=peer, dst=as_str(item[0], f"{w} peer"), bandwidth=bw, rtt=rtt, samples=n))
    hi = math.nextafter(MAX_BANDWIDTH, 0.0)
    up = as_float(typed_field(b, "up", float, w), f"{w} uplink", lo=0.0, hi=hi)
    down = as_float(typed_field(b, "down", float, w), f"{w} downlink", lo=0.0, hi=hi)
    return BandwidthReport(peer=peer, seq=as_int(typed_field(b, "seq", int, w), f"{w} seq", lo=0, hi=U63), uplink=up,
                           downlink=down, measurements=tuple(ms))
