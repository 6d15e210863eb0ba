"""The planner's input: who is in a job at an epoch, what each device can do, and the links between them.

A :class:`Snapshot` is the *only* thing besides the workload, the config and the seed that a plan
depends on, so every node that holds the same snapshot computes the same plan (ARCHITECTURE.md,
"Agreement without a coordinator"). It therefore has a canonical byte encoding (msgpack through
:func:`fusionp2p.wire.msg.packb`, members and links sorted, floats as float64) and a stable sha256
hash. :func:`snapshot_from_records` builds one from gossiped records in any arrival order.

Units: ``Link.bandwidth_bps`` is in **bytes** per second, ``latency_s`` one-way seconds.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.types import DeviceProfile
from fusionp2p.wire.check import U63, as_float, as_int, as_map, as_pair_list, as_str, malformed
from fusionp2p.wire.msg import packb, typed_field, unpackb
from fusionp2p.wire.records import decode_profile

SNAPSHOT_VERSION = 1
MAX_MEMBERS = 4096
MAX_SNAPSHOT_BYTES = 64 * 1024 * 1024  # a full matrix of 4096 members stays under this


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """A measured link: bandwidth in bytes/s and one-way latency in seconds."""

    bandwidth_bps: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.bandwidth_bps > 0 and math.isfinite(self.bandwidth_bps)):
            raise ConfigError(f"link bandwidth must be a positive finite number of bytes/s, got {self.bandwidth_bps}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ConfigError(f"link latency must be a finite number of seconds >= 0, got {self.latency_s}")

    def time(self, nbytes: float) -> float:
        """One-way transfer time of *nbytes*: latency + bytes / bandwidth."""
        return self.latency_s + nbytes / self.bandwidth_bps


def _key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """Members (peer id -> DeviceProfile) and undirected links {(a, b): Link} of a job at an epoch.

    Links are undirected: the key is normalised to ``(min, max)``; a pair given in both directions
    must agree (use :func:`snapshot_from_records` to merge raw measurements). Missing pairs are
    allowed; the planner treats them as ``PlannerConfig.missing_link``.
    """

    job: str
    epoch: int
    members: Mapping[str, DeviceProfile]
    links: Mapping[tuple[str, str], Link] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.job:
            raise ConfigError("a snapshot needs a job id")
        if self.epoch < 0:
            raise ConfigError("snapshot epoch must be >= 0")
        if not self.members:
            raise ConfigError("a snapshot needs at least one member")
        if len(self.members) > MAX_MEMBERS:
            raise ConfigError(f"a snapshot holds at most {MAX_MEMBERS} members")
        members = {p: self.members[p] for p in sorted(self.members)}
        links: dict[tuple[str, str], Link] = {}
        for (a, b), link in self.links.items():
            if a == b:
                raise ConfigError(f"link from {a} to itself")
            if a not in members or b not in members:
                raise ConfigError(f"link {a}-{b} names a peer that is not a member")
            k = _key(a, b)
            if k in links and links[k] != link:
                raise ConfigError(f"link {a}-{b} given twice with different values")
            links[k] = link
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "links", dict(sorted(links.items())))

    @property
    def peers(self) -> tuple[str, ...]:
        """Member peer ids, sorted."""
        return tuple(self.members)

    def link(self, a: str, b: str) -> Link | None:
        return self.links.get(_key(a, b))

    # -- canonical encoding -------------------------------------------------------------------
    def to_obj(self) -> dict[str, Any]:
        return {
            "v": SNAPSHOT_VERSION,
            "job": self.job,
            "epoch": int(self.epoch),
            "members": [[p, prof.to_wire()] for p, prof in self.members.items()],
            "links": [[a, b, float(lk.bandwidth_bps), float(lk.latency_s)] for (a, b), lk in self.links.items()],
        }

    def to_wire(self) -> bytes:
        """Canonical bytes: equal snapshots encode to equal bytes on every node."""
        return packb(self.to_obj())

    def snapshot_hash(self) -> str:
        """Hex sha256 of :meth:`to_wire`."""
        return hashlib.sha256(self.to_wire()).hexdigest()

    @classmethod
    def from_wire(cls, data: bytes, *, max_size: int = MAX_SNAPSHOT_BYTES) -> Snapshot:
        """Decode; any malformed or out-of-range input raises RemoteProtocolError."""
        what = "snapshot"
        m = as_map(unpackb(data, max_size=max_size), what, required=("v", "job", "epoch", "members", "links"), optional=())
        if typed_field(m, "v", int, what) != SNAPSHOT_VERSION:
            raise RemoteProtocolError("snapshot: unsupported version")
        members: dict[str, DeviceProfile] = {}
        for peer, prof in as_pair_list(m["members"], "snapshot members", max_len=MAX_MEMBERS, arity=2):
            members[as_str(peer, "snapshot member")] = decode_profile(prof, "snapshot profile")
        links: dict[tuple[str, str], Link] = {}
        with malformed(what):   # Link and Snapshot check the rest (ConfigError: the peer's fault here)
            for a, b, bw, lat in as_pair_list(m["links"], "snapshot links", max_len=MAX_MEMBERS * MAX_MEMBERS // 2, arity=4):
                links[(as_str(a, "snapshot link"), as_str(b, "snapshot link"))] = Link(
                    bandwidth_bps=as_float(bw, "snapshot link bandwidth"), latency_s=as_float(lat, "snapshot link latency"))
            return cls(job=as_str(m["job"], "snapshot job", min_len=1), epoch=as_int(m["epoch"], "snapshot epoch", lo=0, hi=U63),
                       members=members, links=links)


def snapshot_from_records(
    job: str,
    epoch: int,
    profiles: Iterable[tuple[str, DeviceProfile]],
    measurements: Iterable[tuple[str, str, Link]],
) -> Snapshot:
    """Build a snapshot from records received in any order (the result does not depend on it).

    Duplicate profiles of one peer must be identical (a peer signs one record per epoch); several
    measurements of one pair (either direction) are merged conservatively: the lowest bandwidth and
    the highest latency. Measurements naming non-members are ignored (they left before the cut-off).
    """
    members: dict[str, DeviceProfile] = {}
    for peer, prof in profiles:
        if peer in members and members[peer] != prof:
            raise ConfigError(f"two different profiles for {peer} in one epoch")
        members[peer] = prof
    merged: dict[tuple[str, str], tuple[float, float]] = {}
    for a, b, link in measurements:
        if a == b or a not in members or b not in members:
            continue
        k = _key(a, b)
        bw, lat = merged.get(k, (math.inf, 0.0))
        merged[k] = (min(bw, link.bandwidth_bps), max(lat, link.latency_s))
    links = {k: Link(bandwidth_bps=bw, latency_s=lat) for k, (bw, lat) in merged.items()}
    return Snapshot(job=job, epoch=epoch, members=members, links=links)
