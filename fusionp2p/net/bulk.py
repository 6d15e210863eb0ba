"""The encrypted TCP side channel for tensors, and the ``DataPlane`` service that opens and accepts it.

Theory of operation (ARCHITECTURE.md "Planes", LIBP2P_NOTES.md §9):

1. **Key agreement over the authenticated transport.** The dialer opens a ``BULK_TICKET`` stream to
   the peer. The listener, which knows the stream's authenticated remote peer id, answers with a
   one-time 16-byte ticket, two fresh 32-byte keys (one per direction), the cipher and its TCP address,
   and remembers ``ticket → (peer id, keys)`` for ``ticket_ttl`` seconds.
2. **Raw TCP.** The dialer connects to that address and sends the ticket. The listener pops it (a
   ticket works once) and both ends switch to AEAD records (``fusionp2p.net.aead``,
   ``fusionp2p.net.tensor_stream``); the listener's first record is ``HELLO``, which proves to the
   dialer that the peer holds the keys. The identity behind the channel is therefore the one the
   transport authenticated; an eavesdropper on the TCP link learns only a used-up ticket.
3. **Flow.** ``send`` blocks while ``window`` messages are unacknowledged (the receiver acks when the
   application takes a message). Large records are sealed/opened in worker threads, one record ahead
   of the socket, so encryption overlaps the kernel copy and both cores are used.
4. **Failure.** Every read has a deadline of ``dead_after`` seconds of silence; idle ends send a PING
   every ``keepalive`` seconds. Silence, a reset or an EOF without ``CLOSE`` make ``send``/``receive``
   raise :class:`~fusionp2p.errors.PeerUnavailable`; a record failing authentication raises
   :class:`~fusionp2p.errors.RemoteProtocolError` and closes the channel. Reconnect by calling
   ``DataPlane.connect`` again once the peer is back (a fresh ticket, fresh keys).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from fusionp2p.errors import ConfigError, FusionError, PeerUnavailable, RemoteProtocolError, leaf_errors
from fusionp2p.net.aead import CIPHERS, Opener, Sealer, default_cipher, new_key
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.tensor_stream import RecordPlan, RecordReader, RecordWriter
from fusionp2p.net.transport import Stream, Transport
from fusionp2p.wire import tensor_frame as tf
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.limits import DEFAULT_LIMITS, KiB, Limits, MiB
from fusionp2p.wire.protocols import BULK_TICKET

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DataPlaneConfig:
    """Settings of a node's data plane."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    advertise_host: str | None = None   # address peers should dial (default: the bound address)
    cipher: str = field(default_factory=default_cipher)
    window: int = 8                     # messages in flight per direction
    chunk_size: int = 4 * MiB           # plaintext bytes per record
    thread_threshold: int = 256 * KiB   # records at least this big are sealed/opened in worker threads
    keepalive: float = 0.5              # seconds between PINGs on an idle channel
    dead_after: float = 3.0             # seconds of silence before PeerUnavailable (a killed peer is seen at once: reset or EOF)
    connect_timeout: float = 5.0
    ticket_ttl: float = 10.0
    incoming_buffer: int = 16
    socket_buffer: int = 0              # SO_SNDBUF/SO_RCVBUF; 0 keeps Linux autotuning (faster on loopback)
    insecure_plaintext_for_tests: bool = False
    limits: Limits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        if self.cipher not in CIPHERS:
            raise ConfigError(f"DataPlaneConfig.cipher must be one of {CIPHERS}")
        if self.cipher == "none" and not self.insecure_plaintext_for_tests:
            raise ConfigError("cipher 'none' sends tensors in the clear; it needs insecure_plaintext_for_tests=True")
        if self.window < 1 or self.incoming_buffer < 1:
            raise ConfigError("DataPlaneConfig.window and incoming_buffer must be >= 1")
        if not 1 * KiB <= self.chunk_size <= self.limits.max_frame:
            raise ConfigError("DataPlaneConfig.chunk_size must be between 1 KiB and limits.max_frame")
        if not 0 < self.keepalive < self.dead_after:
            raise ConfigError("DataPlaneConfig needs 0 < keepalive < dead_after")
        if self.connect_timeout <= 0 or self.ticket_ttl <= 0:
            raise ConfigError("DataPlaneConfig timeouts must be positive")


# (kind, header bytes, sealed body, the pooled buffer holding it, nonce)
_Record = tuple[int, bytes, memoryview, bytearray, bytes]


class BulkChannel:
    """One encrypted TCP tensor channel (implements ``fusionp2p.net.channel.TensorChannel``)."""

    def __init__(self, stream: trio.SocketStream, peer: str, keys: tuple[bytes, bytes], cfg: DataPlaneConfig) -> None:
        self._stream = stream
        self._peer = peer
        self._cfg = cfg
        self._writer = RecordWriter(Sealer(cfg.cipher, keys[0]), chunk_size=cfg.chunk_size)
        self._reader = RecordReader(Opener(cfg.cipher, keys[1]), chunk_size=cfg.chunk_size, limits=cfg.limits)
        self._send_lock = trio.Lock()
        self._wire_lock = trio.Lock()
        self._inflight = 0
        self._credit = trio.Event()
        self._inbox_send, self._inbox = trio.open_memory_channel[dict[str, Any]](cfg.window)
        self._error: FusionError | None = None
        self._closed = False
        self._peer_closed = False
        self._hello = trio.Event()
        self._scope = trio.CancelScope()
        self._last_sent = 0.0
        # reusable record buffers (fresh multi-MiB allocations cost page faults on every record)
        self._seal_pool: list[bytearray] = []
        self._recv_pool: list[bytearray] = []
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def remote_peer(self) -> str:
        return self._peer

    # ------------------------------------------------------------------------------------ public API
    async def send(self, msg: TensorMessage) -> None:
        """Send one message; blocks while the window is full. PeerUnavailable if the peer is gone."""
        async with self._send_lock:
            while True:
                self._check_send()
                if self._inflight < self._cfg.window:
                    break
                self._credit = trio.Event()
                await self._credit.wait()
            self._inflight += 1
            async with self._wire_lock:
                self._check_send()
                plans = self._writer.plan_message(msg)
                try:
                    await self._send_plans(plans)
                except BaseException as exc:
                    err = _classify(self._peer, exc)
                    if err is None:
                        raise
                    raise self._fail(err) from None

    async def receive(self) -> TensorMessage:
        """The next message; trio.EndOfChannel after a clean close by the peer."""
        if self._closed:
            raise trio.ClosedResourceError("channel closed")
        try:
            fields = await self._inbox.receive()
        except trio.EndOfChannel:
            if self._error is not None:
                raise self._error from None
            raise
        except trio.ClosedResourceError:
            raise trio.ClosedResourceError("channel closed") from None
        if self._error is None and not self._peer_closed:
            # a failure here is reported by the reader on the next call
            with suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await self._control(tf.ACK, tf.encode_ack(1))
        return TensorMessage(**fields)

    async def aclose(self) -> None:
        """Close cleanly (the peer's ``receive`` ends with EndOfChannel)."""
        if self._closed:
            return
        self._closed = True
        if self._error is None and not self._peer_closed:
            with trio.move_on_after(self._cfg.dead_after) as cs:
                cs.shield = True
                with suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError, trio.BusyResourceError):
                    await self._control(tf.CLOSE)
        self._scope.cancel()
        self._inbox.close()
        self._credit.set()
        await trio.aclose_forcefully(self._stream)

    # ------------------------------------------------------------------------------------- internals
    def _check_send(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("channel closed")
        if self._error is not None:
            raise self._error
        if self._peer_closed:
            raise PeerUnavailable(self._peer, "channel closed by peer")

    def _fail(self, exc: FusionError) -> FusionError:
        if self._error is None:
            self._error = exc
            log.info("bulk channel to %s failed: %s", self._peer, exc)
        self._inbox_send.close()
        self._credit.set()
        self._hello.set()  # wakes a connect() still waiting for the listener's HELLO
        self._scope.cancel()
        return self._error

    async def _write(self, buf: memoryview) -> None:
        await self._stream.send_all(buf)
        self.bytes_sent += len(buf)
        self._last_sent = trio.current_time()

    async def _control(self, kind: int, body: bytes = b"") -> None:
        async with self._wire_lock:
            await self._write(self._writer.control(kind, body))

    async def _seal(self, plan: RecordPlan) -> tuple[memoryview, bytearray | None]:
        if plan.size >= self._cfg.thread_threshold:
            out = self._seal_pool.pop() if self._seal_pool else bytearray(self._writer.max_record)
            return await trio.to_thread.run_sync(self._writer.seal, plan, out), out
        return self._writer.seal(plan), None

    async def _send_plans(self, plans: list[RecordPlan]) -> None:
        if len(plans) == 1:
            view, out = await self._seal(plans[0])
            await self._write(view)
            if out is not None:
                self._seal_pool.append(out)
            return
        # two-stage pipeline: seal record i+1 in a worker thread while the socket takes record i
        sealed_send, sealed_recv = trio.open_memory_channel[tuple[memoryview, bytearray | None]](1)

        async def sealer() -> None:
            async with sealed_send:
                for p in plans:
                    await sealed_send.send(await self._seal(p))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sealer)
            async with sealed_recv:
                async for view, out in sealed_recv:
                    await self._write(view)
                    if out is not None:
                        self._seal_pool.append(out)

    async def _recv_exactly(self, view: memoryview, *, at_boundary: bool) -> bool:
        """Fill *view*; False at a clean EOF on a record boundary. Deadline: dead_after of silence."""
        sock = self._stream.socket
        got = 0
        while got < len(view):
            n = 0
            with trio.move_on_after(self._cfg.dead_after):
                try:
                    n = await sock.recv_into(view[got:])
                except OSError as exc:
                    raise PeerUnavailable(self._peer, f"connection lost: {exc}") from None
                if n == 0:
                    if at_boundary and got == 0:
                        return False
                    raise PeerUnavailable(self._peer, "connection lost in the middle of a record")
            if n == 0:
                raise PeerUnavailable(self._peer, f"silent for {self._cfg.dead_after:.1f} s")
            got += n
            self.bytes_received += n
        return True

    async def _read_records(self, out: trio.MemorySendChannel[_Record]) -> None:
        async with out:
            while True:
                hdr = bytearray(tf.RECORD_HEADER)
                if not await self._recv_exactly(memoryview(hdr), at_boundary=True):
                    return
                kind, n = self._reader.header(hdr)  # bound checked before allocating the body
                buf = self._recv_pool.pop() if self._recv_pool else bytearray(self._reader.max_body)
                body = memoryview(buf)[:n]
                await self._recv_exactly(body, at_boundary=False)
                await out.send((kind, bytes(hdr), body, buf, self._reader.opener.next_nonce()))

    async def _open_records(self, inp: trio.MemoryReceiveChannel[_Record]) -> None:
        opener = self._reader.opener
        async with inp:
            async for kind, hdr, body, buf, nonce in inp:
                dest = self._reader.destination(kind, len(body))  # decrypt in place into the message
                if len(body) >= self._cfg.thread_threshold:
                    plain = await trio.to_thread.run_sync(opener.open, nonce, hdr, body, dest)
                else:
                    plain = opener.open(nonce, hdr, body, dest)
                del body
                if len(self._recv_pool) < 4:
                    self._recv_pool.append(buf)
                for ev in self._reader.on_plaintext(kind, plain):
                    self._on_event(ev.kind, ev.message, ev.count)

    def _on_event(self, kind: int, message: dict[str, Any] | None, count: int) -> None:
        if kind == tf.MSG_END:
            assert message is not None
            try:
                self._inbox_send.send_nowait(message)
            except trio.WouldBlock:
                raise RemoteProtocolError("peer sent more messages than the window allows") from None
        elif kind == tf.ACK:
            if count > self._inflight:
                raise RemoteProtocolError("peer acknowledged messages never sent")
            self._inflight -= count
            self._credit.set()
        elif kind == tf.HELLO:
            self._hello.set()
        elif kind == tf.CLOSE:
            self._peer_closed = True
            self._inbox_send.close()
            self._credit.set()

    async def _keepalive(self) -> None:
        while True:
            await trio.sleep(self._cfg.keepalive / 2)
            if trio.current_time() - self._last_sent >= self._cfg.keepalive and not self._wire_lock.locked():
                try:
                    await self._control(tf.PING)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    return

    # Any: the trio-typing stubs libp2p installs shadow trio.TaskStatus for mypy
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The channel's background work (reader, opener, keepalive) until it closes or fails."""
        self._last_sent = trio.current_time()
        with self._scope:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._keepalive)
                    task_status.started()
                    records_send, records_recv = trio.open_memory_channel[_Record](2)
                    async with trio.open_nursery() as inner:
                        inner.start_soon(self._open_records, records_recv)
                        await self._read_records(records_send)
                    # EOF and every record processed: clean only if the peer said CLOSE first
                    if not self._reader.closed:
                        raise PeerUnavailable(self._peer, "connection closed without CLOSE")
                    nursery.cancel_scope.cancel()
            except BaseException as exc:
                err = _classify(self._peer, exc)
                if err is None:
                    raise
                self._fail(err)
        if self._error is not None or self._closed:
            await trio.aclose_forcefully(self._stream)


def _classify(peer: str, exc: BaseException) -> FusionError | None:
    """The channel error behind *exc* (unwrapping exception groups): a peer's protocol violation wins
    over a lost connection; None when *exc* is not a channel failure (e.g. a cancellation)."""
    leaves = leaf_errors(exc)
    for leaf in leaves:
        if isinstance(leaf, RemoteProtocolError):
            return leaf
    for leaf in leaves:
        if isinstance(leaf, PeerUnavailable):
            return leaf
        if isinstance(leaf, trio.BrokenResourceError | trio.ClosedResourceError | OSError):
            return PeerUnavailable(peer, f"connection lost: {leaf!r}")
    return None


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

    def __init__(self, transport: Transport, cfg: DataPlaneConfig, nursery: trio.Nursery, host: str, port: int) -> None:
        self._transport = transport
        self._cfg = cfg
        self._nursery = nursery
        self.host = host
        self.port = port
        self._tickets: dict[bytes, tuple[str, bytes, bytes, float]] = {}
        self._incoming_send, self.incoming = trio.open_memory_channel[BulkChannel](cfg.incoming_buffer)
        self._closed = False

    @property
    def config(self) -> DataPlaneConfig:
        return self._cfg

    async def connect(self, peer: str) -> BulkChannel:
        """Open an encrypted channel to *peer* (PeerUnavailable if it cannot be reached in time)."""
        cfg = self._cfg
        ch: BulkChannel | None = None
        try:
            with trio.fail_after(cfg.connect_timeout):
                reply = await self._request_ticket(peer)
                host = reply["host"]
                if host in ("", "0.0.0.0", "::"):
                    host = _ip_from_multiaddrs(self._transport.peer_addrs(peer)) or "127.0.0.1"
                stream = await trio.open_tcp_stream(host, reply["port"])
                _tune(stream, cfg)
                await stream.send_all(reply["ticket"])
                ch = BulkChannel(stream, peer, _keys_for_dialer(reply), replace(cfg, cipher=reply["cipher"]))
                await self._nursery.start(ch.run)
                await ch._hello.wait()  # set by HELLO, or by a failure
                if ch._error is not None:
                    raise ch._error
        except BaseException as exc:
            if ch is not None:
                with trio.CancelScope(shield=True):
                    await ch.aclose()
            if isinstance(exc, trio.TooSlowError):
                raise PeerUnavailable(peer, "bulk channel set-up timed out") from None
            if isinstance(exc, OSError):
                raise PeerUnavailable(peer, f"cannot reach the bulk port: {exc}") from None
            if isinstance(exc, RemoteProtocolError | PeerUnavailable) and ch is not None and exc is ch._error:
                raise PeerUnavailable(peer, f"bulk channel set-up failed: {exc}") from None
            raise
        return ch

    async def _request_ticket(self, peer: str) -> dict[str, Any]:
        stream = await self._transport.open_stream(peer, BULK_TICKET)
        try:
            limits = self._cfg.limits
            await stream.send_all(encode_frame(tf.encode_ticket_request(self._cfg.cipher), max_frame=limits.max_control_frame))
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

    async def handle_ticket(self, stream: Stream) -> None:
        """BULK_TICKET handler: issue a one-time ticket and fresh keys to the authenticated peer."""
        peer = stream.remote_peer
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
                cipher = tf.decode_ticket_request(frames[0], limits=limits)
                if cipher != self._cfg.cipher:
                    log.info("refusing bulk ticket for %s: cipher %r, ours is %r", peer, cipher, self._cfg.cipher)
                    return
                self._expire()
                ticket, k_dial, k_listen = os.urandom(tf.TICKET_SIZE), new_key(), new_key()
                self._tickets[ticket] = (peer, k_dial, k_listen, trio.current_time() + self._cfg.ticket_ttl)
                await stream.send_all(encode_frame(
                    tf.encode_ticket_reply(ticket=ticket, cipher=cipher, k_dial=k_dial, k_listen=k_listen,
                                           host=self._cfg.advertise_host or self.host, port=self.port),
                    max_frame=limits.max_control_frame))
        except (RemoteProtocolError, PeerUnavailable, trio.TooSlowError) as exc:
            log.info("bulk ticket exchange with %s failed: %s", peer, exc)

    def _expire(self) -> None:
        now = trio.current_time()
        for t in [t for t, v in self._tickets.items() if v[3] < now]:
            del self._tickets[t]

    async def handle_tcp(self, stream: trio.SocketStream) -> None:
        """A dialer arrived on the bulk port: check its ticket, then serve the channel."""
        _tune(stream, self._cfg)
        ticket = bytearray()
        with trio.move_on_after(self._cfg.connect_timeout):
            while len(ticket) < tf.TICKET_SIZE:
                data = await stream.receive_some(tf.TICKET_SIZE - len(ticket))
                if not data:
                    break
                ticket += data
        self._expire()
        entry = self._tickets.pop(bytes(ticket), None) if len(ticket) == tf.TICKET_SIZE else None
        if entry is None or self._closed:
            await trio.aclose_forcefully(stream)
            return
        peer, k_dial, k_listen, _ = entry
        ch = BulkChannel(stream, peer, (k_listen, k_dial), self._cfg)
        try:
            await ch._control(tf.HELLO)
            self._incoming_send.send_nowait(ch)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await trio.aclose_forcefully(stream)
            return
        await ch.run()


def _tune(stream: trio.SocketStream, cfg: DataPlaneConfig) -> None:
    if cfg.socket_buffer <= 0:
        return
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with suppress(OSError):
            stream.setsockopt(socket.SOL_SOCKET, opt, cfg.socket_buffer)


@asynccontextmanager
async def open_data_plane(transport: Transport, *, config: DataPlaneConfig | None = None,
                          **overrides: Any) -> AsyncIterator[DataPlane]:
    """``async with open_data_plane(transport, listen_host="127.0.0.1") as dp:`` — registers the
    BULK_TICKET handler on *transport*, listens on TCP, and closes every channel on exit.
    Keyword overrides are :class:`DataPlaneConfig` fields."""
    cfg = replace(config or DataPlaneConfig(), **overrides) if overrides else (config or DataPlaneConfig())
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(cfg.listen_port, host=cfg.listen_host)
        sockname = listeners[0].socket.getsockname()
        dp = DataPlane(transport, cfg, nursery, sockname[0], int(sockname[1]))
        await nursery.start(trio.serve_listeners, dp.handle_tcp, listeners)
        transport.set_stream_handler(BULK_TICKET, dp.handle_ticket)
        try:
            yield dp
        finally:
            dp._closed = True
            dp._incoming_send.close()
            nursery.cancel_scope.cancel()


__all__ = ["BulkChannel", "DataPlane", "DataPlaneConfig", "open_data_plane"]
