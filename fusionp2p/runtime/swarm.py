"""The swarm service every node (and the bootstrap) runs: join, heartbeats, membership, probes, views.

Tasks, all owned by :meth:`SwarmNode.run`'s nursery:

* heartbeat: publish our signed NodeRecord every ``heartbeat`` seconds on TOPIC_MEMBERS;
* listener: verify and apply records and bandwidth reports from gossip (bad ones are counted and dropped);
* reaper: mark peers dead after ``dead_timeout`` without a heartbeat;
* prober: measure RTT/throughput to peers (all while the swarm is small, a bounded sample plus the
  never-measured ones when large), EMA-smoothed, published as a signed BandwidthReport;
* dialer: connect directly to every member we learn of, so gossip and probes do not depend on the
  bootstrap.

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
from fusionp2p.wire.protocols import PROBE, TOPIC_BANDWIDTH, TOPIC_MEMBERS
from fusionp2p.wire.records import BandwidthReport, Measurement, NodeRecord, decode_signed, encode_signed

log = logging.getLogger(__name__)

VIEW = "/fusionp2p/view/1.0.0"
MAX_VIEW = 4 * 1024 * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class SwarmConfig:
    role: str = "node"                 # "node" | "bootstrap"
    heartbeat: float = 1.0
    dead_timeout: float = 5.0
    probe_interval: float = 10.0
    probe_sample: int = 8              # peers probed per round once the swarm is larger
    probe_bytes: int = 256 * 1024      # first probe size; adapted so a probe lasts ~0.3 s
    probe_timeout: float = 10.0
    probe: bool = True
    ema_alpha: float = 0.5
    join_attempts: int = 5
    join_backoff: float = 0.5

    def __post_init__(self) -> None:
        if self.role not in ("node", "bootstrap"):
            raise ConfigError(f"role must be node or bootstrap, not {self.role!r}")
        if self.heartbeat <= 0 or self.dead_timeout <= self.heartbeat:
            raise ConfigError("dead_timeout must be larger than the heartbeat period")
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
        self.view = MembershipView(self_peer=self.peer_id, timeout=config.dead_timeout)
        self.bandwidth = BandwidthTable()
        self.counters = Counters()
        self._started = wall_clock()
        self._seq = 0
        self._bw_seq = 0
        self._links: dict[str, _Link] = {}
        self._raw: dict[str, bytes] = {}        # latest signed record bytes per peer (for VIEW)
        self._raw_bw: dict[str, bytes] = {}
        self._dialed: set[str] = set()
        self._changed = trio.Event()
        self._probe_now = trio.Event()
        self._rng = rng or random.Random()
        self._leaving = False
        self.listeners: list[Callable[[MemberEvent], None]] = []
        self._dial_send, self._dial_recv = trio.open_memory_channel[NodeRecord](1024)

    # -- public -----------------------------------------------------------------------------------
    async def run(self, bootstrap: list[str], *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Join through *bootstrap* addresses and serve until cancelled."""
        self.t.set_stream_handler(PROBE, ProbeServer())
        self.t.set_stream_handler(VIEW, self._serve_view)
        members = await self.t.subscribe(TOPIC_MEMBERS)
        bw = await self.t.subscribe(TOPIC_BANDWIDTH)
        await self._join(bootstrap)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._listen, members)
            nursery.start_soon(self._listen, bw)
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
    async def _join(self, bootstrap: list[str]) -> None:
        if not bootstrap:
            return
        delay = self.config.join_backoff
        last: Exception | None = None
        for _attempt in range(self.config.join_attempts):
            ok = 0
            for addr in bootstrap:
                try:
                    await self.t.connect(addr)
                    ok += 1
                except PeerUnavailable as exc:
                    last = exc
            if ok:
                return
            await trio.sleep(delay)  # backoff between join attempts, not a readiness wait
            delay *= 2
        raise PeerUnavailable(bootstrap[0].rsplit("/p2p/", 1)[-1], f"no bootstrap reachable after {self.config.join_attempts} attempts ({last})")

    # -- heartbeats and records -------------------------------------------------------------------
    def _record(self, leaving: bool = False) -> NodeRecord:
        self._seq += 1
        return NodeRecord(peer=self.peer_id, role=self.config.role, addrs=tuple(a.rsplit("/p2p/", 1)[0] for a in self.t.listen_addrs()),
                          profile=self.profile, started=self._started, seq=self._seq, leaving=leaving)

    async def _publish_record(self, leaving: bool = False) -> None:
        data = encode_signed(self._record(leaving), self.t.sign)
        await self.t.publish(TOPIC_MEMBERS, data)

    async def _heartbeat_loop(self) -> None:
        while not self._leaving:
            await trio.sleep(self.config.heartbeat)
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
        """Verify and apply one gossip message; anything bad is counted and dropped."""
        try:
            rec = decode_signed(msg.data, verify)
        except RemoteProtocolError as exc:
            self.counters.bad_records += 1
            log.debug("dropped record from %s: %s", msg.sender[:16], exc)
            return
        if isinstance(rec, NodeRecord):
            events = self.view.on_record(rec, trio.current_time())
            if events:
                self._raw[rec.peer] = msg.data
            if rec.leaving:
                self.bandwidth.forget(rec.peer)
            self._apply_events(events)
            # Only the larger peer id dials: simultaneous cross-dials leave py-libp2p with a half-dead
            # duplicate connection on which new streams hang (seen with 8 hosts in one process).
            if rec.peer < self.peer_id and not rec.leaving and rec.peer not in self._dialed and rec.addrs:
                self._dialed.add(rec.peer)
                self._spawn_dial(rec)
        elif isinstance(rec, BandwidthReport) and self.bandwidth.on_report(rec):
            self._raw_bw[rec.peer] = msg.data
            self._notify()

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
    def _probe_targets(self) -> list[str]:
        connected = set(self.t.connected_peers())
        peers = [p for p in self.members() if p != self.peer_id and p in connected]
        self._rng.shuffle(peers)   # every node walking the same sorted list would pile onto one target
        never = [p for p in peers if p not in self._links or self._links[p].samples == 0]
        rest = [p for p in peers if p not in never]
        k = max(0, self.config.probe_sample - len(never))
        return never + (rest if len(peers) <= self.config.probe_sample else self._rng.sample(rest, min(k, len(rest))))

    async def _probe_loop(self) -> None:
        while True:
            targets = self._probe_targets()
            last_pub = -1e9
            for peer in targets:
                if await self._probe_one(peer) and trio.current_time() - last_pub >= 0.5:
                    # publish as results come in (at most 2/s), so that a large swarm gets a figure for
                    # every pair (measured, or estimated from capacities) long before a round ends
                    await self._publish_bandwidth()
                    last_pub = trio.current_time()
            if targets:
                await self._publish_bandwidth()
            connected = set(self.t.connected_peers())
            pending = [p for p in self.members() if p != self.peer_id
                       and (p not in connected or p not in self._links or self._links[p].samples == 0)]
            # members not yet connected (their dial is under way) or never measured (a probe failed) are retried
            # after one heartbeat rather than a full probe interval
            with trio.move_on_after(self.config.heartbeat if pending else self.config.probe_interval):
                await self._probe_now.wait()
            self._probe_now = trio.Event()

    async def _probe_one(self, peer: str) -> bool:
        """Probe *peer* once; True when a measurement was taken."""
        link = self._links.setdefault(peer, _Link(next_bytes=self.config.probe_bytes))
        try:
            res: ProbeResult = await probe(self.t, peer, nbytes=link.next_bytes, timeout=self.config.probe_timeout)
        except ProbeBusy:
            self.counters.probes_busy += 1   # retried at the next round, one heartbeat later
            return False
        except PeerUnavailable as exc:
            self.counters.probes_failed += 1
            log.debug("probe %s failed: %s", peer[:16], exc)
            return False
        self.counters.probes_ok += 1
        a = self.config.ema_alpha
        link.bandwidth = ema(link.bandwidth, res.bandwidth, a)
        link.rtt = ema(link.rtt, res.rtt, a)
        link.samples += 1
        link.next_bytes = next_probe_size(res.nbytes, res.elapsed)
        return True

    async def _publish_bandwidth(self) -> None:
        ms = tuple(Measurement(src=self.peer_id, dst=p, bandwidth=ln.bandwidth or 0.0, rtt=ln.rtt or 0.0, samples=ln.samples)
                   for p, ln in sorted(self._links.items()) if ln.samples)
        if not ms:
            return
        self._bw_seq += 1
        # Capacity estimates: the best rate we ever saw out of (and, symmetric probes assumed, into) this node.
        best = max(m.bandwidth for m in ms)
        rep = BandwidthReport(peer=self.peer_id, seq=self._bw_seq, uplink=best, downlink=best, measurements=ms)
        await self.t.publish(TOPIC_BANDWIDTH, encode_signed(rep, self.t.sign))

    # -- VIEW protocol ----------------------------------------------------------------------------
    async def _serve_view(self, stream: Stream) -> None:
        body = packb({"records": list(self._raw.values()), "bw": list(self._raw_bw.values()),
                      "alive": self.view.alive(role=None), "dead": sorted(self.view.dead)})
        await stream.send_all(encode_frame(body, max_frame=MAX_VIEW))
        await stream.send_eof()


async def fetch_view(transport: Transport, peer: str, *, timeout: float = 10.0) -> dict[str, Any]:
    """Ask *peer* for its view; every record in the answer is verified here."""
    with trio.fail_after(timeout):
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
    records = [decode_signed(r, verify) for r in wfield(m, "records", list, "view") if isinstance(r, bytes)]
    bws = [decode_signed(r, verify) for r in wfield(m, "bw", list, "view") if isinstance(r, bytes)]
    return {"records": records, "bw": bws, "alive": wfield(m, "alive", list, "view"), "dead": wfield(m, "dead", list, "view")}
