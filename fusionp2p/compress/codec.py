"""Tensor codecs: ``encode(x) -> (payload tensors, meta)`` and ``decode(payload, meta) -> x̂``.

Every codec is a frozen config object; ``meta`` is a small msgpack-safe map (str keys; int, float,
bool, str and list values) that always names the codec (``meta["codec"]``), so a receiver can decode
any message with :func:`decode` without knowing the sender's settings. :func:`decode` treats payload
and meta as peer input: any inconsistency (shape, dtype, counts, index range) raises
:class:`~fusionp2p.errors.RemoteProtocolError` before it could crash or allocate without bound.

Codecs here: :class:`IdentityCodec` (``id``), :class:`CastCodec` (``cast``: fp16/bf16 on the wire),
:class:`TopKCodec` (``topk``: global or per-row, exact or fast-approximate selection, dense fallback).
AdaTopK is a :class:`TopKCodec` whose ratio comes from the link (see ``compress.policy``).

Legend: n = numel of the dense tensor, k = kept entries, rows × cols = the per-row view (cols = last dim).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from fusionp2p.compress.select import approx_topk_indices, exact_topk_indices, k_for
from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.wire.limits import DEFAULT_LIMITS, Limits
from fusionp2p.wire.tensor import DTYPES, dtype_name

Payload = tuple[torch.Tensor, ...]
Meta = dict[str, Any]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_VALUE_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
_INDEX_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


class Codec(Protocol):
    """The one codec interface."""

    def encode(self, x: torch.Tensor) -> tuple[Payload, Meta]: ...

    def decode(self, payload: Sequence[torch.Tensor], meta: Mapping[str, Any]) -> torch.Tensor: ...


def index_dtype(n: int) -> torch.dtype:
    """The narrowest wire integer type that holds every index in ``[0, n)``."""
    if n <= 1 << 8:
        return torch.uint8
    if n <= 1 << 15:
        return torch.int16
    if n <= 1 << 31:
        return torch.int32
    return torch.int64


def sparse_bytes(k: int, *, n: int, value_itemsize: int) -> int:
    """Payload bytes of a global top-k message: ``k·(b_val + b_idx)`` (ALGORITHMS.md §1.6)."""
    return k * (value_itemsize + torch.empty((), dtype=index_dtype(n)).element_size())


# ----------------------------------------------------------------------------------------- validation
def _meta_shape(meta: Mapping[str, Any], limits: Limits) -> tuple[tuple[int, ...], torch.dtype]:
    shape = meta.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > limits.max_tensor_dims
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)
    ):
        raise RemoteProtocolError(f"codec meta: invalid shape {shape!r}")
    name = meta.get("dtype")
    if not isinstance(name, str) or name not in DTYPES or DTYPES[name] not in FLOAT_DTYPES:
        raise RemoteProtocolError(f"codec meta: dtype {name!r} is not a float dtype")
    dtype = DTYPES[name]
    if math.prod(shape) * torch.empty((), dtype=dtype).element_size() > limits.max_tensor_bytes:
        raise RemoteProtocolError("codec meta: dense tensor exceeds the size limit")
    return tuple(shape), dtype


def _one(payload: Sequence[torch.Tensor], count: int, what: str) -> None:
    if len(payload) != count or not all(isinstance(t, torch.Tensor) for t in payload):
        raise RemoteProtocolError(f"{what}: expected {count} payload tensors, got {len(payload)}")


# ---------------------------------------------------------------------------------------------- codecs
@dataclass(frozen=True, slots=True, kw_only=True)
class IdentityCodec:
    """No compression: the tensor itself (bit-exact)."""

    def encode(self, x: torch.Tensor) -> tuple[Payload, Meta]:
        return (x,), {"codec": "id"}

    def decode(self, payload: Sequence[torch.Tensor], meta: Mapping[str, Any]) -> torch.Tensor:
        _one(payload, 1, "id codec")
        return payload[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class CastCodec:
    """Send float tensors as fp16 or bf16; decode casts back to the original dtype."""

    wire_dtype: Literal["f16", "bf16"] = "bf16"

    def __post_init__(self) -> None:
        if self.wire_dtype not in _VALUE_DTYPES:
            raise ConfigError("CastCodec.wire_dtype must be 'f16' or 'bf16'")

    def encode(self, x: torch.Tensor) -> tuple[Payload, Meta]:
        if x.dtype not in FLOAT_DTYPES:
            raise ConfigError(f"CastCodec needs a float tensor, got {x.dtype}")
        return (x.detach().to(_VALUE_DTYPES[self.wire_dtype]),), {"codec": "cast", "dtype": dtype_name(x.dtype)}

    def decode(self, payload: Sequence[torch.Tensor], meta: Mapping[str, Any]) -> torch.Tensor:
        return decode(payload, meta)


@dataclass(frozen=True, slots=True, kw_only=True)
class TopKCodec:
    """Keep the ``k = ⌈ratio·n⌉`` largest-magnitude entries (per row: ``⌈ratio·cols⌉`` of each row).

    * ``ratio >= 1.0`` (or a sparse payload no smaller than the dense one) sends the tensor dense and
      unchanged, so ratio 1.0 is bit-exact identity.
    * ``approx=True`` uses the fast sampled-threshold selection (global mode only; see
      ``compress.select`` for its bound: the kept set is an exact top-k' with k <= k' <= ⌈(1+tol)k⌉).
    * ``value_dtype`` sends the kept values as fp16/bf16 (``None``: the tensor's own dtype).
    """

    ratio: float
    per_row: bool = False
    approx: bool = False
    tolerance: float = 0.05
    exact_k: bool = False
    value_dtype: Literal["f16", "bf16"] | None = None
    sample_size: int = 1 << 18
    seed: int = 0
    _gen: torch.Generator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.ratio, int | float) and 0.0 < self.ratio <= 1.0):
            raise ConfigError(f"TopKCodec.ratio must be in (0, 1], got {self.ratio!r}")
        if not 0.0 <= self.tolerance <= 1.0:
            raise ConfigError("TopKCodec.tolerance must be in [0, 1]")
        if self.sample_size < 16:
            raise ConfigError("TopKCodec.sample_size must be at least 16")
        if self.value_dtype is not None and self.value_dtype not in _VALUE_DTYPES:
            raise ConfigError("TopKCodec.value_dtype must be None, 'f16' or 'bf16'")
        # the sampling RNG is injected through the seed (STYLE.md 9); per-instance, so runs are reproducible
        object.__setattr__(self, "_gen", torch.Generator().manual_seed(self.seed))

    def with_ratio(self, ratio: float) -> TopKCodec:
        """The same codec for another link ratio."""
        return TopKCodec(ratio=ratio, per_row=self.per_row, approx=self.approx, tolerance=self.tolerance,
                         exact_k=self.exact_k, value_dtype=self.value_dtype, sample_size=self.sample_size,
                         seed=self.seed)

    def _value_itemsize(self, x: torch.Tensor) -> int:
        vd = _VALUE_DTYPES[self.value_dtype] if self.value_dtype else x.dtype
        return torch.empty((), dtype=vd).element_size()

    def is_dense(self, x: torch.Tensor) -> bool:
        """True when this tensor would be sent dense (ratio 1.0, or sparse saves no bytes)."""
        n = x.numel()
        if self.ratio >= 1.0 or n == 0:
            return True
        if self.per_row and x.dim() >= 1:
            cols = x.shape[-1]
            k = k_for(self.ratio, cols) * (n // max(cols, 1))
            width = cols
        else:
            k, width = k_for(self.ratio, n), n
        return sparse_bytes(k, n=width, value_itemsize=self._value_itemsize(x)) >= n * x.element_size()

    def encode(self, x: torch.Tensor) -> tuple[Payload, Meta]:
        if x.dtype not in FLOAT_DTYPES:
            raise ConfigError(f"TopKCodec needs a float tensor, got {x.dtype}")
        x = x.detach()
        if self.is_dense(x):
            return (x,), {"codec": "id"}
        meta: Meta = {"codec": "topk", "shape": list(x.shape), "dtype": dtype_name(x.dtype)}
        vd = _VALUE_DTYPES[self.value_dtype] if self.value_dtype else x.dtype
        if self.per_row and x.dim() >= 1:
            cols = x.shape[-1]
            x_RC = x.reshape(-1, cols)
            k = k_for(self.ratio, cols)
            idx_RK = torch.topk(x_RC.abs(), k, dim=1, sorted=False).indices
            vals_RK = torch.gather(x_RC, 1, idx_RK)
            meta.update(k=k, row=True)
            return (vals_RK.to(vd).contiguous(), idx_RK.to(index_dtype(cols))), meta
        flat = x.reshape(-1)
        n = flat.numel()
        k = k_for(self.ratio, n)
        if self.approx:
            idx = approx_topk_indices(flat, k, generator=self._gen, tolerance=self.tolerance,
                                       sample_size=self.sample_size, exact_k=self.exact_k)
        else:
            idx = exact_topk_indices(flat.abs(), k)
        vals = flat.index_select(0, idx)
        meta.update(k=idx.numel(), row=False)
        return (vals.to(vd), idx.to(index_dtype(n))), meta

    def decode(self, payload: Sequence[torch.Tensor], meta: Mapping[str, Any]) -> torch.Tensor:
        return decode(payload, meta)


def _decode_topk(payload: Sequence[torch.Tensor], meta: Mapping[str, Any], limits: Limits) -> torch.Tensor:
    shape, dtype = _meta_shape(meta, limits)
    _one(payload, 2, "topk codec")
    vals, idx = payload
    k, row = meta.get("k"), meta.get("row")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0 or not isinstance(row, bool):
        raise RemoteProtocolError("topk codec: meta needs int 'k' >= 0 and bool 'row'")
    if vals.dtype not in FLOAT_DTYPES or idx.dtype not in _INDEX_DTYPES:
        raise RemoteProtocolError(f"topk codec: bad payload dtypes {vals.dtype}, {idx.dtype}")
    n = math.prod(shape)
    if row:
        if not shape:
            raise RemoteProtocolError("topk codec: per-row needs at least one dimension")
        cols = shape[-1]
        rows = n // cols if cols else 0
        if k > cols or vals.shape != (rows, k) or idx.shape != (rows, k):
            raise RemoteProtocolError("topk codec: per-row payload does not match k and shape")
    elif k > n or vals.shape != (k,) or idx.shape != (k,):
        raise RemoteProtocolError("topk codec: payload does not match k and shape")
    width = shape[-1] if row else n
    idx64 = idx.long()
    if idx64.numel() and (int(idx64.min()) < 0 or int(idx64.max()) >= width):
        raise RemoteProtocolError("topk codec: index out of range")
    out = torch.zeros(shape, dtype=dtype)
    if row:
        out.view(-1, shape[-1]).scatter_(1, idx64, vals.to(dtype))
    else:
        out.view(-1).scatter_(0, idx64, vals.to(dtype))
    return out


def decode(payload: Sequence[torch.Tensor], meta: Mapping[str, Any], *, limits: Limits = DEFAULT_LIMITS) -> torch.Tensor:
    """Decode any codec's output from a peer; RemoteProtocolError on anything inconsistent."""
    if not isinstance(meta, Mapping):
        raise RemoteProtocolError("codec meta is not a map")
    name = meta.get("codec")
    if name == "id":
        _one(payload, 1, "id codec")
        return payload[0]
    if name == "cast":
        _one(payload, 1, "cast codec")
        dn = meta.get("dtype")
        if not isinstance(dn, str) or dn not in DTYPES or DTYPES[dn] not in FLOAT_DTYPES:
            raise RemoteProtocolError(f"cast codec: bad dtype {dn!r}")
        if payload[0].dtype not in FLOAT_DTYPES:
            raise RemoteProtocolError("cast codec: payload is not a float tensor")
        return payload[0].to(DTYPES[dn])
    if name == "topk":
        return _decode_topk(payload, meta, limits)
    raise RemoteProtocolError(f"unknown codec {name!r}")
