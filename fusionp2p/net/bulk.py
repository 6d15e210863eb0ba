"""The ``DataPlane`` service that opens and accepts encrypted tensor channels (``bulk_channel.BulkChannel``).

Theory of operation (ARCHITECTURE.md "Planes", LIBP2P_NOTES.md §9):

1. **Key agreement over the authenticated transport.** The dialer opens a ``BULK_TICKET`` stream to
   the peer. The listener, which knows the stream's authenticated remote peer id, answers with a
   one-time 16-byte ticket, two fresh 32-byte keys (one per direction), the cipher and its TCP address,
   and remembers ``ticket → (peer id, keys)`` for ``ticket_ttl`` seconds.
2. **Raw TCP.** The dialer opens the granted number of lanes (TCP connections) to that address and
   sends the ticket and the lane's index on each. The listener keeps them until every lane is in, then
   drops the ticket (it works once) and both ends switch to AEAD records (``fusionp2p.net.aead``,
   ``fusionp2p.net.tensor_stream``); the listener's first record is ``HELLO``, which proves to the
   dialer that the peer holds the keys. The identity behind the channel is therefore the one the
   transport authenticated; an eavesdropper on the TCP link learns only a used-up ticket.
3. **Flow.** ``send`` blocks while ``window`` messages are unacknowledged (the receiver acks when the
   application takes a message). Each lane runs two OS threads (a writer that seals and sends, a
   reader that receives each record into a cache-hot scratch buffer and decrypts it into its place in
   the message), and large messages are striped over the lanes; see
   :class:`~fusionp2p.net.bulk_channel.BulkChannel`.
4. **Failure.** Every read has a deadline of ``dead_after`` seconds of silence; idle ends send a PING
   every ``keepalive`` seconds. Silence, a reset or an EOF without ``CLOSE`` make ``send``/``receive``
   raise :class:`~fusionp2p.errors.PeerUnavailable`; a record failing authentication raises
   :class:`~fusionp2p.errors.RemoteProtocolError` and closes the channel. Reconnect by calling
   ``DataPlane.connect`` again once the peer is back (a fresh ticket, fresh keys).
5. **Raw probe sockets** (``swarm/probe.py``). A node's bandwidth probe asks the peer's probe server,
   over the authenticated PROBE stream, for a one-time raw ticket (:meth:`DataPlane.grant_raw`); it
   dials the same data-plane port and sends the ticket with lane byte ``RAW_LANE``, and the probe server
   takes the socket (:meth:`DataPlane.take_raw`). Both directions of the link are then timed on plain
   TCP driven by OS threads, as fast as a tensor channel and not bound by py-libp2p's per-byte cost.
   Only filler bytes cross it (no key is needed); at most ``MAX_RAW_TICKETS`` are outstanding, one per
   peer, each for at most ``RAW_WAIT`` seconds.
6. **Admission** (``fusionp2p.net.admission``). A ticket goes only to a peer that ``admit`` accepts
   (the job service: members of this node's started jobs), within caps on handshakes in progress,
   tickets per peer and channels per peer and in total; every incoming message's announced size is
   claimed from a per-peer and a total byte budget before its buffer exists. A refusal is counted
   in ``refusals`` and costs the peer nothing else: no key, ticket, socket or thread.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.net.admission import Admission, BufferBudget
from fusionp2p.net.aead import new_key
from fusionp2p.net.bulk_channel import PATH_DIRECT, PATH_LIBP2P, BulkChannel, DataPlaneConfig, _detach
from fusionp2p.net.refusals import Refusals
from fusionp2p.net.shaping import TokenBucket
from fusionp2p.net.stream_channel import StreamChannel, stream_hello, stream_welcome
from fusionp2p.net.transport import Stream, Transport
from fusionp2p.types import short_peer
from fusionp2p.wire import tensor_frame as tf
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.limits import KiB
from fusionp2p.wire.protocols import BULK_TICKET, TENSOR

log = logging.getLogger(__name__)

Link = BulkChannel | StreamChannel   # one connection of a tensor channel: direct TCP, or the libp2p fallback


RAW_LANE = 0xFF        # the lane byte after a raw probe ticket (tensor channels use 0 .. MAX_LANES - 1)
MAX_RAW_TICKETS = 4    # raw probe tickets outstanding at once (the probe server grants one at a time)
RAW_WAIT = 3.0         # seconds a raw ticket waits for its socket


class _Unreachable(Exception):
    """The peer's data-plane port could not be reached over TCP (the fallback path may still work)."""


def _keys_for_dialer(reply: dict[str, Any]) -> tuple[bytes, bytes]:
    return reply["k_dial"], reply["k_listen"]


def _ip_from_multiaddrs(addrs: list[str]) -> str | None:
    for a in addrs:
        parts = a.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            return parts[2]
    return None


class DataPlane:
    """A node's data plane: dials and accepts :class:`BulkChannel` s (create with :func:`open_data_plane`)."""

    def __init__(self, transport: Transport, cfg: DataPlaneConfig, nursery: trio.Nursery, host: str, port: int,
                 admit: Callable[[str], bool] | None = None, refusals: Refusals | None = None) -> None:
        self._transport = transport
        self._cfg = cfg
        self._nursery = nursery
        self.host = host
        self.port = port
        self._admit = admit
        self.admission = Admission(max_handshakes=cfg.max_handshakes, max_peer_tickets=cfg.max_peer_tickets,
                                   max_channels=cfg.max_channels, max_peer_channels=cfg.max_peer_channels)
        self.budget = BufferBudget(max_total=cfg.max_buffered, max_peer=cfg.max_peer_buffered)
        self.refusals = refusals if refusals is not None else Refusals()   # the node's, when it has one
        self._tickets: dict[bytes, _Ticket] = {}
        self._raw: dict[bytes, _RawTicket] = {}
        self._incoming_send, self.incoming = trio.open_memory_channel[Link](cfg.incoming_buffer)
        self._closed = False
        self._direct_failed: dict[str, float] = {}   # peer -> until when its direct dial is not tried again
        self._open_streams: set[StreamChannel] = set()
        # traffic: the open channels' lanes count their own bytes; closed channels are folded into the meter
        self._open: set[BulkChannel] = set()
        self._traffic = transport.traffic
        self._detach = self._traffic.attach(self._live_traffic)

    @property
    def config(self) -> DataPlaneConfig:
        return self._cfg

    def _shape(self, peer: str) -> TokenBucket | None:
        """The emulated link to *peer* (``DataPlaneConfig.emulator``), None when it is not shaped."""
        emu = self._cfg.emulator
        return emu.bucket(self._transport.peer_id, peer, "data") if emu is not None else None

    @property
    def announced(self) -> tuple[str, int]:
        """(host, port) that peers are told to dial (``advertise_host``/``advertise_port``, else the bound ones;
        a host of 0.0.0.0 means "the IP you reach my libp2p address at")."""
        return self._cfg.advertise_host or self.host, self._cfg.advertise_port or self.port

    def path_to(self, peer: str) -> str:
        """The path the next ``connect`` to *peer* tries first (``PATH_DIRECT`` or ``PATH_LIBP2P``)."""
        until = self._direct_failed.get(peer)
        return PATH_LIBP2P if until is not None and trio.current_time() < until else PATH_DIRECT

    async def connect(self, peer: str) -> Link:
        """Open a tensor channel to *peer*: directly over TCP to its data-plane port, or, when that port
        cannot be reached (closed, filtered, behind a NAT) and ``fallback`` is on, over a stream on the
        libp2p connection (``net/stream_channel.py``). PeerUnavailable if neither works in time. After a
        failed direct attempt the peer is dialled on the fallback path for ``direct_retry`` seconds."""
        if not self._cfg.fallback or self.path_to(peer) == PATH_DIRECT:
            try:
                return await self._connect_direct(peer)
            except _Unreachable as exc:
                if not self._cfg.fallback:
                    raise PeerUnavailable(peer, f"cannot reach the data-plane port: {exc}") from None
                self._direct_failed[peer] = trio.current_time() + self._cfg.direct_retry
                log.info("data plane: %s is not reachable directly (%s); using the libp2p stream", short_peer(peer), exc)
        return await self._connect_stream(peer)

    async def _connect_stream(self, peer: str) -> StreamChannel:
        cfg = self._cfg
        stream = await self._transport.open_stream(peer, TENSOR)
        ch: StreamChannel | None = None
        try:
            await stream_hello(stream, peer, cfg.connect_timeout)
            ch = StreamChannel(stream, peer, cfg, self.budget)
            await self._nursery.start(self._run_stream, ch)
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            if isinstance(exc, RemoteProtocolError):
                raise PeerUnavailable(peer, f"libp2p tensor channel set-up failed: {exc}") from None
            raise
        return ch

    async def _connect_direct(self, peer: str) -> BulkChannel:
        """A direct channel; _Unreachable when the TCP connects fail (not when the peer refuses a ticket)."""
        cfg = self._cfg
        ch: BulkChannel | None = None
        streams: list[trio.SocketStream] = []
        try:
            # the libp2p connection first, bounded by the transport's own deadlines: reaching a NAT'd peer
            # through a relay takes longer than connect_timeout under load, and cutting it there restarted it
            # at every retry, so that the link never came up (issue 43's live hostile test)
            ticket_stream = await self._transport.open_stream(peer, BULK_TICKET)
            with trio.fail_after(cfg.connect_timeout):
                reply = await self._request_ticket(peer, ticket_stream)
                host = self._dial_host(peer, reply["host"])
                lanes = reply["lanes"]
                if lanes > cfg.lanes:
                    raise RemoteProtocolError(f"peer granted {lanes} lanes, {cfg.lanes} were asked for")
                for i in range(lanes):
                    stream = await self._dial(host, reply["port"])
                    streams.append(stream)
                    _tune(stream, cfg)
                    await stream.send_all(reply["ticket"] + bytes([i]))
                ch = BulkChannel(list(streams), peer, _keys_for_dialer(reply), replace(cfg, cipher=reply["cipher"]),
                                 budget=self.budget, shape=self._shape(peer))
                streams.clear()  # the channel owns the sockets now
                await self._nursery.start(self._run_channel, ch)
                await ch._hello.wait()  # set by HELLO, or by a failure
                if ch._error is not None:
                    raise ch._error
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                for stream in streams:
                    await trio.aclose_forcefully(stream)
                if ch is not None:
                    await ch.aclose()
            if isinstance(exc, trio.TooSlowError):
                raise PeerUnavailable(peer, "bulk channel set-up timed out") from None
            if isinstance(exc, OSError):
                raise PeerUnavailable(peer, f"cannot reach the bulk port: {exc}") from None
            if isinstance(exc, RemoteProtocolError | PeerUnavailable) and ch is not None and exc is ch._error:
                raise PeerUnavailable(peer, f"bulk channel set-up failed: {exc}") from None
            raise
        return ch

    def _dial_host(self, peer: str, host: str) -> str:
        """The host to dial for a port *peer* announced on *host* ("the IP you reach me at" when unspecified)."""
        if host in ("", "0.0.0.0", "::"):
            return _ip_from_multiaddrs(self._transport.peer_addrs(peer)) or "127.0.0.1"
        return host

    async def _dial(self, host: str, port: int) -> trio.SocketStream:
        """One TCP connection to a data-plane port; _Unreachable when it fails or takes ``direct_timeout``."""
        try:
            with trio.fail_after(self._cfg.direct_timeout):
                return await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError) as exc:
            why = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
            raise _Unreachable(f"{host}:{port}: {why}") from None

    async def _request_ticket(self, peer: str, stream: Stream) -> dict[str, Any]:
        """The peer's ticket reply on *stream* (a BULK_TICKET stream to *peer*; closed here)."""
        try:
            limits = self._cfg.limits
            await stream.send_all(encode_frame(tf.encode_ticket_request(self._cfg.cipher, self._cfg.lanes),
                                               max_frame=limits.max_control_frame))
            dec = FrameDecoder(max_frame=limits.max_control_frame)
            while True:
                data = await stream.receive_some(64 * KiB)
                if not data:
                    dec.check_eof()
                    raise PeerUnavailable(peer, "ticket stream closed without a reply")
                frames = dec.feed(data)
                if frames:
                    reply = tf.decode_ticket_reply(frames[0], limits=limits)
                    if reply["cipher"] != self._cfg.cipher:
                        raise RemoteProtocolError("peer answered with another cipher")
                    return reply
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    # -- raw probe sockets (swarm/probe.py) -----------------------------------------------------------
    def grant_raw(self, peer: str) -> tuple[bytes, str, int] | None:
        """A one-time ticket for *peer* to dial our port with for a raw probe socket, and the (host, port)
        to dial; None when the plane is closed, its links are emulated (the probe then runs on the
        shaped libp2p stream), *peer* holds a ticket already, or ``MAX_RAW_TICKETS`` are outstanding."""
        now = trio.current_time()
        for t in [t for t, v in self._raw.items() if v.expires < now and v.sock is None]:
            del self._raw[t]
        if (self._closed or self._cfg.emulator is not None or len(self._raw) >= MAX_RAW_TICKETS
                or any(v.peer == peer for v in self._raw.values())):
            return None
        ticket = os.urandom(tf.TICKET_SIZE)
        self._raw[ticket] = _RawTicket(peer, now + RAW_WAIT)
        host, port = self.announced
        return ticket, host, port

    async def take_raw(self, ticket: bytes) -> socket.socket | None:
        """The socket the peer dialled with *ticket* (blocking mode, ours to close), or None when it did
        not come within ``RAW_WAIT`` seconds."""
        entry = self._raw.get(ticket)
        if entry is None:
            return None
        try:
            with trio.move_on_after(max(0.0, entry.expires - trio.current_time())):
                await entry.ready.wait()
        except BaseException:
            if entry.sock is not None:
                entry.sock.close()
            raise
        finally:
            self._raw.pop(ticket, None)
        return entry.sock

    async def dial_raw(self, peer: str, host: str, port: int, ticket: bytes) -> socket.socket:
        """Dial *peer*'s data-plane port for a raw probe socket with *ticket* (``grant_raw`` on its side);
        PeerUnavailable when the port cannot be reached within ``direct_timeout``."""
        host = self._dial_host(peer, host)
        try:
            stream = await self._dial(host, port)
        except _Unreachable as exc:
            raise PeerUnavailable(peer, f"raw probe port {exc}") from None
        try:
            with trio.fail_after(self._cfg.direct_timeout):
                await stream.send_all(ticket + bytes([RAW_LANE]))
        except (OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
            await trio.aclose_forcefully(stream)
            raise PeerUnavailable(peer, f"raw probe port {host}:{port}: {exc or 'timed out'}") from None
        return _detach(stream)

    def _refuse(self, peer: str, reason: str, detail: str = "") -> None:
        self.refusals.refuse(peer, reason, now=trio.current_time(), detail=detail)

    async def handle_ticket(self, stream: Stream) -> None:
        """BULK_TICKET handler: issue a one-time ticket and fresh keys to the authenticated peer."""
        peer = stream.remote_peer
        if self.refusals.banned(peer, now=trio.current_time()):
            return   # a flooder: refused unread, not even counted (its ban decays on its own)
        if self._admit is not None and not self._admit(peer):
            self._refuse(peer, "bulk/not-admitted", "no job of this node has it as a member")
            return   # the transport closes the stream when its handler returns
        if not self.admission.start_handshake():
            self._refuse(peer, "bulk/handshakes", "too many handshakes in progress")
            return   # the transport closes the stream when its handler returns
        try:
            await self._ticket_exchange(stream, peer)
        finally:
            self.admission.end_handshake()

    async def _ticket_exchange(self, stream: Stream, peer: str) -> None:
        limits = self._cfg.limits
        try:
            with trio.fail_after(self._cfg.connect_timeout):
                dec = FrameDecoder(max_frame=limits.max_control_frame)
                frames: list[bytes] = []
                while not frames:
                    data = await stream.receive_some(64 * KiB)
                    if not data or self._closed:
                        return
                    frames = dec.feed(data)
                cipher, lanes = tf.decode_ticket_request(frames[0], limits=limits)
                if cipher != self._cfg.cipher:
                    log.info("refusing bulk ticket for %s: cipher %r, ours is %r", peer, cipher, self._cfg.cipher)
                    return
                self._expire()
                why = self.admission.may_issue(peer)
                if why:
                    self._refuse(peer, "bulk/caps", why)
                    return
                ticket, k_dial, k_listen = os.urandom(tf.TICKET_SIZE), new_key(), new_key()
                lanes = min(lanes, self._cfg.lanes)
                self._tickets[ticket] = _Ticket(peer, k_dial, k_listen, trio.current_time() + self._cfg.ticket_ttl,
                                                [None] * lanes)
                self.admission.issued(peer)
                await stream.send_all(encode_frame(
                    tf.encode_ticket_reply(ticket=ticket, cipher=cipher, k_dial=k_dial, k_listen=k_listen,
                                           host=self.announced[0], port=self.announced[1],
                                           lanes=lanes),
                    max_frame=limits.max_control_frame))
        except (RemoteProtocolError, PeerUnavailable, trio.TooSlowError) as exc:
            log.info("bulk ticket exchange with %s failed: %s", peer, exc)

    async def handle_stream(self, stream: Stream) -> None:
        """TENSOR handler: a peer that cannot reach our data-plane port opens a channel on the libp2p
        connection instead; same admission as a ticket (who, and how many channels)."""
        peer = stream.remote_peer
        if self.refusals.banned(peer, now=trio.current_time()) or self._closed:
            return
        if self._admit is not None and not self._admit(peer):
            self._refuse(peer, "bulk/not-admitted", "no job of this node has it as a member")
            return   # the transport closes the stream when its handler returns
        why = self.admission.may_issue(peer)
        if why or not self.admission.start_handshake():
            self._refuse(peer, "bulk/caps", why or "too many handshakes in progress")
            return
        try:
            try:
                ok = await stream_welcome(stream, self._cfg.connect_timeout)
            except (RemoteProtocolError, PeerUnavailable) as exc:
                log.info("libp2p tensor channel from %s: %s", peer, exc)
                return
        finally:
            self.admission.end_handshake()
        if not ok:
            return
        ch = StreamChannel(stream, peer, self._cfg, self.budget)
        await self._serve_incoming(peer, ch, self._run_stream)   # the stream lives as long as this handler

    async def _serve_incoming(self, peer: str, ch: Any, run: Callable[[Any], Awaitable[None]]) -> None:
        """Hand an accepted channel (direct or libp2p stream) to ``accept`` and run it while it counts
        against *peer*'s admitted channels; closed at once when nobody can take it."""
        self.admission.channel_opened(peer)
        try:
            try:
                self._incoming_send.send_nowait(ch)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                await ch.aclose()
                return
            await run(ch)
        finally:
            self.admission.channel_closed(peer)

    async def _run_stream(self, ch: StreamChannel, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._open_streams.add(ch)
        try:
            await ch.run(task_status=task_status)
        finally:
            self._open_streams.discard(ch)

    def _expire(self) -> None:
        now = trio.current_time()
        for t in [t for t, v in self._tickets.items() if v.expires < now]:
            entry = self._tickets.pop(t)
            self.admission.ticket_done(entry.peer)
            for sock in entry.socks:
                if sock is not None:
                    sock.close()

    async def handle_tcp(self, stream: trio.SocketStream) -> None:
        """A dialer arrived on the bulk port with a ticket and a lane index: once every lane of the ticket
        is in, serve the channel (in the task of the last lane to arrive)."""
        if not self.admission.start_handshake():   # unauthenticated yet: only the total is capped
            await trio.aclose_forcefully(stream)
            return
        try:
            _tune(stream, self._cfg)
            hello = bytearray()
            with trio.move_on_after(self._cfg.connect_timeout):
                while len(hello) < tf.TICKET_SIZE + 1:
                    data = await stream.receive_some(tf.TICKET_SIZE + 1 - len(hello))
                    if not data:
                        break
                    hello += data
        finally:
            self.admission.end_handshake()
        if len(hello) == tf.TICKET_SIZE + 1 and hello[-1] == RAW_LANE:
            raw = self._raw.get(bytes(hello[: tf.TICKET_SIZE]))
            if raw is None or raw.sock is not None or self._closed:
                await trio.aclose_forcefully(stream)
                return
            raw.sock = _detach(stream)   # take_raw hands it to the probe server, which closes it
            raw.ready.set()
            return
        self._expire()
        entry = self._tickets.get(bytes(hello[: tf.TICKET_SIZE])) if len(hello) == tf.TICKET_SIZE + 1 else None
        lane = hello[-1] if entry is not None else 0
        if entry is None or self._closed or lane >= len(entry.socks) or entry.socks[lane] is not None:
            await trio.aclose_forcefully(stream)
            return
        entry.socks[lane] = _detach(stream)  # the trio stream closing at the end of this task leaves it alone
        if any(sock is None for sock in entry.socks):
            return
        del self._tickets[bytes(hello[: tf.TICKET_SIZE])]
        self.admission.ticket_done(entry.peer)
        socks: list[trio.SocketStream | socket.socket] = [sock for sock in entry.socks if sock is not None]
        ch = BulkChannel(socks, entry.peer, (entry.k_listen, entry.k_dial), self._cfg, budget=self.budget,
                         shape=self._shape(entry.peer))
        ch._control(tf.HELLO)  # the writer sends it as soon as the channel runs
        await self._serve_incoming(entry.peer, ch, self._run_channel)

    async def _run_channel(self, ch: BulkChannel, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run *ch*, its bytes counted in the transport's traffic meter (plane ``"data"``)."""
        self._traffic.add("data", ch.remote_peer)   # the peer's row exists before its first snapshot
        self._open.add(ch)
        try:
            await ch.run(task_status=task_status)
        finally:
            self._open.discard(ch)
            self._traffic.add("data", ch.remote_peer, sent=ch.bytes_sent, received=ch.bytes_received)

    def _live_traffic(self) -> list[tuple[str, str, int, int]]:
        return [("data", ch.remote_peer, ch.bytes_sent, ch.bytes_received) for ch in self._open]


@dataclass(slots=True)
class _Ticket:
    """A ticket the listener issued: who may use it, the keys, and the lanes that arrived so far."""

    peer: str
    k_dial: bytes
    k_listen: bytes
    expires: float
    socks: list[socket.socket | None]


@dataclass(slots=True)
class _RawTicket:
    """A raw probe ticket: who may use it, until when, and the socket once it arrived."""

    peer: str
    expires: float
    sock: socket.socket | None = None
    ready: trio.Event = field(default_factory=trio.Event)


def _tune(stream: trio.SocketStream, cfg: DataPlaneConfig) -> None:
    if cfg.socket_buffer <= 0:
        return
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with suppress(OSError):
            stream.setsockopt(socket.SOL_SOCKET, opt, cfg.socket_buffer)


@asynccontextmanager
async def open_data_plane(transport: Transport, *, config: DataPlaneConfig | None = None,
                          admit: Callable[[str], bool] | None = None, refusals: Refusals | None = None,
                          **overrides: Any) -> AsyncIterator[DataPlane]:
    """``async with open_data_plane(transport, listen_host="127.0.0.1") as dp:`` — registers the
    BULK_TICKET handler on *transport*, listens on TCP, and closes every channel on exit.
    *admit* decides which authenticated peers may open channels to us (None: every one; a node's job
    service passes its own); refused tickets are counted in *refusals* (the node's table, so that a
    flooder is banned across its services; a table of its own when None). Keyword overrides are
    :class:`DataPlaneConfig` fields."""
    cfg = replace(config or DataPlaneConfig(), **overrides) if overrides else (config or DataPlaneConfig())
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(cfg.listen_port, host=cfg.listen_host)
        sockname = listeners[0].socket.getsockname()
        dp = DataPlane(transport, cfg, nursery, sockname[0], int(sockname[1]), admit=admit, refusals=refusals)
        await nursery.start(trio.serve_listeners, dp.handle_tcp, listeners)
        transport.set_stream_handler(BULK_TICKET, dp.handle_ticket)
        transport.set_stream_handler(TENSOR, dp.handle_stream)
        try:
            yield dp
        finally:
            dp._closed = True
            dp._detach()
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                for ch in list(dp._open_streams):   # accepted ones live in the transport's handler tasks
                    await ch.abort()
            dp._incoming_send.close()
            for ticket in dp._tickets.values():  # lanes of channels whose other lanes never came
                for sock in ticket.socks:
                    if sock is not None:
                        sock.close()
            for raw in dp._raw.values():   # raw probe sockets their probe server has not taken yet
                if raw.sock is not None:
                    raw.sock.close()
            nursery.cancel_scope.cancel()


__all__ = ["PATH_DIRECT", "PATH_LIBP2P", "RAW_LANE", "BulkChannel", "DataPlane", "DataPlaneConfig", "Link", "StreamChannel",
           "open_data_plane"]
