"""Sans-IO core of the tensor channel (h11 style): messages in → sealed records out, bytes in → events out.

The trio shell (``fusionp2p.net.bulk``) only moves bytes and runs the sealing in worker threads; all
protocol decisions live here so they can be tested one byte at a time. Record layout and kinds are
in ``fusionp2p.wire.tensor_frame``.

A message is cut into records of at most ``chunk_size`` plaintext bytes (``MSG_START``, ``MSG_MORE`` …
``MSG_END``),
so no record needs a huge allocation and keepalives still flow between the slices of a large tensor.
Small pieces (the header, small tensors) are coalesced into one record; large tensors are sealed
straight from their memory (no plaintext copy).
"""

from __future__ import annotations

import sys
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
        chunks: list[list[Buffer]] = []
        pending: list[Buffer] = []
        pending_n = 0
        total = 0
        small = min(64 * 1024, self.chunk_size)
        for part in tf.encode_message(msg):
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

    def seal(self, plan: RecordPlan, out: bytearray | None = None) -> memoryview:
        return self.sealer.seal(plan.nonce, plan.kind, plan.parts, out)

    def control(self, kind: int, body: bytes = b"") -> memoryview:
        """A sealed control record (ACK, PING, HELLO, CLOSE)."""
        return self.sealer.seal(self.sealer.next_nonce(), kind, [body])


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
                 pool: BufferPool | None = None) -> None:
        self.opener = opener
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
        if self.closed:
            raise RemoteProtocolError("record after CLOSE")
        return tf.parse_record_header(hdr, max_body=self.max_body)

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
        return self.pool.get(size) if self.pool is not None else alloc_buffer(size)

    def on_plaintext(self, kind: int, plain: bytearray | memoryview, *, owned: bool = False) -> list[Event]:
        """Process one authenticated record's plaintext. *owned*: *plain* lies where :meth:`destination`
        said (it already is the message's memory), so it is not copied."""
        if self.closed:
            raise RemoteProtocolError("record after CLOSE")
        if kind == tf.MSG_START:
            if self._msg is not None:
                raise RemoteProtocolError("MSG_START inside a message")
            total = tf.decode_start(plain, limits=self.limits)
            self._msg = self.pool.get(total) if self.pool is not None else alloc_buffer(total)
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
