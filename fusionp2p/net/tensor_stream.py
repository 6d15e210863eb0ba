"""Sans-IO core of the tensor channel (h11 style): messages in → sealed records out, bytes in → events out.

The trio shell (``fusionp2p.net.bulk``) only moves bytes and runs the sealing in worker threads; all
protocol decisions live here so they can be tested one byte at a time. Record layout and kinds are
in ``fusionp2p.wire.tensor_frame``.

A message is cut into records of at most ``chunk_size`` plaintext bytes (``MSG_MORE`` … ``MSG_END``),
so no record needs a huge allocation and keepalives still flow between the slices of a large tensor.
Small pieces (the header, small tensors) are coalesced into one record; large tensors are sealed
straight from their memory (no plaintext copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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

    def plan_message(self, msg: tf.MessageLike) -> list[RecordPlan]:
        chunks: list[list[Buffer]] = []
        pending: list[Buffer] = []
        pending_n = 0
        small = min(64 * 1024, self.chunk_size)
        for part in tf.encode_message(msg):
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
            for i in range(0, len(mv), self.chunk_size):
                chunks.append([mv[i : i + self.chunk_size]])
        if pending:
            chunks.append(pending)
        last = len(chunks) - 1
        return [RecordPlan(self.sealer.next_nonce(), tf.MSG_END if i == last else tf.MSG_MORE, c)
                for i, c in enumerate(chunks)]

    def seal(self, plan: RecordPlan) -> bytearray:
        return self.sealer.seal(plan.nonce, plan.kind, plan.parts)

    def control(self, kind: int, body: bytes = b"") -> bytearray:
        """A sealed control record (ACK, PING, HELLO, CLOSE)."""
        return self.sealer.seal(self.sealer.next_nonce(), kind, [body])


class RecordReader:
    """Turns received bytes (or whole records) into events, with every bound checked before allocating."""

    def __init__(self, opener: Opener, *, chunk_size: int, limits: Limits = DEFAULT_LIMITS) -> None:
        self.opener = opener
        self.limits = limits
        self.max_body = chunk_size + overhead(opener.cipher)
        self._buf = bytearray()
        self._msg = bytearray()
        self._msg_parts = 0
        self.closed = False

    # --- the byte path (tests, small reads)
    def feed(self, data: Buffer) -> list[Event]:
        """Add received bytes; return the events now complete. Any split of the stream works."""
        self._buf += data
        out: list[Event] = []
        while len(self._buf) >= tf.RECORD_HEADER:
            kind, n = tf.parse_record_header(self._buf, max_body=self.max_body)
            if len(self._buf) < tf.RECORD_HEADER + n:
                break
            hdr = bytes(self._buf[: tf.RECORD_HEADER])
            body = bytes(self._buf[tf.RECORD_HEADER : tf.RECORD_HEADER + n])
            del self._buf[: tf.RECORD_HEADER + n]
            out.extend(self.on_plaintext(kind, self.opener.open(self.opener.next_nonce(), hdr, body)))
        return out

    @property
    def pending(self) -> int:
        """Bytes held that are not yet a complete record or message (0 at a clean boundary)."""
        return len(self._buf) + len(self._msg) + self._msg_parts

    def check_eof(self) -> None:
        """At end of stream: RemoteProtocolError if a record or a message was cut off."""
        if self.pending:
            raise RemoteProtocolError(f"stream ended inside a record or message ({self.pending} bytes pending)")

    # --- the record path (the trio shell reads a header, then exactly the body, then opens it)
    def header(self, hdr: Buffer) -> tuple[int, int]:
        """Validate a record header: (kind, body length). Raises before the body is allocated."""
        return tf.parse_record_header(hdr, max_body=self.max_body)

    def on_plaintext(self, kind: int, plain: bytearray) -> list[Event]:
        """Process one authenticated record's plaintext."""
        if self.closed:
            raise RemoteProtocolError("record after CLOSE")
        if kind in (tf.MSG_MORE, tf.MSG_END):
            if len(self._msg) + len(plain) > self.limits.max_frame:
                raise RemoteProtocolError(f"message exceeds the limit of {self.limits.max_frame} bytes")
            if kind == tf.MSG_MORE:
                self._msg += plain
                self._msg_parts += 1
                return []
            if self._msg_parts:
                self._msg += plain
                whole, self._msg, self._msg_parts = self._msg, bytearray(), 0
            else:
                whole = plain  # single-record message: no copy
            return [Event(tf.MSG_END, message=tf.decode_message(whole, limits=self.limits))]
        if self._msg_parts:
            # the writer holds its wire lock for a whole message: nothing interleaves its slices
            raise RemoteProtocolError("control record inside a message")
        if kind == tf.ACK:
            return [Event(tf.ACK, count=tf.decode_ack(plain))]
        if plain:
            raise RemoteProtocolError(f"record kind {kind} must be empty")
        if kind == tf.CLOSE:
            self.closed = True
        return [Event(kind)]
