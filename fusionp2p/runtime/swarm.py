"""The swarm service every node (and the bootstrap) runs: join, heartbeats, membership, probes, views.

Tasks, all owned by :meth:`SwarmNode.run`'s nursery:

* heartbeat: publish one bundle per period on TOPIC_MEMBERS: our signed NodeRecord plus our latest
  signed BandwidthReport. The period is ``heartbeat`` while the swarm is small and stretches to
  ``members / gossip_rate`` beyond, so that the whole swarm sends about ``gossip_rate`` messages a
  second whatever its size (every message reaches every node, D times over gossipsub);
* listener: verify and apply the records in gossip (bad ones are counted and dropped; a report
  identical to the one we hold is not verified again);
* reaper: mark peers dead after ``dead_timeout`` (or ``dead_beats`` of their announced periods, if
  longer) without a heartbeat;
* prober: measure RTT/throughput to peers: all of them while the swarm has at most ``probe_sample``
  other members, otherwise at most ``probe_sample`` per round, never-measured peers first and then a
  random sample; EMA-smoothed. Rounds are spaced so that bulk transfers take at most ``probe_duty``
  of the time. The first measurement is published at once (an early heartbeat), so that the node's
  capacity estimate, and with it an estimate for every pair it is part of, is known within seconds;
* dialer: connect directly to every member we learn of, so gossip and probes do not depend on the
  bootstrap; on joining, one VIEW round trip to the bootstrap tells us every live member at once.

A VIEW protocol serves the raw signed records we hold, so ``fusionp2p status`` can show the swarm
after one round trip and verify every record itself.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from fusionp2p.errors import ConfigError, PeerUnavailable, RemoteProtocolError
from fusionp2p.net.identity import verify
from fusionp2p.net.transport import GossipMessage, Stream, Transport
from fusionp2p.plan.profile import DeviceProfile
from fusionp2p.runtime.membership import BandwidthTable, Change, MemberEvent, MembershipView, ema
from fusionp2p.runtime.probe import ProbeBusy, ProbeResult, ProbeServer, next_probe_size, probe
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.msg import expect_map, packb, unpackb
from fusionp2p.wire.msg import field as wfield
from fusionp2p.wire.protocols import PROBE, TOPIC_MEMBERS
from fusionp2p.wire.records import (
    BandwidthReport,
    Measurement,
    NodeRecord,
    Record,
    decode_signed,
    encode_bundle,
    encode_signed,
    split_bundle,
)

log = logging.getLogger(__name__)

VIEW = "/fusionp2p/view/1.0.0"
MAX_VIEW = 4 * 1024 * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class SwarmConfig:
    role: str = "node"                 # "node" | "bootstrap"
    heartbeat: float = 1.0             # period while the swarm is small (see gossip_rate)
    dead_timeout: float = 5.0          # or dead_beats of the member's announced periods, if longer
    dead_beats: float = 5.0
    gossip_rate: float = 5.0           # swarm-wide heartbeat messages / s: period = max(heartbeat, members / rate)
    probe_interval: float = 10.0       # at least this long between probe rounds once every peer is measured
    probe_sample: int = 8              # all peers while there are at most this many, else this many per round
    probe_duty: float = 0.02           # bulk transfer time / wall time a node spends measuring, at most
    probe_bytes: int = 256 * 1024      # first probe size; adapted so a probe lasts ~0.3 s
    probe_timeout: float = 10.0
    probe_ctrl_timeout: float = 3.0    # open + pings + go/busy: a peer too loaded to answer is tried again later
    probe: bool = True
    ema_alpha: float = 0.5
    join_attempts: int = 5
    join_backoff: float = 0.5

    def __post_init__(self) -> None:
        if self.role not in ("node", "bootstrap"):
            raise ConfigError(f"role must be node or bootstrap, not {self.role!r}")
        if self.heartbeat <= 0 or self.dead_timeout <= self.heartbeat:
            raise ConfigError("dead_timeout must be larger than the heartbeat period")
        if self.dead_beats <= 1:
            raise ConfigError("dead_beats must be larger than 1")
        if self.gossip_rate <= 0 or not 0 < self.probe_duty <= 1 or self.probe_sample < 1:
            raise ConfigError("gossip_rate and probe_sample must be positive, probe_duty in (0, 1]")
        if not 0 < self.ema_alpha <= 1:
            raise ConfigError("ema_alpha must be in (0, 1]")


@dataclass
class _Link:
    bandwidth: float | None = None
    rtt: float | None = None
    samples: int = 0
    next_bytes: int = 0


@dataclass
class Counters:
    bad_records: int = 0
    probes_ok: int = 0
    probes_failed: int = 0
    probes_busy: int = 0
    events: list[MemberEvent] = field(default_factory=list)


class SwarmNode:
    """One participant's membership and bandwidth view, kept current over a Transport."""

    def __init__(self, transport: Transport, config: SwarmConfig, profile: DeviceProfile | None, *,
                 wall_clock: Callable[[], float] = time.time, rng: random.Random | None = None) -> None:
        self.t = transport
        self.config = config
        self.profile = profile
        self.peer_id = transport.peer_id
        self.view = MembershipView(self_peer=self.peer_id, timeout=config.dead_timeout, beats=config.dead_beats)
        self.bandwidth = BandwidthTable()
        self.counters = Counters()
        self._started = wall_clock()
        self._seq = 0
        self._bw_seq = 0
        self._links: dict[str, _Link] = {}
        self._raw: dict[str, bytes] = {}        # latest signed record bytes per peer (for VIEW)
        self._raw_bw: dict[str, bytes] = {}
        self._known_bw: set[bytes] = set()      # = set(_raw_bw.values()): repeats are not verified again
        self._own_bw: bytes | None = None       # our latest signed report, re-signed when it changes
        self._bw_dirty = False
        self._reported_down = 0.0
        self._announced = config.heartbeat
        self._dialed: set[str] = set()
        self._changed = trio.Event()
        self._probe_now = trio.Event()
        self._beat_now = trio.Event()
        self._probe_server = ProbeServer()
        self._rng = rng or random.Random()
        self._leaving = False
        self.listeners: list[Callable[[MemberEvent], None]] = []
        self._dial_send, self._dial_recv = trio.open_memory_channel[NodeRecord](1024)

    # -- public -----------------------------------------------------------------------------------
    async def run(self, bootstrap: list[str], *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Join through *bootstrap* addresses and serve until cancelled."""
        self.t.set_stream_handler(PROBE, self._probe_server)
        self.t.set_stream_handler(VIEW, self._serve_view)
        members = await self.t.subscribe(TOPIC_MEMBERS)
        joined = await self._join(bootstrap)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._listen, members)
            for peer in joined:
                nursery.start_soon(self._pull_view, peer)
            nursery.start_soon(self._heartbeat_loop)
            nursery.start_soon(self._reaper)
            nursery.start_soon(self._dialer)
            if self.config.probe and self.config.role == "node":
                nursery.start_soon(self._probe_loop)
            await self._publish_record()
            task_status.started()

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
        return {"peer": rec.peer, "role": rec.role, "addrs": list(rec.addrs), "profile": prof.to_wire() if prof else None}

    # -- joining ----------------------------------------------------------------------------------
    async def _join(self, bootstrap: list[str]) -> list[str]:
        """Connect to the bootstrap addresses; the peer ids reached."""
        if not bootstrap:
            return []
        delay = self.config.join_backoff
        last: Exception | None = None
        for _attempt in range(self.config.join_attempts):
            ok = []
            for addr in bootstrap:
                try:
                    ok.append(await self.t.connect(addr))
                except PeerUnavailable as exc:
                    last = exc
            if ok:
                return ok
            await trio.sleep(delay)  # backoff between join attempts, not a readiness wait
            delay *= 2
        raise PeerUnavailable(bootstrap[0].rsplit("/p2p/", 1)[-1], f"no bootstrap reachable after {self.config.join_attempts} attempts ({last})")

    async def _pull_view(self, peer: str) -> None:
        """Take the live members' signed records from *peer* (a bootstrap) once, on joining.

        Gossip only carries heartbeats sent after we joined, and py-libp2p's replay of its message cache
        to new peers is off for the members topic (it cost one RPC per cached message per connection);
        one VIEW round trip gives us every member (and its latest report) at once, so we dial and probe
        them without waiting for a heartbeat period or a gossipsub mesh."""
        try:
            with trio.fail_after(self.config.probe_timeout):
                raw = await _fetch_view_raw(self.t, peer)
        except (PeerUnavailable, RemoteProtocolError, trio.TooSlowError) as exc:
            log.debug("view from %s: %s", peer[:16], exc)
            return
        alive = set(raw["alive"])
        for data in [*raw["records"], *raw["bw"]]:
            self._ingest(data, peer, only=alive)

    # -- heartbeats and records -------------------------------------------------------------------
    def period(self) -> float:
        """Our heartbeat period: the configured one, stretched so the swarm sends ~gossip_rate messages/s."""
        return max(self.config.heartbeat, len(self.view.last_seen) / self.config.gossip_rate)

    def _record(self, leaving: bool = False) -> NodeRecord:
        self._seq += 1
        self._announced = self.period()   # peers time us out by this, so it is also our next wait
        return NodeRecord(peer=self.peer_id, role=self.config.role, addrs=tuple(a.rsplit("/p2p/", 1)[0] for a in self.t.listen_addrs()),
                          profile=self.profile, started=self._started, seq=self._seq, leaving=leaving, period=self._announced)

    async def _publish_record(self, leaving: bool = False) -> None:
        parts = [encode_signed(self._record(leaving), self.t.sign)]
        if not leaving and (bw := self._signed_report()) is not None:
            parts.append(bw)
        await self.t.publish(TOPIC_MEMBERS, encode_bundle(parts))

    async def _heartbeat_loop(self) -> None:
        while not self._leaving:
            # jitter below the announced period, so that heartbeats of nodes started together spread out
            with trio.move_on_after(self._announced * self._rng.uniform(0.8, 1.0)):
                await self._beat_now.wait()
            self._beat_now = trio.Event()
            if not self._leaving:
                await self._publish_record()

    async def _reaper(self) -> None:
        while True:
            await trio.sleep(self.config.heartbeat / 2)
            self._apply_events(self.view.tick(trio.current_time()))

    async def _listen(self, ch: trio.MemoryReceiveChannel[GossipMessage]) -> None:
        async for msg in ch:
            self.handle_gossip(msg)

    def handle_gossip(self, msg: GossipMessage) -> None:
        """Verify and apply one gossip message (a record or a bundle); anything bad is counted and dropped."""
        try:
            parts = split_bundle(msg.data)
        except RemoteProtocolError as exc:
            self.counters.bad_records += 1
            log.debug("dropped gossip from %s: %s", msg.sender[:16], exc)
            return
        for raw in parts:
            self._ingest(raw, msg.sender)

    def _ingest(self, raw: bytes, sender: str, *, only: set[str] | None = None) -> None:
        if raw in self._known_bw:
            return   # the report we already hold, repeated in a heartbeat: nothing new to verify
        try:
            rec = decode_signed(raw, verify)
        except RemoteProtocolError as exc:
            self.counters.bad_records += 1
            log.debug("dropped record from %s: %s", sender[:16], exc)
            return
        if only is None or rec.peer in only:
            self._apply_record(rec, raw)

    def _apply_record(self, rec: Record, raw: bytes) -> None:
        if isinstance(rec, NodeRecord):
            events = self.view.on_record(rec, trio.current_time())
            if events:
                self._raw[rec.peer] = raw
            if rec.leaving:
                self._forget_bw(rec.peer)
            self._apply_events(events)
            # Only the larger peer id dials: simultaneous cross-dials leave py-libp2p with a half-dead
            # duplicate connection on which new streams hang (seen with 8 hosts in one process).
            if rec.peer < self.peer_id and not rec.leaving and rec.peer not in self._dialed and rec.addrs:
                self._dialed.add(rec.peer)
                self._spawn_dial(rec)
        elif isinstance(rec, BandwidthReport) and self.bandwidth.on_report(rec):
            self._known_bw.discard(self._raw_bw.get(rec.peer, b""))
            self._raw_bw[rec.peer] = raw
            self._known_bw.add(raw)
            self._notify()

    def _forget_bw(self, peer: str) -> None:
        self.bandwidth.forget(peer)
        self._known_bw.discard(self._raw_bw.pop(peer, b""))

    def _spawn_dial(self, rec: NodeRecord) -> None:
        try:
            self._dial_send.send_nowait(rec)
        except trio.WouldBlock:
            self._dialed.discard(rec.peer)  # retried at its next heartbeat

    async def _dialer(self) -> None:
        async for rec in self._dial_recv:
            if rec.peer in self.t.connected_peers() or not self.view.is_alive(rec.peer):
                continue
            for addr in rec.addrs:
                try:
                    await self.t.connect(f"{addr}/p2p/{rec.peer}")
                    break
                except (PeerUnavailable, ConfigError) as exc:
                    log.debug("dial %s at %s: %s", rec.peer[:16], addr, exc)
            else:
                self._dialed.discard(rec.peer)

    def _apply_events(self, events: list[MemberEvent]) -> None:
        if not events:
            return
        for ev in events:
            if ev.change in (Change.DEAD, Change.LEFT):
                self._dialed.discard(ev.peer)
                self._links.pop(ev.peer, None)
            if ev.change in (Change.JOINED, Change.REVIVED):
                self._probe_now.set()
            if ev.change is not Change.UPDATED:
                log.info("member %s %s", ev.peer[:16], ev.change.value)
                self.counters.events.append(ev)
            for fn in self.listeners:
                fn(ev)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- probes -----------------------------------------------------------------------------------
    def _measured(self, peer: str) -> bool:
        return peer in self._links and self._links[peer].samples > 0

    def _probe_targets(self) -> list[str]:
        """This round's peers, at most ``probe_sample``: never-measured ones while there are any (their first
        probe is small), otherwise a random sample of the others (all of them while the swarm is small)."""
        connected = set(self.t.connected_peers())
        peers = [p for p in self.members() if p != self.peer_id and p in connected]
        self._rng.shuffle(peers)   # every node walking the same sorted list would pile onto one target
        never = [p for p in peers if not self._measured(p)]
        return (never or peers)[: self.config.probe_sample]

    async def _probe_loop(self) -> None:
        while True:
            spent = 0.0
            for peer in self._probe_targets():
                spent += await self._probe_one(peer)
            connected = set(self.t.connected_peers())
            pending = any(p != self.peer_id and (p not in connected or not self._measured(p)) for p in self.members())
            # Members not yet connected (their dial is under way) or never measured (not reached yet, busy, or a
            # failed probe) are tried again after one heartbeat, otherwise after probe_interval; either way our
            # bulk transfers take at most probe_duty of the time (they load the peer's link and, on one machine,
            # its CPU: py-libp2p streams cost ~3 CPU-s per GB on each side).
            wait = max(self.config.heartbeat if pending else self.config.probe_interval, spent / self.config.probe_duty)
            with trio.move_on_after(wait):
                await self._probe_now.wait()
            self._probe_now = trio.Event()

    async def _probe_one(self, peer: str) -> float:
        """Probe *peer* once; the seconds its bulk transfer took (0 when no measurement was taken)."""
        link = self._links.setdefault(peer, _Link(next_bytes=self.config.probe_bytes))
        try:
            res: ProbeResult = await probe(self.t, peer, nbytes=link.next_bytes, timeout=self.config.probe_timeout,
                                           ctrl_timeout=self.config.probe_ctrl_timeout)
        except ProbeBusy:
            self.counters.probes_busy += 1   # retried at the next round, one heartbeat later
            return 0.0
        except PeerUnavailable as exc:
            self.counters.probes_failed += 1
            log.debug("probe %s failed: %s", peer[:16], exc)
            return 0.0
        self.counters.probes_ok += 1
        log.debug("probe %s: %.1f MB/s, rtt %.1f ms, %d bytes", peer[:16], res.bandwidth / 1e6, res.rtt * 1e3, res.nbytes)
        first = not any(ln.samples for ln in self._links.values())
        a = self.config.ema_alpha
        link.bandwidth = ema(link.bandwidth, res.bandwidth, a)
        link.rtt = ema(link.rtt, res.rtt, a)
        link.samples += 1
        link.next_bytes = next_probe_size(res.nbytes, res.elapsed)
        self._bw_dirty = True
        if first:
            self._beat_now.set()   # publish our first figures (and capacity estimate) now, not a period later
        return res.elapsed

    def _signed_report(self) -> bytes | None:
        """Our latest BandwidthReport, signed; re-signed only when a measurement changed."""
        if self._bw_dirty or self._own_bw is None or self._probe_server.best_inbound() != self._reported_down:
            rep = self._report()
            self._bw_dirty = False
            if rep is not None:
                self._own_bw = encode_signed(rep, self.t.sign)
                self._apply_record(rep, self._own_bw)
        return self._own_bw

    def _report(self) -> BandwidthReport | None:
        ms = tuple(Measurement(src=self.peer_id, dst=p, bandwidth=ln.bandwidth or 0.0, rtt=ln.rtt or 0.0, samples=ln.samples)
                   for p, ln in sorted(self._links.items()) if ln.samples)
        if not ms:
            return None
        self._bw_seq += 1
        # Capacity estimates: uplink = the best rate we sent at; downlink = the best rate a peer's probe
        # arrived at (our probe server times them), or the uplink while no peer has probed us yet.
        up = max(m.bandwidth for m in ms)
        self._reported_down = self._probe_server.best_inbound()
        down = self._reported_down or up
        return BandwidthReport(peer=self.peer_id, seq=self._bw_seq, uplink=up, downlink=down, measurements=ms)

    # -- VIEW protocol ----------------------------------------------------------------------------
    async def _serve_view(self, stream: Stream) -> None:
        body = packb({"records": list(self._raw.values()), "bw": list(self._raw_bw.values()),
                      "alive": self.view.alive(role=None), "dead": sorted(self.view.dead)})
        await stream.send_all(encode_frame(body, max_frame=MAX_VIEW))
        await stream.send_eof()


async def fetch_view(transport: Transport, peer: str, *, timeout: float = 10.0) -> dict[str, Any]:
    """Ask *peer* for its view; every record in the answer is verified here."""
    with trio.fail_after(timeout):
        m = await _fetch_view_raw(transport, peer)
    records = [decode_signed(r, verify) for r in m["records"]]
    bws = [decode_signed(r, verify) for r in m["bw"]]
    return {"records": records, "bw": bws, "alive": m["alive"], "dead": m["dead"]}


async def _fetch_view_raw(transport: Transport, peer: str) -> dict[str, list[Any]]:
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
    m = expect_map(unpackb(frames[0], max_size=MAX_VIEW), "view")
    return {"records": [r for r in wfield(m, "records", list, "view") if isinstance(r, bytes)],
            "bw": [r for r in wfield(m, "bw", list, "view") if isinstance(r, bytes)],
            "alive": [p for p in wfield(m, "alive", list, "view") if isinstance(p, str)],
            "dead": wfield(m, "dead", list, "view")}
