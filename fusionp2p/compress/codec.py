"""Tensor codecs: ``encode(x) -> (payload tensors, meta)`` and ``decode(payload, meta) -> x̂``.

Every codec is a frozen config object; ``meta`` is a small msgpack-safe map (str keys; int, float,
bool, str and list values) that always names the codec (``meta["codec"]``), so a receiver can decode
any message with :func:`decode` without knowing the sender's settings. :func:`decode` treats payload
and meta as peer input: any inconsistency (shape, dtype, counts, index range) raises
:class:`~fusionp2p.errors.RemoteProtocolError` before it could crash or allocate without bound.

Codecs here: :class:`IdentityCodec` (``id``), :class:`CastCodec` (``cast``: fp16/bf16 on the wire),
:class:`TopKCodec` (``topk``: global or per-row, exact or fast-approximate selection, dense fallback).
A global top-k message carries the kept values plus either their indices (narrowest integer type) or,
when smaller, a ``⌈n/8⌉``-byte bitmap (meta ``fmt: "bitmap"``; see :func:`uses_bitmap`).
AdaTopK is a :class:`TopKCodec` whose ratio comes from the link (see ``compress.policy``).
:func:`decode` can write into a caller's buffer (``out=``); otherwise dense outputs are numpy
allocations (transparent huge pages: ~4x cheaper to fault in than torch's allocator here).

Legend: n = numel of the dense tensor, k = kept entries, rows × cols = the per-row view (cols = last dim).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import torch

from fusionp2p.compress.select import CHUNK, RAW_NP, from_raw, k_for, raw_numpy, select_topk
from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.wire.check import as_shape
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

    def decode(self, payload: Sequence[torch.Tensor], meta: Mapping[str, Any], *,
               out: torch.Tensor | None = None) -> torch.Tensor: ...


def index_dtype(n: int) -> torch.dtype:
    """The narrowest wire integer type that holds every index in ``[0, n)``."""
    if n <= 1 << 8:
        return torch.uint8
    if n <= 1 << 15:
        return torch.int16
    if n <= 1 << 31:
        return torch.int32
    return torch.int64


def uses_bitmap(k: int, n: int) -> bool:
    """Whether a global top-k message of *k* out of *n* carries a bitmap rather than indices: the
    ``⌈n/8⌉``-byte bitmap is strictly smaller than ``k`` narrowest-type indices (ρ > 1/32 for int32)."""
    return (n + 7) // 8 < k * torch.empty((), dtype=index_dtype(n)).element_size()


def sparse_bytes(k: int, *, n: int, value_itemsize: int) -> int:
    """Payload bytes of a global top-k message: ``k·b_val + min(k·b_idx, ⌈n/8⌉)`` (ALGORITHMS.md §1.6's
    ``k·(b_val + b_idx)`` with the bitmap encoding where that is smaller)."""
    idx_bytes = k * torch.empty((), dtype=index_dtype(n)).element_size()
    return k * value_itemsize + min(idx_bytes, (n + 7) // 8)


# ----------------------------------------------------------------------------------------- validation
def _meta_shape(meta: Mapping[str, Any], limits: Limits) -> tuple[tuple[int, ...], torch.dtype]:
    name = meta.get("dtype")
    if not isinstance(name, str) or name not in DTYPES or DTYPES[name] not in FLOAT_DTYPES:
        raise RemoteProtocolError(f"codec meta: dtype {name!r} is not a float dtype")
    dtype = DTYPES[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    # zero dimensions counted as ones: a zero-size shape with huge other dimensions cannot be built either
    shape = as_shape(meta.get("shape"), "codec meta shape", max_dims=limits.max_tensor_dims,
                     max_extent=max(1, limits.max_tensor_bytes // itemsize))
    return shape, dtype


def _one(payload: Sequence[torch.Tensor], count: int, what: str) -> None:
    if len(payload) != count or not all(isinstance(t, torch.Tensor) for t in payload):
        raise RemoteProtocolError(f"{what}: expected {count} payload tensors, got {len(payload)}")


# ---------------------------------------------------------------------------------------------- codecs
@dataclass(frozen=True, slots=True, kw_only=True)
class IdentityCodec:
    """No compression: the tensor itself (bit-exact)."""

    def encode(self, x: torch.Tensor) -> tuple[Payload, Meta]:
        return (x,), {"codec": "id"}

    def decode(self, payload: Sequence[torch.Tensor], meta: Mapping[str, Any], *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return decode(payload, meta, out=out)


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

    def decode(self, payload: Sequence[torch.Tensor], meta: Mapping[str, Any], *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return decode(payload, meta, out=out)


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
        if self.per_row and x.dim() >= 1:  # per row: always indices
            cols = x.shape[-1]
            k = k_for(self.ratio, cols) * (n // max(cols, 1))
            b_idx = torch.empty((), dtype=index_dtype(cols)).element_size()
            sparse = k * (self._value_itemsize(x) + b_idx)
        else:
            sparse = sparse_bytes(k_for(self.ratio, n), n=n, value_itemsize=self._value_itemsize(x))
        return sparse >= n * x.element_size()

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
        bitmap = uses_bitmap(k, n)
        vals, idx, bits = select_topk(flat, k, approx=self.approx, generator=self._gen, tolerance=self.tolerance,
                                      sample_size=self.sample_size, exact_k=self.exact_k,
                                      index_dtype=None if bitmap else index_dtype(n), bitmap=bitmap)
        where = bits if bitmap else idx
        assert where is not None
        vals = vals.to(vd)
        if vals.nbytes + where.nbytes >= x.nbytes:  # massive ties at the threshold: sparse saves nothing
            return (x,), {"codec": "id"}
        meta.update(k=vals.numel(), row=False)
        if bitmap:
            meta["fmt"] = "bitmap"
        return (vals, where), meta

    def decode(self, payload: Sequence[torch.Tensor], meta: Mapping[str, Any], *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return decode(payload, meta, out=out)


@dataclass(frozen=True, slots=True)
class _TopK:
    """A validated top-k message."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    n: int
    k: int
    row: bool
    bitmap: bool
    vals: torch.Tensor      # (k,) or (rows, k), any float dtype
    where: torch.Tensor     # indices (any wire integer type) or the packed bitmap (uint8)


def _check_topk(payload: Sequence[torch.Tensor], meta: Mapping[str, Any], limits: Limits) -> _TopK:
    """Validate a peer's top-k message completely (before anything of its size is allocated)."""
    shape, dtype = _meta_shape(meta, limits)
    _one(payload, 2, "topk codec")
    vals, where = payload
    k, row, fmt = meta.get("k"), meta.get("row"), meta.get("fmt", "idx")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0 or not isinstance(row, bool):
        raise RemoteProtocolError("topk codec: meta needs int 'k' >= 0 and bool 'row'")
    if fmt not in ("idx", "bitmap"):
        raise RemoteProtocolError(f"topk codec: unknown payload format {fmt!r}")
    bitmap = fmt == "bitmap"
    if vals.dtype not in FLOAT_DTYPES or where.dtype not in ((torch.uint8,) if bitmap else _INDEX_DTYPES):
        raise RemoteProtocolError(f"topk codec: bad payload dtypes {vals.dtype}, {where.dtype}")
    n = math.prod(shape)
    if bitmap:
        if row or k > n or vals.shape != (k,) or where.shape != ((n + 7) // 8,):
            raise RemoteProtocolError("topk codec: bitmap payload does not match k and shape")
        bits = where.detach().contiguous().numpy()
        if n % 8 and bits.size and int(bits[-1]) >> (n % 8):
            raise RemoteProtocolError("topk codec: bitmap padding bits are set")
        if _popcount(bits) != k:
            raise RemoteProtocolError("topk codec: bitmap does not hold k set bits")
        return _TopK(shape, dtype, n, k, False, True, vals, where)
    if row:
        if not shape:
            raise RemoteProtocolError("topk codec: per-row needs at least one dimension")
        cols = shape[-1]
        rows = n // cols if cols else 0
        if k > cols or vals.shape != (rows, k) or where.shape != (rows, k):
            raise RemoteProtocolError("topk codec: per-row payload does not match k and shape")
    elif k > n or vals.shape != (k,) or where.shape != (k,):
        raise RemoteProtocolError("topk codec: payload does not match k and shape")
    width = shape[-1] if row else n
    if where.numel():
        lo, hi = torch.aminmax(where.detach())
        if int(lo) < 0 or int(hi) >= width:
            raise RemoteProtocolError("topk codec: index out of range")
    return _TopK(shape, dtype, n, k, row, False, vals, where)


_POP8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def _popcount(bits: np.ndarray) -> int:
    count = getattr(np, "bitwise_count", None)  # numpy >= 2.0
    per_byte = count(bits) if count is not None else _POP8.take(bits)
    return int(per_byte.sum(dtype=np.int64))


def _out_buffer(shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """The decoded tensor's memory: *out* (checked; not yet zeroed) or a fresh zeroed numpy allocation
    (calloc'd, huge-page backed: far cheaper to fault in than ``torch.zeros`` of the same size)."""
    if out is None:
        fresh = np.zeros(math.prod(shape), dtype=RAW_NP[dtype])
        return from_raw(fresh, dtype).view(shape), True
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError("decode(out=...) needs a contiguous CPU tensor")
    if out.dtype != dtype or tuple(out.shape) != shape:
        raise RemoteProtocolError(f"decoded {dtype} {list(shape)} does not fit the output buffer "
                                  f"{out.dtype} {list(out.shape)}")
    return out, False


def _decode_topk(payload: Sequence[torch.Tensor], meta: Mapping[str, Any], limits: Limits,
                 out: torch.Tensor | None) -> torch.Tensor:
    msg = _check_topk(payload, meta, limits)
    dest, zeroed = _out_buffer(msg.shape, msg.dtype, out)
    vals = msg.vals.detach().to(msg.dtype).contiguous()
    if msg.row:
        if not zeroed:
            dest.zero_()
        if msg.n:
            dest.view(-1, msg.shape[-1]).scatter_(1, msg.where.detach().long(), vals)
        return dest
    dest_raw, vals_raw = raw_numpy(dest.view(-1)), raw_numpy(vals.view(-1))
    if not msg.bitmap:
        if not zeroed:
            dest.zero_()
        dest_raw[msg.where.detach().contiguous().numpy()] = vals_raw
        return dest
    # bitmap: chunk by chunk (unpack, local indices, assign) so the mask never leaves the cache
    bits = msg.where.detach().contiguous().numpy()
    off = 0
    for a in range(0, msg.n, CHUNK):
        b = min(msg.n, a + CHUNK)
        chunk = dest_raw[a:b]
        if not zeroed:
            chunk.fill(0)
        loc = np.flatnonzero(np.unpackbits(bits[a >> 3 : (b + 7) >> 3], count=b - a, bitorder="little").view(np.bool_))
        chunk[loc] = vals_raw[off : off + loc.size]
        off += loc.size
    return dest


def kept_mask(payload: Sequence[torch.Tensor], meta: Mapping[str, Any], *,
              limits: Limits = DEFAULT_LIMITS) -> torch.Tensor | None:
    """Boolean mask (the dense shape) of the entries a top-k message kept; ``None`` when it was not a
    top-k message (dense). RemoteProtocolError on a malformed message, like :func:`decode`."""
    if not isinstance(meta, Mapping) or meta.get("codec") != "topk":
        return None
    msg = _check_topk(payload, meta, limits)
    if msg.bitmap:
        bits = msg.where.detach().contiguous().numpy()
        return torch.from_numpy(np.unpackbits(bits, count=msg.n, bitorder="little").view(np.bool_)).view(msg.shape)
    mask = torch.from_numpy(np.zeros(msg.n, dtype=np.bool_)).view(msg.shape)
    if msg.row:
        if msg.n:
            mask.view(-1, msg.shape[-1]).scatter_(1, msg.where.detach().long(), True)
    else:
        mask.view(-1).numpy()[msg.where.detach().contiguous().numpy()] = True
    return mask


def decode(payload: Sequence[torch.Tensor], meta: Mapping[str, Any], *, limits: Limits = DEFAULT_LIMITS,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode any codec's output from a peer; RemoteProtocolError on anything inconsistent.

    *out*: optional contiguous CPU tensor of the decoded shape and dtype to decode into (a receiver
    that re-uses its input buffers saves the fresh allocation); it is returned. A message whose shape
    or dtype differs from *out* raises RemoteProtocolError. Without *out*, ``id`` returns the payload
    tensor itself and every other codec a fresh tensor.
    """
    if not isinstance(meta, Mapping):
        raise RemoteProtocolError("codec meta is not a map")
    name = meta.get("codec")
    if name == "id":
        _one(payload, 1, "id codec")
        if out is None:
            return payload[0]
        dest, _ = _out_buffer(tuple(payload[0].shape), payload[0].dtype, out)
        return dest.copy_(payload[0])
    if name == "cast":
        _one(payload, 1, "cast codec")
        dn = meta.get("dtype")
        if not isinstance(dn, str) or dn not in DTYPES or DTYPES[dn] not in FLOAT_DTYPES:
            raise RemoteProtocolError(f"cast codec: bad dtype {dn!r}")
        if payload[0].dtype not in FLOAT_DTYPES:
            raise RemoteProtocolError("cast codec: payload is not a float tensor")
        if out is None:
            return payload[0].to(DTYPES[dn])
        dest, _ = _out_buffer(tuple(payload[0].shape), DTYPES[dn], out)
        return dest.copy_(payload[0])
    if name == "topk":
        return _decode_topk(payload, meta, limits, out)
    raise RemoteProtocolError(f"unknown codec {name!r}")
