"""A swarm node's bandwidth prober: it measures RTT and throughput to peers (``swarm/probe.py`` sessions).

A node measures a bounded set of links however large the swarm: those of the ``probe.peers`` members it
chose (``membership.chosen``, a hash of each pair), each pair from one side only (``membership.probes_of``),
or from ours once its prober has left it unmeasured for ``probe.takeover`` seconds. The other pairs are
estimated from the nodes' announced capacities (``BandwidthTable.estimate``). Rounds: every never-measured peer of ours at once
(at most ``probe.first``; a first probe starts with a small pilot), then refresh rounds of a random
sample of ``probe.sample`` every ``probe.interval``, none while this node trains. A busy peer queues us
(``swarm/probe_hold.py``, where ``may_wait`` allows) or is tried
again within the round and on the same session in the next; figures are EMA-smoothed, RTTs the smallest of the last ``RTT_WINDOW``. A token
bucket keeps bulk transfers at ``probe.duty`` of the time (``probe.burst`` seconds at once; refresh
rounds wait for it). Refresh rounds also wait ``probe.interval`` after a peer first measured its link to
us (the swarm is forming: a refresh would hold servers that first measurements wait for). While the peers we chose stay the same and refreshed figures stay within a factor
``REFRESH_SHIFT`` of what we had, each refresh round doubles the time to the next, up to
``probe.refresh_max``: an idle swarm's links do not change, and re-measuring them every ``probe.interval``
was a third of an idle node's CPU (loopback transfers run at CPU speed). The node publishes our first figure, and the round that completes our share of
the matrix, at once (``SwarmNode.beat_soon``).
"""

from __future__ import annotations

import collections
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.refusals import Refusals
from fusionp2p.net.transport import Transport
from fusionp2p.swarm.membership import BandwidthTable, LinkEstimate, MembershipView, chosen, ema, probes_of
from fusionp2p.swarm.probe import (
    RAW_RETRY,
    SERVER_IDLE,
    ProbeBusy,
    ProbeConfig,
    ProbeResult,
    ProbeServer,
    ProbeSession,
    RawPath,
    open_probe,
    probe_size,
)
from fusionp2p.swarm.probe_hold import OWN, may_wait
from fusionp2p.types import short_peer

log = logging.getLogger("fusionp2p.swarm.node")   # the node's log, as before the prober had a module of its own

# A link's latency is the smallest RTT of its last RTT_WINDOW probes, not their average: a ping waits
# for both ends' event loops, and on a host at its CPU quota that wait is most of it. The links of
# benchmarks.wan's `mixed` hosts (tbf, no added delay) read 1-154 ms, the planner charged streaming
# CO2 that latency every step, and which hosts a plan took changed from run to run.
RTT_WINDOW = 8

# A member declared dead keeps its link's figure this long (a revived one is not measured again): on a
# machine at its CPU limit members flap (8 node processes at load 14-23: 326 deaths and 300 revivals in
# 100 s), and a figure dropped at every flap was measured again, while the pair read unmeasured in our
# report meanwhile, so the swarm's matrix was rarely complete at any one moment.
KEEP_DEAD = 120.0
# A peer whose probe stream did not open and answer in time is tried again after this many heartbeats,
# doubled after each failure in a row (at most BACKOFF_MAX: kept small, since once the machine quiets down
# a backed-off peer waits that long; 6 processes of the old code measured every pair within 3 s of the
# load easing, after 185 timeouts), with a deadline of ctrl_timeout times
# (1 + failures), at most CTRL_STRETCH: at load 14-23 stream opens took 1-3 s and more, the 3 s deadline
# discarded opens that were nearly done, and every node tried each such peer again after one heartbeat
# (236 open/ping timeouts and not one pair measured in 100 s, 8 processes), adding to the load that made
# them slow.
BACKOFF_MAX = 4
CTRL_STRETCH = 4
# A refreshed figure outside this factor of the link's smoothed one (either way) sets the refresh interval
# back to probe.interval: the link changed, and its neighbours may have too. Noise within it (loopback
# figures on a loaded machine vary by tens of percent) only stretches the interval further.
REFRESH_SHIFT = 1.5
# A session whose peer was busy is kept for the next round (one heartbeat later) while it was used within
# this long (the server closes one idle for SERVER_IDLE): at 20 processes a refused prober closed its session
# and opened a new one a heartbeat later, 3.8 opens a pair at 0.74 s (median) and 8.6 CPU-ms each.
SESSION_KEEP = SERVER_IDLE / 2


@dataclass
class _Link:
    bandwidth: float | None = None
    rtt: float | None = None       # the smallest of the recent RTTs (``RTT_WINDOW``)
    samples: int = 0
    next_bytes: int = 0
    raw_after: float = 0.0   # its raw socket failed: probed on the stream only until then
    failures: int = 0        # probes in a row whose stream did not open and answer in time
    retry_at: float = 0.0    # ... so it is not tried again before then
    rtts: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=RTT_WINDOW))


class ProbeCounters(Protocol):
    """The probe counters of the node's ``Counters`` (``swarm/node.py``), which the prober counts in."""

    probes_ok: int
    probes_failed: int
    probes_busy: int
    probes_direct: int
    probes_inconclusive: int


class LinkProber:
    """The probe state of one node (``SwarmNode.prober``): our links, our probe server, the duty bucket
    and the refresh clock. ``dirty`` says a figure changed since the node last signed its report.

    It reads the node's view, bandwidth table and live members, counts in its counters, and asks it to
    publish early (*beat_soon*); it does not know the node itself (swarm/node.py imports this module)."""

    def __init__(self, transport: Transport, config: ProbeConfig, *, heartbeat: float, view: MembershipView,
                 bandwidth: BandwidthTable, members: Callable[[], list[str]], counters: ProbeCounters,
                 beat_soon: Callable[[], None], refusals: Refusals, rng: random.Random) -> None:
        self.transport = transport
        self.peer_id = transport.peer_id
        self.config = config
        self.heartbeat = heartbeat
        self.view = view
        self.bandwidth = bandwidth
        self.members = members
        self.counters = counters
        self.beat_soon = beat_soon
        self.rng = rng
        self.links: dict[str, _Link] = {}
        self.server = ProbeServer(refusals=refusals)
        self.known_since: dict[str, float] = {}   # when each live member joined our view (for probe takeover)
        self.dead_since: dict[str, float] = {}    # members declared dead whose links we keep (KEEP_DEAD)
        self.next_refresh = 0.0                    # when the next refresh round (re-measuring peers) is due
        self.refresh_every = config.interval       # ... after the one now due: doubles while nothing changes
        self.unsettled = True                      # a link or our chosen peers changed since the last refresh
        self.credit = self.config.burst            # duty-cycle bucket: seconds of bulk transfer we may spend
        self.credit_t = 0.0
        self.new_pairs = False                     # this round measured a pair for the first time
        self.dirty = False                         # a figure changed since the node signed its report
        self.raw_path: RawPath | None = None
        self.training: Callable[[], bool] = lambda: False   # the job service's, once it runs
        self.wake = trio.Event()                   # a member joined or came back: probe now
        # our links measured once, by us or the peers (the first round done): the node's deferred start-up
        # may run now (swarm/startup.py) without its CPU holding up our first probes or theirs of us
        self.first_round = trio.Event()
        self._inbound_seen = 0                     # peers our server had timed as of the last round
        # (members, the peers we chose, the ones of them we measure), recomputed when the members change, at
        # most once a heartbeat: it costs probe.peers passes over the members (25,000 hashes at 1,000), and a
        # forming swarm changes its members with every node that joins
        # (the view hands out the same list object until its members change: compared by identity first)
        self._sets: tuple[list[str], list[str], set[str]] = ([], [], set())
        self._sets_at = -float("inf")
        self._asked = trio.Lock()                  # measurements asked for by a job's publisher: one at a time
        self.kept: dict[str, ProbeSession] = {}    # open sessions of peers that were busy (SESSION_KEEP)

    def set_training(self, training: Callable[[], bool]) -> None:
        self.training = training
        self.server.quiet = training

    def set_raw_path(self, raw: RawPath | None) -> None:
        self.raw_path = raw
        self.server.raw = raw
        self.unsettled = True   # the links are measured on another path now: the next refresh is soon

    def on_joined(self, peer: str) -> None:
        self.known_since[peer] = trio.current_time()
        self.dead_since.pop(peer, None)
        self.wake.set()

    def on_gone(self, peer: str, *, left: bool = True) -> None:
        """*peer* left (its link is forgotten) or was declared dead (its link is kept for ``KEEP_DEAD``
        seconds: a flap must not cost the pair its measurement)."""
        self.known_since.pop(peer, None)
        if left:
            self.links.pop(peer, None)
            self.dead_since.pop(peer, None)
            return
        now = trio.current_time()
        self.dead_since[peer] = now
        for p, since in list(self.dead_since.items()):
            if now - since > KEEP_DEAD:
                del self.dead_since[p]
                self.links.pop(p, None)

    def _measured(self, peer: str) -> bool:
        return peer in self.links and self.links[peer].samples > 0

    def chosen(self) -> tuple[list[str], set[str]]:
        """The live members we chose (``membership.chosen``, at most ``probe.peers``), and those of them
        whose link we measure (``membership.probes_of``)."""
        members = self.members()
        now = trio.current_time()
        if not self._same(members) and (now - self._sets_at >= self.heartbeat or not self._sets[1]):
            self._sets_at = now
            k = self.config.peers
            picked = chosen(self.peer_id, members, k)
            if picked != self._sets[1]:
                self.unsettled = True
            self._sets = (members, picked, set(probes_of(self.peer_id, members, k)))
        return self._sets[1], self._sets[2]

    def _same(self, members: list[str]) -> bool:
        """*members* are those we chose ours from."""
        return members is self._sets[0] or members == self._sets[0]

    def _ours(self, peer: str, now: float, mine: set[str]) -> bool:
        """Whether we probe *peer*, one of the members we chose: the pair is ours (``probes_of``), or its
        prober has left it unmeasured for ``probe.takeover`` seconds and has not asked our server for a
        probe within that time either (a peer that does not probe, or cannot reach us). One that tries
        (it waits for busy servers, ours included, in a starved swarm) is left to it: at 20 processes
        57 of 190 pairs were measured from both sides while their probers were alive and queued."""
        if peer in mine:
            return True
        since = self.known_since.get(peer)
        return (since is not None and now - since > self.config.takeover
                and now - self.server.tried.get(peer, -float("inf")) > self.config.takeover
                and self.bandwidth.direct(self.peer_id, peer) is None)

    def _probe_targets(self) -> list[str]:
        """This round's peers: every never-measured one of ours (at most ``probe.first``; their first probe
        starts with a small pilot), otherwise, once ``probe.interval`` has passed since the last refresh,
        a random sample of ``probe.sample`` of ours."""
        connected = set(self.transport.connected_peers())
        now = trio.current_time()
        if len(self.server.inbound) > self._inbound_seen:
            # a peer measured its link to us for the first time since the last round: the swarm around us is
            # still forming, and a refresh now would hold our server and a peer's while first measurements
            # wait for them (as our own first measurements put it off: _apply_probe)
            self._inbound_seen = len(self.server.inbound)
            self.next_refresh = max(self.next_refresh, now + self.config.interval)
        peers_chosen, mine = self.chosen()
        peers = [p for p in peers_chosen if p in connected and self._ours(p, now, mine)]
        self.rng.shuffle(peers)   # every node walking the same sorted list would pile onto one target
        never = [p for p in peers if not self._measured(p)]
        if never:
            # a peer whose last probes did not open in time waits out its backoff (it stays pending)
            return [p for p in never if p not in self.links or self.links[p].retry_at <= now][: self.config.first]
        if now < self.next_refresh or self._refill() < 0 or self.training():
            return []
        top = max(self.config.refresh_max, self.config.interval)
        self.refresh_every = self.config.interval if self.unsettled else min(2 * self.refresh_every, top)
        self.unsettled = False
        self.next_refresh = now + self.refresh_every
        return peers[: self.config.sample]

    def _pending(self) -> bool:
        """Some peer of ours is not measured yet (not connected yet, busy, or its probe failed), or the
        members changed since we chose ours."""
        now = trio.current_time()
        peers, mine = self.chosen()
        if not self._same(self.members()):
            return True
        return any(not self._measured(p) and self._ours(p, now, mine) for p in peers)

    def _links_measured(self) -> bool:
        """Every link to the members we chose is measured, from our side or theirs (``first_round``)."""
        peers, _ = self.chosen()
        return bool(peers) and self.links_measured() == len(peers)

    def links_measured(self) -> int:
        """How many links to the members we chose are measured, from our side or theirs (the deferred
        start-up waits while this grows: swarm/startup.py)."""
        peers, _ = self.chosen()
        return sum(self._measured(p) or p in self.server.inbound
                   or self.bandwidth.direct(self.peer_id, p) is not None for p in peers)

    async def _probe_round(self) -> float:
        """Probe this round's peers; the seconds of bulk transfer spent.

        Up to ``probe.parallel`` sessions open and ping at once (a peer too loaded to answer then holds up
        only its own slot, for ``probe.ctrl_timeout``), but the transfers go one at a time, so that they
        never share our link. A busy peer is tried again within the round, its session kept open."""
        spent = [0.0]
        bulk = trio.Lock()
        slots = trio.CapacityLimiter(self.config.parallel)
        async with trio.open_nursery() as nursery:
            for peer in self._probe_targets():
                nursery.start_soon(self._probe_one, peer, bulk, slots, spent)
        return spent[0]

    def _refill(self) -> float:
        """The duty-cycle bucket (seconds of bulk transfer we may spend), refilled up to now."""
        now = trio.current_time()
        self.credit = min(self.config.burst, self.credit + self.config.duty * (now - self.credit_t))
        self.credit_t = now
        return self.credit

    async def run(self) -> None:
        """Probe rounds until cancelled (the node's nursery)."""
        try:
            await self._rounds()
        finally:
            with trio.CancelScope(shield=True):
                for session in self.kept.values():
                    await session.aclose()
                self.kept.clear()

    async def _rounds(self) -> None:
        self.credit, self.credit_t = self.config.burst, trio.current_time()
        while True:
            spent = await self._probe_round()
            if self.new_pairs and not self._pending():
                # our share of the matrix is complete: publish it now, not up to a period later (not after
                # every round: each gossip message costs the swarm ~N x D RPCs, which a forming swarm feels)
                self.new_pairs = False
                self.beat_soon()
            if not self.first_round.is_set() and self._links_measured():
                self.first_round.set()
            # Our bulk transfers take at most probe_duty of the time in the long run (they load the peer's link
            # and, on one machine, its CPU: py-libp2p streams cost ~3 CPU-s per GB on each side): a token bucket
            # refills at probe_duty seconds per second up to probe_burst, and every transfer draws from it. A
            # refresh round waits until it is not overdrawn; the first measurement of a new peer does not (it
            # is one probe per pair, at most MEASURE_BYTES and a pilot). Peers of ours not measured yet (a dial
            # under way, a busy peer, a failed probe) are tried again after one heartbeat; a member joining or
            # coming back starts a round at once.
            self._refill()
            self.credit -= spent
            if self._pending() or not self.first_round.is_set():   # (the others' probes of us are not heard)
                wait = self.heartbeat
            else:
                wait = max(self.heartbeat, self.next_refresh - trio.current_time(), -self.credit / self.config.duty)
            with trio.move_on_after(wait):
                await self.wake.wait()
            self.wake = trio.Event()

    async def _probe_one(self, peer: str, bulk: trio.Lock, slots: trio.CapacityLimiter, spent: list[float]) -> None:
        """Probe *peer* once (within a round): add the seconds its transfers took to ``spent[0]``."""
        async with slots:
            session = self.kept.pop(peer, None)
            if session is not None and (trio.current_time() - session.used > SESSION_KEEP
                                        or not self.view.is_alive(peer)):
                await session.aclose()
                session = None
            if not self.view.is_alive(peer):
                return
            link = self._link(peer)
            if session is None:
                session = await self._open(peer, link)
                if session is None:
                    return
            keep = False
            try:
                res, keep = await self._measure(session, bulk, spent)
            finally:
                if keep and trio.current_time() - session.used <= SESSION_KEEP:
                    self.kept[peer] = session   # busy: the next round tries again on it
                else:
                    await session.aclose()
        if res is not None:
            self._apply_probe(peer, res)

    async def _open(self, peer: str, link: _Link) -> ProbeSession | None:
        """A new session to *peer*; None (counted, backed off) when it did not open and answer in time."""
        try:
            # with our raw socket the kernel's smallest RTT of it replaces the pings' (it is below both
            # event loops, so smaller): one ping then, not three (benchmarks.membership --probe-cost)
            pings = 1 if self.raw_path is not None and trio.current_time() >= link.raw_after else 3
            with trio.fail_after(self.config.ctrl_timeout * min(1 + link.failures, CTRL_STRETCH)):
                session = await open_probe(self.transport, peer, pings=pings)
        except (PeerUnavailable, trio.TooSlowError) as exc:
            self.counters.probes_failed += 1
            link.retry_at = trio.current_time() + self.heartbeat * min(2 ** link.failures, BACKOFF_MAX)
            link.failures += 1
            log.debug("probe %s failed: %s", short_peer(peer), str(exc) or "timed out (open/ping)")
            return None
        link.failures = 0
        return session

    async def measure_now(self, peer: str, *, timeout: float) -> LinkEstimate | None:
        """Our link to *peer*, measured now if we have no figure of it (asked for by a job's publisher before
        it adopts a plan: jobs/verify_links.py), within *timeout*; None when it could not be. One such probe
        at a time, outside the rounds (its transfer still draws on the duty bucket); the figure is ours from
        then on, as a round's would be (our next report carries it)."""
        link = self.links.get(peer)
        if link is None or link.samples == 0:
            spent = [0.0]
            with trio.move_on_after(timeout):
                async with self._asked:
                    for _ in range(2):   # a pilot (no estimate to size the first transfer) is not a figure yet
                        await self._probe_one(peer, trio.Lock(), trio.CapacityLimiter(1), spent)
                        tried = self.links.get(peer)
                        if tried is None or tried.samples or tried.failures:
                            break
            self._refill()
            self.credit -= spent[0]
            link = self.links.get(peer)
        if link is None or not link.samples or not link.bandwidth:
            return None
        return LinkEstimate(link.bandwidth, link.rtt or 0.0, True)

    def _link(self, peer: str) -> _Link:
        """Our probe state for *peer*, created on first use."""
        link = self.links.get(peer)
        if link is None:
            link = self.links[peer] = self._new_link(peer)
        return link

    def _new_link(self, peer: str) -> _Link:
        """A never-measured link: its first transfer is sized from the pair's capacity estimate (our uplink,
        its downlink) when there is one, else it is a small pilot. Too long an estimate only costs a longer
        transfer (at most MEASURE_BYTES), too short a one a follow-up transfer."""
        est = self.bandwidth.estimate(self.peer_id, peer)
        size = probe_size(est.bandwidth, lo=self.config.bytes) if est is not None else self.config.bytes
        return _Link(next_bytes=size)

    async def _measure(self, session: ProbeSession, bulk: trio.Lock,
                       spent: list[float]) -> tuple[ProbeResult | None, bool]:
        """(the result or None, whether the peer or our own server was only busy: the session is worth keeping).
        A measurement needs our server and the peer's; we wait our turn for both (probe_hold.py), the one
        of the lower peer id first (``may_wait``), so that no two nodes ever wait for each other."""
        peer = session.peer
        link = self._link(peer)
        own_first = may_wait(self.peer_id, peer)
        for attempt in range(self.config.busy_retries + 1):
            if attempt:
                # it is measuring someone else, which takes a few hundred ms: let our other peers go first
                await trio.sleep(self.rng.uniform(0.1, 0.3))
            async with bulk:
                if own_first and not await self._own_turn():
                    self.counters.probes_busy += 1   # a peer measures its link to us: ours would share it
                    log.debug("probe %s: our own server is busy", short_peer(peer))
                    continue
                try:
                    raw = self.raw_path if trio.current_time() >= link.raw_after else None
                    with trio.fail_after(self.config.timeout):
                        res = await session.measure(link.next_bytes, raw=raw, wait=True,
                                                    then=None if own_first else self._own_turn)
                except ProbeBusy as exc:
                    self.counters.probes_busy += 1
                    if exc.held:   # its server is ours until the session closes: close it now
                        log.debug("probe %s: our own server is busy", short_peer(peer))
                        return None, False
                    log.debug("probe %s: busy", short_peer(peer))
                    continue
                except (PeerUnavailable, trio.TooSlowError) as exc:
                    self.counters.probes_failed += 1
                    log.debug("probe %s failed: %s", short_peer(peer), str(exc) or "timed out (bulk)")
                    return None, False
                finally:
                    self.server.release(OWN, trio.current_time())
                spent[0] += res.elapsed
                return res, False
        return None, True   # still busy: the next round tries again on this session, one heartbeat later

    async def _own_turn(self) -> bool:
        """Our own server, for our measurement (at once, or in its queue): a peer's transfer into or out of
        us at the same time would share our link."""
        return self.server.reserve(OWN, trio.current_time()) or await self.server.wait_turn(OWN)

    def _apply_probe(self, peer: str, res: ProbeResult) -> None:
        if not self.view.is_alive(peer):
            return   # it died or left while we measured it
        link = self._link(peer)
        if res.raw_failed:
            link.raw_after = trio.current_time() + RAW_RETRY
        log.debug("probe %s: %.1f MB/s (%s: ours %.1f, theirs %s), rtt %.1f ms, %d bytes in %d transfers, %.3f s%s",
                  short_peer(peer), res.bandwidth / 1e6, res.path, (res.forward or res.bandwidth) / 1e6,
                  "-" if res.reverse is None else f"{res.reverse / 1e6:.1f}", res.rtt * 1e3, res.sent, res.transfers,
                  res.elapsed, "" if res.measured else " (inconclusive)")
        if res.reverse is not None:
            self.server.record_inbound(peer, res.reverse)   # its direction is our downlink
        if not res.measured:   # a pilot's figure: it sizes the next probe, it is never reported
            self.counters.probes_inconclusive += 1
            link.next_bytes = probe_size(res.bandwidth, lo=self.config.bytes)
            return
        self.counters.probes_ok += 1
        self.counters.probes_direct += res.path == "direct"
        a = self.config.ema_alpha
        if link.samples == 0:
            self.new_pairs = True
            # fresh figures need no refresh for a while; our very first one goes out at once (with it, our
            # capacity estimate: a figure for every pair we are part of), the rest once our share is complete
            self.next_refresh = max(self.next_refresh, trio.current_time() + self.config.interval)
            if not any(ln.samples for ln in self.links.values()):
                self.beat_soon()
        elif link.bandwidth and not 1 / REFRESH_SHIFT <= res.bandwidth / link.bandwidth <= REFRESH_SHIFT:
            self.unsettled = True
        link.bandwidth = ema(link.bandwidth, res.bandwidth, a)
        link.rtts.append(res.rtt)
        link.rtt = min(link.rtts)
        link.samples += 1
        link.next_bytes = probe_size(link.bandwidth, lo=self.config.bytes)   # one transfer of ~0.25 s next time
        self.dirty = True
