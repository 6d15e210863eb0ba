"""Membership and bandwidth views: pure state machines fed with verified records and a clock.

Every node keeps its *own* authoritative view (the DHT is only for discovery): a peer is alive while
its heartbeats (signed NodeRecords with increasing ``seq``) keep arriving; it is dead once nothing
came for ``timeout`` seconds, or for ``beats`` of its own announced heartbeat periods when that is
longer (large swarms stretch the period, see swarm.py), and gone at once when it announces ``leaving``. ``now`` is always
passed in (trio.current_time() in the shell, a fake clock in tests).

The bandwidth table keeps each measuring node's latest report and answers, for any pair, the
directly measured link (either direction, the fresher EMA wins) or, when unmeasured, the sound
estimate ``min(uplink[a], downlink[b])`` from the nodes' own capacity estimates.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum

from fusionp2p.wire.records import BandwidthReport, Measurement, NodeRecord


def prober_of(a: str, b: str) -> str:
    """The one of *a* and *b* that probes their link (every node computes the same answer).

    Each unordered pair is probed from one side only: the measurement covers the pair (the bandwidth
    table treats it as the link's figure in both directions, and the probed side times the same transfer
    for its downlink figure), and halves the probes. A hash of the pair picks the side, so that every
    node probes about half of its peers (the smaller peer id would leave one node all the work).
    """
    if a == b:
        raise ValueError("a pair needs two peers")
    lo, hi = (a, b) if a < b else (b, a)
    return lo if hashlib.blake2b(f"{lo}/{hi}".encode(), digest_size=1).digest()[0] & 1 else hi


class Change(Enum):
    JOINED = "joined"
    UPDATED = "updated"
    LEFT = "left"
    DEAD = "dead"
    REVIVED = "revived"


@dataclass(frozen=True, slots=True)
class MemberEvent:
    change: Change
    peer: str


def ema(old: float | None, new: float, alpha: float) -> float:
    """Exponential moving average; the first sample is taken as is."""
    if not 0 < alpha <= 1:
        raise ValueError("alpha must be in (0, 1]")
    return new if old is None else (1 - alpha) * old + alpha * new


class MembershipView:
    """Live members from heartbeats, with a timeout for dead peers."""

    def __init__(self, *, self_peer: str, timeout: float, beats: float = 5.0) -> None:
        if timeout <= 0 or beats <= 1:
            raise ValueError("timeout must be positive and beats larger than 1")
        self.self_peer = self_peer
        self.timeout = timeout
        self.beats = beats
        self.records: dict[str, NodeRecord] = {}
        self.last_seen: dict[str, float] = {}
        self.dead: set[str] = set()
        self.left: set[str] = set()
        self.rejected = 0   # records older than what we hold (replays) or malformed

    def on_record(self, rec: NodeRecord, now: float) -> list[MemberEvent]:
        old = self.records.get(rec.peer)
        if old is not None and rec.seq <= old.seq and not (rec.started > old.started):
            self.rejected += 1
            return []
        self.records[rec.peer] = rec
        if rec.leaving:
            self.last_seen.pop(rec.peer, None)
            self.dead.discard(rec.peer)
            self.left.add(rec.peer)
            return [MemberEvent(Change.LEFT, rec.peer)]
        self.last_seen[rec.peer] = now
        if rec.peer in self.dead or rec.peer in self.left:
            self.dead.discard(rec.peer)
            self.left.discard(rec.peer)
            return [MemberEvent(Change.REVIVED, rec.peer)]
        return [MemberEvent(Change.JOINED if old is None else Change.UPDATED, rec.peer)]

    def timeout_of(self, peer: str) -> float:
        """Seconds without a heartbeat after which *peer* is dead."""
        rec = self.records.get(peer)
        return max(self.timeout, self.beats * rec.period) if rec is not None else self.timeout

    def excuse(self, seconds: float) -> None:
        """This node was not listening for *seconds* (its event loop was held up): the heartbeats peers sent
        meanwhile are not read yet, so that time does not count as their silence."""
        for peer in self.last_seen:
            self.last_seen[peer] += seconds

    def tick(self, now: float) -> list[MemberEvent]:
        out = []
        for peer, seen in list(self.last_seen.items()):
            if peer != self.self_peer and now - seen > self.timeout_of(peer):
                del self.last_seen[peer]
                self.dead.add(peer)
                out.append(MemberEvent(Change.DEAD, peer))
        return out

    def alive(self, *, role: str | None = "node") -> list[str]:
        """Sorted peer ids of live members (of one role, or all with role=None)."""
        return sorted(p for p in self.last_seen if role is None or self.records[p].role == role)

    def is_alive(self, peer: str) -> bool:
        return peer in self.last_seen


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    bandwidth: float   # bytes / s
    rtt: float         # seconds
    measured: bool     # False: estimated from capacities


class BandwidthTable:
    """The swarm's bandwidth matrix, assembled from every node's signed reports."""

    def __init__(self) -> None:
        self.reports: dict[str, BandwidthReport] = {}

    def on_report(self, rep: BandwidthReport) -> bool:
        old = self.reports.get(rep.peer)
        if old is not None and rep.seq <= old.seq:
            return False
        self.reports[rep.peer] = rep
        return True

    def forget(self, peer: str) -> None:
        self.reports.pop(peer, None)

    def direct(self, a: str, b: str) -> LinkEstimate | None:
        """The measurement of a->b or b->a; the one with more samples wins (then the smaller bandwidth)."""
        found: list[tuple[int, float, Measurement]] = []
        for src, dst in ((a, b), (b, a)):
            rep = self.reports.get(src)
            if rep is None:
                continue
            found.extend((m.samples, -m.bandwidth, m) for m in rep.measurements if m.dst == dst and m.samples > 0)
        if not found:
            return None
        m = max(found, key=lambda x: (x[0], x[1]))[2]
        return LinkEstimate(m.bandwidth, m.rtt, True)

    def estimate(self, a: str, b: str) -> LinkEstimate | None:
        d = self.direct(a, b)
        if d is not None:
            return d
        ra, rb = self.reports.get(a), self.reports.get(b)
        caps = [c for c in ((ra.uplink if ra else 0.0), (rb.downlink if rb else 0.0)) if c > 0]
        return LinkEstimate(min(caps), 0.0, False) if caps else None

    def matrix(self, peers: list[str]) -> dict[tuple[str, str], LinkEstimate]:
        out = {}
        for a in peers:
            for b in peers:
                if a != b and (e := self.estimate(a, b)) is not None:
                    out[(a, b)] = e
        return out

    def complete(self, peers: list[str]) -> bool:
        """True when every pair of *peers* has a direct measurement."""
        return all(self.direct(a, b) is not None for i, a in enumerate(peers) for b in peers[i + 1 :])
