"""A node's content store: blobs by sha256, on disk within a cap, with a bounded memory cache in front.

Theory of operation. A node that runs for weeks stores, job after job, DAGs, weights, data shards,
stage states and checkpoints. Without a bound it grows until the machine kills it (issue 42), so
every blob the store holds is either

* **pinned** by an owner (a job this node has accepted or runs: ``pin``/``pinned_to``), and never
  evicted while any owner holds it; or
* **cached**: held only because it may be asked for again (a finished job's final stage files that
  its publisher downloads, a checkpoint this node replicated, weights a later job reuses). Cached
  blobs go oldest first (least recently used) when room is needed.

Two caps, one :class:`StoreConfig`:

* ``disk_bytes`` (``fusionp2p node --disk``) bounds everything the store holds: on disk with a root,
  in memory without one (the publisher's and the tests' stores). A put that would need more than
  the cap once every cached blob is gone raises :class:`StoreFull`, so what pinned blobs add up to
  stays under the cap too: a job that does not fit is refused (at its offer) or fails, the node does not.
* ``memory_bytes`` bounds the copies kept in memory in front of the disk, and only blobs that an owner
  pins get one (least recently used go first). When an owner releases its pins, its blobs leave memory
  at once and stay on disk as cache, newest in the eviction order; a cached blob is read from disk
  whenever it is asked for (served to a peer), without taking memory.

Pinning is done by scope: ``with store.pinned_to(owner):`` pins every blob put or read within the
scope to *owner*, in the task that entered it and in every task it starts (a ``ContextVar``: trio
copies the context into each new task). The intake's fetches and a job's state and checkpoint
writes run deep in other modules; the scope lets them stay unaware of pins.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import itertools
import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fusionp2p.data.file_shards import FileRange
from fusionp2p.data.shards import is_sha256_hex
from fusionp2p.errors import ConfigError, FusionError, IntegrityError
from fusionp2p.wire.limits import GiB, MiB

log = logging.getLogger(__name__)

_OWNER: contextvars.ContextVar[str | None] = contextvars.ContextVar("fusionp2p_store_owner", default=None)


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class StoreFull(FusionError):
    """A blob does not fit: what running jobs pin plus the blob would pass the store's cap (``--disk``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreConfig:
    """Caps of a content store (docs/operations.md "What a node keeps")."""

    # everything held (on disk, or in memory for a store without a root); None: no cap
    disk_bytes: int | None = 20 * GiB
    memory_bytes: int = 64 * MiB    # copies in memory in front of the disk (a store with a root)

    def __post_init__(self) -> None:
        if (self.disk_bytes is not None and self.disk_bytes < 1) or self.memory_bytes < 0:
            raise ConfigError("the store's disk cap must be positive and its memory cap >= 0")


class ContentStore:
    """Blobs by sha256 within :class:`StoreConfig`'s caps, on disk (with *root*) as ``root/<h[:2]>/<h>``.

    See the module docstring for the eviction policy. A store with a root finds the blobs a previous
    run left there (they count as cached, oldest by modification time first). Without a config, a store
    with a root has the default caps and one without (a publisher's: what it published, for the life of
    the process) none.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, config: StoreConfig | None = None) -> None:
        self.config = config or (StoreConfig() if root is not None else StoreConfig(disk_bytes=None))
        self._root = Path(root) if root is not None else None
        self._held: OrderedDict[str, int] = OrderedDict()    # hash -> size, least recently used first
        self._held_bytes = 0
        self._mem: OrderedDict[str, bytes] = OrderedDict()   # the memory copies, least recently used first
        self._ranges: dict[str, FileRange] = {}              # blobs read from a file when asked (put_range)
        self._mem_bytes = 0
        self._pins: dict[str, set[str]] = {}                 # owner -> the hashes it pins
        self._pinned: dict[str, int] = {}                    # hash -> how many owners pin it
        self._pinned_bytes = 0
        self.evicted = 0                                     # blobs evicted so far (for the operator)
        self._serial = itertools.count()                     # names write_chunks' temporary files
        if self._root is not None:
            self._scan()

    def _path(self, h: str) -> Path:
        assert self._root is not None
        return self._root / h[:2] / h

    def _scan(self) -> None:
        assert self._root is not None
        found: list[tuple[float, str, int]] = []
        if self._root.is_dir():
            for p in self._root.glob("put-*.tmp"):
                p.unlink(missing_ok=True)       # a put_chunks cut short by a crash
            for p in self._root.glob("??/*"):
                if p.name.endswith(".tmp"):
                    p.unlink(missing_ok=True)   # a write cut short by a crash
                elif is_sha256_hex(p.name) and p.is_file():
                    st = p.stat()
                    found.append((st.st_mtime, p.name, st.st_size))
        for _, h, n in sorted(found):
            self._held[h] = n
            self._held_bytes += n
        self.make_room(0)   # a smaller --disk than the last run's: evict down to it now

    # ------------------------------------------------------------------ caps and pins
    def stats(self) -> dict[str, int]:
        """What the store holds now, in bytes and blobs (the soak benchmark and the operator read it)."""
        return {"held_bytes": self._held_bytes, "memory_bytes": self._mem_bytes, "pinned_bytes": self._pinned_bytes,
                "blobs": len(self._held), "pinned_blobs": len(self._pinned), "owners": len(self._pins),
                "evicted": self.evicted}

    def pinned_by(self, owner: str) -> frozenset[str]:
        return frozenset(self._pins.get(owner, ()))

    def pin(self, owner: str, h: str) -> None:
        """Keep *h* until *owner* releases it (KeyError if the store does not hold it)."""
        if h not in self._held:
            raise KeyError(h)
        hashes = self._pins.setdefault(owner, set())
        if h in hashes:
            return
        hashes.add(h)
        count = self._pinned.get(h, 0)
        self._pinned[h] = count + 1
        if count == 0:
            self._pinned_bytes += self._held[h]

    def release(self, owner: str) -> None:
        """Drop every pin of *owner*: its blobs leave memory (with a root) and stay as the newest cache."""
        for h in self._pins.pop(owner, ()):
            count = self._pinned[h] - 1
            if count:
                self._pinned[h] = count
                continue
            del self._pinned[h]
            self._pinned_bytes -= self._held[h]
            self._held.move_to_end(h)
            if self._root is not None:
                self._drop_mem(h)

    def discard(self, owner: str, h: str) -> None:
        """Drop *owner*'s pin of *h* and the blob itself unless another owner pins it: superseded copies that
        are of no use as cache (a stage's older shadow copies, jobs/shadow.py)."""
        hashes = self._pins.get(owner)
        if hashes is not None and h in hashes:
            hashes.discard(h)
            count = self._pinned[h] - 1
            if count:
                self._pinned[h] = count
                return
            del self._pinned[h]
            self._pinned_bytes -= self._held[h]
        if h in self._held and h not in self._pinned:
            self._remove(h)   # not counted as evicted: that count tells operators about pressure

    def transfer(self, src: str, dst: str) -> None:
        """Move *src*'s pins to *dst* (an offer's pins become its job's once the job id is known)."""
        for h in list(self._pins.get(src, ())):
            self.pin(dst, h)
        self.release(src)

    @contextlib.contextmanager
    def pinned_to(self, owner: str) -> Iterator[None]:
        """Pin every blob put or read in this scope (and in the tasks started from it) to *owner*."""
        token = _OWNER.set(owner)
        try:
            yield
        finally:
            _OWNER.reset(token)

    @contextlib.contextmanager
    def unpinned(self) -> Iterator[None]:
        """Pin nothing put or read in this scope, inside an owner's scope too: a streamed data shard is
        cache, evicted oldest first, so that a dataset larger than ``--disk`` streams through the store."""
        token = _OWNER.set(None)
        try:
            yield
        finally:
            _OWNER.reset(token)

    def make_room(self, n: int) -> None:
        """Evict cached blobs, oldest first, until *n* more bytes fit; StoreFull if pins leave no room."""
        cap = self.config.disk_bytes
        if cap is None or self._held_bytes + n <= cap:
            return
        if self._pinned_bytes + n > cap:
            raise StoreFull(f"a blob of {n} bytes does not fit in the content store: running jobs pin "
                            f"{self._pinned_bytes} of its {cap} bytes (raise --disk or run fewer jobs)")
        for h in list(self._held):
            if self._held_bytes + n <= cap:
                break
            if h not in self._pinned:
                self._evict(h)

    def _evict(self, h: str) -> None:
        self._remove(h)
        self.evicted += 1

    def _remove(self, h: str) -> None:
        self._held_bytes -= self._held.pop(h)
        self._drop_mem(h)
        if self._root is not None:
            self._path(h).unlink(missing_ok=True)

    def _drop_mem(self, h: str) -> None:
        self._ranges.pop(h, None)
        blob = self._mem.pop(h, None)
        if blob is not None:
            self._mem_bytes -= len(blob)

    def _cache(self, h: str, blob: bytes) -> None:
        if h in self._mem:
            self._mem.move_to_end(h)
            return
        if self._root is not None:
            if h not in self._pinned or len(blob) > self.config.memory_bytes:
                return   # only what running jobs use is worth memory; a large blob would push all else out
            while self._mem and self._mem_bytes + len(blob) > self.config.memory_bytes:
                _, old = self._mem.popitem(last=False)
                self._mem_bytes -= len(old)
        self._mem[h] = blob
        self._mem_bytes += len(blob)

    def _used(self, h: str) -> None:
        self._held.move_to_end(h)
        owner = _OWNER.get()
        if owner is not None:
            self.pin(owner, h)

    # ------------------------------------------------------------------ blobs
    def put(self, data: bytes | bytearray | memoryview) -> str:
        """Store *data*; return its hash (idempotent). StoreFull when it does not fit beside the pins."""
        blob = bytes(data)
        h = sha256_hex(blob)
        if h not in self._held:
            self.make_room(len(blob))
            if self._root is not None:
                p = self._path(h)
                p.parent.mkdir(parents=True, exist_ok=True)
                tmp = p.with_name(p.name + ".tmp")
                tmp.write_bytes(blob)
                os.replace(tmp, p)
            self._held[h] = len(blob)
            self._held_bytes += len(blob)
        self._used(h)
        self._cache(h, blob)
        return h

    def put_chunks(self, parts: Iterable[bytes | memoryview], size: int) -> str:
        """Store the blob of exactly *size* bytes that *parts* make up; return its hash. With a root, the parts
        are hashed and written to disk as they come, so the whole blob is never held in memory (a stage
        state from its tensors, ``wire/stfile.py``), and it gets no memory copy. StoreFull as :meth:`put`.
        Blocking: from a trio task, :meth:`write_chunks` in a worker thread, then :meth:`adopt`."""
        if self._root is None:
            return self.put(b"".join(parts))
        return self.adopt(self.write_chunks(parts, size))   # room is made once the hash says the blob is new

    def write_chunks(self, parts: Iterable[bytes | memoryview], size: int) -> tuple[Path, str]:
        """(thread-safe: it touches no bookkeeping) write *parts* to a temporary file of the store, hashing
        them; (its path, the hash). ValueError when they are not *size* bytes."""
        tmp = self.temp_path()
        digest = hashlib.sha256()
        n = 0
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    digest.update(part)
                    f.write(part)
                    n += len(part)
            if n != size:
                raise ValueError(f"write_chunks: {n} bytes given, {size} announced")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, digest.hexdigest()

    def temp_path(self) -> Path:
        """A fresh temporary file name in the store (for :meth:`adopt`; removed by the next start if left)."""
        assert self._root is not None
        self._root.mkdir(parents=True, exist_ok=True)
        return self._root / f"put-{os.getpid()}-{next(self._serial)}.tmp"

    def adopt(self, written: tuple[Path, str]) -> str:
        """Take a file written in :meth:`temp_path` (by :meth:`write_chunks`, or a fetch that checked its hash)
        under its hash *h*, which it returns; the file is gone either way."""
        tmp, h = written
        try:
            if h not in self._held:
                n = tmp.stat().st_size
                self.make_room(n)
                p = self._path(h)
                p.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, p)
                self._held[h] = n
                self._held_bytes += n
        finally:
            tmp.unlink(missing_ok=True)
        self._used(h)
        return h

    @property
    def on_disk(self) -> bool:
        """Whether blobs live on disk (a node's store), not in memory (a publisher's, the tests')."""
        return self._root is not None

    def put_view(self, h: str, view: memoryview) -> None:
        """Hold *view* (of a tensor's bytes, whose hash *h* its owner computed) as blob *h* without a copy: a
        publisher's weight pieces, served from its module. Only a store in memory (a publisher's) holds views;
        one on disk stores a copy. A view whose bytes changed since (the module trained on) is not served."""
        if self._root is not None:
            self.put(view)
            return
        if h not in self._held:
            self._held[h] = len(view)
            self._held_bytes += len(view)
            self._mem[h] = view   # type: ignore[assignment]  # read as bytes-like only (reader, get)
            self._mem_bytes += len(view)
        self._used(h)

    def put_range(self, h: str, rng: FileRange) -> None:
        """Hold blob *h* (hashed by its owner) as a range of a file, read a part at a time when served and
        never held in memory: a publisher's token shards (``data/file_shards.py``). A store on disk stores a copy."""
        if self._root is not None:
            self.put(bytes(rng))
            return
        if h not in self._held:
            self._held[h] = len(rng)
            self._held_bytes += len(rng)
            self._ranges[h] = rng
        self._used(h)

    def put_verified(self, h: str, data: bytes | bytearray | memoryview) -> None:
        """Store *data* only if it hashes to *h* (IntegrityError otherwise)."""
        if sha256_hex(data) != h:
            raise IntegrityError(f"content does not match its hash {h[:16]}…")
        self.put(data)

    def has(self, h: str) -> bool:
        return h in self._held

    def get(self, h: str) -> bytes:
        """The blob named *h*; KeyError if absent; IntegrityError if its file on disk was corrupted."""
        blob = self._mem.get(h)
        rng = self._ranges.get(h)
        if isinstance(blob, memoryview) or rng is not None:   # a view or a file range: a copy, checked (its
            blob = bytes(blob if rng is None else rng)        # owner may have changed it since)
            if sha256_hex(blob) != h:
                raise KeyError(h)
            self._used(h)
            return blob
        if blob is None:
            if h not in self._held:
                raise KeyError(h)
            try:
                blob = self._path(h).read_bytes()
            except FileNotFoundError:   # removed under us (by hand): forget it
                self._forget(h)
                raise KeyError(h) from None
            if sha256_hex(blob) != h:
                raise IntegrityError(f"stored blob {h[:16]}… is corrupted on disk; delete {self._path(h)}")
        self._used(h)
        self._cache(h, blob)
        return blob

    @contextlib.contextmanager
    def reader(self, h: str) -> Iterator[BinaryIO | _ViewReader | _RangeReader]:
        """Blob *h* to read a part at a time: its file, or its memory copy (KeyError if absent). Unlike
        :meth:`get` it does not check the hash (whoever fetches it does) nor load it whole into memory."""
        rng = self._ranges.get(h)
        if rng is not None:   # a file's range: served as read (the fetcher checks the hash), a part at a time
            self._used(h)
            yield _RangeReader(rng)
            return
        blob = self._mem.get(h)
        if blob is None and self._root is None:
            raise KeyError(h)
        if blob is not None:
            if isinstance(blob, memoryview) and sha256_hex(blob) != h:   # a publisher's module changed since
                log.warning("blob %s… changed since it was stored (its module trained on?): not served", h[:16])
                raise KeyError(h)
            self._used(h)
            yield _ViewReader(memoryview(blob))
            return
        if h not in self._held:
            raise KeyError(h)
        try:
            f = open(self._path(h), "rb")   # noqa: SIM115 - closed below
        except FileNotFoundError:   # removed under us (by hand): forget it
            self._forget(h)
            raise KeyError(h) from None
        self._used(h)
        with f:
            yield f

    def _forget(self, h: str) -> None:
        n = self._held.pop(h)
        self._held_bytes -= n
        if self._pinned.pop(h, 0):
            self._pinned_bytes -= n
        for hashes in self._pins.values():
            hashes.discard(h)

    def size(self, h: str) -> int:
        if h not in self._held:
            raise KeyError(h)
        return self._held[h]


class _RangeReader:
    """``read(n)`` over a :class:`FileRange`: a part at a time from its file."""

    def __init__(self, rng: FileRange) -> None:
        self._rng = rng
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        part = self._rng.read(self._pos, self._rng.size - self._pos if n < 0 else n)
        self._pos += len(part)
        return part


class _ViewReader:
    """``read(n)`` over a memoryview: a copy of each part read only (``io.BytesIO`` copies it whole)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n < 0 else min(len(self._view), self._pos + n)
        part = bytes(self._view[self._pos:end])
        self._pos = end
        return part


__all__ = ["ContentStore", "StoreConfig", "StoreFull", "sha256_hex"]
