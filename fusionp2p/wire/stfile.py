"""The safetensors layout, written piece by piece from the tensors themselves (issue 37).

``safetensors.torch.save`` builds the whole file in memory and, on the way, a ``bytes`` copy of every
tensor: a stage state of parameters and Adam's two moments cost three more copies of it at each
checkpoint (the measured part of a node's peak memory over its stage's figure). :func:`layout` computes
the header and the exact size first; :func:`chunks` then yields zero-copy views of each tensor's bytes, so
a writer (``ContentStore.put_chunks``) can hash them and write them to disk while nothing but the
tensors is held. The result is byte for byte what the reference reader (``safetensors.torch.load``)
expects: an 8-byte little-endian header length, the JSON header padded with spaces to a multiple of 8,
then every tensor's raw little-endian bytes in header order. Tensors are laid out by name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

# safetensors' dtype names
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
CHUNK = 8 << 20   # the largest view handed to a writer at once


@dataclass(frozen=True, slots=True)
class Layout:
    """A file's header bytes (length prefix included), its tensors in file order and its total size."""

    head: bytes
    tensors: tuple[torch.Tensor, ...]
    size: int


def layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> Layout:
    """The header and order of a safetensors file of *tensors* (CPU tensors; made contiguous here, which
    copies only a tensor that is not)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    order: list[torch.Tensor] = []
    off = 0
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.device.type != "cpu":
            raise ValueError(f"{name}: a safetensors file is written from CPU tensors, not {t.device}")
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        t = t.contiguous()
        n = math.prod(t.shape) * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        order.append(t)
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = len(raw).to_bytes(8, "little") + raw
    return Layout(head=head, tensors=tuple(order), size=len(head) + off)


def chunks(lay: Layout) -> Iterator[memoryview]:
    """The file's bytes as views: the header, then each tensor's bytes in pieces of at most :data:`CHUNK`."""
    yield memoryview(lay.head)
    for t in lay.tensors:
        if t.numel() == 0:
            continue
        flat = t.reshape(-1)
        raw = memoryview(flat.view(torch.uint8).numpy().data)   # bool and bfloat16 too: same element size
        for i in range(0, len(raw), CHUNK):
            yield raw[i:i + CHUNK]


__all__ = ["CHUNK", "DTYPE_NAMES", "Layout", "chunks", "layout"]
