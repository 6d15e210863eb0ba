"""A token dataset that the nodes read themselves from a URL: HTTP range requests, each shard verified.

``TokenURL("https://host/corpus.bin", seq_len=..., dtype="uint16")`` names raw little-endian tokens
served over HTTP(S). At ``publish`` the publisher reads the file once, streaming, to hash it shard by
shard: the signed manifest lists each shard's sha256 (``data/shards.py``), so a node that reads shard
``i`` with ``Range: bytes=a-b`` checks what it got, and a server that serves other bytes is refused. The
publisher keeps only the first shard (to trace the model on a real batch) and publishes only the
manifest; the shards come from the URL and from the nodes that read them before (DHT providers).

:func:`read_range` is the node's side: blocking (the feed runs it in a worker thread, under a trio
deadline), at most the exact size asked, refusing a server that ignores the range.
"""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np

from fusionp2p.data.shards import (
    DEFAULT_SHARD_TOKENS,
    STORAGE_DTYPES,
    ShardManifest,
    TokenArray,
    storage_dtype,
)
from fusionp2p.data.tokens import ARRAY_DTYPES
from fusionp2p.errors import ConfigError, RemoteProtocolError

MAX_URL = 256                # a DatasetRef's name holds the URL
READ_CHUNK = 1 << 20


def check_url(url: str) -> str:
    """*url* if it is an http(s) URL short enough for the job's signed reference, else ConfigError."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > MAX_URL:
        raise ConfigError(f"a dataset URL must be http:// or https:// and at most {MAX_URL} characters, got {url!r:.80}")
    return url


def read_range(url: str, start: int, size: int, *, timeout: float) -> bytes:
    """Bytes ``[start, start + size)`` of *url*: exactly *size* of them, or RemoteProtocolError (the
    server ignored the range, sent fewer or more bytes, failed, or stalled past *timeout*)."""
    req = urllib.request.Request(url, headers={"Range": f"bytes={start}-{start + size - 1}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if resp.status != 206 and not (resp.status == 200 and start == 0):
                raise RemoteProtocolError(f"{url:.80} answered {resp.status} to a range request")
            data: bytes = resp.read(size + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RemoteProtocolError(f"{url:.80}: {exc}") from None
    if resp.status == 200:
        data = data[:size]     # a whole file from offset 0: its first bytes are the range
    if len(data) != size:
        raise RemoteProtocolError(f"{url:.80} sent {len(data)} bytes for a range of {size}")
    return data


@dataclass(frozen=True, slots=True)
class TokenURL:
    """Raw little-endian tokens at an http(s) URL (see the module docstring). ``vocab_size`` is required
    (the publisher does not keep the tokens to infer it); a token id at or beyond it is refused."""

    url: str
    _: KW_ONLY
    seq_len: int = 128
    dtype: str = "uint16"
    vocab_size: int = 0
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    timeout: float = 60.0
    _manifest: ShardManifest | None = field(default=None, init=False, repr=False, compare=False)
    _head: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_url(self.url)
        if self.dtype not in ARRAY_DTYPES:
            raise ConfigError(f"TokenURL dtype must be one of {', '.join(ARRAY_DTYPES)}, got {self.dtype!r}")
        if self.vocab_size < 2 or self.seq_len < 1 or self.shard_tokens < self.seq_len + 1:
            raise ConfigError("TokenURL needs vocab_size >= 2, seq_len >= 1 and shard_tokens > seq_len")

    @property
    def kind(self) -> str:
        return "url"

    def manifest(self) -> ShardManifest:
        """Read the URL once, streaming, and hash it shard by shard (cached)."""
        if self._manifest is not None:
            return self._manifest
        src = ARRAY_DTYPES[self.dtype]
        dt = storage_dtype(self.vocab_size)
        if STORAGE_DTYPES[dt] != src:
            raise ConfigError(f"a URL dataset is read as stored: give dtype={ {'u8': 'uint8', 'u16': 'uint16', 'i32': 'int32'}[dt]!r} "
                              f"for vocab_size={self.vocab_size}")
        shard_bytes = self.shard_tokens * src.itemsize
        hashes: list[str] = []
        total = 0
        buf = bytearray()
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout) as resp:
                while True:
                    chunk = resp.read(READ_CHUNK)
                    buf += chunk
                    while len(buf) >= shard_bytes or (not chunk and buf):
                        piece, buf = bytes(buf[:shard_bytes]), buf[shard_bytes:]
                        self._take(piece, hashes)
                        total += len(piece)
                    if not chunk:
                        break
        except (urllib.error.URLError, OSError) as exc:
            raise ConfigError(f"cannot read the dataset at {self.url}: {exc}") from None
        if total % src.itemsize or total // src.itemsize < self.seq_len + 1:
            raise ConfigError(f"{self.url} holds {total} bytes: not whole {self.dtype} tokens, or fewer than seq_len + 1")
        man = ShardManifest(dtype=dt, num_tokens=total // src.itemsize, shard_tokens=self.shard_tokens,
                            vocab_size=self.vocab_size, shards=tuple(hashes))
        object.__setattr__(self, "_manifest", man)
        return man

    def _take(self, piece: bytes, hashes: list[str]) -> None:
        arr = np.frombuffer(piece[: len(piece) - len(piece) % ARRAY_DTYPES[self.dtype].itemsize],
                            dtype=ARRAY_DTYPES[self.dtype])
        if arr.size and int(arr.max()) >= self.vocab_size:
            raise ConfigError(f"{self.url} holds token id {int(arr.max())}, beyond vocab_size={self.vocab_size}")
        if self._head is None:
            object.__setattr__(self, "_head", arr.copy())
        hashes.append(hashlib.sha256(piece).hexdigest())

    @property
    def num_tokens(self) -> int:
        return self.manifest().num_tokens

    def tokens(self) -> TokenArray:
        """The first shard's tokens (what the publisher traces the model on; the nodes read the rest)."""
        self.manifest()
        assert self._head is not None
        return self._head  # type: ignore[no-any-return]


__all__ = ["MAX_URL", "TokenURL", "check_url", "read_range"]
