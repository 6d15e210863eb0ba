"""Tensor codec: a small msgpack header (dtype, shape) plus the raw little-endian bytes.

No pickle: only the dtypes in ``DTYPES`` are accepted, shapes are bounded, and the byte count must
equal ``prod(shape) * itemsize`` exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fusionp2p.errors import LocalProtocolError, RemoteProtocolError
from fusionp2p.wire.check import as_shape
from fusionp2p.wire.limits import DEFAULT_LIMITS, Limits

DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f64": torch.float64,
    "i64": torch.int64,
    "i32": torch.int32,
    "i16": torch.int16,
    "i8": torch.int8,
    "u8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise LocalProtocolError(f"dtype {dtype} cannot be sent on the wire") from None


def tensor_header(t: torch.Tensor) -> dict[str, Any]:
    """The header describing *t* on the wire."""
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}


def encode_tensor(t: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
    """Header and a zero-copy view of the contiguous CPU bytes of *t*. A tensor on another device is
    refused: its copy would block the event loop here, one tensor at a time; ``fusionp2p.device.to_host``
    copies a message's tensors in a worker thread before they are framed."""
    t = t.detach()
    if t.device.type != "cpu":
        raise LocalProtocolError(f"a {t.device} tensor reached the wire encoder: copy it with fusionp2p.device.to_host")
    t = t.contiguous()
    header = tensor_header(t)
    if t.numel() == 0:
        return header, memoryview(b"")
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    arr = raw.reshape(-1).numpy()
    return header, memoryview(arr.data)


def check_header(header: Any, *, limits: Limits = DEFAULT_LIMITS) -> tuple[torch.dtype, tuple[int, ...], int]:
    """Validate a tensor header from a peer; return (dtype, shape, nbytes)."""
    if not isinstance(header, dict):
        raise RemoteProtocolError("tensor header is not a map")
    name = header.get("dtype")
    if not isinstance(name, str) or name not in DTYPES:
        raise RemoteProtocolError(f"tensor dtype {name!r} is not allowed")
    dtype = DTYPES[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    # the extent bound also covers zero-size shapes, which hold no bytes but which torch cannot build
    shape = as_shape(header.get("shape"), "tensor shape", max_dims=limits.max_tensor_dims,
                     max_extent=max(1, limits.max_tensor_bytes // itemsize))
    nbytes = math.prod(shape) * itemsize
    if nbytes > limits.max_tensor_bytes:
        raise RemoteProtocolError(f"tensor of {nbytes} bytes exceeds the limit of {limits.max_tensor_bytes}")
    return dtype, shape, nbytes


def decode_tensor(header: Any, data: bytes | bytearray | memoryview, *, limits: Limits = DEFAULT_LIMITS) -> torch.Tensor:
    """Rebuild a tensor from a peer's header and bytes (copied into fresh, writable memory)."""
    dtype, shape, nbytes = check_header(header, limits=limits)
    if len(data) != nbytes:
        raise RemoteProtocolError(f"tensor needs {nbytes} bytes, got {len(data)}")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if dtype == torch.bool:
        return buf.to(torch.bool).reshape(shape)
    return buf.view(dtype).reshape(shape)
