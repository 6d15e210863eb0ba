"""Membership and bandwidth views: pure state machines fed with verified records and a clock.

Every node keeps its *own* authoritative view (the DHT is only for discovery): a peer is alive while
its heartbeats (signed NodeRecords with increasing ``seq``) keep arriving; once nothing came for ``timeout``
seconds, or for ``beats`` of its own announced heartbeat periods when that is longer (large swarms stretch
the period, see swarm.py), it is *suspect* for ``confirm`` seconds (0: dead at once): still a member, and
dead only if no word of it (a record, or the answer to the direct ping the shell sends it,
``swarm/suspect.py``, :meth:`MembershipView.vouch`) came by then; it is gone at once when it announces
``leaving``. ``now`` is always passed in (trio.current_time() in the shell, a fake clock in tests).

The bandwidth table keeps each measuring node's latest report and answers, for any pair, the
directly measured link (either direction, the fresher EMA wins) or, when unmeasured, the sound
estimate ``min(uplink[a], downlink[b])`` from the nodes' own capacity estimates.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from fusionp2p.swarm.capacity_trust import StrikeHistory, TrustConfig, corroborated
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


def pair_rank(a: str, b: str) -> int:
    """A number of the unordered pair {a, b} that every node computes alike, spread at random."""
    lo, hi = (a, b) if a < b else (b, a)
    return int.from_bytes(hashlib.blake2b(f"{lo}/{hi}".encode(), digest_size=8).digest(), "big")


def chosen(peer: str, members: list[str], k: int) -> list[str]:
    """The *k* members whose pair with *peer* ranks lowest (:func:`pair_rank`): the peers *peer* measures
    and watches (docs/swarm.md "Bounded work"). A hash of the pair picks them, so they are spread over
    the swarm whatever the peer ids, no node can choose to be chosen, and every node computes every
    node's choice from its own view. All the others while the swarm has at most *k* of them."""
    others = [p for p in members if p != peer]
    if len(others) <= k:
        return others
    return heapq.nsmallest(k, others, key=lambda p: pair_rank(peer, p))


def probes_of(peer: str, members: list[str], k: int) -> list[str]:
    """The peers whose link with *peer* it measures itself.

    A pair is measured when either side chose the other (:func:`chosen`), by the side that chose it,
    :func:`prober_of` when both did. So a node measures at most *k* links, a few dozen however large the
    swarm, and is measured by the peers that chose it (*k* on average); at most *k* + 1 members, every
    pair is measured, each from one side, as before."""
    everyone = members if peer in members else [*members, peer]   # a node's view of the members leaves itself out
    return [p for p in chosen(peer, everyone, k) if prober_of(peer, p) == peer or peer not in chosen(p, everyone, k)]


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


# seconds a member that died still counts in the swarm's size (MembershipView.counted): a few of a large
# swarm's stretched heartbeat periods, and the prober keeps a dead member's link as long (KEEP_DEAD)
RECENT_DEATHS = 120.0


class MembershipView:
    """Live members from heartbeats, with a timeout for dead peers (after *confirm* seconds of suspicion)."""

    def __init__(self, *, self_peer: str, timeout: float, beats: float = 5.0, confirm: float = 0.0) -> None:
        if timeout <= 0 or beats <= 1 or not confirm >= 0:
            raise ValueError("timeout must be positive, beats larger than 1 and confirm >= 0")
        self.self_peer = self_peer
        self.timeout = timeout
        self.beats = beats
        self.confirm = confirm
        # members silent past their timeout, by the end of their suspicion: alive until then, dead at it
        # unless a record or a ping's answer (vouch) came; at most the live members
        self.suspects: dict[str, float] = {}
        self.records: dict[str, NodeRecord] = {}
        self.last_seen: dict[str, float] = {}
        self.dead: set[str] = set()
        # members that died recently, by the time of death: they still count in the swarm's size
        # (:meth:`counted`), pruned past the window asked for, so bounded by the recent deaths
        self._died: dict[str, float] = {}
        self.left: set[str] = set()
        self.rejected = 0   # records older than what we hold (replays) or malformed
        # (deadline, peer), one per live member, earliest first: a tick looks only at the members whose
        # deadline passed, not at every member (a pass over all of them twice a heartbeat was the largest
        # per-node cost that grew with the swarm: 12% of the CPU of 150 simulated nodes). A deadline is a
        # lower bound (a later record moves the real one on): the entry is checked and pushed again.
        self._due: list[tuple[float, str]] = []
        self._alive: dict[str | None, list[str]] = {}   # alive() by role, until the member set changes

    def on_record(self, rec: NodeRecord, now: float) -> list[MemberEvent]:
        old = self.records.get(rec.peer)
        if old is not None and rec.seq <= old.seq and not (rec.started > old.started):
            self.rejected += 1
            return []
        self.records[rec.peer] = rec
        self.suspects.pop(rec.peer, None)
        if rec.leaving:
            self.last_seen.pop(rec.peer, None)
            self.dead.discard(rec.peer)
            self._died.pop(rec.peer, None)
            self.left.add(rec.peer)
            self._alive.clear()
            return [MemberEvent(Change.LEFT, rec.peer)]
        if rec.peer not in self.last_seen:
            heapq.heappush(self._due, (now + self.timeout_of(rec.peer), rec.peer))
            self._alive.clear()
        elif old is not None and old.role != rec.role:
            self._alive.clear()
        self.last_seen[rec.peer] = now
        if rec.peer in self.dead or rec.peer in self.left:
            self._died.pop(rec.peer, None)
            self.dead.discard(rec.peer)
            self.left.discard(rec.peer)
            return [MemberEvent(Change.REVIVED, rec.peer)]
        return [MemberEvent(Change.JOINED if old is None else Change.UPDATED, rec.peer)]

    def timeout_of(self, peer: str) -> float:
        """Seconds without a heartbeat after which *peer* is dead."""
        rec = self.records.get(peer)
        return max(self.timeout, self.beats * rec.period) if rec is not None else self.timeout

    def counted(self, now: float, within: float = RECENT_DEATHS) -> int:
        """Members alive, ourselves included, plus those that died less than *within* seconds ago: the
        swarm's size as a heartbeat period follows it. A node that only stopped hearing its peers
        (a starved process, lost gossip) must not shorten its period on that account: its peers time it
        out by the period it announces, so a shorter one got it declared dead sooner, and it then heard
        fewer of them still (20 processes on the loaded 2-core machine, 2026-11-29: 976 deaths in 3
        minutes, half of them 5-10 s after the member joined or revived, no pair measured in 200 s)."""
        old = [p for p, t in self._died.items() if now - t >= within]
        for p in old:
            del self._died[p]
        return len(self.last_seen) + len(self._died)

    def excuse(self, seconds: float) -> None:
        """This node was not listening for *seconds* (its event loop was held up): the heartbeats peers sent
        meanwhile are not read yet, so that time does not count as their silence."""
        for peer in self.last_seen:
            self.last_seen[peer] += seconds
        for peer in self.suspects:
            self.suspects[peer] += seconds

    def vouch(self, peer: str, now: float) -> bool:
        """*peer* answered us directly (a ping): as good as a record now. False if it is no live member."""
        if peer not in self.last_seen or peer == self.self_peer:
            return False
        self.last_seen[peer] = seen = max(self.last_seen[peer], now)
        if self.suspects.pop(peer, None) is not None:   # its entry in _due is at the suspicion's end: one now
            heapq.heappush(self._due, (seen + self.timeout_of(peer), peer))
        return True

    def tick(self, now: float) -> list[MemberEvent]:
        """The members silent past their timeout, now suspect (:attr:`suspects`), and those whose
        suspicion ended without word of them, now dead. Looks only at those whose deadline (as of their
        last record) passed: per tick, work in the members that died or sent a record since."""
        out = []
        while self._due and self._due[0][0] < now:
            _, peer = heapq.heappop(self._due)
            seen = self.last_seen.get(peer)
            if seen is None or peer == self.self_peer:
                continue   # dead, left or ourselves: no longer watched here
            deadline = seen + self.timeout_of(peer)
            if now <= deadline:
                self.suspects.pop(peer, None)
                heapq.heappush(self._due, (deadline, peer))
                continue
            if self.confirm > 0:
                until = self.suspects.setdefault(peer, now + self.confirm)
                if now <= until:
                    heapq.heappush(self._due, (until, peer))
                    continue
            out.extend(self._kill(peer, now))
        return out

    def _kill(self, peer: str, now: float | None) -> list[MemberEvent]:
        self.suspects.pop(peer, None)
        if peer == self.self_peer or self.last_seen.pop(peer, None) is None:
            return []
        self.dead.add(peer)
        if now is not None:
            self._died[peer] = now
        self._alive.clear()
        return [MemberEvent(Change.DEAD, peer)]

    def declare_dead(self, peer: str, now: float | None = None) -> list[MemberEvent]:
        """*peer* is dead by a watcher's word (``swarm/watch.py``), not by its silence here; a newer record
        of it revives it. *now*: when (for :meth:`counted`; None: not counted as a recent death)."""
        return self._kill(peer, now)

    def alive(self, *, role: str | None = "node") -> list[str]:
        """Sorted peer ids of live members (of one role, or all with role=None). The same list object until
        the member set changes (do not modify it): callers asking every heartbeat, or for every record,
        cost no sort of the whole swarm, and may tell a change by the object."""
        got = self._alive.get(role)
        if got is None:
            got = self._alive[role] = sorted(p for p in self.last_seen if role is None or self.records[p].role == role)
        return got

    def is_alive(self, peer: str) -> bool:
        return peer in self.last_seen


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    bandwidth: float   # bytes / s
    rtt: float         # seconds
    measured: bool     # False: estimated from capacities


# An announced capacity more than this multiple of the best rate other nodes measured on a link of the node
# is contradicted by them: the estimates take that measured rate instead, and the announcement is counted
# against the node (``BandwidthTable.strikes``). A link's rate is at most either end's capacity, so the best
# one is a lower bound of it; the slack leaves room for a node whose measured peers were all slower than itself.
CAPACITY_SLACK = 4.0


class BandwidthTable:
    """The swarm's bandwidth matrix, assembled from every node's signed reports.

    A pair is measured (some node's report has it) or estimated from the two nodes' capacities, each the
    node's own announcement checked against what others measured of it (``CAPACITY_SLACK``): a node that
    announces capacities its peers' measurements contradict is estimated at what they measured, never above
    a measurement, and each such announcement is counted against it (``strikes``). A node contradicted
    report after report is distrusted (``swarm/capacity_trust.py``): its announcements and its own
    uncorroborated measurements of its pairs no longer count."""

    def __init__(self, trust: TrustConfig | None = None) -> None:
        self.reports: dict[str, BandwidthReport] = {}
        # dst -> src -> the figure src measured of its link to dst (every report's measurements, by dst)
        self._of: dict[str, dict[str, Measurement]] = {}
        self.strikes: dict[str, int] = {}    # per node, its announcements (reports) that measurements contradicted
        self._struck: dict[str, int] = {}    # per node, the seq of its report last counted (each counted once)
        self.trust = StrikeHistory(trust)    # nodes contradicted again and again: .distrusted

    def on_report(self, rep: BandwidthReport) -> bool:
        old = self.reports.get(rep.peer)
        if old is not None and rep.seq <= old.seq:
            return False
        self._unindex(old)
        if old is not None:
            self.trust.settle(rep.peer, self._struck.get(rep.peer) == old.seq)
        self.reports[rep.peer] = rep
        for m in rep.measurements:
            if m.samples > 0 and m.dst != rep.peer:
                self._of.setdefault(m.dst, {})[rep.peer] = m
        # the report's own announcement, and those of the nodes it measured, may be contradicted now
        for peer in {rep.peer, *(m.dst for m in rep.measurements)}:
            r = self.reports.get(peer)
            if r is None:
                continue
            if self._struck.get(peer) != r.seq and self.contradicted(peer):
                self._struck[peer] = r.seq
                self.strikes[peer] = self.strikes.get(peer, 0) + 1
            self.trust.judge(peer, self._struck.get(peer) == r.seq)
        return True

    def _unindex(self, rep: BandwidthReport | None) -> None:
        if rep is None:
            return
        for m in rep.measurements:
            by = self._of.get(m.dst)
            if by is not None:
                by.pop(rep.peer, None)
                if not by:
                    del self._of[m.dst]

    def forget(self, peer: str) -> None:
        self._unindex(self.reports.pop(peer, None))
        self.trust.forget(peer)

    def direct(self, a: str, b: str) -> LinkEstimate | None:
        """The measurement of a->b or b->a; the one with more samples wins (then the smaller bandwidth). A
        distrusted node's measurement counts only when the other end measured nothing of the pair and
        corroborates it (``swarm/capacity_trust.py``)."""
        found = [(m.samples, -m.bandwidth, m) for m in (self._of.get(b, {}).get(a), self._of.get(a, {}).get(b))
                 if m is not None]
        if not found:
            return None
        if self.trust.distrusted:
            found = self._credible(found)
            if not found:
                return None
        m = max(found, key=lambda x: (x[0], x[1]))[2]
        return LinkEstimate(m.bandwidth, m.rtt, True)

    def _credible(self, found: list[tuple[int, float, Measurement]]) -> list[tuple[int, float, Measurement]]:
        bad = self.trust.distrusted
        kept = [f for f in found if f[2].src not in bad]
        if kept:
            return kept   # the other end measured the pair: its figure, whatever sample count the other claims
        return [f for f in found if corroborated(f[2], self.reports.get(f[2].dst), CAPACITY_SLACK)]

    def measured_of(self, peer: str) -> float | None:
        """The best rate other (trusted) nodes measured on a link of *peer* (a lower bound of its capacities;
        None: none)."""
        by_others = self._of.get(peer)
        if not by_others:
            return None
        bad = self.trust.distrusted
        if not bad:
            return max(m.bandwidth for m in by_others.values())
        return max((m.bandwidth for src, m in by_others.items() if src not in bad), default=None)

    def contradicted(self, peer: str) -> bool:
        """Whether *peer*'s announced uplink or downlink is more than ``CAPACITY_SLACK`` times what others
        measured of it (:meth:`measured_of`)."""
        rep, best = self.reports.get(peer), self.measured_of(peer)
        return rep is not None and best is not None and max(rep.uplink, rep.downlink) > CAPACITY_SLACK * best

    def capacity(self, peer: str) -> tuple[float, float, float]:
        """(uplink, downlink, latency) of *peer* for estimates: its announced capacities (0: unknown), each
        one more than ``CAPACITY_SLACK`` times the best rate others measured of it replaced by that measured
        rate; its latency, half the smallest RTT measured on any of its links (0: none measured)."""
        rep = self.reports.get(peer)
        up, down = (rep.uplink, rep.downlink) if rep is not None else (0.0, 0.0)
        best = self.measured_of(peer)
        if best is not None and peer in self.trust.distrusted:
            up = down = best   # its word counts for nothing: what others measured of it
        elif best is not None:
            up, down = (best if c > CAPACITY_SLACK * best else c for c in (up, down))
        by_others = list(self._of.get(peer, {}).values())
        rtts = [m.rtt for m in by_others if m.rtt > 0]
        if rep is not None:
            rtts += [m.rtt for m in rep.measurements if m.samples > 0 and m.rtt > 0]
        return up, down, min(rtts, default=0.0) / 2

    def estimate(self, a: str, b: str) -> LinkEstimate | None:
        """The measured link of *a* and *b*, else an estimate: the smaller of a's uplink and b's downlink
        (either one while the other is unknown), and the sum of their latencies (:meth:`capacity`)."""
        d = self.direct(a, b)
        if d is not None:
            return d
        up, _, lat_a = self.capacity(a)
        _, down, lat_b = self.capacity(b)
        caps = [c for c in (up, down) if c > 0]
        return LinkEstimate(min(caps), lat_a + lat_b, False) if caps else None

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


def judged_links(reports: Iterable[BandwidthReport], distrusted: Iterable[str] = ()) -> list[tuple[str, str, LinkEstimate]]:
    """The measured links of *reports* (the latest of each node, as a bootstrap's view gives them: the
    publisher's first plan), judged as a member's own table judges them (``capacity_trust``): every
    measurement as reported, but a distrusted node's own one of a pair that the other end measured, or does
    not corroborate, is dropped, and a pair left without one is estimated (:meth:`BandwidthTable.estimate`:
    from what others measured of it). One view of the latest reports holds no strike history, so
    *distrusted* (the view giver's: ``view_wire.decode_view``) seeds it (``StrikeHistory.assume``); a node
    contradicted in enough of the reports seen since is distrusted here too."""
    table = BandwidthTable()
    reports = list(reports)
    table.trust.assume(distrusted)
    for r in reports:
        table.on_report(r)
    bad = table.trust.distrusted
    measured = {(m.src, m.dst) for r in reports for m in r.measurements if m.samples > 0}
    out: list[tuple[str, str, LinkEstimate]] = []
    dropped: set[tuple[str, str]] = set()
    for r in reports:
        for m in r.measurements:
            if not (m.bandwidth > 0 and math.isfinite(m.bandwidth) and math.isfinite(m.rtt)) or m.src == m.dst:
                continue
            other_measured = m.dst not in bad and (m.dst, m.src) in measured
            if m.src in bad and (other_measured or not corroborated(m, table.reports.get(m.dst), CAPACITY_SLACK)):
                dropped.add((m.src, m.dst))
                continue
            out.append((m.src, m.dst, LinkEstimate(m.bandwidth, m.rtt, True)))
    kept = {frozenset((a, b)) for a, b, _ in out}
    for a, b in sorted(dropped):
        if frozenset((a, b)) not in kept and (e := table.estimate(a, b)) is not None:
            out.append((a, b, e))
    return out
