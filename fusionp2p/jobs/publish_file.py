"""Publishing weights larger than the publisher's memory: the model on ``meta``, its tensors from a file (issue 37).

Theory of operation. ``build_job`` needs the model only for its structure (the trace) and its
tensors only as bytes to cut into content-addressed pieces (``wire/pieces.py``). With a safetensors
file beside a model whose parameters are on the ``meta`` device (:func:`empty_parameters`, or
``accelerate.init_empty_weights``), :func:`file_manifest` makes the same manifest from the file:

* the file's header is read and checked (offsets inside the file, each tensor's size equal to its
  dtype and shape), and each DAG tensor is found in it under its DAG name or one of the module's
  ``state_dict`` names for it (a tied weight saved once under either name);
* each tensor's raw bytes are hashed a piece at a time with ``os.pread`` into one reused buffer (not a
  memory map: its touched pages would count in the publisher's resident set), and every piece is
  named by a :class:`~fusionp2p.data.file_shards.FileRange` of the user's file, which the publisher's
  content store serves part by part. The publisher never holds a whole tensor, let alone the state dict.

The pieces are byte for byte those ``make_manifest`` cuts from a module holding the same values (a
safetensors file stores each tensor's little-endian bytes contiguously, in C order), so a node cannot
tell the two paths apart. A tensor the file lacks (a non-persistent buffer such as Llama's rotary
``inv_freq``) comes from the model, which must hold it as a real tensor; a ``meta`` one is refused
with what to do. A file rewritten after publishing serves bytes that no longer match their hashes:
every node refuses them and counts the publisher against.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusionp2p.data.file_shards import FileRange, _Fd
from fusionp2p.errors import ConfigError
from fusionp2p.graph import OpDAG
from fusionp2p.wire.pieces import MAX_PIECE_BYTES, MIN_PIECE_BYTES, TensorPieces, WeightManifest, split_tensor
from fusionp2p.wire.stfile import DTYPE_NAMES
from fusionp2p.wire.tensor import dtype_name

MAX_HEADER_BYTES = 100 << 20   # safetensors' own bound on a header
_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class FileTensor:
    """One tensor of a safetensors file: its declaration and where its bytes lie in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int      # from the start of the file
    nbytes: int


def read_index(path: str | os.PathLike[str]) -> dict[str, FileTensor]:
    """The tensors of the safetensors file *path* (its header only; ConfigError on a file that is not one)."""
    p = Path(path)
    size = p.stat().st_size
    with p.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ConfigError(f"{p} is not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ConfigError(f"{p} is not a safetensors file (a header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ConfigError(f"{p} is not a safetensors file (its header is not JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise ConfigError(f"{p} is not a safetensors file (its header is not a map)")
    out: dict[str, FileTensor] = {}
    base = 8 + n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _BY_NAME[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{p}: tensor {name[:80]!r} has a header entry this reader does not take "
                              f"({entry!r:.120}): save it with safetensors.torch.save_file") from exc
        nbytes = math.prod(shape) * (torch.empty((), dtype=dtype).element_size())
        if min(shape, default=0) < 0 or not 0 <= start <= end or end - start != nbytes or base + end > size:
            raise ConfigError(f"{p}: tensor {name[:80]!r} lies outside the file or has the wrong size")
        out[name] = FileTensor(dtype=dtype, shape=shape, offset=base + start, nbytes=nbytes)
    return out


def _hash_range(fd: int, offset: int, n: int, buf: bytearray) -> str:
    """sha256 of bytes ``[offset, offset + n)`` of *fd*, read into *buf* (reused) a part at a time."""
    h = hashlib.sha256()
    view = memoryview(buf)
    pos = 0
    while pos < n:
        got = os.preadv(fd, [view[:min(len(buf), n - pos)]], offset + pos)
        if got <= 0:
            raise ConfigError("the weights file shrank while it was read: publish it when it is no longer written")
        h.update(view[:got])
        pos += got
    return h.hexdigest()


def file_manifest(dag: OpDAG, path: str | os.PathLike[str], piece_bytes: int
                  ) -> tuple[WeightManifest, dict[str, bytes | memoryview | FileRange]]:
    """The weight manifest of *dag*'s tensors with their values from the safetensors file *path*, and every
    distinct piece as a range of that file (see the module docstring). ConfigError when the file lacks a
    tensor the model holds on ``meta`` or holds one of another dtype or shape."""
    if not MIN_PIECE_BYTES <= piece_bytes <= MAX_PIECE_BYTES:
        raise ConfigError(f"piece_bytes must be in [{MIN_PIECE_BYTES}, {MAX_PIECE_BYTES}], not {piece_bytes}")
    index = read_index(path)
    fd = _Fd(os.open(path, os.O_RDONLY))
    buf = bytearray(min(piece_bytes, 1 << 20))   # what the publisher holds of the file at once
    entries: list[TensorPieces] = []
    blobs: dict[str, bytes | memoryview | FileRange] = {}
    missing: list[str] = []
    for name, t in dag.tensors.items():
        key = next((k for k in (name, *dag.module_names.get(name, ())) if k in index), None)
        hashes: list[str] = []
        if key is None:
            if t.device.type == "meta":
                missing.append(name)
                continue
            for view in split_tensor(t, piece_bytes):   # a real tensor of the model (a non-persistent buffer)
                h = hashlib.sha256(view).hexdigest()
                blobs.setdefault(h, bytes(view))
                hashes.append(h)
        else:
            ft = index[key]
            if ft.dtype != t.dtype or ft.shape != tuple(t.shape):
                raise ConfigError(f"{key} is {ft.dtype} {list(ft.shape)} in {path} but {t.dtype} {list(t.shape)} in "
                                  "the model: build the model with the file's configuration and dtype")
            for off in range(0, ft.nbytes, piece_bytes):
                n = min(piece_bytes, ft.nbytes - off)
                h = _hash_range(fd.fd, ft.offset + off, n, buf)
                blobs.setdefault(h, FileRange(fd, ft.offset + off, n))
                hashes.append(h)
        entries.append(TensorPieces(name=name, dtype=dtype_name(t.dtype), shape=tuple(int(d) for d in t.shape),
                                    pieces=tuple(hashes)))
    if missing:
        raise ConfigError(f"{path} lacks {len(missing)} tensors the model holds on the meta device ({missing[:3]}): "
                          "publish the file the model's state_dict was saved to, and keep buffers that no file "
                          "holds real (build the model under fusionp2p.empty_parameters())")
    return WeightManifest(piece_bytes=piece_bytes, tensors=tuple(entries)), blobs


@contextlib.contextmanager
def stand_ins(model: nn.Module) -> Iterator[set[int]]:
    """*model*'s ``meta`` parameters and buffers replaced, while the block runs, by uninitialised CPU tensors of their
    dtypes and shapes (``torch.empty``: pages never written, so never resident), tied ones by one tensor;
    yields the stand-ins' data pointers. The trace then records exactly the graph of a model on the CPU
    (traced on ``meta`` it differs: ``aten.arange(device=meta)``, device copies of the inputs) and counts
    the same FLOPs (its one run reads the stand-ins: their values do not matter, and a page never
    written reads as the shared zero page)."""
    made: dict[int, torch.Tensor] = {}
    undo: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for mod in model.modules():   # buffers too: a model built under torch.device("meta") has meta buffers
        tables: tuple[dict[str, Any], ...] = (mod._parameters, mod._buffers)
        for table in tables:
            for name, t in list(table.items()):
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in made:
                    new = torch.empty(t.shape, dtype=t.dtype)
                    made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
                table[name] = made[id(t)]
                undo.append((table, name, t))
    try:
        yield {t.data_ptr() for t in made.values() if t.numel()}
    finally:
        for table, name, t in undo:
            table[name] = t


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Build a model with its parameters on the ``meta`` device and its buffers real: a model of any size
    in almost no memory, to publish with its weights from a file (``Swarm.publish(..., weights=path)``).
    Buffers stay real because no ``state_dict`` file holds a non-persistent one (Llama's rotary
    ``inv_freq``): it is computed at construction. Tied weights stay tied (a parameter already on
    ``meta`` is registered as it is)."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


__all__ = ["FileTensor", "empty_parameters", "file_manifest", "read_index", "stand_ins"]
