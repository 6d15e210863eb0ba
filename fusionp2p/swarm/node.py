"""The swarm service every node (and the bootstrap) runs: join, heartbeats, membership, probes, views.

Tasks, all owned by :meth:`SwarmNode.run`'s nursery:

* heartbeat: publish one bundle per period on TOPIC_MEMBERS: our signed NodeRecord plus our latest
  signed BandwidthReport. The period is ``heartbeat`` while the swarm is small and stretches to
  ``members / gossip_rate`` beyond, so that the whole swarm sends about ``gossip_rate`` messages a
  second whatever its size (every message reaches every node, D times over gossipsub);
* listener: verify and apply the records in gossip (bad ones are counted and dropped; a report
  identical to the one we hold is not verified again);
* reaper: mark peers suspect after ``dead_timeout`` (or ``dead_beats`` of their announced periods, if
  longer) without a heartbeat, and dead ``confirm`` seconds later unless they answered the direct ping
  the confirmer (``swarm/suspect.py``, ``SwarmNode.confirmer``) sends them meanwhile;
* watcher (``swarm/watch.py``, ``SwarmNode.watcher``): ping the ``watch`` members we chose every heartbeat
  and announce at once those that stopped answering (``NodeRecord.gone``), so that a death is known
  within a bound that does not grow with the swarm, as the heartbeat period does;
* prober (``swarm/prober.py``, ``SwarmNode.prober``): measure RTT/throughput to peers, each pair from
  one side only; the node signs its figures into our BandwidthReport and publishes our first figure,
  and the round that completes our share of the matrix, at once (early heartbeats, at most one per
  half period);
* dialer (``swarm/dialer.py``): connect directly to every member we learn of (again if the connection dropped), so gossip
  and probes do not depend on the bootstrap; on joining, one VIEW round trip to the bootstrap tells us
  every live member at once;
* reach and relay (``swarm/self_reach.py``, ``SwarmNode.own_reach``): from joining on, whatever the deferred
  start-up, learn from our bootstraps' dial-back whether peers can dial us, and hold relay slots while not.

A VIEW protocol serves the raw signed records we hold, so ``fusionp2p status`` can show the swarm
after one round trip and verify every record itself.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from fusionp2p.errors import ConfigError, PeerUnavailable, RemoteProtocolError
from fusionp2p.net.addrs import addr_ip, dial_scopes, ip_scope, peer_dial_addrs
from fusionp2p.net.dial_errors import is_final
from fusionp2p.net.identity import verify
from fusionp2p.net.refusals import Refusals
from fusionp2p.net.transport import GossipMessage, Relaying, Stream, Transport
from fusionp2p.swarm.dialer import MemberDialer
from fusionp2p.swarm.membership import BandwidthTable, Change, MemberEvent, MembershipView
from fusionp2p.swarm.probe import ProbeConfig, RawPath
from fusionp2p.swarm.prober import LinkProber
from fusionp2p.swarm.reach import ReachConfig, ReachService, install_reversal, should_dial
from fusionp2p.swarm.rejoin import keep_joined
from fusionp2p.swarm.self_reach import SelfReach
from fusionp2p.swarm.suspect import Confirmer

# the VIEW protocol's wire lives in swarm/view_wire.py; re-exported here for its older importers
from fusionp2p.swarm.view_wire import MAX_VIEW, fetch_view_raw
from fusionp2p.swarm.view_wire import VIEW as VIEW
from fusionp2p.swarm.view_wire import decode_view as decode_view
from fusionp2p.swarm.view_wire import fetch_view as fetch_view
from fusionp2p.swarm.watch import Watcher, watches
from fusionp2p.types import DeviceProfile, short_peer
from fusionp2p.wire.framing import encode_frame
from fusionp2p.wire.msg import packb
from fusionp2p.wire.protocols import PROBE, REACH, TOPIC_MEMBERS
from fusionp2p.wire.records import (
    MAX_ADDRS,
    MAX_BANDWIDTH,
    MAX_RTT,
    MAX_SPEED,
    BandwidthReport,
    Measurement,
    NodeRecord,
    Record,
    decode_signed,
    encode_bundle,
    encode_signed,
    speed_on,
    split_bundle,
)

log = logging.getLogger(__name__)



@dataclass(frozen=True, kw_only=True, slots=True)
class SwarmConfig:
    role: str = "node"                 # "node" | "bootstrap"
    heartbeat: float = 1.0             # period while the swarm is small (see gossip_rate)
    dead_timeout: float = 5.0          # or dead_beats of the member's announced periods, if longer
    dead_beats: float = 5.0
    gossip_rate: float = 5.0           # swarm-wide heartbeat messages / s: period = max(heartbeat, members / rate)
    watch: int = 8                     # members each node pings every heartbeat (swarm/watch.py; 0: none)
    # a watched member silent this long (or dead_timeout, if longer) is declared dead, where the records' own
    # timeout is longer (more than ~20 members): 12 processes on the loaded 2-core machine opened streams in
    # 8 s (median), and a 10 s watch declared live nodes dead 14 times in 2 minutes
    watch_timeout: float = 20.0
    # a member silent past its timeout is suspect this long, pinged directly (at most confirm_pings at once),
    # and declared dead only if it neither answered nor sent a record (swarm/suspect.py; 0: dead at once)
    # (20 processes on the 2-core machine, 2026-11-30: PROBE streams opened in 5.4 s, median, 9 s at p90)
    confirm: float = 10.0
    confirm_pings: int = 4
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    probing: bool = True               # measure bandwidth to peers (off on bootstraps)
    join_attempts: int = 5
    join_backoff: float = 0.5
    reach: ReachConfig = field(default_factory=ReachConfig)
    relays: int = 2                    # relay slots a node that cannot be dialled keeps (0: never relayed)
    relay_retry: float = 300.0         # a peer that refused us a slot is asked again after this long

    def __post_init__(self) -> None:
        if self.relays < 0 or self.relay_retry <= 0:
            raise ConfigError("relays must be >= 0 and relay_retry positive")
        if self.role not in ("node", "bootstrap"):
            raise ConfigError(f"role must be node or bootstrap, not {self.role!r}")
        if self.heartbeat <= 0 or self.dead_timeout <= self.heartbeat:
            raise ConfigError("dead_timeout must be larger than the heartbeat period")
        if self.dead_beats <= 1:
            raise ConfigError("dead_beats must be larger than 1")
        if self.gossip_rate <= 0:
            raise ConfigError("gossip_rate must be positive")
        if self.watch < 0 or not self.watch_timeout > 0:
            raise ConfigError("watch must be >= 0 and watch_timeout positive")
        if not self.confirm >= 0 or self.confirm_pings < 1:
            raise ConfigError("confirm must be >= 0 and confirm_pings >= 1")


# A job's measured speed of this node (note_speed) enters the announced figure with this weight: one job's
# figure is noisy (a benchmarks.wan host read 0.65-0.99x on the whole model in four consecutive jobs).
SPEED_WEIGHT = 0.5
ADDRS_TTL = 30.0   # seconds our derived listen addresses are reused (SwarmNode._own_addrs)


@dataclass
class Counters:
    bad_records: int = 0
    probes_ok: int = 0
    probes_failed: int = 0
    probes_busy: int = 0
    probes_direct: int = 0             # measured both ways on a raw socket to the peer's data-plane port
    probes_inconclusive: int = 0       # no transfer long enough to count (the figure only sizes the next probe)
    early_beats: int = 0               # heartbeats sent early to publish newly measured pairs
    events: list[MemberEvent] = field(default_factory=list)


class SwarmNode:
    """One participant's membership and bandwidth view, kept current over a Transport."""

    def __init__(self, transport: Transport, config: SwarmConfig, profile: DeviceProfile | None, *,
                 wall_clock: Callable[[], float] = time.time, rng: random.Random | None = None,
                 refusals: Refusals | None = None) -> None:
        self.transport = transport
        # refused input of every intake loop of this node (gossip, probes, and the job service's JOB,
        # content and data plane, which take this table), counted per peer and reason, with a penalty
        self.refusals = refusals if refusals is not None else Refusals()
        self.config = config
        self.profile = profile
        self.peer_id = transport.peer_id
        self.view = MembershipView(self_peer=self.peer_id, timeout=config.dead_timeout, beats=config.dead_beats,
                                   confirm=config.confirm)
        self.bandwidth = BandwidthTable()
        self.counters = Counters()
        self._started = wall_clock()
        self._seq = 0
        self._bw_seq = 0
        self._raw: dict[str, bytes] = {}        # latest signed record bytes per peer (for VIEW)
        self._raw_bw: dict[str, bytes] = {}
        self._known_bw: set[bytes] = set()      # = set(_raw_bw.values()): repeats are not verified again
        self._own_bw: bytes | None = None       # our latest signed report, re-signed when it changes
        self._reported_down = 0.0
        self._announced = config.heartbeat
        self._last_beat = -float("inf")
        self._addrs: tuple[float, tuple[str, ...]] | None = None   # (when, _own_addrs())
        self._connected_at, self._connected_set = -float("inf"), set[str]()
        self._changed = trio.Event()
        self._beat_now = trio.Event()
        self._rng = rng or random.Random()
        self.prober = LinkProber(transport, config.probe, heartbeat=config.heartbeat, view=self.view,
                                 bandwidth=self.bandwidth, members=self.members, counters=self.counters,
                                 beat_soon=self.beat_soon, refusals=self.refusals, rng=self._rng)
        self.watcher = Watcher(transport, k=config.watch, heartbeat=config.heartbeat, dead_after=max(config.watch_timeout, config.dead_timeout),
                               members=self.members, heard=self.view.last_seen.get, timeout_of=self.view.timeout_of,
                               declare=self._declare_gone)
        self._urgent = False                        # the next early beat goes out at once (we were declared dead)
        self._urgent_now = trio.Event()             # ... even one already waiting out its half period
        self._pulling = False                       # the records being applied come from a VIEW, not gossip
        self._leaving = False
        self.listeners: list[Callable[[MemberEvent], None]] = []
        # the speed this node trained at in its last jobs of one model, as a factor of its profile's (0: none
        # measured; note_speed), and that model's hash, announced in our record for the planners of later jobs
        self.speed = 0.0
        self.speed_model = ""
        self._boot_ips: set[str] = set()            # the IPs of the bootstrap addresses we were given
        self._servers: set[str] = set()             # the bootstraps we joined (dial-back checks, reversal)
        # announced in our record: what our bootstraps' dial-back found (swarm/self_reach.py: checked on joining,
        # whatever the start-up), the data plane's addresses (set by the job service once it listens), relay slots
        self.own_reach = SelfReach(transport, config.reach, relays=config.relays, relay_retry=config.relay_retry,
                                   heartbeat=config.heartbeat, servers=lambda: self._servers,
                                   records=lambda: self.view.records, announce=self.beat_soon)
        self.reach_service = ReachService(transport, serve_checks=config.role == "bootstrap",
                                          servers=lambda: self._servers, config=config.reach)
        self.dialer = MemberDialer(transport, connected=self._connected, alive=self.view.is_alive,
                                   scopes=self.dial_scopes)   # swarm/dialer.py
        self._dialed = self.dialer.queued
        self.confirmer = Confirmer(transport, self.view, limit=config.confirm_pings, redial=self._redial,
                                   dead=lambda p: self._apply_events(self.view.declare_dead(p, trio.current_time())))

    # -- public -----------------------------------------------------------------------------------
    async def run(self, bootstrap: list[str], *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Join through *bootstrap* addresses and serve until cancelled."""
        self.transport.set_stream_handler(PROBE, self.prober.server)
        self.transport.set_stream_handler(VIEW, self._serve_view)
        self.transport.set_stream_handler(REACH, self.reach_service)
        members = await self.transport.subscribe(TOPIC_MEMBERS)
        self._boot_ips = {ip for a in bootstrap if (ip := addr_ip(a.split("/p2p/", 1)[0])) is not None}
        joined = await self._join(bootstrap)
        self._servers = set(joined)
        # a reversal has the peer dial us: pointless while we cannot be dialled (both behind NATs), where it
        # held up the relay by its request timeout (issue 43); a relayed peer is dialled at its record's circuits
        install_reversal(self.transport, lambda: [] if self.needs_relay() else
                         sorted(self._servers & set(self.transport.connected_peers())))
        if (circuits := getattr(self.transport, "set_circuit_source", None)) is not None:
            circuits(self.circuits_of)
        punch = getattr(self.transport, "set_hole_punch_policy", None)
        if punch is not None:
            punch(self.punch_ips)
        scopes = getattr(self.transport, "set_dial_scopes", None)   # what the transport's own dials may reach
        if scopes is not None:
            scopes(self.dial_scopes)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._listen, members)
            pulled = trio.Event()
            nursery.start_soon(self._pull_views, joined, pulled)
            nursery.start_soon(self._reaper)
            nursery.start_soon(self.confirmer.run)
            nursery.start_soon(self.dialer.run)
            if self.config.probing and self.config.role == "node":
                nursery.start_soon(self.prober.run)
            if self.config.watch and self.config.role == "node":
                nursery.start_soon(self.watcher.run)
            if self.config.role == "node" and self._servers:   # at once: a relay slot must not wait for the start-up
                nursery.start_soon(self.own_reach.check_loop)
            if self._servers:   # a dropped bootstrap connection is dialled again (swarm/rejoin.py)
                at = {p: a for a in bootstrap if (p := a.rsplit("/p2p/", 1)[-1]) in self._servers}
                nursery.start_soon(partial(keep_joined, self.transport, at, period=self.period, pull=self._pull_view,
                                           dial_timeout=self.config.probe.timeout))
            if self.config.role == "node" and self.config.relays and isinstance(self.transport, Relaying):
                nursery.start_soon(self.own_reach.relay_loop, self.transport)
            # Our first record announces our heartbeat period, which follows the swarm's size: with the view
            # in hand it is the stretched one at once (otherwise the configured one, and an extra beat that
            # every node of a forming swarm sends within a second). The pull is not waited for long.
            with trio.move_on_after(self.config.heartbeat):
                await pulled.wait()
            await self._publish_record()
            nursery.start_soon(self._heartbeat_loop)
            task_status.started()

    def set_training(self, training: Callable[[], bool]) -> None:
        """The job service says whether this node trains now (``jobs/node.py``): while it does, it runs no
        refresh probes and its probe server refuses re-measurements (first measurements still run).
        A transfer that shares a link with a job's traffic reads the job's leftovers, not the link, and
        the next plan would take that for the link."""
        self.prober.set_training(training)

    def note_speed(self, factor: float, model: str) -> None:
        """A job of *model* (its ``model_hash``) measured this node training at *factor* times the speed its
        profile predicts (``jobs/run.py``): announce the geometric mean of it and the figures before on the
        same model (``SPEED_WEIGHT`` for the new one), at once. A job of another model starts over: the cost
        model's error is not the same for every model (the built-in gpt2-tiny read 2.56x on a free core of
        the 2-core machine, benchmarks.wan's GPT-2 0.78-0.99x on its 0.33-core hosts)."""
        if not (math.isfinite(factor) and factor > 0):
            return
        f = min(MAX_SPEED, max(1.0 / MAX_SPEED, factor))
        if self.speed <= 0 or model != self.speed_model:
            self.speed, self.speed_model = f, model
        else:
            self.speed = math.exp((1.0 - SPEED_WEIGHT) * math.log(self.speed) + SPEED_WEIGHT * math.log(f))
        self._beat_now.set()

    def beat_soon(self) -> None:
        """Publish our records early (newly measured pairs, a new speed): at most one per half period."""
        self._beat_now.set()

    def speed_on(self, model: str) -> float:
        """Our announced speed if it was measured on *model* (a job's ``model_hash``), else 0 (none)."""
        return speed_on(self.speed, self.speed_model, model)

    def set_raw_path(self, raw: RawPath | None) -> None:
        """The data plane listens (``jobs/node.py``): probes time both directions of a link on raw sockets
        to its port (``swarm/probe.py``), in both roles."""
        self.prober.set_raw_path(raw)

    def set_data_addrs(self, addrs: tuple[str, ...]) -> None:
        """The data plane listens (``jobs/node.py``): announce *addrs* and check that peers can dial them."""
        self.own_reach.set_data_addrs(addrs)

    @property
    def data_addrs(self) -> tuple[str, ...]:
        return self.own_reach.data_addrs

    @property
    def reach(self) -> str:
        """What our bootstraps' dial-back found (``wire/records.py`` REACH_*; ``swarm/self_reach.py``)."""
        return self.own_reach.reach

    @reach.setter
    def reach(self, reach: str) -> None:
        self.own_reach.reach = reach

    def needs_relay(self) -> bool:
        """Peers cannot open a libp2p connection to us (the dial-back check said so)."""
        return self.own_reach.needs_relay()

    async def leave(self) -> None:
        """Announce departure (peers remove us at once)."""
        self._leaving = True
        with trio.move_on_after(2):
            await self._publish_record(leaving=True)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait for *predicate* to hold after some change; trio.TooSlowError after *timeout*."""
        with trio.fail_after(timeout):
            while not predicate():
                await self._changed.wait()

    def members(self) -> list[str]:
        """Live training members (role node), ourselves included when we are one."""
        return self.view.alive(role="node")

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able picture of our view (used by status and benchmarks)."""
        peers = self.view.alive(role=None)
        return {
            "self": self.peer_id,
            "members": [self._member_json(self.view.records[p]) for p in peers],
            "dead": sorted(self.view.dead),
            "bandwidth": [
                {"src": a, "dst": b, "bytes_per_s": e.bandwidth, "rtt_s": e.rtt, "measured": e.measured}
                for (a, b), e in sorted(self.bandwidth.matrix(self.members()).items())
            ],
        }

    @staticmethod
    def _member_json(rec: NodeRecord) -> dict[str, Any]:
        prof = rec.profile
        return {"peer": rec.peer, "role": rec.role, "addrs": list(rec.addrs), "data": list(rec.data), "reach": rec.reach,
                "profile": prof.to_wire() if prof else None}

    # -- joining ----------------------------------------------------------------------------------
    async def _join(self, bootstrap: list[str]) -> list[str]:
        """Connect to the bootstrap addresses; the peer ids reached."""
        if not bootstrap:
            return []
        delay = self.config.join_backoff
        attempts = self.config.join_attempts
        causes: dict[str, str] = {}
        for attempt in range(1, attempts + 1):
            ok = []
            for addr in bootstrap:
                try:
                    ok.append(await self.transport.connect(addr))
                except PeerUnavailable as exc:
                    causes[addr] = exc.reason or str(exc)
                    log.warning("bootstrap %s, attempt %d/%d: %s", short_peer(exc.peer), attempt, attempts, causes[addr])
            if ok:
                return ok
            # a port that answers with another peer id (or another protocol) answers so again: stop now
            if attempt == attempts or all(is_final(c) for c in causes.values()):
                break
            await trio.sleep(delay)  # backoff between join attempts, not a readiness wait
            delay *= 2
        raise PeerUnavailable(bootstrap[0].rsplit("/p2p/", 1)[-1],
                              f"no bootstrap reachable after {attempt} attempt{'s' * (attempt > 1)}: "
                              + "; ".join(dict.fromkeys(causes.values())))

    async def _pull_views(self, peers: list[str], done: trio.Event) -> None:
        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(self._pull_view, peer)
        done.set()

    async def _pull_view(self, peer: str) -> None:
        """Take the live members' signed records from *peer* (a bootstrap) once, on joining.

        Gossip only carries heartbeats sent after we joined, and py-libp2p's replay of its message cache
        to new peers is off for the members topic (it cost one RPC per cached message per connection);
        one VIEW round trip gives us every member (and its latest report) at once, so we dial and probe
        them without waiting for a heartbeat period or a gossipsub mesh."""
        try:
            with trio.fail_after(self.config.probe.timeout):
                raw = await fetch_view_raw(self.transport, peer)
        except (PeerUnavailable, RemoteProtocolError, trio.TooSlowError) as exc:
            log.debug("view from %s: %s", short_peer(peer), exc)
            return
        alive = set(raw["alive"])
        self._pulling = True   # a death notice in a pulled record is old news: the peer may have revived since
        try:
            for data in [*raw["records"], *raw["bw"]]:
                self._ingest(data, peer, only=alive)
        finally:
            self._pulling = False

    # -- heartbeats and records -------------------------------------------------------------------
    def period(self) -> float:
        """Our heartbeat period: the configured one, stretched so the swarm sends ~gossip_rate messages/s."""
        return max(self.config.heartbeat, self.view.counted(trio.current_time()) / self.config.gossip_rate)

    def _record(self, leaving: bool = False, gone: tuple[str, ...] = ()) -> NodeRecord:
        self._seq += 1
        self._announced = self.period()   # peers time us out by this, so it is also our next wait
        # direct addresses first (a peer on our LAN dials them), then circuits through our relays
        circuits = self.transport.circuit_addrs() if isinstance(self.transport, Relaying) else []
        addrs = list(self._own_addrs())[: MAX_ADDRS - min(len(circuits), 4)]
        addrs += [a.rsplit("/p2p/", 1)[0] for a in circuits][:4]
        return NodeRecord(peer=self.peer_id, role=self.config.role, addrs=tuple(addrs),
                          profile=self.profile, started=self._started, seq=self._seq, leaving=leaving, period=self._announced,
                          data=self.data_addrs, reach=self.reach, speed=self.speed, speed_model=self.speed_model,
                          seen=self.own_reach.seen_ip, gone=gone)

    def _own_addrs(self) -> tuple[str, ...]:
        """Our listen addresses without the /p2p/ part, derived again at most every ``ADDRS_TTL`` seconds:
        py-libp2p builds them anew per call (6% of publishing a heartbeat, per record and per dial)."""
        now = trio.current_time()
        if self._addrs is None or now - self._addrs[0] > ADDRS_TTL:
            self._addrs = (now, tuple(a.rsplit("/p2p/", 1)[0] for a in self.transport.listen_addrs()))
        return self._addrs[1]

    async def _publish_record(self, leaving: bool = False, gone: tuple[str, ...] = ()) -> None:
        self._last_beat = trio.current_time()
        parts = [encode_signed(self._record(leaving, gone), self.transport.sign)]
        if not leaving and (bw := self._signed_report()) is not None:
            parts.append(bw)
        await self.transport.publish(TOPIC_MEMBERS, encode_bundle(parts))

    async def _heartbeat_loop(self) -> None:
        while not self._leaving:
            # jitter below the announced period, so that heartbeats of nodes started together spread out
            with trio.move_on_after(self._announced * self._rng.uniform(0.8, 1.0)):
                await self._beat_now.wait()
                # an early beat (newly measured pairs): at most one per half period, and the next regular beat
                # is a full period after it, so peers' timeouts hold and the gossip budget is barely touched;
                # at once when a watcher declared us dead (our record revives us everywhere), also while an early
                # beat already waits here (a new reach verdict on joining had delayed a revival by seconds)
                if not self._urgent:
                    with trio.move_on_at(self._last_beat + self._announced / 2):
                        await self._urgent_now.wait()
                self.counters.early_beats += 1
            self._beat_now, self._urgent_now, self._urgent = trio.Event(), trio.Event(), False
            if not self._leaving:
                await self._publish_record()

    async def _declare_gone(self, peer: str) -> None:
        """Our watcher found *peer* dead: so it is here at once, and everywhere once our notice arrives."""
        if not self.view.is_alive(peer):
            return
        self._apply_events(self.view.declare_dead(peer, trio.current_time()))
        if not self._leaving:
            await self._publish_record(gone=(peer,))

    def _on_notice(self, rec: NodeRecord) -> None:
        """*rec* (new) announces peers dead: taken from a watcher of theirs (``swarm/watch.py``); about us,
        answered with a record at once."""
        members = None
        for peer in rec.gone:
            if peer == self.peer_id:
                if not self._leaving:
                    self._urgent = True
                    self._beat_now.set()
                    self._urgent_now.set()
                continue
            if not self.view.is_alive(peer) or rec.peer == peer:
                continue
            members = members if members is not None else self.members()
            if watches(rec.peer, peer, members, self.config.watch):
                log.debug("member %s declared dead by its watcher %s", short_peer(peer), short_peer(rec.peer))
                self._apply_events(self.view.declare_dead(peer, trio.current_time()))

    async def _reaper(self) -> None:
        period = self.config.heartbeat / 2
        due = trio.current_time() + period
        while True:
            await trio.sleep_until(due)
            now = trio.current_time()
            if now - due > period:
                # we were held up (a long synchronous step, a starved process): what peers sent meanwhile
                # waits unread behind this wake-up, and is no evidence of their death
                self.view.excuse(now - due)
            self._apply_events(self.view.tick(now))
            if self.view.suspects:
                self.confirmer.kick()
            due = now + period

    async def _listen(self, ch: trio.MemoryReceiveChannel[GossipMessage]) -> None:
        async for msg in ch:
            self.handle_gossip(msg)

    def handle_gossip(self, msg: GossipMessage) -> None:
        """Verify and apply one gossip message (a record or a bundle); anything bad is counted and dropped.

        Never raises: one message must not end the listener. A peer banned by :attr:`refusals` (a flood of
        bad records) is not read at all until its penalty decays."""
        now = trio.current_time()
        if self.refusals.banned(msg.sender, now=now):
            self.counters.bad_records += 1
            return
        try:
            parts = split_bundle(msg.data)
        except RemoteProtocolError as exc:
            self._refuse(msg.sender, "gossip/malformed", exc)
            return
        for raw in parts:
            self._ingest(raw, msg.sender)

    def _refuse(self, peer: str, reason: str, exc: BaseException) -> None:
        self.counters.bad_records += 1
        self.refusals.refuse(peer, reason, now=trio.current_time(), detail=str(exc))

    def _ingest(self, raw: bytes, sender: str, *, only: set[str] | None = None) -> None:
        if raw in self._known_bw:
            return   # the report we already hold, repeated in a heartbeat: nothing new to verify
        try:
            rec = decode_signed(raw, verify)
        except RemoteProtocolError as exc:
            self._refuse(sender, "gossip/record", exc)
            return
        if only is None or rec.peer in only:
            try:
                self._apply_record(rec, raw)
            except Exception as exc:   # a bug of ours that a peer's valid record reached: log it, keep listening
                log.exception("applying a %s record of %s failed", type(rec).__name__, short_peer(rec.peer))
                self._refuse(sender, "gossip/apply", exc)

    def _apply_record(self, rec: Record, raw: bytes) -> None:
        if isinstance(rec, NodeRecord):
            events = self.view.on_record(rec, trio.current_time())
            if events:
                self._raw[rec.peer] = raw
                if rec.gone and not self._pulling and self.config.watch:
                    self._on_notice(rec)
            if rec.leaving:
                self._forget_bw(rec.peer)
            self._apply_events(events)
            # Only the larger peer id dials: simultaneous cross-dials leave py-libp2p with a half-dead
            # duplicate connection on which new streams hang (seen with 8 hosts in one process). A member
            # we are not connected to (never yet, or the connection dropped) is dialled at its heartbeat.
            # A node that peers cannot dial (behind a NAT) dials those that can instead (swarm/reach.py).
            if (should_dial(self.peer_id, self.reach, rec.peer, rec.reach) and not rec.leaving
                    and rec.addrs and self.dialer.due(rec.peer) and rec.peer not in self._connected()):
                self.dialer.spawn(rec)
        elif isinstance(rec, BandwidthReport) and self.bandwidth.on_report(rec):
            self._known_bw.discard(self._raw_bw.get(rec.peer, b""))
            self._raw_bw[rec.peer] = raw
            self._known_bw.add(raw)
            self._notify()

    def _connected(self) -> set[str]:
        """The peers we are connected to, as of at most half a period ago (our dials are added at once):
        asked for every record we take, and the transport's answer costs a pass over all of them, so once
        per half period (members / gossip_rate), not per half heartbeat: per-node work flat in N, not linear."""
        now = trio.current_time()
        if now - self._connected_at > self.period() / 2:
            self._connected_at, self._connected_set = now, set(self.transport.connected_peers())
        return self._connected_set

    def _forget_bw(self, peer: str) -> None:
        self.bandwidth.forget(peer)
        self._known_bw.discard(self._raw_bw.pop(peer, b""))

    def dial_scopes(self) -> frozenset[str]:
        """Where we dial peers' announced addresses (``net/addrs.py``): public addresses, and the private or
        loopback ranges that we listen on, reached a bootstrap on, or were seen at ourselves."""
        own = {ip for a in self._own_addrs() if (ip := addr_ip(a)) is not None}
        return dial_scopes(own | self._boot_ips | ({self.own_reach.seen_ip} if self.own_reach.seen_ip else set()))

    def punch_ips(self, peer: str) -> set[str] | None:
        """Where hole punching may dial *peer* (``net/holepunch.py``): the IPs its signed record names (its
        direct addresses, the IP a bootstrap saw it at) within our scopes; None if it is no live member."""
        rec = self.view.records.get(peer)
        if rec is None or rec.leaving or not self.view.is_alive(peer):
            return None
        scopes = self.dial_scopes()
        ips = {addr_ip(a) for a in rec.addrs if "/p2p-circuit" not in a} | {rec.seen}
        return {ip for ip in ips if ip and ip_scope(ip) in scopes}

    def circuits_of(self, peer: str) -> list[str]:
        """The circuit addresses (at most 2, at relays in our scopes) that live member *peer*'s record announces."""
        rec = self.view.records.get(peer)
        if rec is None or rec.leaving or not self.view.is_alive(peer):
            return []
        return peer_dial_addrs([a for a in rec.addrs if "/p2p-circuit" in a], self.dial_scopes(), limit=2)

    async def _redial(self, peer: str) -> bool:
        rec = self.view.records.get(peer)
        return rec is not None and bool(rec.addrs) and await self.dialer.dial(rec)

    def _apply_events(self, events: list[MemberEvent]) -> None:
        if not events:
            return
        for ev in events:
            if ev.change in (Change.DEAD, Change.LEFT):
                self._dialed.discard(ev.peer)
                self.prober.on_gone(ev.peer, left=ev.change is Change.LEFT)
            if ev.change in (Change.JOINED, Change.REVIVED):
                self.prober.on_joined(ev.peer)
            if ev.change is not Change.UPDATED:
                log.info("member %s %s", short_peer(ev.peer), ev.change.value)
                self.counters.events.append(ev)
            for fn in self.listeners:
                fn(ev)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- bandwidth reports -------------------------------------------------------------------------
    def _signed_report(self) -> bytes | None:
        """Our latest BandwidthReport, signed; re-signed only when a measurement changed."""
        pr = self.prober
        if pr.dirty or self._own_bw is None or pr.server.best_inbound() != self._reported_down:
            rep = self._report()
            pr.dirty = False
            if rep is not None:
                self._own_bw = encode_signed(rep, self.transport.sign)
                self._apply_record(rep, self._own_bw)
        return self._own_bw

    def _report(self) -> BandwidthReport | None:
        # every figure within what peers accept (wire/records.py): one bad figure, whatever its source,
        # must not make the whole signed report unacceptable (a peer's 1e300 once did)
        ms = tuple(Measurement(src=self.peer_id, dst=p, bandwidth=_in_range(ln.bandwidth, MAX_BANDWIDTH),
                               rtt=_in_range(ln.rtt, MAX_RTT), samples=ln.samples)
                   for p, ln in sorted(self.prober.links.items()) if ln.samples)
        inbound = _in_range(self.prober.server.best_inbound(), MAX_BANDWIDTH)
        if not ms and not inbound:
            return None
        self._bw_seq += 1
        # Capacity estimates: uplink = the best rate we sent at; downlink = the best rate a peer's probe
        # arrived at (our probe server times them); either one stands in for the other while it is unknown
        # (each pair is probed from one side, so a node may have only one of them).
        self._reported_down = inbound
        up = max((m.bandwidth for m in ms), default=inbound)
        down = inbound or up
        return BandwidthReport(peer=self.peer_id, seq=self._bw_seq, uplink=up, downlink=down, measurements=ms)

    # -- VIEW protocol ----------------------------------------------------------------------------
    async def _serve_view(self, stream: Stream) -> None:
        if self.refusals.banned(stream.remote_peer, now=trio.current_time()):
            return   # closed unanswered
        body = packb({"records": list(self._raw.values()), "bw": list(self._raw_bw.values()),
                      "alive": self.view.alive(role=None), "dead": sorted(self.view.dead),
                      "distrusted": sorted(self.bandwidth.trust.distrusted)})   # for a publisher's first plan
        await stream.send_all(encode_frame(body, max_frame=MAX_VIEW))
        await stream.send_eof()


def _in_range(x: float | None, hi: float) -> float:
    """*x* clamped into ``[0, hi)`` (NaN and None: 0)."""
    if x is None or not x > 0:
        return 0.0
    return x if x < hi else math.nextafter(hi, 0.0)
