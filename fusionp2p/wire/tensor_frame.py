"""Byte layouts of the data plane: a TensorMessage, the records of a tensor channel, the bulk ticket.

**TensorMessage** (the plaintext of one message)::

    u32 BE header_len | msgpack header | zero pad to 8 | tensor 0 bytes | pad to 8 | tensor 1 bytes | ...

    header = {"v": 1, "job": str, "kind": str, "stage": int, "step": int, "micro": int, "name": str,
              "meta": map, "t": [[dtype, shape], ...]}

Tensor bytes are little-endian, C-contiguous, each starting at an 8-byte aligned offset, so the
decoder can hand out zero-copy tensor views into one receive buffer. The decoder checks every size
against :class:`~fusionp2p.wire.limits.Limits` and that the byte count matches the header exactly.

**Channel record** (one AEAD-sealed unit on the TCP side channel)::

    u32 BE n | u8 kind | ciphertext (n - 1 bytes: sealed body + 16-byte tag)

The 5 header bytes are the AEAD associated data, so the kind and length are authenticated too. The
nonce is implicit (a per-direction counter), so a replayed, reordered or dropped record fails
authentication. Kinds: ``MSG_START`` (plaintext ``u64 BE total message length`` + first slice),
``MSG_MORE`` … ``MSG_END`` carry consecutive slices of one TensorMessage (a message that fits one
record is a lone ``MSG_END``; the announced total lets the receiver allocate the message once and
decrypt every slice in place);
``ACK`` (u32 BE count of messages consumed) returns window credit; ``PING`` keeps an idle link
alive; ``HELLO`` confirms the keys; ``CLOSE`` is a clean end.

**Lanes.** A channel may use several TCP connections ("lanes", agreed in the ticket exchange); lane 0
carries everything above, the others only the slots of striped messages. Each lane has its own record
counter, and lane *j*'s nonce is ``u32 BE j || u64 BE counter``, so no nonce repeats under the
direction's key. A *striped* message is announced on lane 0 by ``STRIPE_START`` (plaintext
``u64 BE total | u32 BE slot size | the message's first part``: its length-prefixed header and pad);
the rest of the message, ``body = total - len(first part)`` bytes, is cut into ``n = ceil(body / slot)``
slots, and slot *i* travels as one ``SLOT`` record on lane ``(first + i) % lanes``, where ``first`` is
the number of striped messages sent before it, modulo the lane count. Each lane sends its slots in
order and a message's records contiguously, so a receiver knows where every ``SLOT`` belongs without
any offset on the wire; the message is complete when all its slots are in, and messages are delivered
in the order of their ``MSG_END``/``STRIPE_START`` on lane 0.

**Bulk ticket** (over the authenticated libp2p stream, each a length-prefixed msgpack map): request
``{"v": 1, "cipher": str}``; reply ``{"v": 1, "ticket": bin16, "cipher": str, "k_dial": bin32,
"k_listen": bin32, "host": str, "port": int}``; then on the TCP connection the dialer sends the
16 raw ticket bytes first. With lanes: the request carries ``"lanes": int`` (what the dialer wants), the
reply ``"lanes": int`` (at most that: what the listener grants), and the dialer opens that many TCP
connections, each starting with the 16 ticket bytes and one byte, its lane index.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

import torch

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.wire.limits import DEFAULT_LIMITS, Limits
from fusionp2p.wire.msg import expect_map, packb, typed_field, unpackb
from fusionp2p.wire.tensor import check_header, encode_tensor

VERSION = 1
_U32 = struct.Struct(">I")
_REC = struct.Struct(">IB")
RECORD_HEADER = _REC.size  # 5
TAG_SIZE = 16
TICKET_SIZE = 16
KEY_SIZE = 32

# record kinds
MSG_MORE = 1
MSG_END = 2
ACK = 3
PING = 4
HELLO = 5
CLOSE = 6
MSG_START = 7
STRIPE_START = 8
SLOT = 9
KINDS = frozenset({MSG_MORE, MSG_END, ACK, PING, HELLO, CLOSE, MSG_START, STRIPE_START, SLOT})
MSG_KINDS = frozenset({MSG_START, MSG_MORE, MSG_END})
_U64 = struct.Struct(">Q")
START_PREFIX = _U64.size
_STRIPE = struct.Struct(">QI")
STRIPE_PREFIX = _STRIPE.size  # 12
MAX_LANES = 8
MIN_SLOT = 4096

Buffer = bytes | bytearray | memoryview


class MessageLike(Protocol):
    """What the encoder reads (``fusionp2p.net.channel.TensorMessage``; wire/ does not import net/)."""

    @property
    def job(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def stage(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def micro(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def meta(self) -> dict[str, Any]: ...
    @property
    def tensors(self) -> tuple[torch.Tensor, ...]: ...


def _pad(n: int) -> int:
    return -n % 8


# ------------------------------------------------------------------------------------- TensorMessage
def encode_message(msg: MessageLike) -> list[Buffer]:
    """The message as a list of buffers (header first, then zero-copy tensor views and pads)."""
    specs: list[list[Any]] = []
    views: list[memoryview] = []
    for t in msg.tensors:
        h, view = encode_tensor(t)
        specs.append([h["dtype"], h["shape"]])
        views.append(view)
    header = packb({"v": VERSION, "job": msg.job, "kind": msg.kind, "stage": msg.stage, "step": msg.step,
                    "micro": msg.micro, "name": msg.name, "meta": msg.meta, "t": specs})
    head = _U32.pack(len(header)) + header
    parts: list[Buffer] = [head + bytes(_pad(len(head)))]
    for v in views:
        if len(v):
            parts.append(v)
            if _pad(len(v)):
                parts.append(bytes(_pad(len(v))))
    return parts


def message_bytes(msg: MessageLike) -> bytes:
    """The whole message as one bytes object (tests and small messages)."""
    return b"".join(bytes(p) for p in encode_message(msg))


def _int(m: dict[str, Any], name: str) -> int:
    v = typed_field(m, name, int, "tensor message")
    if not 0 <= v < 2**63:
        raise RemoteProtocolError(f"tensor message: field {name!r} out of range")
    return int(v)


def decode_message(data: bytes | bytearray | memoryview, *, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Decode one complete message from a peer into the keyword arguments of a ``TensorMessage``. With a
    ``bytearray`` or a writable ``memoryview`` the tensors are zero-copy views into it (the caller hands the
    buffer over); ``bytes`` and read-only views are copied first. RemoteProtocolError on any malformed,
    inconsistent or oversized input."""
    if len(data) > limits.max_frame:
        raise RemoteProtocolError(f"tensor message of {len(data)} bytes exceeds the limit of {limits.max_frame}")
    if len(data) < 4:
        raise RemoteProtocolError("tensor message: truncated header length")
    (hlen,) = _U32.unpack_from(data, 0)
    if 4 + hlen > len(data) or hlen > limits.max_control_frame:
        raise RemoteProtocolError("tensor message: header length out of bounds")
    h = expect_map(unpackb(memoryview(data)[4 : 4 + hlen], limits=limits), "tensor message")
    if h.get("v") != VERSION:
        raise RemoteProtocolError(f"tensor message: unsupported version {h.get('v')!r}")
    specs = typed_field(h, "t", list, "tensor message")
    meta = expect_map(typed_field(h, "meta", dict, "tensor message"), "tensor message meta")
    off = 4 + hlen + _pad(4 + hlen)
    layout: list[tuple[torch.dtype, tuple[int, ...], int, int]] = []
    total = 0
    for spec in specs:
        if not isinstance(spec, list) or len(spec) != 2:
            raise RemoteProtocolError("tensor message: bad tensor spec")
        dtype, shape, nbytes = check_header({"dtype": spec[0], "shape": spec[1]}, limits=limits)
        total += nbytes
        if total > limits.max_frame:
            raise RemoteProtocolError("tensor message: tensors exceed the frame limit")
        layout.append((dtype, shape, off, nbytes))
        off += nbytes + (_pad(nbytes) if nbytes else 0)
    if off != len(data):
        raise RemoteProtocolError(f"tensor message: expected {off} bytes, got {len(data)}")
    buf = data if isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly) else bytearray(data)
    tensors: list[torch.Tensor] = []
    for dtype, shape, start, nbytes in layout:
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start)
        tensors.append(raw.to(torch.bool).reshape(shape) if dtype == torch.bool else raw.view(dtype).reshape(shape))
    return {"job": typed_field(h, "job", str, "tensor message"), "kind": typed_field(h, "kind", str, "tensor message"),
            "stage": _int(h, "stage"), "step": _int(h, "step"), "micro": _int(h, "micro"),
            "name": typed_field(h, "name", str, "tensor message"), "meta": meta, "tensors": tuple(tensors)}


# ------------------------------------------------------------------------------------------- records
def record_header(kind: int, body_len: int) -> bytes:
    """The 5-byte record header (also the AEAD associated data) for a sealed body of *body_len* bytes."""
    return _REC.pack(body_len + 1, kind)


def parse_record_header(hdr: Buffer, *, max_body: int) -> tuple[int, int]:
    """(kind, sealed body length) from 5 header bytes; RemoteProtocolError before any allocation if the
    length is over *max_body* or the kind is unknown."""
    n, kind = _REC.unpack_from(hdr, 0)
    if kind not in KINDS:
        raise RemoteProtocolError(f"unknown record kind {kind}")
    if n < 1 or n - 1 > max_body:
        raise RemoteProtocolError(f"record of {n - 1} bytes exceeds the limit of {max_body}")
    return kind, n - 1


def encode_start(total: int) -> bytes:
    return _U64.pack(total)


def decode_start(plain: Buffer, *, limits: Limits = DEFAULT_LIMITS) -> int:
    """The total length announced by a MSG_START record, checked against the frame limit."""
    if len(plain) < START_PREFIX:
        raise RemoteProtocolError("MSG_START record too short")
    (total,) = _U64.unpack_from(plain, 0)
    if total > limits.max_frame:
        raise RemoteProtocolError(f"message of {total} bytes exceeds the limit of {limits.max_frame}")
    if total < len(plain) - START_PREFIX:
        raise RemoteProtocolError("MSG_START carries more than the announced message")
    return int(total)


def encode_stripe_start(total: int, slot: int) -> bytes:
    return _STRIPE.pack(total, slot)


def decode_stripe_start(plain: Buffer, *, max_slot: int, limits: Limits = DEFAULT_LIMITS) -> tuple[int, int, int]:
    """(total, slot size, number of slots) of a STRIPE_START plaintext, every bound checked."""
    if len(plain) < STRIPE_PREFIX:
        raise RemoteProtocolError("STRIPE_START record too short")
    total, slot = _STRIPE.unpack_from(plain, 0)
    if total > limits.max_frame:
        raise RemoteProtocolError(f"message of {total} bytes exceeds the limit of {limits.max_frame}")
    body = total - (len(plain) - STRIPE_PREFIX)
    if body <= 0:
        raise RemoteProtocolError("STRIPE_START announces no slots")
    if not MIN_SLOT <= slot <= max_slot:
        raise RemoteProtocolError(f"stripe slot of {slot} bytes outside [{MIN_SLOT}, {max_slot}]")
    return int(total), int(slot), -(-body // slot)


def stripe_slot(body: int, lanes: int, chunk: int) -> int:
    """The slot size a sender uses for *body* bytes over *lanes*: a multiple of *lanes* slots of at most
    *chunk* bytes, as equal as 4 KiB alignment allows (every lane gets the same share)."""
    n = lanes * -(-body // (lanes * chunk))
    per = -(-body // n)
    return max(MIN_SLOT, min(chunk, -(-per // 4096) * 4096))


def encode_ack(count: int) -> bytes:
    return _U32.pack(count)


def decode_ack(body: Buffer) -> int:
    if len(body) != 4:
        raise RemoteProtocolError("ACK record must carry exactly 4 bytes")
    (n,) = _U32.unpack_from(body, 0)
    return int(n)


# -------------------------------------------------------------------------------------------- ticket
def encode_ticket_request(cipher: str, lanes: int) -> bytes:
    return packb({"v": VERSION, "cipher": cipher, "lanes": lanes})


def _lanes(m: dict[str, Any], what: str) -> int:
    n = typed_field(m, "lanes", int, what)
    if not 1 <= n <= MAX_LANES:
        raise RemoteProtocolError(f"{what}: lanes must be between 1 and {MAX_LANES}")
    return int(n)


def decode_ticket_request(data: Buffer, *, limits: Limits = DEFAULT_LIMITS) -> tuple[str, int]:
    """(cipher, lanes wanted) of a ticket request."""
    m = expect_map(unpackb(data, limits=limits), "bulk ticket request")
    if m.get("v") != VERSION:
        raise RemoteProtocolError("bulk ticket request: unsupported version")
    return str(typed_field(m, "cipher", str, "bulk ticket request")), _lanes(m, "bulk ticket request")


def encode_ticket_reply(*, ticket: bytes, cipher: str, k_dial: bytes, k_listen: bytes, host: str, port: int,
                        lanes: int) -> bytes:
    return packb({"v": VERSION, "ticket": ticket, "cipher": cipher, "k_dial": k_dial, "k_listen": k_listen,
                  "host": host, "port": port, "lanes": lanes})


def decode_ticket_reply(data: Buffer, *, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The validated reply map (ticket, cipher, k_dial, k_listen, host, port, lanes)."""
    m = expect_map(unpackb(data, limits=limits), "bulk ticket reply")
    if m.get("v") != VERSION:
        raise RemoteProtocolError("bulk ticket reply: unsupported version")
    what = "bulk ticket reply"
    if len(typed_field(m, "ticket", bytes, what)) != TICKET_SIZE:
        raise RemoteProtocolError("bulk ticket reply: ticket must be 16 bytes")
    for k in ("k_dial", "k_listen"):
        if len(typed_field(m, k, bytes, what)) != KEY_SIZE:
            raise RemoteProtocolError(f"bulk ticket reply: {k} must be 32 bytes")
    typed_field(m, "cipher", str, what)
    typed_field(m, "host", str, what)
    if not 0 < typed_field(m, "port", int, what) < 65536:
        raise RemoteProtocolError("bulk ticket reply: bad port")
    _lanes(m, what)
    return m
