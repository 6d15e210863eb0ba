"""AEAD record sealing for the tensor side channel: per-direction keys, counter nonces, no replays.

Each direction has its own 32-byte key, and each lane (TCP connection) of a channel its own 64-bit
record counter; the 12-byte nonce is ``u32 BE lane || u64 BE counter`` (lane 0: four zero bytes), so
no nonce repeats under a key. Because the nonce is implicit, the receiver's counter must match the
sender's: a replayed, reordered, dropped or forged record fails authentication and is reported as
:class:`~fusionp2p.errors.RemoteProtocolError` (the channel then closes). A key is never used for more
than 2^63 records. ``seal_into``/``open`` are pure and thread-safe for distinct nonces, so large
records are sealed and opened in worker threads (the ``cryptography`` AEADs release the GIL).

``cipher="none"`` (no encryption, no authentication) exists only for tests and benchmarks and must be
enabled explicitly (``DataPlaneConfig.insecure_plaintext_for_tests``).
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from fusionp2p.errors import LocalProtocolError, RemoteProtocolError
from fusionp2p.wire.tensor_frame import KEY_SIZE, RECORD_HEADER, TAG_SIZE, record_header

CIPHERS = ("aes-128-gcm", "aes-gcm", "chacha20-poly1305", "none")  # "aes-gcm": AES-256-GCM
_NONCE = struct.Struct(">IQ")
_MAX_COUNTER = 2**63


def default_cipher() -> str:
    """AES-128-GCM where the CPU has AES instructions (11 GB/s per core here, AES-256-GCM 9.6: the
    channel's cipher is most of its CPU cost), else ChaCha20-Poly1305."""
    try:
        with open("/proc/cpuinfo") as f:
            if " aes" in f.read(1 << 16):
                return "aes-128-gcm"
    except OSError:
        pass
    return "chacha20-poly1305"


def new_key() -> bytes:
    return os.urandom(KEY_SIZE)


def _aead(cipher: str, key: bytes) -> AESGCM | ChaCha20Poly1305 | None:
    """The AEAD for a 32-byte random key (AES-128-GCM uses its first 16 bytes)."""
    if cipher == "aes-128-gcm":
        return AESGCM(key[:16])
    if cipher == "aes-gcm":
        return AESGCM(key)
    if cipher == "chacha20-poly1305":
        return ChaCha20Poly1305(key)
    if cipher == "none":
        return None
    raise LocalProtocolError(f"unknown cipher {cipher!r}")


def overhead(cipher: str) -> int:
    """Bytes a sealed body adds to its plaintext."""
    return 0 if cipher == "none" else TAG_SIZE


class Sealer:
    """The sending half: assigns counters in order (call :meth:`next_nonce` on the owning task) and
    seals records into ready-to-send buffers (``header || ciphertext``)."""

    __slots__ = ("_aead", "_counter", "_lane", "cipher")

    def __init__(self, cipher: str, key: bytes, *, lane: int = 0) -> None:
        self.cipher = cipher
        self._aead = _aead(cipher, key)
        self._counter = 0
        self._lane = lane

    def next_nonce(self) -> bytes:
        if self._counter >= _MAX_COUNTER:
            raise LocalProtocolError("record counter exhausted; reconnect for fresh keys")
        nonce = _NONCE.pack(self._lane, self._counter)
        self._counter += 1
        return nonce

    def seal(self, nonce: bytes, kind: int, parts: list[bytes | bytearray | memoryview],
             out: bytearray | None = None) -> memoryview:
        """One wire record carrying the concatenation of *parts* (a single part is sealed without a
        plaintext copy), written into *out* when it is large enough (buffer reuse) or a fresh buffer."""
        n = sum(len(p) for p in parts)
        size = RECORD_HEADER + n + overhead(self.cipher)
        if out is None or len(out) < size:
            out = bytearray(size)
        view = memoryview(out)[:size]
        hdr = record_header(kind, n + overhead(self.cipher))
        view[:RECORD_HEADER] = hdr
        if self._aead is None:
            off = RECORD_HEADER
            for p in parts:
                view[off : off + len(p)] = p
                off += len(p)
            return view
        data: bytes | bytearray | memoryview = parts[0] if len(parts) == 1 else b"".join(parts)
        self._aead.encrypt_into(nonce, data, hdr, view[RECORD_HEADER:])
        return view


class Opener:
    """The receiving half: opens records strictly in counter order."""

    __slots__ = ("_aead", "_counter", "_lane", "cipher")

    def __init__(self, cipher: str, key: bytes, *, lane: int = 0) -> None:
        self.cipher = cipher
        self._aead = _aead(cipher, key)
        self._counter = 0
        self._lane = lane

    def next_nonce(self) -> bytes:
        if self._counter >= _MAX_COUNTER:
            raise RemoteProtocolError("peer exhausted the record counter")
        nonce = _NONCE.pack(self._lane, self._counter)
        self._counter += 1
        return nonce

    def open(self, nonce: bytes, hdr: bytes, body: bytes | bytearray | memoryview,
             out: memoryview | None = None) -> bytearray | memoryview:
        """The plaintext of a sealed *body* whose 5-byte header was *hdr*, decrypted into *out* when given
        (it must have exactly the plaintext's length); RemoteProtocolError if forged."""
        size = len(body) - overhead(self.cipher)
        if size < 0:
            raise RemoteProtocolError("record shorter than its authentication tag")
        if out is not None and len(out) != size:
            raise RemoteProtocolError("record does not fit its destination")
        if self._aead is None:
            if out is None:
                return bytearray(body)
            out[:] = body
            return out
        dest: bytearray | memoryview = bytearray(size) if out is None else out
        try:
            self._aead.decrypt_into(nonce, body, hdr, dest)
        except InvalidTag:
            raise RemoteProtocolError("record failed authentication (forged, replayed or reordered)") from None
        return dest
