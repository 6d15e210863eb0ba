"""Sans-IO core of the tensor channel (h11 style): messages in → sealed records out, bytes in → events out.

The I/O shell (``fusionp2p.net.bulk_channel``) only moves bytes and runs the sealing in worker threads; all
protocol decisions live here so they can be tested one byte at a time. Record layout and kinds are
in ``fusionp2p.wire.tensor_frame``.

A message is cut into records of at most ``chunk_size`` plaintext bytes (``MSG_START``, ``MSG_MORE`` …
``MSG_END``),
so no record needs a huge allocation and keepalives still flow between the slices of a large tensor.
Small pieces (the header, small tensors) are coalesced into one record; large tensors are sealed
straight from their memory (no plaintext copy).
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.net.aead import Opener, Sealer, overhead
from fusionp2p.wire import tensor_frame as tf
from fusionp2p.wire.limits import DEFAULT_LIMITS, Limits

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class RecordPlan:
    """One record to seal: nonce already assigned (order matters), plaintext parts."""

    nonce: bytes
    kind: int
    parts: list[Buffer]

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.parts)


@dataclass(frozen=True, slots=True)
class Event:
    """What the receiver core reports: ``kind`` is a record kind; ``message`` (TensorMessage kwargs)
    for MSG_END, ``count`` for ACK."""

    kind: int
    message: dict[str, Any] | None = None
    count: int = 0
    stripe: Stripe | None = None


class RecordWriter:
    """Plans the records of outgoing messages and control records."""

    def __init__(self, sealer: Sealer, *, chunk_size: int) -> None:
        if chunk_size < 1024:
            raise ValueError("chunk_size must be at least 1 KiB")
        self.sealer = sealer
        self.chunk_size = chunk_size

    @property
    def max_record(self) -> int:
        """The largest wire record this writer produces (header + MSG_START prefix + chunk + tag)."""
        return tf.RECORD_HEADER + tf.START_PREFIX + self.chunk_size + overhead(self.sealer.cipher)

    def plan_message(self, msg: tf.MessageLike) -> list[RecordPlan]:
        """The records of *msg*, nonces assigned in order (call under the channel's wire lock)."""
        return self.plan_parts(tf.encode_message(msg))

    def plan_parts(self, message_parts: list[Buffer]) -> list[RecordPlan]:
        """The records of an encoded message (``tf.encode_message``) on one lane."""
        chunks: list[list[Buffer]] = []
        pending: list[Buffer] = []
        pending_n = 0
        total = 0
        small = min(64 * 1024, self.chunk_size)
        for part in message_parts:
            total += len(part)
            if len(part) <= small and pending_n + len(part) <= self.chunk_size:
                pending.append(part)
                pending_n += len(part)
                continue
            if pending:
                chunks.append(pending)
                pending, pending_n = [], 0
            if len(part) <= small:
                pending, pending_n = [part], len(part)
                continue
            mv = memoryview(part)
            chunks.extend([mv[i : i + self.chunk_size]] for i in range(0, len(mv), self.chunk_size))
        if pending:
            chunks.append(pending)
        if len(chunks) == 1:
            return [RecordPlan(self.sealer.next_nonce(), tf.MSG_END, chunks[0])]
        kinds = [tf.MSG_START] + [tf.MSG_MORE] * (len(chunks) - 2) + [tf.MSG_END]
        chunks[0] = [tf.encode_start(total), *chunks[0]]
        return [RecordPlan(self.sealer.next_nonce(), k, c) for k, c in zip(kinds, chunks)]

    def can_stripe(self, message_parts: list[Buffer]) -> bool:
        """Whether an encoded message can be striped: its first part (header) fits a STRIPE_START record
        and something follows it."""
        return (self.chunk_size >= tf.MIN_SLOT and len(message_parts) > 1
                and tf.STRIPE_PREFIX + len(message_parts[0]) <= self.chunk_size)

    def plan_striped(self, message_parts: list[Buffer], lane_sealers: list[Sealer], first: int
                     ) -> list[list[RecordPlan]]:
        """The records of an encoded message striped over ``len(lane_sealers)`` lanes (lane 0's sealer is
        this writer's): per lane, in send order. *first* is the lane of slot 0 (the count of striped
        messages before this one, modulo the lanes: both ends keep it). See ``tf`` "Lanes"."""
        lanes = len(lane_sealers)
        head, rest = message_parts[0], message_parts[1:]
        body = sum(len(p) for p in rest)
        slot = tf.stripe_slot(body, lanes, self.chunk_size)
        out: list[list[RecordPlan]] = [[] for _ in range(lanes)]
        out[0].append(RecordPlan(self.sealer.next_nonce(), tf.STRIPE_START,
                                 [tf.encode_stripe_start(len(head) + body, slot), head]))
        for i, pieces in enumerate(_cut(rest, slot)):
            lane = (first + i) % lanes
            out[lane].append(RecordPlan(lane_sealers[lane].next_nonce(), tf.SLOT, pieces))
        return out

    def seal(self, plan: RecordPlan, out: bytearray | None = None) -> memoryview:
        return self.sealer.seal(plan.nonce, plan.kind, plan.parts, out)

    def control(self, kind: int, body: bytes = b"") -> memoryview:
        """A sealed control record (ACK, PING, HELLO, CLOSE)."""
        return self.sealer.seal(self.sealer.next_nonce(), kind, [body])


def _cut(parts: list[Buffer], size: int) -> list[list[Buffer]]:
    """The concatenation of *parts* cut into pieces of *size* bytes (the last one shorter), each a list of
    zero-copy views of the parts it spans."""
    out: list[list[Buffer]] = []
    cur: list[Buffer] = []
    room = size
    for part in parts:
        mv = memoryview(part).cast("B") if not isinstance(part, memoryview) or part.format != "B" else part
        while len(mv):
            take = mv[:room]
            cur.append(take)
            mv = mv[len(take):]
            room -= len(take)
            if room == 0:
                out.append(cur)
                cur, room = [], size
    if cur:
        out.append(cur)
    return out


class Stripe:
    """A striped message being assembled: where its slots go, and how many are still missing (the
    channel's lanes decrement :attr:`left` under its lock)."""

    __slots__ = ("body", "buf", "first", "head", "lanes", "left", "n", "slot", "total")

    def __init__(self, buf: memoryview, *, total: int, head: int, slot: int, n: int, first: int, lanes: int) -> None:
        self.buf = buf
        self.total = total
        self.head = head
        self.body = total - head
        self.slot = slot
        self.n = n
        self.first = first
        self.lanes = lanes
        self.left = n

    def slots_of(self, lane: int) -> range:
        """The slot indices that travel on *lane*, in order."""
        return range((lane - self.first) % self.lanes, self.n, self.lanes)

    def piece(self, i: int) -> memoryview:
        start = i * self.slot
        return self.buf[self.head + start : self.head + min(start + self.slot, self.body)]


class SlotCursor:
    """One lane's receiving side of striping: the slots it owes, in order, as lane 0 announces them."""

    def __init__(self, lane: int, cipher: str) -> None:
        self.lane = lane
        self._tag = overhead(cipher)
        self._queue: collections.deque[tuple[Stripe, range]] = collections.deque()
        self._pos = 0

    def add(self, stripe: Stripe) -> bool:
        """Expect *stripe*'s slots on this lane (False when it has none here)."""
        slots = stripe.slots_of(self.lane)
        if not len(slots):
            return False
        self._queue.append((stripe, slots))
        return True

    @property
    def waiting(self) -> bool:
        """Slots are announced and not yet received."""
        return bool(self._queue)

    def next(self, body_len: int) -> tuple[Stripe, memoryview]:
        """Where the next SLOT record of this lane goes; RemoteProtocolError if none is owed or its
        length is not the slot's."""
        if not self._queue:
            raise RemoteProtocolError(f"SLOT record on lane {self.lane} with no striped message announced")
        stripe, slots = self._queue[0]
        dest = stripe.piece(slots[self._pos])
        if body_len != len(dest) + self._tag:
            raise RemoteProtocolError("SLOT record does not match its slot's length")
        self._pos += 1
        if self._pos == len(slots):
            self._queue.popleft()
            self._pos = 0
        return stripe, dest


def alloc_buffer(n: int) -> memoryview:
    """A writable, uninitialised *n*-byte buffer for an incoming message (``torch.empty``: no zero-fill;
    tensors decoded from it keep it alive and free it with the last of them)."""
    return torch.empty(n, dtype=torch.uint8).numpy().data


class BufferPool:
    """Recycles incoming-message buffers once the application has dropped every tensor decoded from them.

    A fresh multi-MiB buffer costs a page fault per 4 KiB page on first touch (0.6-0.8 s per GB on the
    development VM: more than decrypting it), and a pipeline stage receives same-sized activations every
    micro-batch. The pool keeps the numpy arrays behind the last few buffers; an array whose only
    references are the pool's own is free (tensors and memoryviews over it hold references), so it is
    handed out again for a message of the same size. Bounded by *max_buffers* and *max_bytes*; buffers
    below *min_size* are not pooled (the allocator recycles those cheaply).
    """

    def __init__(self, *, max_buffers: int = 8, max_bytes: int = 512 << 20, min_size: int = 1 << 20) -> None:
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        self.min_size = min_size
        self._arrays: list[Any] = []
        self.reused = 0
        self.allocated = 0

    def get(self, n: int) -> memoryview:
        if n < self.min_size:
            return alloc_buffer(n)
        for arr in self._arrays:
            # references: the list, the loop variable, getrefcount's argument
            if arr.nbytes == n and sys.getrefcount(arr) <= 3:
                self.reused += 1
                return arr.data  # type: ignore[no-any-return]
        self.allocated += 1
        arr = torch.empty(n, dtype=torch.uint8).numpy()
        self._arrays.append(arr)
        while len(self._arrays) > self.max_buffers or sum(a.nbytes for a in self._arrays) > self.max_bytes:
            self._arrays.pop(0)
        return arr.data


class RecordReader:
    """Turns received bytes (or whole records) into events, with every bound checked before allocating.

    A multi-record message is allocated once, at its ``MSG_START`` (whose announced total is checked
    against the limit), and the following records are decrypted straight into their place in it
    (:meth:`destination`): no plaintext copy.
    """

    def __init__(self, opener: Opener, *, chunk_size: int, limits: Limits = DEFAULT_LIMITS,
                 pool: BufferPool | None = None, lanes: int = 1, claim: Callable[[int], None] | None = None) -> None:
        self.opener = opener
        self.claim = claim   # called with each message's size before its buffer exists; may raise
        self.lanes = lanes
        self.chunk_size = chunk_size
        self.stripes = 0  # striped messages announced so far (slot 0's lane rotates with it)
        self.pool = pool
        self.limits = limits
        self.max_body = tf.START_PREFIX + chunk_size + overhead(opener.cipher)
        self._buf = bytearray()
        self._msg: memoryview | None = None   # the message being assembled (+ tag slack)
        self._total = 0
        self._pos = 0
        self.closed = False

    # --- the byte path (tests, small reads)
    def feed(self, data: Buffer) -> list[Event]:
        """Add received bytes; return the events now complete. Any split of the stream works."""
        self._buf += data
        out: list[Event] = []
        while len(self._buf) >= tf.RECORD_HEADER:
            kind, n = self.header(self._buf)
            if len(self._buf) < tf.RECORD_HEADER + n:
                break
            hdr = bytes(self._buf[: tf.RECORD_HEADER])
            body = bytes(self._buf[tf.RECORD_HEADER : tf.RECORD_HEADER + n])
            del self._buf[: tf.RECORD_HEADER + n]
            dest = self.destination(kind, n)
            plain = self.opener.open(self.opener.next_nonce(), hdr, body, dest)
            out.extend(self.on_plaintext(kind, plain, owned=dest is not None))
        return out

    @property
    def pending(self) -> int:
        """Bytes held that are not yet a complete record or message (0 at a clean boundary)."""
        return len(self._buf) + (self._pos + 1 if self._msg is not None else 0)

    def check_eof(self) -> None:
        """At end of stream: RemoteProtocolError if a record or a message was cut off."""
        if self.pending:
            raise RemoteProtocolError(f"stream ended inside a record or message ({self.pending} bytes pending)")

    # --- the record path (the I/O shell reads a header, then exactly the body, then opens it)
    def header(self, hdr: Buffer) -> tuple[int, int]:
        """Validate a record header: (kind, body length). Raises before the body is allocated."""
        kind, n = tf.parse_record_header(hdr, max_body=self.max_body)
        if self.closed:
            raise RemoteProtocolError(f"record (kind {kind}) after CLOSE")
        return kind, n

    def _slice(self, body_len: int) -> memoryview:
        assert self._msg is not None
        size = body_len - overhead(self.opener.cipher)
        if size < 0 or self._pos + size > self._total:
            raise RemoteProtocolError("message slices exceed the announced length")
        return self._msg[self._pos : self._pos + size]

    def destination(self, kind: int, body_len: int) -> memoryview | None:
        """Where to decrypt the next record (``opener.open(nonce, hdr, body, target)``): the message's next
        slice, or, for a message that fits one record, a fresh buffer of the plaintext's size that becomes
        the message. None for records that are not message data."""
        if kind not in (tf.MSG_MORE, tf.MSG_END):
            return None
        if self._msg is not None:
            return self._slice(body_len)
        if kind == tf.MSG_MORE:
            raise RemoteProtocolError("MSG_MORE without MSG_START")
        size = body_len - overhead(self.opener.cipher)
        if size < 0:
            raise RemoteProtocolError("record shorter than its authentication tag")
        return self._buffer(size)

    def _buffer(self, n: int) -> memoryview:
        """A buffer for an incoming message of *n* bytes (pooled when the reader has a pool), claimed first."""
        if self.claim is not None:
            self.claim(n)
        return self.pool.get(n) if self.pool is not None else alloc_buffer(n)

    def on_plaintext(self, kind: int, plain: bytearray | memoryview, *, owned: bool = False) -> list[Event]:
        """Process one authenticated record's plaintext. *owned*: *plain* lies where :meth:`destination`
        said (it already is the message's memory), so it is not copied."""
        if self.closed:
            raise RemoteProtocolError("record after CLOSE")
        if kind == tf.STRIPE_START:
            if self._msg is not None:
                raise RemoteProtocolError("STRIPE_START inside a message")
            if self.lanes < 2:
                raise RemoteProtocolError("striped message on a channel with one lane")
            total, slot, n = tf.decode_stripe_start(plain, max_slot=self.chunk_size, limits=self.limits)
            head = len(plain) - tf.STRIPE_PREFIX
            buf = self._buffer(total)
            buf[:head] = plain[tf.STRIPE_PREFIX :]
            stripe = Stripe(buf[:total], total=total, head=head, slot=slot, n=n, first=self.stripes % self.lanes,
                            lanes=self.lanes)
            self.stripes += 1
            return [Event(tf.STRIPE_START, stripe=stripe)]
        if kind == tf.SLOT:
            raise RemoteProtocolError("SLOT record outside the channel's lanes")  # the I/O shell routes slots
        if kind == tf.MSG_START:
            if self._msg is not None:
                raise RemoteProtocolError("MSG_START inside a message")
            total = tf.decode_start(plain, limits=self.limits)
            self._msg = self._buffer(total)
            self._total = total
            first = len(plain) - tf.START_PREFIX
            self._msg[:first] = plain[tf.START_PREFIX :]
            self._pos = first
            return []
        if kind in (tf.MSG_MORE, tf.MSG_END):
            if self._msg is None:
                if kind == tf.MSG_MORE:
                    raise RemoteProtocolError("MSG_MORE without MSG_START")
                # a message in one record
                whole: bytearray | memoryview = plain if owned or isinstance(plain, bytearray) else bytearray(plain)
                return [Event(tf.MSG_END, message=tf.decode_message(whole, limits=self.limits))]
            if not owned:
                if self._pos + len(plain) > self._total:
                    raise RemoteProtocolError("message slices exceed the announced length")
                self._msg[self._pos : self._pos + len(plain)] = plain
            self._pos += len(plain)
            if kind == tf.MSG_MORE:
                return []
            if self._pos != self._total:
                raise RemoteProtocolError("message shorter than announced")
            done, self._msg, self._pos = self._msg[: self._total], None, 0
            return [Event(tf.MSG_END, message=tf.decode_message(done, limits=self.limits))]
        if self._msg is not None:
            # the writer sends a whole message before anything else: nothing interleaves its slices
            raise RemoteProtocolError("control record inside a message")
        if kind == tf.ACK:
            return [Event(tf.ACK, count=tf.decode_ack(plain))]
        if plain:
            raise RemoteProtocolError(f"record kind {kind} must be empty")
        if kind == tf.CLOSE:
            self.closed = True
        return [Event(kind)]
