"""The weight manifest: a job's initial tensors as content-addressed pieces (issue 37).

Theory of operation. The DAG travels without its tensors (``wire/dag.py``, ``weights=False``); the
job's signed spec names, by hash (``JobSpec.weights_hash``), one :class:`WeightManifest`: for every
parameter, buffer and constant of the DAG its dtype, shape and the sha256 of each of its pieces. A
tensor's raw little-endian bytes are cut into pieces of ``piece_bytes`` (the last one shorter), so
every piece's size follows from the tensor's declaration and is checked exactly; no piece is over
:data:`MAX_PIECE_BYTES`. A node fetches only the pieces of the tensors its stage reads and rebuilds
each tensor from them (:func:`join_pieces`), never touching another stage's.

Layout (version 1), msgpack, canonical::

    {"v": 1, "piece": piece_bytes, "tensors": [[name, dtype, [shape...], [sha256 hex, ...]], ...]}

Decoding is bounded (:data:`MAX_MANIFEST_BYTES`, the msgpack item limits, :data:`MAX_PIECES` pieces in
all) and :func:`check_against` holds the manifest to the DAG's declarations before any piece is
fetched: same names, dtypes and shapes, and the exact piece count each tensor's size implies. Any
violation raises :class:`~fusionp2p.errors.RemoteProtocolError`.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from fusionp2p.errors import ConfigError, IntegrityError, RemoteProtocolError
from fusionp2p.wire.check import as_shape
from fusionp2p.wire.limits import MiB
from fusionp2p.wire.msg import expect_map, packb, typed_field, unpackb
from fusionp2p.wire.tensor import DTYPES, check_header, dtype_name, encode_tensor

VERSION = 1
MAX_PIECE_BYTES = 64 * MiB           # no piece over this: far under the content fetch's 2 GiB cap
DEFAULT_PIECE_BYTES = 16 * MiB
MIN_PIECE_BYTES = 1024               # keeps the piece count of a tensor bounded by its size
MAX_PIECES = 200_000                 # every tensor's pieces together: 3 TB in 16 MiB pieces (13 MB of hashes)
MAX_MANIFEST_BYTES = 32 * MiB        # MAX_PIECES hashes and the names of 100,000 tensors (msgpack's item limit)
MAX_NAME = 512
_HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorPieces:
    """One tensor of the manifest: its declaration and the hashes of its pieces in order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightManifest:
    """Every initial tensor of a job as pieces of at most ``piece_bytes`` (see the module docstring)."""

    piece_bytes: int
    tensors: tuple[TensorPieces, ...]

    def __post_init__(self) -> None:
        if not MIN_PIECE_BYTES <= self.piece_bytes <= MAX_PIECE_BYTES:
            raise ConfigError(f"piece_bytes must be in [{MIN_PIECE_BYTES}, {MAX_PIECE_BYTES}], not {self.piece_bytes}")

    def by_name(self) -> dict[str, TensorPieces]:
        return {t.name: t for t in self.tensors}

    def piece_sizes(self, entry: TensorPieces) -> list[int]:
        """The exact size of each piece of *entry* (all ``piece_bytes`` but the last)."""
        n, p = entry.nbytes, self.piece_bytes
        return [min(p, n - i) for i in range(0, n, p)]

    def pieces_of(self, names: Iterable[str]) -> Iterator[tuple[str, int]]:
        """(hash, exact size) of every piece of the tensors *names*, in manifest order."""
        wanted = set(names)
        for t in self.tensors:
            if t.name in wanted:
                yield from zip(t.pieces, self.piece_sizes(t), strict=True)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def encode(self) -> bytes:
        """Canonical bytes; their sha256 is :attr:`content_hash` (the spec's ``weights_hash``)."""
        return packb({"v": VERSION, "piece": self.piece_bytes,
                      "tensors": [[t.name, t.dtype, list(t.shape), list(t.pieces)] for t in self.tensors]})

    @property
    def content_hash(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, *, expected_hash: str | None = None) -> WeightManifest:
        """A manifest from a peer: RemoteProtocolError on anything malformed or over bound, IntegrityError
        (a RemoteProtocolError) when the bytes are not those *expected_hash* names."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise RemoteProtocolError(f"weight manifest of {len(data)} bytes exceeds the limit of {MAX_MANIFEST_BYTES}")
        if expected_hash is not None and hashlib.sha256(data).hexdigest() != expected_hash:
            raise IntegrityError("weight manifest does not match its content hash")
        m = expect_map(unpackb(data, max_size=MAX_MANIFEST_BYTES), "weight manifest")
        if m.get("v") != VERSION:
            raise RemoteProtocolError(f"weight manifest version {str(m.get('v'))[:16]} is not supported (want {VERSION})")
        piece = typed_field(m, "piece", int, "weight manifest")
        if not MIN_PIECE_BYTES <= piece <= MAX_PIECE_BYTES:
            raise RemoteProtocolError(f"weight manifest: piece size {piece} outside [{MIN_PIECE_BYTES}, {MAX_PIECE_BYTES}]")
        tensors: list[TensorPieces] = []
        seen: set[str] = set()
        total = 0
        for raw in typed_field(m, "tensors", list, "weight manifest"):
            if not (isinstance(raw, list) and len(raw) == 4 and isinstance(raw[0], str) and isinstance(raw[1], str)
                    and isinstance(raw[3], list)):
                raise RemoteProtocolError("weight manifest: bad tensor entry")
            name, dtype, hashes = raw[0], raw[1], raw[3]
            if not name or len(name) > MAX_NAME or name in seen:
                raise RemoteProtocolError(f"weight manifest: empty, long or duplicate tensor name {name[:80]!r}")
            if dtype not in DTYPES:
                raise RemoteProtocolError(f"weight manifest: tensor {name[:80]!r} has dtype {dtype[:16]!r}")
            shape = as_shape(raw[2], f"weight manifest: tensor {name[:80]!r}")
            total += len(hashes)
            if total > MAX_PIECES:
                raise RemoteProtocolError(f"weight manifest lists over {MAX_PIECES} pieces")
            if not all(isinstance(h, str) and _HEX.match(h) for h in hashes):
                raise RemoteProtocolError(f"weight manifest: tensor {name[:80]!r} has a malformed piece hash")
            entry = TensorPieces(name=name, dtype=dtype, shape=shape, pieces=tuple(hashes))
            if len(hashes) != -(-entry.nbytes // piece):
                raise RemoteProtocolError(f"weight manifest: tensor {name[:80]!r} of {entry.nbytes} bytes lists "
                                          f"{len(hashes)} pieces of {piece}")
            seen.add(name)
            tensors.append(entry)
        man = cls(piece_bytes=piece, tensors=tuple(tensors))
        if man.encode() != bytes(data):
            raise RemoteProtocolError("weight manifest is not canonically encoded")
        return man


def holders_key(manifest_hash: str) -> str:
    """The DHT provider key under which a node announces that it holds pieces of the manifest *manifest_hash*
    (hex sha256): one announcement a node and job, not one a piece (each costs a DHT walk of about ten
    streams; the 4-node demo's 26 pieces a stage made that most of its weight phase's CPU, issue 40). A
    fetcher looks it up once for its whole stage and asks the holders piece by piece, checking each hash."""
    return hashlib.sha256(b"fusionp2p/weight-holders/1/" + manifest_hash.encode()).hexdigest()


def check_against(manifest: WeightManifest, declared: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """The manifest names exactly the *declared* tensors (DAG name -> dtype, shape), with their dtypes
    and shapes; RemoteProtocolError naming the first difference (nothing is fetched before this)."""
    have = manifest.by_name()
    missing, extra = sorted(set(declared) - set(have)), sorted(set(have) - set(declared))
    if missing or extra:
        raise RemoteProtocolError(f"weight manifest does not match the model's tensors: missing {missing[:3]}, "
                                  f"extra {extra[:3]}")
    for name, (dtype, shape) in declared.items():
        t = have[name]
        if DTYPES[t.dtype] != dtype or t.shape != tuple(shape):
            raise RemoteProtocolError(f"weight manifest: tensor {name[:80]!r} is {t.dtype} {t.shape}, the model "
                                      f"declares {dtype} {tuple(shape)}")


def split_tensor(t: torch.Tensor, piece_bytes: int) -> list[memoryview]:
    """Zero-copy views of *t*'s raw bytes in pieces of *piece_bytes* (the last shorter)."""
    _, raw = encode_tensor(t)
    return [raw[i:i + piece_bytes] for i in range(0, len(raw), piece_bytes)]


def make_manifest(tensors: Mapping[str, torch.Tensor], piece_bytes: int = DEFAULT_PIECE_BYTES, *, copy: bool = True
                  ) -> tuple[WeightManifest, dict[str, bytes | memoryview]]:
    """The manifest of *tensors* and ``{hash: bytes}`` of every distinct piece (the publisher's side). Without
    *copy* the pieces are views of the tensors' own bytes (no second copy of the weights: the publisher
    serves them from its module, ``ContentStore.put_view``)."""
    if not MIN_PIECE_BYTES <= piece_bytes <= MAX_PIECE_BYTES:
        raise ConfigError(f"piece_bytes must be in [{MIN_PIECE_BYTES}, {MAX_PIECE_BYTES}], not {piece_bytes}")
    entries: list[TensorPieces] = []
    blobs: dict[str, bytes | memoryview] = {}
    for name, t in tensors.items():
        hashes = []
        for view in split_tensor(t, piece_bytes):
            h = hashlib.sha256(view).hexdigest()
            if h not in blobs:
                blobs[h] = bytes(view) if copy else view
            hashes.append(h)
        entries.append(TensorPieces(name=name, dtype=dtype_name(t.dtype), shape=tuple(int(d) for d in t.shape),
                                    pieces=tuple(hashes)))
    return WeightManifest(piece_bytes=piece_bytes, tensors=tuple(entries)), blobs


def join_pieces(manifest: WeightManifest, entry: TensorPieces, pieces: Sequence[bytes | memoryview]) -> torch.Tensor:
    """Rebuild *entry*'s tensor from its pieces, each checked for its exact size (their hashes are the
    fetch's to check); RemoteProtocolError on a piece of the wrong size or count."""
    sizes = manifest.piece_sizes(entry)
    if len(pieces) != len(sizes):
        raise RemoteProtocolError(f"tensor {entry.name[:80]!r}: {len(pieces)} pieces, expected {len(sizes)}")
    buf = bytearray(entry.nbytes)
    off = 0
    for i, (p, n) in enumerate(zip(pieces, sizes, strict=True)):
        if len(p) != n:
            raise RemoteProtocolError(f"tensor {entry.name[:80]!r}: piece {i} has {len(p)} bytes, expected {n}")
        buf[off:off + n] = p
        off += n
    dtype, shape, nbytes = check_header({"dtype": entry.dtype, "shape": list(entry.shape)})
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8)   # the tensor owns *buf*: no second copy of it
    return raw.to(torch.bool).reshape(shape) if dtype == torch.bool else raw.view(dtype).reshape(shape)


__all__ = ["DEFAULT_PIECE_BYTES", "MAX_MANIFEST_BYTES", "MAX_PIECE_BYTES", "TensorPieces", "WeightManifest",
           "check_against", "holders_key", "join_pieces", "make_manifest", "split_tensor"]
