"""A token file cut into shards without ever holding it: read a bounded chunk at a time, served from the file.

Why. A publisher's dataset may be many times its memory (issue 38: a 2 GiB file on a laptop). Before,
``make_shards`` took the whole token array and returned every shard's bytes, so the publisher held the
dataset in memory (and a mask of it, in ``check_vocab``): about 3.4 times the file at its peak. Here:

* :func:`file_chunks` reads the file with ``readinto`` into one reused buffer (not a memory map, whose
  touched pages would count in the process's resident set until it unmaps them);
* :func:`id_range` is the smallest and largest token id over those chunks (with an ``ignore`` value left
  out, as a loss's ``ignore_index``);
* :func:`shard_file` hashes one shard at a time and names each shard by a :class:`FileRange`: where the
  file already holds the shard's storage dtype (a text file, a ``uint16`` file with a vocabulary over
  256), the range of the user's file itself; otherwise the range of a converted copy in an unlinked
  temporary file (disk, never memory). The publisher's content store serves a range part by part.

A user who rewrites the file after publishing gets a job whose shards no longer match the manifest:
every node checks each shard's hash, refuses those bytes and counts the publisher against.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fusionp2p.data.shards import MAX_SHARDS, STORAGE_DTYPES, ShardManifest, storage_dtype
from fusionp2p.errors import ConfigError

CHUNK_BYTES = 32 << 20     # what a scan holds at once


class _Fd:
    """An open file descriptor, closed when the last :class:`FileRange` naming it goes (a raw fd: no
    ResourceWarning from the garbage collector, unlike a file object)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class FileRange:
    """Bytes ``[offset, offset + size)`` of an open file, read when asked (``os.pread``): a shard that a
    publisher serves from disk. ``bytes(r)`` reads it whole; :meth:`read` a part. A file shortened since
    gives fewer bytes, which the fetching node's size and hash checks refuse."""

    __slots__ = ("_fd", "offset", "size")

    def __init__(self, fd: _Fd, offset: int, size: int) -> None:
        self._fd, self.offset, self.size = fd, offset, size

    def __len__(self) -> int:
        return self.size

    def read(self, pos: int, n: int) -> bytes:
        n = max(0, min(n, self.size - pos))
        return os.pread(self._fd.fd, n, self.offset + pos) if n else b""

    def __bytes__(self) -> bytes:
        return self.read(0, self.size)


def file_chunks(path: str | os.PathLike[str], *, offset: int, dtype: np.dtype[np.integer], count: int,
                chunk_tokens: int | None = None) -> Iterator[np.ndarray]:
    """Tokens ``[0, count)`` of the array of *dtype* at byte *offset* of *path*, in chunks of *chunk_tokens*
    (views of one reused buffer: each is valid until the next is asked for)."""
    per = chunk_tokens or max(1, CHUNK_BYTES // dtype.itemsize)
    buf = bytearray(min(per, count) * dtype.itemsize)
    with open(path, "rb") as f:
        f.seek(offset)
        left = count
        while left:
            k = min(per, left)
            view = memoryview(buf)[: k * dtype.itemsize]
            got = f.readinto(view)
            if got != len(view):
                raise ConfigError(f"{path} ended early ({got} of {len(view)} bytes read); was it changed while read?")
            yield np.frombuffer(view, dtype=dtype)
            left -= k


def id_range(chunks: Iterator[np.ndarray], *, ignore: int | None = None) -> tuple[int, int] | None:
    """(smallest, largest) token id over *chunks*, *ignore* left out; None when nothing is left."""
    lo: int | None = None
    hi: int | None = None
    for c in chunks:
        kept = c[c != ignore] if ignore is not None else c
        if kept.size:
            a, b = int(kept.min()), int(kept.max())
            lo, hi = (a, b) if lo is None or hi is None else (min(lo, a), max(hi, b))
    return None if lo is None or hi is None else (lo, hi)


def shard_file(path: str | os.PathLike[str], *, offset: int, dtype: np.dtype[np.integer], num_tokens: int,
               vocab_size: int, shard_tokens: int) -> tuple[ShardManifest, dict[str, FileRange]]:
    """The manifest of the token array in *path* (see :func:`file_chunks`) and each distinct shard as a
    :class:`FileRange` (see the module docstring). The caller checked the ids against *vocab_size*."""
    if shard_tokens < 1:
        raise ConfigError("shard_tokens must be >= 1")
    if -(-num_tokens // shard_tokens) > MAX_SHARDS:
        raise ConfigError(f"{num_tokens} tokens make more than {MAX_SHARDS} shards of {shard_tokens}; "
                          "pass a larger shard_tokens")
    dt = storage_dtype(vocab_size)
    out_dt = STORAGE_DTYPES[dt]
    as_stored = dtype == out_dt      # '<u2' == '<u2'; a big-endian or wider file is converted
    if as_stored:
        fd = _Fd(os.open(Path(path), os.O_RDONLY))
    else:
        tmp_fd, tmp_name = tempfile.mkstemp(prefix="fusionp2p-shards-")
        os.unlink(tmp_name)          # gone from the directory at once; the space is freed with the fd
        fd = _Fd(tmp_fd)
    hashes: list[str] = []
    blobs: dict[str, FileRange] = {}
    pos = 0   # byte offset of the next shard in the served file
    for chunk in file_chunks(path, offset=offset, dtype=dtype, count=num_tokens, chunk_tokens=shard_tokens):
        data = chunk if as_stored else np.ascontiguousarray(chunk, dtype=out_dt)
        raw = memoryview(data.data).cast("B")   # the chunk as bytes, no copy
        if not as_stored:
            os.pwrite(fd.fd, raw, pos)
        h = hashlib.sha256(raw).hexdigest()
        hashes.append(h)
        blobs.setdefault(h, FileRange(fd, (offset if as_stored else 0) + pos, len(raw)))
        pos += len(raw)
    man = ShardManifest(dtype=dt, num_tokens=num_tokens, shard_tokens=shard_tokens, vocab_size=vocab_size,
                        shards=tuple(hashes))
    return man, blobs


__all__ = ["CHUNK_BYTES", "FileRange", "file_chunks", "id_range", "shard_file"]
