"""The encrypted tensor channel: one ``BulkChannel`` over one or more TCP connections ("lanes").

The channel's design (docs/dataplane.md "I/O threads", "Lanes"): each lane's socket is driven by a
writer and a reader OS thread with blocking calls; lane 0 carries the protocol and judges liveness,
large messages are striped slot by slot over all lanes. Record layouts are in
``fusionp2p.wire.tensor_frame``, the sans-IO core in ``fusionp2p.net.tensor_stream``, keys and nonces
in ``fusionp2p.net.aead``. ``fusionp2p.net.bulk`` opens and accepts channels (``DataPlane``).
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import struct
import threading
import time
from contextlib import suppress
from typing import Any

import trio

from fusionp2p.errors import ConfigError, FusionError, PeerUnavailable, RemoteProtocolError, leaf_errors
from fusionp2p.net.admission import BufferBudget
from fusionp2p.net.aead import Opener, Sealer
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.dataplane_config import PATH_DIRECT, PATH_LIBP2P, PATH_RELAY, DataPlaneConfig
from fusionp2p.net.heap import keep_freed_heap
from fusionp2p.net.shaping import TokenBucket
from fusionp2p.net.tensor_stream import BufferPool, RecordReader, RecordWriter, SlotCursor, Stripe
from fusionp2p.wire import tensor_frame as tf
from fusionp2p.wire.limits import KiB

log = logging.getLogger(__name__)


# writer-queue items: (tag, payload, trio.Event to set when done or None)
_RAW, _SEALED, _PLANS, _FLUSH = range(4)  # bytes | [(sealed view, pooled buffer)] | ([plans], _Release) | -
_EOF = -1  # an ordered delivery: lane 0 ended cleanly after CLOSE
_POOLED_SEAL = 64 * KiB  # records from this size on are sealed into recycled record-sized buffers


class _Release:
    """Releases the sender of a message sealed by writer threads: once every lane involved is done with
    its records (sealed them all, or gave up because the channel ended), ``event`` is set; ``ok`` says
    whether every lane sealed all of its records."""

    __slots__ = ("event", "left", "lock", "ok")

    def __init__(self, lanes: int) -> None:
        self.event = trio.Event()
        self.left = lanes
        self.ok = True
        self.lock = threading.Lock()

    def lane_done(self, ok: bool, to_trio: Any) -> None:
        """(any thread) One lane is done reading the message's tensors."""
        with self.lock:
            self.ok = self.ok and ok
            self.left -= 1
            last = self.left == 0
        if last:
            to_trio(self.event.set)


class _Lane:
    """One TCP connection of a channel: its socket, writer queue, record counters and owed slots."""

    __slots__ = ("bytes_received", "bytes_sent", "cursor", "ended", "gone", "index", "opener", "queue", "sealer",
                 "sock")

    def __init__(self, index: int, sock: socket.socket, sealer: Sealer, opener: Opener) -> None:
        self.index = index
        self.sock = sock
        self.sealer = sealer
        self.opener = opener
        self.queue: queue.SimpleQueue[tuple[int, Any, trio.Event | None] | None] = queue.SimpleQueue()
        self.gone = False    # the writer has exited: queued items are never sent, their waiters are released
        self.ended = False   # the reader has seen the peer's clean end of this lane
        self.cursor = SlotCursor(index, opener.cipher)
        self.bytes_sent = 0
        self.bytes_received = 0


class BulkChannel:
    """One encrypted tensor channel over one or more TCP connections, "lanes" (implements
    ``fusionp2p.net.channel.TensorChannel``).

    Each lane's socket belongs to two OS threads: a writer that seals the records of large messages and
    sends all records in queue order, and a reader that receives each record's body into a scratch buffer
    of one record (it stays in the CPU cache: the kernel's copy into a multi-MiB message buffer cost twice
    as much, measured) and decrypts it from there into its place in the message being assembled. Both
    block in the kernel or in the AEAD with the GIL released, and the per-record cost is a few
    microseconds of Python instead of an event-loop round trip. The trio side only plans records
    (assigning nonces in queue order), seals small messages itself, waits for the writers to have read a
    large message (after which the caller may reuse its tensors) and receives complete messages, which
    the readers hand over with ``run_sync_soon``.

    Lane 0 carries the whole protocol (messages, ACKs, PINGs, CLOSE) and alone judges the peer's
    liveness; with several lanes, messages of at least ``stripe_min`` bytes are striped: their slots are
    spread over all lanes (``tensor_frame`` "Lanes"), so the sealing, sending, receiving and opening of
    one message run on as many cores as there are lanes. Messages are delivered in the order they were
    sent. Aux lanes never declare the peer dead by themselves: a silent aux lane waits as long as lane 0
    hears from the peer (lane 0 has the deadlines and keepalives).
    """

    path = PATH_DIRECT

    def __init__(self, stream: trio.SocketStream | socket.socket | list[trio.SocketStream | socket.socket],
                 peer: str, keys: tuple[bytes, bytes], cfg: DataPlaneConfig, budget: BufferBudget | None = None,
                 *, shape: TokenBucket | None = None) -> None:
        keep_freed_heap()
        streams = stream if isinstance(stream, list) else [stream]
        if not 1 <= len(streams) <= tf.MAX_LANES:
            raise ConfigError(f"a bulk channel has 1 to {tf.MAX_LANES} lanes")
        socks = [s if isinstance(s, socket.socket) else _detach(s) for s in streams]
        for s in socks:
            _kernel_timeouts(s, cfg.dead_after / 2)
        self._sock = socks[0]
        self._peer = peer
        self._cfg = cfg
        self._shape = shape   # an emulated link: the writers send at its rate, its lanes together
        self._writer = RecordWriter(Sealer(cfg.cipher, keys[0]), chunk_size=cfg.chunk_size)
        # every incoming message's announced size is claimed from the budget when its buffer is allocated
        # (reader thread) and returned when the application takes it (receive) or the channel ends
        self._budget = budget or BufferBudget(max_total=cfg.max_buffered, max_peer=cfg.max_peer_buffered)
        self._claims: collections.deque[int] = collections.deque()   # in delivery order (lane 0's)
        self._claims_lock = threading.Lock()
        self._claims_open = True
        self._draining = False   # closed by us: the peer's messages that crossed our CLOSE are read and dropped
        self._reader = RecordReader(Opener(cfg.cipher, keys[1]), chunk_size=cfg.chunk_size, limits=cfg.limits,
                                    pool=BufferPool(max_buffers=cfg.window + 2), lanes=len(socks), claim=self._claim)
        self._lanes = [_Lane(0, socks[0], self._writer.sealer, self._reader.opener)]
        self._lanes += [_Lane(i, s, Sealer(cfg.cipher, keys[0], lane=i), Opener(cfg.cipher, keys[1], lane=i))
                        for i, s in enumerate(socks[1:], 1)]
        self._stripes_sent = 0
        self._token = trio.lowlevel.current_trio_token()
        self._queue_lock = threading.Lock()
        self._seal_free: collections.deque[bytearray] = collections.deque(maxlen=cfg.window + 2)
        self._send_lock = trio.Lock()
        self._inflight = 0                   # unacknowledged messages (lane 0's reader takes ACKs)
        self._window_lock = threading.Lock()
        self._credit = trio.Event()
        self._credit_wanted = False          # a send waits for an ACK: the reader must wake trio
        self._inbox_send, self._inbox = trio.open_memory_channel[dict[str, Any]](cfg.window)
        # striping: lanes wait here for slots to be announced; deliveries leave in lane-0 order
        self._stripe_cond = threading.Condition()
        self._order: collections.deque[list[Any]] = collections.deque()  # [kind, message, stripe or None]
        self._ending = False
        self._error: FusionError | None = None
        self._closed = False
        self._peer_closed = False
        self._hello = trio.Event()
        self._finished = trio.Event()
        self._linger = trio.Event()   # closed gracefully: reading on until the peer closes, within dead_after
        self._threads: list[threading.Thread] = []  # writer and reader of each lane
        self._threads_left = 2 * len(socks)
        self._threads_lock = threading.Lock()
        self._last_sent = time.monotonic()      # on lane 0 (keepalives)
        self._last_received = time.monotonic()  # on lane 0 (the peer's liveness)

    @property
    def remote_peer(self) -> str:
        return self._peer

    @property
    def lanes(self) -> int:
        """TCP connections this channel uses."""
        return len(self._lanes)

    @property
    def bytes_sent(self) -> int:
        return sum(lane.bytes_sent for lane in self._lanes)

    @property
    def bytes_received(self) -> int:
        return sum(lane.bytes_received for lane in self._lanes)

    @property
    def closed_by_peer(self) -> bool:
        """The peer closed the channel cleanly (CLOSE): sends now fail, but ``receive`` still returns what
        the peer sent before closing, then ends with EndOfChannel."""
        return self._peer_closed and self._error is None

    # ------------------------------------------------------------------------------------ public API
    async def send(self, msg: TensorMessage) -> None:
        """Send one message; blocks while the window is full, and until the message is sealed: its
        tensors may be changed once ``send`` returns or raises (but not after a *cancelled* send of a
        message over ``inline_seal``, which the writer threads may still be reading). PeerUnavailable if
        the peer is gone."""
        async with self._send_lock:
            while True:
                self._check_send()
                with self._window_lock:
                    if self._inflight < self._cfg.window:
                        self._inflight += 1
                        break
                    self._credit = trio.Event()
                    self._credit_wanted = True
                await self._credit.wait()
            parts = tf.encode_message(msg)
            size = sum(len(p) for p in parts)
            if len(self._lanes) > 1 and size >= self._cfg.stripe_min and self._writer.can_stripe(parts):
                # striped: every lane's writer seals and sends its share of the slots (nonces assigned here,
                # in each lane's queue order)
                per_lane = self._writer.plan_striped(parts, [lane.sealer for lane in self._lanes],
                                                     self._stripes_sent % len(self._lanes))
                self._stripes_sent += 1
                jobs = [(lane, plans) for lane, plans in zip(self._lanes, per_lane) if plans]
                release = _Release(len(jobs))
                for lane, plans in jobs:
                    self._put((_PLANS, (plans, release), None), lane)
            else:
                plans = self._writer.plan_parts(parts)  # nonces assigned in queue order
                if size <= self._cfg.inline_seal:
                    # small: seal here (the AEAD releases the GIL) and return at once; a cross-thread
                    # wake-up per message would cost more than the sealing
                    sealed: list[tuple[memoryview, bytearray | None]] = []
                    for p in plans:
                        if p.size < _POOLED_SEAL:  # a header or a small tensor: its own small buffer
                            sealed.append((self._writer.seal(p), None))
                            continue
                        # recycled: a fresh record-sized bytearray is zero-filled first (a memset per MiB)
                        out = self._seal_free.pop() if self._seal_free else bytearray(self._writer.max_record)
                        sealed.append((self._writer.seal(p, out), out))
                    self._put((_SEALED, sealed, None))
                    await trio.lowlevel.checkpoint()
                    return
                release = _Release(1)
                self._put((_PLANS, (plans, release), None))
            # set once the writers have read every tensor of the message, or once it will never be sent
            # (the channel is ending); never before, so the caller may change its tensors now
            await release.event.wait()
            if not release.ok:
                self._check_send()
                raise PeerUnavailable(self._peer, "channel ended before the message was sent")

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
        self._unclaim_one()
        if self._error is None and not self._peer_closed:
            self._control(tf.ACK, tf.encode_ack(1))
        return TensorMessage(**fields)

    async def aclose(self) -> None:
        """Close cleanly (the peer's ``receive`` ends with EndOfChannel)."""
        if self._closed:
            return
        self._closed = True
        graceful = False
        if self._error is None and not self._peer_closed and self._threads:
            self._control(tf.CLOSE)
            flushed = [trio.Event() for _ in self._lanes]
            for lane, ev in zip(self._lanes, flushed):
                self._put((_FLUSH, None, ev), lane)
            with trio.move_on_after(self._cfg.dead_after) as cs:
                cs.shield = True
                for ev in flushed:
                    await ev.wait()
            graceful = all(ev.is_set() for ev in flushed) and self._error is None
        self._draining = graceful
        self._inbox.close()
        self._unclaim_all()
        self._wake_waiters()
        if graceful:
            # FIN after the CLOSE record, and keep reading until the peer closes too: closing a socket
            # with unread bytes (the peer's ACKs or PINGs) sends a reset, and a reset makes the peer's
            # kernel drop the messages it has not read yet
            for lane in self._lanes:
                self._put(None, lane)
                with suppress(OSError):
                    lane.sock.shutdown(socket.SHUT_WR)
            self._linger.set()   # run() gives the peer dead_after to close its side
        else:
            self._shutdown()

    # ------------------------------------------------------------------------------------- internals
    def _claim(self, n: int) -> None:
        """(a reader thread) A message of *n* bytes is announced: count it against the peer's budget."""
        with self._claims_lock:
            if not self._claims_open:
                if self._draining:
                    # our CLOSE is on its way and the peer sent this before reading it (an ACK of our last
                    # message, say): read it to the end and drop it. Failing here would close the socket
                    # with its bytes unread, and that reset makes the peer's kernel drop what we sent
                    # before the CLOSE (the last activations, the resilient goodbye). Bounded: aclose
                    # gives the peer dead_after to close its side.
                    return
                raise PeerUnavailable(self._peer, "channel ended")
            self._budget.claim(self._peer, n)   # RemoteProtocolError over a bound: the channel fails
            self._claims.append(n)

    def _unclaim_one(self) -> None:
        """The application took the oldest delivered message."""
        with self._claims_lock:
            if self._claims:
                self._budget.release(self._peer, self._claims.popleft())

    def _unclaim_all(self) -> None:
        """The channel is over: whatever it still holds is returned, and nothing more is claimed."""
        with self._claims_lock:
            self._claims_open = False
            while self._claims:
                self._budget.release(self._peer, self._claims.popleft())

    def _check_send(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("channel closed")
        if self._error is not None:
            raise self._error
        if self._peer_closed:
            raise PeerUnavailable(self._peer, "channel closed by peer")

    def _fail(self, exc: FusionError) -> None:
        """(trio thread) Record the first failure and wake everyone waiting on the channel."""
        if self._error is None and not self._closed:
            self._error = exc
            log.info("bulk channel to %s failed: %s", self._peer, exc)
        self._wake_waiters()
        self._hello.set()  # wakes a connect() still waiting for the listener's HELLO
        self._finished.set()
        self._shutdown()

    def _wake_waiters(self) -> None:
        """(trio thread) The channel is ending: receivers see the end of the inbox, and sends waiting for
        window credit return (and re-check the channel's state). Sends waiting for the writers are released
        by the writers themselves, once they no longer read their tensors (``_writer_main``, ``_writer_exit``)."""
        self._inbox_send.close()
        self._credit.set()

    def _control(self, kind: int, body: bytes = b"") -> None:
        """Queue a control record on lane 0 (sealed here, so that its nonce follows the queue order)."""
        self._put((_RAW, bytes(self._writer.control(kind, body)), None))

    def _put(self, item: tuple[int, Any, trio.Event | None] | None, lane: _Lane | None = None) -> None:
        """(trio thread) Queue an item for a lane's writer (lane 0 by default), or, once that writer has
        exited, release its waiter."""
        lane = lane or self._lanes[0]
        with self._queue_lock:
            if not lane.gone:
                lane.queue.put(item)
                return
        _release_item(item, self._to_trio)

    def _writer_exit(self, lane: _Lane) -> None:
        """(writer thread) No more sends on *lane*: wake whoever waits on a queued item (a flush in
        aclose, a send)."""
        with self._queue_lock:
            lane.gone = True
        while True:
            try:
                item = lane.queue.get_nowait()
            except queue.Empty:
                return
            _release_item(item, self._to_trio)

    def _send_raw_for_tests(self, data: bytes, lane: int = 0) -> None:
        """Queue raw bytes on the wire (tests forge records with it)."""
        self._put((_RAW, data, None), self._lanes[lane])

    def _to_trio(self, fn: Any, *args: Any) -> None:
        """(any thread) Run *fn* on the trio thread soon; nothing to do if the trio run has ended."""
        with suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _shutdown(self) -> None:
        """Wake every thread (a blocked recv/send returns, the writers' queues yield their end marker, a
        lane waiting for slots to be announced gives up); the last thread out closes the sockets."""
        with self._stripe_cond:
            self._ending = True
            self._stripe_cond.notify_all()
        for lane in self._lanes:
            self._put(None, lane)
            with suppress(OSError):
                lane.sock.shutdown(socket.SHUT_RDWR)
        if not self._threads:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for lane in self._lanes:
            lane.sock.close()

    def _thread_error(self, role: str, exc: BaseException) -> None:
        """(any channel thread) Report why the thread stops; a traceback only for what is not a channel error."""
        if not isinstance(exc, OSError | FusionError):
            log.exception("bulk channel %s thread for %s crashed", role, self._peer)
        self._to_trio(self._thread_failed, exc)

    def _thread_exit(self) -> None:
        with self._threads_lock:
            self._threads_left -= 1
            last = self._threads_left == 0
        if last:
            self._close_sockets()

    def _peer_alive(self) -> bool:
        """Lane 0 heard from the peer within the deadline (aux lanes wait while this holds)."""
        return time.monotonic() - self._last_received < self._cfg.dead_after

    # --- the writer threads
    def _send_exactly(self, lane: _Lane, view: memoryview) -> None:
        if self._shape is None:
            self._send_now(lane, view)
            return
        # an emulated link: pieces of a few ms each, waiting for the link between them (this is a writer
        # thread: sleeping here paces this lane only; the lanes share the bucket, as they share a link)
        bucket = self._shape
        step = bucket.piece()
        for i in range(0, len(view), step):
            piece = view[i:i + step]
            wait = bucket.reserve(len(piece), time.monotonic())
            if wait > 0:
                time.sleep(wait)
            self._send_now(lane, piece)

    def _send_now(self, lane: _Lane, view: memoryview) -> None:
        sent = 0
        moved = time.monotonic()   # the socket's timeout is dead_after / 2: judged here, on the last progress
        while sent < len(view):
            try:
                n = lane.sock.send(view[sent:])
            except _TIMEOUTS:
                if time.monotonic() - moved < self._cfg.dead_after or (lane.index and self._peer_alive()):
                    continue  # the peer reads lane 0 (it may be behind on this lane): only lane 0 judges
                raise PeerUnavailable(self._peer, f"not reading for {self._cfg.dead_after:.1f} s") from None
            moved = time.monotonic()
            sent += n
            lane.bytes_sent += n
            if not lane.index:
                self._last_sent = time.monotonic()

    def _writer_main(self, lane: _Lane) -> None:
        buf = bytearray(self._writer.max_record)  # large messages are sealed here record by record
        job: _Release | None = None
        try:
            while (item := lane.queue.get()) is not None:
                tag, what, done = item
                if tag == _RAW:
                    self._send_exactly(lane, memoryview(what))
                elif tag == _SEALED:
                    for view, out in what:
                        self._send_exactly(lane, view)
                        if out is not None:
                            self._seal_free.append(out)
                elif tag == _PLANS:
                    plans, release = what
                    job = release  # released below, or in `finally` if this fails
                    last = len(plans) - 1
                    for i, plan in enumerate(plans):
                        view = lane.sealer.seal(plan.nonce, plan.kind, plan.parts, buf)
                        if i == last:  # every tensor this lane sends has been read
                            job = None
                            release.lane_done(True, self._to_trio)
                        self._send_exactly(lane, view)
                if done is not None:
                    self._to_trio(done.set)
        except BaseException as exc:
            self._thread_error("writer", exc)
        finally:
            if job is not None:  # failed in the middle of a message: its send raises
                job.lane_done(False, self._to_trio)
            self._writer_exit(lane)
            self._thread_exit()

    # --- the reader threads
    def _recv_exactly(self, lane: _Lane, view: memoryview, *, at_boundary: bool) -> bool:
        """Fill *view*; False at a clean EOF on a record boundary. Deadline: dead_after of silence on
        lane 0."""
        got = 0
        heard = time.monotonic()
        while got < len(view):
            try:
                # a record's body in one call (the kernel waits for all of it, or for the socket's timeout):
                # one GIL hand-off per record instead of one per loopback segment
                n = lane.sock.recv_into(view[got:], 0, 0 if at_boundary else _WAITALL)
            except _TIMEOUTS:
                if time.monotonic() - heard < self._cfg.dead_after or (lane.index and self._peer_alive()):
                    continue
                raise PeerUnavailable(self._peer, f"silent for {self._cfg.dead_after:.1f} s") from None
            heard = time.monotonic()
            if n == 0:
                if at_boundary and got == 0:
                    return False
                raise PeerUnavailable(self._peer, "connection lost in the middle of a record")
            got += n
            lane.bytes_received += n
            if not lane.index:
                self._last_received = time.monotonic()
        return True

    def _reader_main(self, lane: _Lane) -> None:
        reader, opener, cursor = self._reader, lane.opener, lane.cursor
        hdr = bytearray(tf.RECORD_HEADER)
        hview = memoryview(hdr)
        scratch = memoryview(bytearray(reader.max_body))
        try:
            while True:
                if not self._recv_exactly(lane, hview, at_boundary=True):
                    if lane.index:
                        self._lane_ended(lane)
                    elif not reader.closed:
                        raise PeerUnavailable(self._peer, "connection closed without CLOSE")
                    else:
                        self._deliver(_EOF, None)
                    break
                # bound checked before anything is allocated (aux lanes: their slots may follow lane 0's CLOSE)
                kind, n = tf.parse_record_header(hdr, max_body=reader.max_body) if lane.index else reader.header(hdr)
                stripe: Stripe | None = None
                target: memoryview | None = None
                if kind == tf.SLOT:
                    stripe, target = self._slot_target(lane, n)
                elif lane.index:
                    raise RemoteProtocolError(f"record kind {kind} on lane {lane.index} (only slots travel there)")
                elif cursor.waiting:
                    raise RemoteProtocolError("record inside a striped message's slots on lane 0")
                else:
                    target = reader.destination(kind, n)
                nonce = opener.next_nonce()
                body = scratch[:n]
                self._recv_exactly(lane, body, at_boundary=False)
                if stripe is not None:
                    opener.open(nonce, bytes(hdr), body, target)
                    self._slot_done(stripe)
                    continue
                if target is not None:  # message data: decrypted straight into its place in the message
                    plain = opener.open(nonce, bytes(hdr), body, target)
                    events = reader.on_plaintext(kind, plain, owned=True)
                else:
                    events = reader.on_plaintext(kind, opener.open(nonce, bytes(hdr), body))
                for ev in events:
                    if ev.kind == tf.ACK:
                        self._on_ack(ev.count)  # here: trio is woken only if a send waits for credit
                    elif ev.kind == tf.STRIPE_START:
                        assert ev.stripe is not None
                        self._announce(ev.stripe)
                    elif ev.kind in (tf.MSG_END, tf.CLOSE):
                        self._deliver(ev.kind, ev.message)
                    else:
                        self._to_trio(self._on_event, ev.kind, ev.message, ev.count)
        except BaseException as exc:
            self._thread_error("reader", exc)
        finally:
            self._thread_exit()

    def _slot_target(self, lane: _Lane, n: int) -> tuple[Stripe, memoryview]:
        """(reader thread) Where the next SLOT record of *lane* goes, waiting (on an aux lane) until lane 0
        has announced its message: lane 0's own reader never waits, so this ends when lane 0 reads on, or
        when the channel ends."""
        with self._stripe_cond:
            while not lane.cursor.waiting:
                if self._ending or lane.index == 0:
                    break
                self._stripe_cond.wait(self._cfg.dead_after)
            if self._ending:
                raise PeerUnavailable(self._peer, "channel ended")
            return lane.cursor.next(n)

    def _announce(self, stripe: Stripe) -> None:
        """(lane 0's reader) A striped message begins: queue it for delivery, tell the lanes its slots."""
        with self._stripe_cond:
            self._order.append([tf.MSG_END, None, stripe])
            for lane in self._lanes:
                if lane.cursor.add(stripe) and lane.ended:
                    raise PeerUnavailable(self._peer, f"lane {lane.index} was closed, but a message needs it")
            self._stripe_cond.notify_all()

    def _slot_done(self, stripe: Stripe) -> None:
        """(a reader thread) One slot of *stripe* is in place."""
        with self._stripe_cond:
            stripe.left -= 1
            if stripe.left == 0:
                self._flush_order()

    def _deliver(self, kind: int, message: dict[str, Any] | None) -> None:
        """(lane 0's reader) A complete message, CLOSE or the clean end: handed to trio after every striped
        message announced before it."""
        with self._stripe_cond:
            self._order.append([kind, message, None])
            self._flush_order()

    def _flush_order(self) -> None:
        """(under the stripe lock) Hand trio every delivery at the front that is complete, in order."""
        while self._order:
            kind, message, stripe = self._order[0]
            if stripe is not None:
                if stripe.left:
                    return
                message = tf.decode_message(stripe.buf, limits=self._cfg.limits)
            self._order.popleft()
            if kind == _EOF:
                self._to_trio(self._on_eof)
            else:
                self._to_trio(self._on_event, kind, message, 0)

    def _lane_ended(self, lane: _Lane) -> None:
        """(an aux lane's reader) The peer ended this lane cleanly: fine unless it still owes slots."""
        with self._stripe_cond:
            lane.ended = True
            if lane.cursor.waiting:
                raise PeerUnavailable(self._peer, f"lane {lane.index} closed before its slots arrived")

    def _on_ack(self, count: int) -> None:
        """(lane 0's reader) The peer took *count* messages."""
        with self._window_lock:
            if count > self._inflight:
                raise RemoteProtocolError("peer acknowledged messages never sent")
            self._inflight -= count
            wake, self._credit_wanted = self._credit_wanted, False
            credit = self._credit
        if wake:
            self._to_trio(credit.set)

    # --- the trio side of the threads' reports
    def _thread_failed(self, exc: BaseException) -> None:
        if self._closed or self._error is not None:
            self._finished.set()
            return
        err = _classify(self._peer, exc)
        if self._peer_closed and not isinstance(err, RemoteProtocolError):
            # the peer closed cleanly: a send that fails now (an ACK racing our own shutdown, or the peer's
            # close) loses nothing, and the channel stays "closed by peer" (ResilientChannel relies on it
            # to read the goodbye still in the inbox instead of reconnecting)
            self._finished.set()
            return
        self._fail(err if err is not None else PeerUnavailable(self._peer, f"channel thread failed: {exc!r}"))

    def _on_eof(self) -> None:
        """The peer said CLOSE and then closed its side: everything has been read, so close ours."""
        self._peer_closed = True
        self._wake_waiters()
        self._finished.set()
        self._shutdown()

    def _on_event(self, kind: int, message: dict[str, Any] | None, count: int) -> None:
        if self._error is not None or self._closed:
            return
        if kind == tf.MSG_END:
            assert message is not None
            try:
                self._inbox_send.send_nowait(message)
            except trio.WouldBlock:
                self._fail(RemoteProtocolError("peer sent more messages than the window allows"))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass
        elif kind == tf.HELLO:
            self._hello.set()
        elif kind == tf.CLOSE:
            self._peer_closed = True
            self._inbox_send.close()
            self._credit.set()

    async def _keepalive(self) -> None:
        while True:
            await trio.sleep(self._cfg.keepalive / 2)
            if self._closed:
                return  # nothing may follow our CLOSE (aclose may still be flushing the other lanes)
            if time.monotonic() - self._last_sent >= self._cfg.keepalive and self._lanes[0].queue.empty():
                self._control(tf.PING)

    async def _linger_bound(self) -> None:
        """After a graceful aclose the readers read on until the peer closes its side too; a peer that
        never does is cut off after dead_after (run's exit shuts the sockets down)."""
        await self._linger.wait()
        await trio.sleep(self._cfg.dead_after)
        self._finished.set()

    # Any: the trio-typing stubs libp2p installs shadow trio.TaskStatus for mypy
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Start the channel's threads and keep it alive (keepalives) until it closes or fails."""
        self._last_sent = self._last_received = time.monotonic()
        tag = self._peer[-6:]
        self._threads = [t for lane in self._lanes for t in (
            threading.Thread(target=self._writer_main, args=(lane,), name=f"bulk-w{lane.index}-{tag}", daemon=True),
            threading.Thread(target=self._reader_main, args=(lane,), name=f"bulk-r{lane.index}-{tag}", daemon=True))]
        for t in self._threads:
            t.start()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keepalive)
                nursery.start_soon(self._linger_bound)
                task_status.started()
                await self._finished.wait()
                nursery.cancel_scope.cancel()
        finally:
            if not self._finished.is_set() or self._error is not None or self._closed:
                self._shutdown()
            self._unclaim_all()


def _release_item(item: tuple[int, Any, trio.Event | None] | None, to_trio: Any) -> None:
    """Release whoever waits on a writer-queue item that will never be sent."""
    if item is None:
        return
    if item[0] == _PLANS:
        item[1][1].lane_done(False, to_trio)
    elif item[2] is not None:
        to_trio(item[2].set)


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


_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_TIMEOUTS = (TimeoutError, BlockingIOError)   # Python's own timeout; the kernel's (SO_RCVTIMEO): EAGAIN


def _kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Bound each blocking send and receive of *sock* by *seconds* in the kernel (SO_SNDTIMEO/SO_RCVTIMEO)
    and keep the socket blocking. Python's own ``settimeout`` makes the socket non-blocking and polls
    before every call: two syscalls and GIL hand-offs per call, no ``MSG_WAITALL``, and a send that moves
    only what fits the buffer (with 48 channel threads in one process, the GIL hand-offs were 11.6k futex
    calls a round). Elsewhere (no such options) Python's timeout does the same job."""
    sec = int(seconds)
    tv = struct.pack("ll", sec, int((seconds - sec) * 1e6))
    try:
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    except (OSError, AttributeError):
        sock.settimeout(seconds)


def _detach(stream: trio.SocketStream) -> socket.socket:
    """Take the OS socket out of a trio stream (the channel's threads use it in blocking mode)."""
    fd = stream.socket.detach()
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    # trio sets TCP_NOTSENT_LOWAT to 16 KiB on its sockets (low latency for small writes); for bulk data
    # it chops every send into 16 KiB wake-ups: sender CPU 0.42-0.54 -> 0.33-0.42 s/GB without it (A/B).
    # 0 restores the system default (no limit).
    if hasattr(socket, "TCP_NOTSENT_LOWAT"):
        with suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, 0)
    return sock


__all__ = ["PATH_DIRECT", "PATH_LIBP2P", "PATH_RELAY", "BulkChannel", "DataPlaneConfig"]
