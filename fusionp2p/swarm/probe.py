"""Bandwidth and RTT probes between two peers over a Transport stream (protocol PROBE).

A probe is a *session* on one stream: the client opens it and times three ping/pong round trips (RTT =
the minimum; with a raw socket, also the kernel's smallest RTT of that socket, :func:`tcp_min_rtt`), then
runs one or more bulk transfers: it announces *n* bytes and a *mark* (n/4), the
server answers ``go`` (while it is measuring another peer, concurrent transfers would share its link and
each would under-measure: then it queues a client that may wait, ``swarm/probe_hold.py``, or answers ``busy``
and the session stays open for a later try), the client sends, and
the server acknowledges once all arrived with its own timing. That receiver-side figure is the
measurement, on both sides. The server times the transfer twice, from the first read after the mark
(what a token bucket lets through at line rate at the start, its burst, and TCP's slow start are left
out) and from its first read (nothing depends on one late read there), and reports the smaller rate:
a late read at the start of a window can only make its rate look higher (bytes that arrived before it
are counted in it), so the two readings err high in different cases and the smaller one is sound.

A transfer counts as a measurement only when its timed part lasted at least ``MEASURE_SECONDS`` or it
moved ``MEASURE_BYTES`` (on links that fast a burst is a small part of it, and a probe stays cheap).
A shorter one is a *pilot*: the client follows it at once with a transfer sized from the pilot's rate
to last about ``TARGET_SECONDS`` (at most ``MAX_TRANSFERS`` in all). A pilot's figure is never reported
as measured; the server applies the same rule before it takes an inbound rate as its downlink figure.
The server is reserved for the client from its first transfer to the one that ends its probe by the
rule above (or to the end of the stream), for at most
``SERVER_HOLD`` seconds (the client's own probe deadline) and ``MAX_TRANSFERS`` transfers; after that
the stream is closed. Each peer's reservations draw on its own token bucket (``SERVER_HOLD`` seconds,
refilled at ``SERVER_SHARE`` seconds per second), so no peer holds the server more than that share of
the time in the long run: one stream that pinged every 9 s used to keep the server reserved for as
long as it liked (20 of 20 honest probes refused as busy over 10 simulated minutes).

The figure the server reports is a peer's claim: the client accepts a rate only when it is finite,
positive and below ``MAX_BANDWIDTH`` (the bound every node applies to gossiped reports), otherwise the
probe of that pair fails. A liar can so spoil its own pair's figure, never the prober's whole report
(a rate of 1e300 or inf used to go into it, and every peer then refused the report).
All frames use the project's framing (wire/framing.py); control frames are small msgpack maps.

**Both directions, on the data plane's path.** A node with a data plane (``RawPath``: ``net/bulk.py``)
asks first for a raw socket (``raw``): the server, once reserved, grants a one-time ticket and names
its data-plane port (``dial``); the client dials it and sends the ticket, and the server proves it is
the peer it dialled by echoing the ticket on the socket before ``raw``. The transfers then run on that
plain TCP socket, driven by OS threads like a tensor channel's lanes: ``rbulk`` (the client sends, the
server times and acks, as ``bulk``), then ``rback`` (the server sends, the client times). The link's
figure is the slower of the two directions, as a pipeline's activations and gradients, and every CO2
round, cross it both ways. Why: a probe timed only the prober's sending direction, and over
py-libp2p. A home host probing a DSL host read its 19 Mbit/s downlink, the planner made the DSL host a
CO2 replica, and rounds over its 8 Mbit/s uplink stalled every replica 7.5-8.1 s of 18.3; and a
0.165-core host's own sends over py-libp2p read 1.5-61 Mbit/s on 100 Mbit/s links (its per-byte
Python cost, not the link). Without a raw socket (no data plane, emulated links, a port that cannot be
reached: then not tried again for ``RAW_RETRY`` seconds) the probe times the prober's direction on
the stream, as before.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import trio

from fusionp2p.errors import ConfigError, PeerUnavailable, RemoteProtocolError
from fusionp2p.net.refusals import Refusals
from fusionp2p.net.transport import Stream, Transport
from fusionp2p.swarm.probe_hold import OWN as OWN  # re-exported: ProbeServer.reserve(OWN)
from fusionp2p.swarm.probe_hold import QUEUE, QUEUE_WAIT, SERVER_HOLD, SERVER_SHARE, Reservations
from fusionp2p.types import short_peer
from fusionp2p.wire.check import as_map, as_str
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.msg import packb, typed_field, unpackb
from fusionp2p.wire.protocols import PROBE
from fusionp2p.wire.records import MAX_BANDWIDTH

log = logging.getLogger(__name__)
_T = TypeVar("_T")

MAX_PROBE_BYTES = 64 * 1024 * 1024
# A transfer whose timed part (after the mark) lasted MEASURE_SECONDS is a measurement, and so is one of
# MEASURE_BYTES (fast links; also the size cap of a probe). A receiver under a CPU quota is stopped for
# most of each 100 ms period; when it runs again a read can return bytes that arrived during the stop,
# after its clock started, so a window of 0.1-0.2 s read the 8 Mbit/s links of 0.25-core testbed hosts
# at up to 1.21x their tbf rate. Half a second keeps that error near one period's bytes over five.
MEASURE_SECONDS = 0.5
MEASURE_BYTES = 1024 * 1024
TARGET_SECONDS = 1.0            # a transfer sized from a known rate lasts about this long (its timed part 0.75 s)
MAX_TRANSFERS = 3               # per probe: a pilot, its sized follow-up, one more if that fell short
_CHUNK = 256 * 1024
_CTRL = 4096
RAW_RETRY = 600.0               # seconds a peer whose raw socket failed is probed on the stream only
ECHO_WAIT = 3.0                 # seconds the prober waits for the ticket echoed on a raw socket
_TICKET = 16                    # bytes of a raw ticket (wire/tensor_frame.TICKET_SIZE)
_FILL = b"\x5a" * _CHUNK


class RawPath(Protocol):
    """Where probes get plain TCP sockets to and from peers: the data plane's port (``net/bulk.DataPlane``)."""

    def grant_raw(self, peer: str) -> tuple[bytes, str, int] | None: ...
    async def take_raw(self, ticket: bytes) -> socket.socket | None: ...
    async def dial_raw(self, peer: str, host: str, port: int, ticket: bytes) -> socket.socket: ...


def _timed_rate(total: int, t_end: float, mark: tuple[float, int], first: tuple[float, int]) -> tuple[float, float | None]:
    """(seconds timed after the mark, rate) of a transfer of *total* bytes ending at *t_end*, from the
    clock readings ``(time, bytes so far)`` at the read that passed the mark and at the first read
    (``bytes < 0``: none): the rate is the smaller of the two windows' (the module docstring)."""
    t_mark, raw_mark = mark
    rates = [(total - r0) / max(t_end - t0, 1e-6) for t0, r0 in (mark, first) if r0 >= 0 and total > r0]
    return (t_end - t_mark if raw_mark >= 0 else 0.0), min(rates, default=None)


def _raw_send(sock: socket.socket, n: int, timeout: float) -> None:
    """(worker thread) Send *n* filler bytes on *sock* within *timeout* seconds."""
    deadline = time.monotonic() + timeout
    view = memoryview(_FILL)
    while n > 0:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("raw probe send timed out")
        sock.settimeout(left)
        n -= sock.send(view[: min(n, _CHUNK)])


def _raw_recv(sock: socket.socket, n: int, mark: int, timeout: float) -> tuple[int, float, float | None]:
    """(worker thread) Receive exactly *n* bytes: (bytes, seconds timed after the *mark*-th byte, rate),
    the rate the smaller of the ones timed after the mark and after the first read (as ``_Framed``)."""
    deadline = time.monotonic() + timeout
    buf = bytearray(_CHUNK)
    got = 0
    t_first = t_mark = 0.0
    raw_first = raw_mark = -1
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("raw probe receive timed out")
        sock.settimeout(left)
        k = sock.recv_into(buf, min(len(buf), n - got))
        if k == 0:
            raise ConnectionError("raw probe socket closed")
        got += k
        now = time.monotonic()
        if raw_first < 0:
            t_first, raw_first = now, got
        if raw_mark < 0 and got >= mark:
            t_mark, raw_mark = now, got
    return got, *_timed_rate(got, time.monotonic(), (t_mark, raw_mark), (t_first, raw_first))


async def _raw_io(peer: str, fn: Callable[..., _T], *args: Any) -> _T:
    """Run a raw socket function in a worker thread; PeerUnavailable on a socket error or its timeout."""
    def call() -> _T:
        return fn(*args)

    try:
        # trio-typing (a py-libp2p dependency) ships stubs older than abandon_on_cancel (trio 0.23)
        return await trio.to_thread.run_sync(call, abandon_on_cancel=True)  # type: ignore[call-arg]
    except OSError as exc:   # TimeoutError and ConnectionError are OSErrors
        raise PeerUnavailable(peer, f"raw probe socket: {exc}") from None


def _close_raw(sock: socket.socket | None) -> None:
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)   # wakes a worker thread still blocked on it
    sock.close()


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeConfig:
    """How a node measures its links (owned by this module; ``SwarmConfig.probe``)."""

    interval: float = 10.0       # at least this long between probe rounds once every peer is measured
    refresh_max: float = 160.0   # ... doubling up to this (or interval) while our links and chosen peers stay the same
    first: int = 32              # never-measured peers probed in one round, at most
    sample: int = 8              # peers re-measured in one refresh round, at most
    duty: float = 0.02           # bulk transfer time / wall time a node spends measuring, at most ...
    burst: float = 4.0           # ... in the long run: a token bucket of this many seconds of transfer
    busy_retries: int = 3        # a peer busy measuring another is tried again this often within a round
    parallel: int = 4            # probe sessions opened (pings) at once; the transfers still go one at a time
    takeover: float = 30.0       # a pair its prober has not measured after this long is probed from here too
    bytes: int = 256 * 1024      # pilot of a first probe without an estimate; the others last ~0.25 s
    timeout: float = 10.0
    ctrl_timeout: float = 3.0    # open + pings + go/busy: a peer too loaded to answer is tried again later
    ema_alpha: float = 0.5       # weight of a new figure in the smoothed bandwidth
    peers: int = 24              # peers a node chooses to measure, at most, however large the swarm (membership.chosen)

    def __post_init__(self) -> None:
        if not 0 < self.duty <= 1 or self.sample < 1 or self.first < 1:
            raise ConfigError("probe sample and first must be positive, duty in (0, 1]")
        if self.burst < 0 or self.busy_retries < 0 or self.parallel < 1:
            raise ConfigError("probe burst and busy_retries must not be negative, parallel positive")
        if self.peers < 1:
            raise ConfigError("probe peers must be positive")
        if self.interval <= 0 or self.refresh_max <= 0:
            raise ConfigError("probe interval and refresh_max must be positive")
        if not 0 < self.ema_alpha <= 1:
            raise ConfigError("ema_alpha must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class ProbeResult:
    peer: str
    rtt: float          # seconds
    bandwidth: float    # bytes / s: the receiver's timing of the last transfer
    nbytes: int         # bytes of the last transfer
    elapsed: float      # seconds all transfers took together (what the duty cycle counts)
    measured: bool = True   # False: no transfer was long enough (bandwidth is a pilot's estimate only)
    sent: int = 0       # bytes of all transfers together
    transfers: int = 1
    forward: float | None = None   # bytes / s of the prober's direction (None: = bandwidth)
    reverse: float | None = None   # bytes / s of the peer's direction, measured on a raw socket (None: not timed)
    path: str = "libp2p"           # "direct": the transfers ran on a raw socket to the data-plane port
    raw_failed: bool = False       # a raw socket was granted but could not be dialled


def mark_of(nbytes: int) -> int:
    """The byte after which the receiver starts its clock: the first quarter is burst and slow start."""
    return max(1, nbytes // 4)


def conclusive(nbytes: int, timed: float) -> bool:
    """Whether a transfer of *nbytes* whose part after the mark took *timed* seconds is a measurement."""
    return timed >= MEASURE_SECONDS or nbytes >= MEASURE_BYTES


def probe_size(rate: float | None, *, lo: int, hi: int = MEASURE_BYTES, target: float = TARGET_SECONDS) -> int:
    """Bytes for a transfer at *rate* (bytes/s) to last about *target* seconds, within [lo, hi] (hi for an unknown rate)."""
    if rate is None or not rate > 0 or rate == float("inf"):
        return max(lo, hi)
    return max(min(lo, hi), min(hi, int(rate * target)))


def decode_ctrl(frame: bytes) -> dict[str, object]:
    """A control frame of PROBE: a small map with a string ``op`` (its other fields are read where used)."""
    m = as_map(unpackb(frame, max_size=_CTRL), "probe", required=("op",), max_len=8)
    as_str(m["op"], "probe op", max_len=16)
    return m


class _Framed:
    def __init__(self, stream: Stream, max_frame: int) -> None:
        self.s = stream
        self.dec = FrameDecoder(max_frame=max_frame)
        self.frames: list[bytes] = []

    async def recv(self) -> bytes:
        while not self.frames:
            data = await self.s.receive_some()
            if not data:
                self.dec.check_eof()
                raise PeerUnavailable(self.s.remote_peer, "probe stream closed")
            self.frames.extend(self.dec.feed(data))
        return self.frames.pop(0)

    async def recv_payload(self, n: int, mark: int) -> tuple[int, float, float | None]:
        """Receive *n* payload bytes in frames: (bytes, seconds timed after the *mark*-th raw byte, rate).

        The rate is the smaller of the one timed after the mark and the one timed after the first read
        (the bytes a read returns arrived before it, so each window starts after its first read)."""
        got = sum(len(fr) for fr in self.frames)
        self.frames.clear()
        raw = 0
        t_first = t_mark = 0.0
        raw_first = raw_mark = -1
        while got < n:
            data = await self.s.receive_some()
            if not data:
                self.dec.check_eof()
                raise PeerUnavailable(self.s.remote_peer, "probe stream closed")
            raw += len(data)
            if raw_first < 0:
                t_first, raw_first = trio.current_time(), raw
            if raw_mark < 0 and raw >= mark:
                t_mark, raw_mark = trio.current_time(), raw
            got += sum(len(fr) for fr in self.dec.feed(data))
        return got, *_timed_rate(raw, trio.current_time(), (t_mark, raw_mark), (t_first, raw_first))

    async def recv_ctrl(self) -> dict[str, object]:
        return decode_ctrl(await self.recv())

    async def send_ctrl(self, m: dict[str, object]) -> None:
        await self.s.send_all(encode_frame(packb(m), max_frame=_CTRL))


class ProbeBusy(Exception):
    """The peer is measuring someone else right now; try again later (not a failure). ``held``: the peer's
    server was ours but our own was busy (``ProbeSession.measure``'s *then*): close the session."""

    def __init__(self, peer: str, *, held: bool = False) -> None:
        super().__init__(peer)
        self.held = held


SERVER_IDLE = 10.0      # seconds a probe stream may sit without its next control frame
SERVER_BULK = 30.0      # seconds a bulk transfer may take before the server gives up on it


class ProbeServer(Reservations):
    """Server side of PROBE: one bulk transfer at a time, so that measurements do not share the link.

    Who holds it, and who waits for it, is the reservation's (``swarm/probe_hold.py``). The server also
    remembers the rate at which the second half of each peer's probe arrived (EMA): our downlink. The
    node reserves it for itself (``OWN``, no share charged) while it measures a link as a client: a
    peer's transfer into or out of us at the same time would share our link, and both figures would
    read low (the two 10 Mbit/s hosts of ``benchmarks.wan --scenario mixed`` read their own link at
    4.0 and 3.3 Mbit/s in one run, both directions timed, while their peers probed them).
    """

    def __init__(self, *, alpha: float = 0.5, hold: float = SERVER_HOLD, share: float = SERVER_SHARE,
                 refusals: Refusals | None = None, queue: int = QUEUE, queue_wait: float = QUEUE_WAIT) -> None:
        super().__init__(hold=hold, share=share, queue=queue, queue_wait=queue_wait)
        self.refusals = refusals if refusals is not None else Refusals()   # the node's table (SwarmNode.refusals)
        self._alpha = alpha
        self.inbound: dict[str, float] = {}
        self.raw: RawPath | None = None           # the data plane's port, once the node has one
        self.quiet: Callable[[], bool] = lambda: False   # True while the node trains: no re-measurements

    async def __call__(self, stream: Stream) -> None:
        if self.refusals.banned(stream.remote_peer, now=trio.current_time()):
            return   # a banned peer's stream is closed unread
        self.saw(stream.remote_peer, trio.current_time())
        await serve_probe(stream, self)

    def record_inbound(self, peer: str, rate: float) -> None:
        old = self.inbound.pop(peer, None)
        self.inbound[peer] = rate if old is None else (1 - self._alpha) * old + self._alpha * rate
        while len(self.inbound) > self.MAX_PEERS:
            del self.inbound[next(iter(self.inbound))]

    def best_inbound(self) -> float:
        """The best rate any peer's probe reached us at (0 while none did)."""
        return max(self.inbound.values(), default=0.0)


async def serve_probe(stream: Stream, server: ProbeServer | None = None) -> None:
    """Serve one PROBE stream; a protocol violation or a deadline closes it (and frees the server)."""
    try:
        await _serve_probe(stream, server)
    except (trio.TooSlowError, PeerUnavailable):   # a deadline, or the client went away mid-transfer
        return


async def _serve_probe(stream: Stream, server: ProbeServer | None) -> None:
    f = _Framed(stream, _CHUNK)
    peer = stream.remote_peer
    holding = False   # we reserved the server for this client (its first transfer), until the stream ends
    held_at = 0.0     # ... since then
    transfers = back = 0
    sock: socket.socket | None = None   # the raw socket, once the client dialled it
    raw_asked = False
    try:
        while True:
            try:
                with trio.fail_after(SERVER_IDLE):
                    m = await f.recv_ctrl()
            except PeerUnavailable:
                return
            op = typed_field(m, "op", str, "probe")
            if op == "ping":
                with trio.fail_after(SERVER_IDLE):
                    i = m.get("i", 0)
                    await f.send_ctrl({"op": "pong", "i": i if type(i) is int else 0})
                continue
            if op not in ("bulk", "raw", "rbulk", "rback"):
                raise RemoteProtocolError(f"unknown probe op {str(op)[:32]!r}")
            now = trio.current_time()
            limit = SERVER_BULK
            if server is not None:
                if holding and not server.holds(peer, now):
                    raise RemoteProtocolError("probe reservation used up")   # closes the stream
                # while we train, a peer that measured us before is refused like a busy server: its figure
                # would read what our job leaves of the link (a first measurement still runs)
                if not holding:
                    server.saw(peer, now)
                    # a client that can wait ("q") takes a place in the server's short FIFO (probe_hold.py)
                    if (peer in server.inbound and server.quiet()) or not (
                            server.reserve(peer, now) or (m.get("q") is True and await server.wait_turn(peer))):
                        with trio.fail_after(SERVER_IDLE):
                            await f.send_ctrl({"op": "busy"})
                        continue
                    holding, held_at = True, trio.current_time()
                now = trio.current_time()
                limit = min(limit, server.until - now)
            if op == "raw":
                if raw_asked:
                    raise RemoteProtocolError("a second raw socket asked for")
                raw_asked = True
                with trio.fail_after(limit):
                    sock = await _grant_raw(f, server, peer)
                continue
            n = typed_field(m, "n", int, "probe")
            if not 0 < n <= MAX_PROBE_BYTES:
                raise RemoteProtocolError(f"probe of {n} bytes refused")
            if op == "rback":
                back += 1
                if sock is None or back > MAX_TRANSFERS:
                    raise RemoteProtocolError("raw transfer refused (no raw socket, or too many)")
                with trio.fail_after(limit):
                    await f.send_ctrl({"op": "go"})
                    await _raw_io(peer, _raw_send, sock, n, limit)
                if server is not None and (n >= MEASURE_BYTES or back == MAX_TRANSFERS):
                    holding = _served(server, peer, held_at, transfers + back)   # the client's last transfer
                continue
            transfers += 1
            if transfers > MAX_TRANSFERS or (op == "rbulk" and sock is None):
                raise RemoteProtocolError("probe transfer refused (no raw socket, or too many)")
            mark = m.get("mark", n)
            mark = mark if isinstance(mark, int) and 0 < mark < n else n
            with trio.fail_after(limit):
                await f.send_ctrl({"op": "go"})
                if op == "rbulk":
                    assert sock is not None
                    got, timed, rate = await _raw_io(peer, _raw_recv, sock, n, mark, limit)
                else:
                    got, timed, rate = await f.recv_payload(n, mark)
                if got != n:
                    raise RemoteProtocolError("probe payload overran its announced size")
                await f.send_ctrl({"op": "ack", "n": got, "timed": timed, "rate": rate or 0.0})
            # the same figure and the same rule as the client's: a pilot's rate is not a downlink figure
            if server is not None and rate is not None and conclusive(n, timed):
                server.record_inbound(stream.remote_peer, rate)
            if server is not None and op == "bulk" and (conclusive(n, timed) or transfers == MAX_TRANSFERS):
                # the client's last transfer on the stream path (the same rule as its own): free the server
                # now, not a one-way trip later when its stream closes (a loaded loop's trip is ~0.2 s)
                holding = _served(server, peer, held_at, transfers)
    except RemoteProtocolError as exc:
        if server is not None:
            server.refusals.refuse(peer, "probe/protocol", now=trio.current_time(), detail=str(exc))
        return
    finally:
        _close_raw(sock)
        if server is not None and holding:
            _served(server, peer, held_at, transfers + back)


def _served(server: ProbeServer, peer: str, held_at: float, transfers: int) -> bool:
    """Release the server held for *peer* since *held_at* (False: no longer holding)."""
    now = trio.current_time()
    server.release(peer, now)
    log.debug("probe server: %s held %.3f s, %d transfers", short_peer(peer), now - held_at, transfers)
    return False


async def _grant_raw(f: _Framed, server: ProbeServer | None, peer: str) -> socket.socket | None:
    """Answer ``raw``: a ticket and our data-plane port (``dial``), then, once the client's socket came
    and our echo of the ticket is on it, ``raw``; ``noraw`` when we have no raw path or it did not come."""
    grant = server.raw.grant_raw(peer) if server is not None and server.raw is not None else None
    if grant is None or server is None or server.raw is None:
        await f.send_ctrl({"op": "noraw"})
        return None
    ticket, host, port = grant
    await f.send_ctrl({"op": "dial", "t": ticket, "h": host, "p": port})
    sock = await server.raw.take_raw(ticket)
    if sock is not None:
        try:
            await _raw_io(peer, _send_exact, sock, ticket)
        except PeerUnavailable:
            _close_raw(sock)
            sock = None
    await f.send_ctrl({"op": "raw" if sock is not None else "noraw"})
    return sock


# struct tcp_info (linux/tcp.h): tcpi_min_rtt, microseconds, since Linux 4.6
_TCPI_MIN_RTT = 148


def tcp_min_rtt(sock: socket.socket) -> float | None:
    """The kernel's smallest RTT of *sock* in seconds (Linux ``TCP_INFO``'s ``tcpi_min_rtt``: over the
    socket's life, the handshake and the ACKs of its first window included); None elsewhere or unknown.

    Why: a ping on the libp2p stream waits behind whatever the peers' uplinks queue. On benchmarks.wan's
    8 Mbit/s DSL links (tbf, no added delay) pings read 50-110 ms while other probes and the job's
    traffic filled the queue, and the planner charged streaming CO2 that latency every step."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    if len(info) < _TCPI_MIN_RTT + 4:
        return None
    us = int.from_bytes(info[_TCPI_MIN_RTT:_TCPI_MIN_RTT + 4], sys.byteorder)
    return us / 1e6 if 0 < us < 0xFFFFFFFF else None


def _send_exact(sock: socket.socket, data: bytes) -> None:
    sock.settimeout(SERVER_IDLE)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise ConnectionError("raw probe socket closed")
        out += part
    return bytes(out)


def _at_peer(host: str, seen: str | None) -> bool:
    """A raw grant's host may be dialled: unspecified ("the IP you reach me at") or the IP the peer's
    stream comes from; never a name or another IP, which the peer does not prove it owns."""
    try:
        ip = ipaddress.ip_address(host)
        return ip.is_unspecified or (seen is not None and ip == ipaddress.ip_address(seen))
    except ValueError:
        return False


class ProbeSession:
    """A client's open PROBE stream with its RTT; :meth:`measure` runs the bulk transfers."""

    def __init__(self, stream: Stream, peer: str, rtt: float) -> None:
        self.stream = stream
        self.peer = peer
        self.rtt = rtt
        self._f = _Framed(stream, _CTRL)
        self._raw_asked = False
        self._raw_failed = False
        self._sock: socket.socket | None = None
        self._wait: dict[str, object] = {}   # {"q": True}: the first request may wait in the server's FIFO
        self._then: Callable[[], Awaitable[bool]] | None = None
        self._held = False
        self.used = trio.current_time()      # its last control frame (a kept session: swarm/prober.py)

    async def ping(self) -> float:
        """One more round trip on the session (a watcher's liveness check, ``swarm/watch.py``): its RTT.
        PeerUnavailable if the stream broke; no deadline of its own."""
        t0 = trio.current_time()
        try:
            await self._f.send_ctrl({"op": "ping", "i": 0})
            await self._f.recv_ctrl()
        except RemoteProtocolError as exc:
            raise PeerUnavailable(self.peer, f"probe ping: {exc}") from None
        return trio.current_time() - t0

    async def measure(self, nbytes: int, *, max_bytes: int = MEASURE_BYTES, raw: RawPath | None = None,
                      wait: bool = False, then: Callable[[], Awaitable[bool]] | None = None) -> ProbeResult:
        """Transfers until one is a measurement (see the module docstring); ProbeBusy before the first one
        if the server is measuring someone else (the session stays usable), PeerUnavailable on failure.
        With *raw*, both directions are timed on a raw socket to the peer's data-plane port when it grants
        one. With *wait*, a busy server may queue us (``swarm/probe_hold.py``); *then*, if given, is awaited
        once the server is ours, before any transfer (the caller takes its own server: ``probe_hold.may_wait``);
        False from it raises ProbeBusy with ``held`` set (the peer's server stays ours until the session
        closes). No deadline of its own: the caller bounds it."""
        self._wait = {"q": True} if wait else {}
        self._then, self._held = then, False
        if not 0 < nbytes <= MAX_PROBE_BYTES or not 0 < max_bytes <= MAX_PROBE_BYTES:
            raise ValueError(f"nbytes and max_bytes must be in (0, {MAX_PROBE_BYTES}]")
        try:
            if raw is not None and not self._raw_asked:
                await self._open_raw(raw)
            fwd = await self._direction("rbulk" if self._sock is not None else "bulk", min(nbytes, max_bytes), max_bytes)
            rev = None
            if self._sock is not None:
                rev = await self._direction("rback", probe_size(fwd.rate, lo=min(nbytes, max_bytes), hi=max_bytes),
                                            max_bytes)
        except RemoteProtocolError as exc:
            raise PeerUnavailable(self.peer, f"probe failed: {exc}") from None
        finally:
            self.used = trio.current_time()
        reverse = rev.rate if rev is not None and rev.measured else None
        kernel = tcp_min_rtt(self._sock) if self._sock is not None else None
        if kernel is not None and kernel < self.rtt:
            self.rtt = kernel
        return ProbeResult(peer=self.peer, rtt=self.rtt,
                           bandwidth=fwd.rate if reverse is None else min(fwd.rate, reverse),
                           nbytes=fwd.size, elapsed=fwd.elapsed + (rev.elapsed if rev else 0.0),
                           measured=fwd.measured, sent=fwd.sent + (rev.sent if rev else 0),
                           transfers=fwd.transfers + (rev.transfers if rev else 0), forward=fwd.rate,
                           reverse=reverse, path="direct" if self._sock is not None else "libp2p",
                           raw_failed=self._raw_failed)

    async def _granted(self) -> None:
        """The server is ours: the caller's *then*, once a measure."""
        if not self._held:
            self._held = True
            if self._then is not None and not await self._then():
                raise ProbeBusy(self.peer, held=True)

    async def _open_raw(self, raw: RawPath) -> None:
        """Ask for a raw socket (ProbeBusy while the server measures someone else; nothing asked then)."""
        f = self._f
        await f.send_ctrl({"op": "raw", **self._wait})
        answer = await f.recv_ctrl()
        op = answer.get("op")
        if op == "busy":
            raise ProbeBusy(self.peer)
        self._raw_asked = True
        await self._granted()
        if op == "noraw":
            return
        if op != "dial":
            raise RemoteProtocolError(f"unexpected probe answer {str(op)[:32]!r}")
        ticket, host, port = answer.get("t"), answer.get("h"), answer.get("p")
        if (not isinstance(ticket, bytes) or len(ticket) != _TICKET or not isinstance(host, str) or len(host) > 255
                or type(port) is not int or not 0 < port < 65536):
            raise RemoteProtocolError("malformed raw probe grant")
        sock: socket.socket | None = None
        try:
            try:
                if not _at_peer(host, getattr(self.stream, "remote_ip", None)):
                    # issue 43: otherwise any probed peer could make us connect to any host and port
                    raise PeerUnavailable(self.peer, f"the grant names {host[:64]!r}, not the IP the peer is seen at")
                sock = await raw.dial_raw(self.peer, host, port, ticket)
            except PeerUnavailable as exc:
                self._raw_failed = True
                log.debug("probe %s: no raw socket (%s); timing the stream", short_peer(self.peer), exc)
            answer = await f.recv_ctrl()   # "raw" once the server has our socket, "noraw" after RAW_WAIT
            if answer.get("op") == "raw" and sock is not None:
                # the listener proves that it is the peer we asked (not whatever the grant named): our ticket
                if await _raw_io(self.peer, _recv_exact, sock, _TICKET, ECHO_WAIT) != ticket:
                    raise RemoteProtocolError("raw probe socket did not echo the ticket")
                self._sock, sock = sock, None
            elif answer.get("op") not in ("raw", "noraw"):
                raise RemoteProtocolError(f"unexpected probe answer {str(answer.get('op'))[:32]!r}")
        finally:
            _close_raw(sock)

    async def _direction(self, op: str, size: int, max_bytes: int) -> _Transfers:
        """Transfers of *op* (``bulk``/``rbulk``: we send, the server times; ``rback``: it sends, we time)
        until one is a measurement, at most ``MAX_TRANSFERS``."""
        f, stream = self._f, self.stream
        t = _Transfers(size=size)
        while True:
            await f.send_ctrl({"op": op, "n": size, "mark": mark_of(size), **self._wait})
            answer = await f.recv_ctrl()
            if answer.get("op") == "busy" and t.transfers == 0 and op == "bulk":
                raise ProbeBusy(self.peer)
            if answer.get("op") != "go":
                raise RemoteProtocolError(f"unexpected probe answer {str(answer.get('op'))[:32]!r}")
            await self._granted()
            t0 = trio.current_time()
            if op == "rback":
                assert self._sock is not None
                _, timed, got_rate = await _raw_io(self.peer, _raw_recv, self._sock, size, mark_of(size), SERVER_BULK)
                elapsed = trio.current_time() - t0
                rate = got_rate if got_rate is not None else min(size / max(elapsed, 1e-6), MAX_BANDWIDTH / 2)
            else:
                if op == "rbulk":
                    assert self._sock is not None
                    await _raw_io(self.peer, _raw_send, self._sock, size, SERVER_BULK)
                else:
                    chunk = _FILL[: min(_CHUNK, size)]
                    done = 0
                    while done < size:
                        part = chunk[: size - done]
                        await stream.send_all(encode_frame(part, max_frame=_CHUNK))
                        done += len(part)
                ack = await f.recv_ctrl()
                elapsed = trio.current_time() - t0   # = n / bandwidth + one round trip (first byte out, ack back)
                if ack.get("n") != size:
                    raise RemoteProtocolError("probe ack does not match")
                a_timed, a_rate = ack.get("timed"), ack.get("rate")
                timed = float(a_timed) if isinstance(a_timed, (int, float)) and 0 < a_timed < math.inf else 0.0
                if isinstance(a_rate, bool) or not isinstance(a_rate, (int, float)) or not 0 <= a_rate < MAX_BANDWIDTH:
                    raise RemoteProtocolError(f"probe ack claims a rate of {a_rate!r} bytes/s")
                # the receiver's figure; the sender's whole transfer only where it has none (no time passed)
                rate = float(a_rate) if a_rate > 0 else min(size / max(elapsed - self.rtt, 1e-6), MAX_BANDWIDTH / 2)
            t.rate, t.size = min(float(rate), MAX_BANDWIDTH / 2), size
            t.sent += size
            t.transfers += 1
            t.elapsed += elapsed
            t.measured = conclusive(size, timed)
            if t.measured or t.transfers >= MAX_TRANSFERS or size >= max_bytes:
                return t
            size = min(max_bytes, max(2 * size, probe_size(rate, lo=size, hi=max_bytes)))

    async def aclose(self) -> None:
        _close_raw(self._sock)
        self._sock = None
        await self.stream.aclose()


@dataclass(slots=True)
class _Transfers:
    """One direction's transfers within a session."""

    size: int
    rate: float = 0.0
    measured: bool = False
    sent: int = 0
    transfers: int = 0
    elapsed: float = 0.0


async def open_probe(transport: Transport, peer: str, *, pings: int = 3, phase: list[str] | None = None) -> ProbeSession:
    """Open a PROBE stream to *peer* and time *pings* round trips; PeerUnavailable on failure.
    No deadline of its own: the caller bounds it (the server gives up on a silent stream after SERVER_IDLE).
    *phase*, if given, is set to ``["ping"]`` once the stream is open (for the caller's error message)."""
    t_open = trio.current_time()
    stream = await transport.open_stream(peer, PROBE)
    log.debug("probe %s: stream open in %.0f ms", short_peer(peer), 1e3 * (trio.current_time() - t_open))
    if phase is not None:
        phase[:] = ["ping"]
    f = _Framed(stream, _CTRL)
    try:
        rtts = []
        for i in range(pings):
            t0 = trio.current_time()
            await f.send_ctrl({"op": "ping", "i": i})
            await f.recv_ctrl()
            rtts.append(trio.current_time() - t0)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise
    return ProbeSession(stream, peer, min(rtts) if rtts else 0.0)


async def probe(transport: Transport, peer: str, *, nbytes: int, pings: int = 3, timeout: float = 20.0,
                ctrl_timeout: float | None = None, max_bytes: int = MEASURE_BYTES,
                raw: RawPath | None = None) -> ProbeResult:
    """Measure RTT and throughput to *peer* (open a session, measure, close); PeerUnavailable on failure
    or deadline, ProbeBusy if the server is measuring someone else.

    The first transfer has *nbytes*; while a transfer is too short to be a measurement (a pilot), the
    next one, sized from its rate, follows at once (at most ``MAX_TRANSFERS``, each at most *max_bytes*).
    *timeout* bounds the whole probe; *ctrl_timeout* (default: *timeout*) bounds the part before the
    first transfer (open, pings): a peer too loaded to answer a ping within it is given up on quickly,
    rather than holding up the caller's other probes. With *raw* (our data plane), both directions are
    timed on a raw socket when the peer grants one.
    """
    if not 0 < nbytes <= MAX_PROBE_BYTES or not 0 < max_bytes <= MAX_PROBE_BYTES:
        raise ValueError(f"nbytes and max_bytes must be in (0, {MAX_PROBE_BYTES}]")
    phase = ["open"]
    try:
        with trio.fail_after(timeout):
            with trio.fail_after(min(timeout, ctrl_timeout or timeout)):
                session = await open_probe(transport, peer, pings=pings, phase=phase)
            phase = ["bulk"]
            try:
                return await session.measure(nbytes, max_bytes=max_bytes, raw=raw)
            finally:
                await session.aclose()
    except trio.TooSlowError:
        raise PeerUnavailable(peer, f"probe timed out ({phase[0]})") from None
    except RemoteProtocolError as exc:
        raise PeerUnavailable(peer, f"probe failed: {exc}") from None
