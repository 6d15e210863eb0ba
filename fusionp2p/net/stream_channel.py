"""The fallback tensor channel: tensor messages over a libp2p stream (Noise + yamux), when no direct TCP
connection to the peer's data-plane port can be made (a closed port, a NAT, a container whose data port
is not published).

Theory of operation (docs/networking.md "Paths"):

* **Opening.** The dialer opens a ``TENSOR`` stream on the libp2p connection the two peers already
  share (whichever side dialled it) and sends a ``HELLO`` record; the listener answers ``HELLO`` if
  ``admit`` accepts the authenticated peer and the data plane's channel caps allow one more channel
  (``net/admission.py``), and closes the stream otherwise. Noise already authenticates and encrypts
  the stream, so there is no ticket, no key and no AEAD of our own.
* **Records.** The same 5-byte record header as the TCP data plane (``wire/tensor_frame``: length,
  kind): ``MSG_END`` carries one whole encoded ``TensorMessage``, ``ACK`` the number of messages the
  application took, ``CLOSE`` ends the channel cleanly.
  A message's announced size is bounded by ``limits.max_frame`` and claimed from the data plane's
  :class:`~fusionp2p.net.admission.BufferBudget` before its buffer exists.
* **Flow.** As on the TCP path: ``send`` blocks while ``window`` messages are unacknowledged, and the
  receiver acknowledges a message when the application takes it, so the inbox never holds more than
  ``window`` messages (one more is a protocol violation).
* **Failure.** A reset, a lost connection or an EOF without ``CLOSE`` make ``send``/``receive`` raise
  :class:`~fusionp2p.errors.PeerUnavailable`; a malformed record raises
  :class:`~fusionp2p.errors.RemoteProtocolError` and closes the channel. No keepalive of our own: the
  job's reconnecting channel (``net/resilient.py``) and the membership view judge liveness.

It is slower than the TCP path (py-libp2p's Noise + yamux runs in the trio thread:
``benchmarks/paths.py``), and it works wherever the control plane works.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any

import trio

from fusionp2p.errors import FusionError, LocalProtocolError, PeerUnavailable, RemoteProtocolError
from fusionp2p.net.admission import BufferBudget
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.dataplane_config import PATH_DIRECT, PATH_LIBP2P, DataPlaneConfig
from fusionp2p.net.transport import Stream
from fusionp2p.wire import tensor_frame as tf

log = logging.getLogger(__name__)

_CLOSE_WAIT = 2.0          # seconds aclose waits for the peer's end of the stream after our CLOSE
_READ = 256 * 1024         # bytes asked for per read (py-libp2p returns at most one Noise frame, ~64 KiB)


async def _read_into(stream: Stream, view: memoryview, *, at_boundary: bool, peer: str) -> bool:
    """Fill *view* from *stream*; False at a clean end of stream before the first byte (if *at_boundary*)."""
    got = 0
    while got < len(view):
        data = await stream.receive_some(min(_READ, len(view) - got))
        if not data:
            if at_boundary and got == 0:
                return False
            raise PeerUnavailable(peer, "the libp2p stream ended in the middle of a record")
        if len(data) > len(view) - got:
            raise RemoteProtocolError("stream returned more bytes than asked for")
        view[got : got + len(data)] = data
        got += len(data)
    return True


class StreamChannel:
    """A tensor channel over one libp2p stream (implements ``fusionp2p.net.channel.TensorChannel``; the
    data plane opens and accepts them: ``DataPlane.connect`` falls back to it, ``DataPlane.incoming``
    carries both kinds)."""

    path = PATH_LIBP2P
    lanes = 1

    def __init__(self, stream: Stream, peer: str, cfg: DataPlaneConfig, budget: BufferBudget) -> None:
        self._stream = stream
        self._peer = peer
        self._cfg = cfg
        self._budget = budget
        self._claims: collections.deque[int] = collections.deque()
        self._claims_open = True
        self._inbox_send, self._inbox = trio.open_memory_channel[dict[str, Any]](cfg.window)
        self._send_lock = trio.Lock()     # one message at a time
        self._write_lock = trio.Lock()    # one record at a time (a message's, or an ACK)
        self._inflight = 0                # sent, not acknowledged
        self._credit = trio.Event()
        self._error: FusionError | None = None
        self._closed = False
        self._peer_closed = False
        self._finished = trio.Event()
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def remote_peer(self) -> str:
        return self._peer

    @property
    def closed_by_peer(self) -> bool:
        """The peer closed the channel cleanly (see ``BulkChannel.closed_by_peer``)."""
        return self._peer_closed and self._error is None

    # ------------------------------------------------------------------------------------ public API
    async def send(self, msg: TensorMessage) -> None:
        """Send one message; blocks while yamux's window to the peer is full. PeerUnavailable if the peer
        is gone. The message is encoded (copied) before the first write, so its tensors may change once
        ``send`` returns."""
        async with self._send_lock:
            while True:
                self._check_send()
                if self._inflight < self._cfg.window:
                    break
                self._credit = trio.Event()
                await self._credit.wait()
            parts = tf.encode_message(msg)
            size = sum(len(p) for p in parts)
            if size > self._cfg.limits.max_frame:
                raise LocalProtocolError(f"message of {size} bytes exceeds the limit of {self._cfg.limits.max_frame}")
            self._inflight += 1
            async with self._write_lock:
                await self._write(tf.record_header(tf.MSG_END, size) + bytes(parts[0]))
                for p in parts[1:]:
                    await self._write(p)

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
        if self._claims:
            self._budget.release(self._peer, self._claims.popleft())
        if self._error is None and not self._peer_closed:
            with contextlib.suppress(PeerUnavailable):   # a failure shows on the next send or receive
                async with self._write_lock:
                    await self._write(tf.record_header(tf.ACK, 4) + tf.encode_ack(1))
        return TensorMessage(**fields)

    async def aclose(self) -> None:
        """Close cleanly: CLOSE after every message sent, then end our side of the stream; the peer's
        ``receive`` ends with EndOfChannel. Waits briefly (at most ``_CLOSE_WAIT``) for the peer to end its side."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            if self._error is None and not self._peer_closed:
                with trio.move_on_after(min(self._cfg.dead_after, _CLOSE_WAIT)):
                    async with self._write_lock:
                        try:
                            await self._stream.send_all(tf.record_header(tf.CLOSE, 0))
                            await self._stream.send_eof()
                        except PeerUnavailable:
                            pass
                    await self._finished.wait()   # the peer's CLOSE or the end of its side
            self._inbox_send.close()
            self._unclaim_all()
            await self._stream.aclose()
            self._finished.set()

    async def abort(self) -> None:
        """End the channel at once (its data plane is closing): no CLOSE, the stream is closed."""
        self._fail(PeerUnavailable(self._peer, "the data plane closed"))
        self._closed = True
        await self._stream.aclose()

    # ------------------------------------------------------------------------------------- internals
    async def _write(self, data: Any) -> None:
        try:
            await self._stream.send_all(data)
        except PeerUnavailable as exc:
            self._fail(exc)
            raise
        self.bytes_sent += len(data)

    def _check_send(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("channel closed")
        if self._error is not None:
            raise self._error
        if self._peer_closed:
            raise PeerUnavailable(self._peer, "channel closed by peer")

    def _fail(self, exc: FusionError) -> None:
        if self._error is None and not self._closed:
            self._error = exc
            log.info("libp2p tensor channel to %s failed: %s", self._peer, exc)
        self._inbox_send.close()
        self._credit.set()
        self._finished.set()

    def _unclaim_all(self) -> None:
        self._claims_open = False
        while self._claims:
            self._budget.release(self._peer, self._claims.popleft())

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Read the peer's records until CLOSE, the end of the stream or a failure."""
        task_status.started()
        try:
            await self._read_loop()
        except (PeerUnavailable, RemoteProtocolError) as exc:
            self._fail(exc)
        finally:
            self._inbox_send.close()
            self._finished.set()
            if self._closed or self._error is not None:
                self._unclaim_all()

    async def _read_loop(self) -> None:
        hdr = bytearray(tf.RECORD_HEADER)
        max_frame = self._cfg.limits.max_frame
        while True:
            if not await _read_into(self._stream, memoryview(hdr), at_boundary=True, peer=self._peer):
                if not self._peer_closed:
                    raise PeerUnavailable(self._peer, "libp2p stream closed without CLOSE")
                return
            kind, n = tf.parse_record_header(hdr, max_body=max_frame)   # bound checked before allocating
            self.bytes_received += tf.RECORD_HEADER
            if kind == tf.CLOSE:
                if n:
                    raise RemoteProtocolError("CLOSE record with a body")
                self._peer_closed = True
                self._inbox_send.close()   # receive() drains what came before, then EndOfChannel
                self._credit.set()         # a send waiting for credit fails now
                continue                   # read on to the end of the stream (the peer's FIN)
            if kind == tf.ACK:
                body = bytearray(n if n == 4 else 0)
                if n != 4 or not await _read_into(self._stream, memoryview(body), at_boundary=False, peer=self._peer):
                    raise RemoteProtocolError("ACK record must carry exactly 4 bytes")
                count = tf.decode_ack(body)
                if count > self._inflight:
                    raise RemoteProtocolError("peer acknowledged messages never sent")
                self._inflight -= count
                self._credit.set()
                continue
            if kind != tf.MSG_END or self._peer_closed:
                raise RemoteProtocolError(f"record kind {kind} on a libp2p tensor stream")
            if not self._claims_open:
                raise PeerUnavailable(self._peer, "channel ended")
            self._budget.claim(self._peer, n)   # RemoteProtocolError over a bound
            self._claims.append(n)
            buf = bytearray(n)
            await _read_into(self._stream, memoryview(buf), at_boundary=False, peer=self._peer)
            self.bytes_received += n
            fields = tf.decode_message(buf, limits=self._cfg.limits)
            try:
                self._inbox_send.send_nowait(fields)
            except trio.WouldBlock:
                raise RemoteProtocolError("peer sent more messages than the window allows") from None
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return   # we are closing


async def stream_hello(stream: Stream, peer: str, timeout: float) -> None:
    """Dialer side of the opening: HELLO, then wait for the listener's HELLO (PeerUnavailable if refused)."""
    with trio.move_on_after(timeout) as cs:
        await stream.send_all(tf.record_header(tf.HELLO, 0))
        hdr = bytearray(tf.RECORD_HEADER)
        if not await _read_into(stream, memoryview(hdr), at_boundary=True, peer=peer):
            raise PeerUnavailable(peer, "refused a libp2p tensor channel")
        kind, _ = tf.parse_record_header(hdr, max_body=0)
        if kind != tf.HELLO:
            raise RemoteProtocolError(f"expected HELLO on a libp2p tensor stream, got record kind {kind}")
    if cs.cancelled_caught:
        raise PeerUnavailable(peer, "libp2p tensor channel set-up timed out")


async def stream_welcome(stream: Stream, timeout: float) -> bool:
    """Listener side: read the dialer's HELLO and answer HELLO; False if the dialer sent anything else."""
    with trio.move_on_after(timeout):
        hdr = bytearray(tf.RECORD_HEADER)
        if not await _read_into(stream, memoryview(hdr), at_boundary=True, peer=stream.remote_peer):
            return False
        kind, _ = tf.parse_record_header(hdr, max_body=0)
        if kind != tf.HELLO:
            raise RemoteProtocolError(f"expected HELLO on a libp2p tensor stream, got record kind {kind}")
        await stream.send_all(tf.record_header(tf.HELLO, 0))
        return True
    return False


__all__ = ["PATH_DIRECT", "PATH_LIBP2P", "StreamChannel", "stream_hello", "stream_welcome"]
