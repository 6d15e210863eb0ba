"""Content-addressed dataset shards: a token stream cut into contiguous ranges, each named by sha256.

A shard is the little-endian bytes of ``tokens[i*shard_tokens : (i+1)*shard_tokens]`` in the
manifest's storage dtype (``u8`` for vocabularies up to 256, ``u16`` up to 65536, else ``i32``).
The :class:`ShardManifest` lists the shard hashes in order; its own hash (of its canonical msgpack
encoding) is what a job's dataset reference names. A node fetches the manifest, then only the shards
its samples touch (:meth:`ShardManifest.shards_for`), and checks each against the manifest
(:func:`decode_shard`): a peer that serves other bytes raises :class:`IntegrityError`.

Pure: no I/O here; fetching goes through :mod:`fusionp2p.jobs.content`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from fusionp2p.errors import ConfigError, IntegrityError, RemoteProtocolError
from fusionp2p.wire import codec
from fusionp2p.wire.msg import packb, unpackb

STORAGE_DTYPES: dict[str, np.dtype[np.integer]] = {"u8": np.dtype("<u1"), "u16": np.dtype("<u2"), "i32": np.dtype("<i4")}
DEFAULT_SHARD_TOKENS = 1 << 20
MAX_SHARDS = 100_000  # also bounded by the msgpack array limit; 1e5 shards x 1 Mi tokens is plenty
_HEX = frozenset("0123456789abcdef")

TokenArray = npt.NDArray[np.integer]


def is_sha256_hex(h: object) -> bool:
    """True for a lowercase 64-character hex sha256 digest."""
    return isinstance(h, str) and len(h) == 64 and set(h) <= _HEX


def storage_dtype(vocab_size: int) -> str:
    """The narrowest storage dtype that holds token ids below *vocab_size*."""
    if vocab_size <= 256:
        return "u8"
    if vocab_size <= 65536:
        return "u16"
    return "i32"


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardManifest:
    """Ordered shard hashes of one token stream, plus how to read them."""

    dtype: str = field(metadata={"wire": {"max_len": 8}})
    num_tokens: int = field(metadata={"wire": {"lo": 2, "hi": 1 << 48}})
    shard_tokens: int = field(metadata={"wire": {"lo": 1, "hi": 1 << 48}})
    vocab_size: int = field(metadata={"wire": {"lo": 2, "hi": 1 << 31}})
    shards: tuple[str, ...] = field(metadata={"wire": {"max_len": MAX_SHARDS, "item": {"max_len": 64}}})

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise ConfigError(f"shard dtype must be one of {', '.join(STORAGE_DTYPES)}")
        if self.num_tokens < 2 or self.shard_tokens < 1 or self.vocab_size < 2:
            raise ConfigError("a shard manifest needs at least 2 tokens, shard_tokens >= 1 and vocab_size >= 2")
        if self.vocab_size > 2**31 - 1 or (self.dtype != "i32" and self.vocab_size > 2 ** (8 * STORAGE_DTYPES[self.dtype].itemsize)):
            raise ConfigError(f"vocab_size {self.vocab_size} does not fit dtype {self.dtype}")
        expected = -(-self.num_tokens // self.shard_tokens)
        if len(self.shards) != expected or expected > MAX_SHARDS:
            raise ConfigError(f"manifest lists {len(self.shards)} shards, expected {expected} (at most {MAX_SHARDS})")
        if not all(is_sha256_hex(h) for h in self.shards):
            raise ConfigError("shard hashes must be lowercase hex sha256 digests")

    def shard_range(self, index: int) -> tuple[int, int]:
        """Token range ``[start, stop)`` covered by shard *index*."""
        if not 0 <= index < len(self.shards):
            raise IndexError(f"shard {index} out of range")
        start = index * self.shard_tokens
        return start, min(start + self.shard_tokens, self.num_tokens)

    def shards_for(self, start: int, length: int) -> range:
        """Indices of the shards holding tokens ``[start, start + length)``."""
        if start < 0 or length < 1 or start + length > self.num_tokens:
            raise IndexError(f"token range [{start}, {start + length}) outside [0, {self.num_tokens})")
        return range(start // self.shard_tokens, (start + length - 1) // self.shard_tokens + 1)

    def to_wire(self) -> dict[str, Any]:
        return codec.to_wire(self)

    def encode(self) -> bytes:
        """Canonical bytes; their sha256 is :attr:`content_hash`."""
        return packb(self.to_wire())

    @property
    def content_hash(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()

    @classmethod
    def from_wire(cls, obj: Any) -> ShardManifest:
        return codec.from_wire(cls, obj, "shard manifest")

    @classmethod
    def decode(cls, data: bytes, *, expected_hash: str | None = None) -> ShardManifest:
        """Parse a manifest from a peer; with *expected_hash*, check the bytes first."""
        if expected_hash is not None and hashlib.sha256(data).hexdigest() != expected_hash:
            raise IntegrityError("shard manifest does not match its content hash")
        man = cls.from_wire(unpackb(data, max_size=8 << 20))
        if man.encode() != bytes(data):
            raise RemoteProtocolError("shard manifest is not canonically encoded")
        return man


def make_shards(
    tokens: TokenArray, *, vocab_size: int, shard_tokens: int = DEFAULT_SHARD_TOKENS
) -> tuple[ShardManifest, dict[str, bytes]]:
    """Cut *tokens* into shards; return the manifest and ``{hash: bytes}`` of every distinct shard."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError("tokens must be a 1-D integer array")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        raise ConfigError(f"token ids must lie in [0, {vocab_size}); pass the right vocab_size")
    if shard_tokens < 1:
        raise ConfigError("shard_tokens must be >= 1")
    dt = storage_dtype(vocab_size)
    blobs: dict[str, bytes] = {}
    hashes: list[str] = []
    for start in range(0, arr.shape[0], shard_tokens):
        data = np.ascontiguousarray(arr[start : start + shard_tokens], dtype=STORAGE_DTYPES[dt]).tobytes()
        h = hashlib.sha256(data).hexdigest()
        blobs[h] = data
        hashes.append(h)
    man = ShardManifest(
        dtype=dt, num_tokens=int(arr.shape[0]), shard_tokens=shard_tokens, vocab_size=vocab_size, shards=tuple(hashes)
    )
    return man, blobs


def decode_shard(manifest: ShardManifest, index: int, data: bytes) -> TokenArray:
    """Check shard *index* from a peer against the manifest and return its tokens (read-only)."""
    start, stop = manifest.shard_range(index)
    dt = STORAGE_DTYPES[manifest.dtype]
    if len(data) != (stop - start) * dt.itemsize:
        raise IntegrityError(f"shard {index} has {len(data)} bytes, expected {(stop - start) * dt.itemsize}")
    if hashlib.sha256(data).hexdigest() != manifest.shards[index]:
        raise IntegrityError(f"shard {index} does not match its hash in the manifest")
    arr = np.frombuffer(data, dtype=dt)
    # The hash only proves the bytes are the publisher's; still refuse ids the model cannot embed.
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= manifest.vocab_size):
        raise RemoteProtocolError(f"shard {index} holds token ids outside [0, {manifest.vocab_size})")
    return arr


class ShardedTokens:
    """A token stream of which only some shards are present; reads windows across shard boundaries."""

    __slots__ = ("_shards", "manifest")

    def __init__(self, manifest: ShardManifest) -> None:
        self.manifest = manifest
        self._shards: dict[int, TokenArray] = {}

    def add(self, index: int, data: bytes) -> None:
        """Verify and keep shard *index* (raises IntegrityError on a mismatch)."""
        self._shards[index] = decode_shard(self.manifest, index, data)

    def has(self, index: int) -> bool:
        return index in self._shards

    def missing(self, indices: range | list[int]) -> list[int]:
        return [i for i in indices if i not in self._shards]

    def window(self, start: int, length: int) -> TokenArray:
        """Tokens ``[start, start + length)`` as int64; KeyError naming the first missing shard."""
        out = np.empty(length, dtype=np.int64)
        pos = 0
        for i in self.manifest.shards_for(start, length):
            if i not in self._shards:
                raise KeyError(f"shard {i} not loaded")
            s0, s1 = self.manifest.shard_range(i)
            lo, hi = max(start, s0), min(start + length, s1)
            out[pos : pos + hi - lo] = self._shards[i][lo - s0 : hi - s0]
            pos += hi - lo
        return out
