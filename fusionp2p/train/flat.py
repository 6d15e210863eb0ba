"""A stage's parameters as one flat fp32 vector: the copies and in-place loads CO2 averaging runs on
(whole, a slice ``[lo, hi)``, or a fragment's ranges), whatever device the parameters are on."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from fusionp2p import device as dev


def flatten(params: torch.Tensor | Iterable[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """A NEW flat fp32 copy of *params* (never a view of live memory), in host memory: the averaging
    state lives on the host, where the peers' parts arrive, whatever device the parameters are on.
    Written into *out* (a flat fp32 vector of the right size, e.g. a recycled one) when given."""
    if isinstance(params, torch.Tensor):
        host = dev.to_host([params])[0].reshape(-1)
        return host.to(torch.float32, copy=True) if out is None else out.copy_(host)
    pieces = [p.reshape(-1).to(torch.float32) for p in dev.to_host(list(params))]
    return torch.cat(pieces) if out is None else torch.cat(pieces, out=out)


def load_flat_(params: Iterable[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy the flat vector *flat* into *params* in place (sizes must add up)."""
    off = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[off : off + n].view_as(p))
            off += n
    if off != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} elements, parameters {off}")


def _pieces(params: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [params.reshape(-1)] if isinstance(params, torch.Tensor) else [p.reshape(-1) for p in params]


def read_slice(params: torch.Tensor | Iterable[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """A NEW fp32 copy of the elements ``[lo, hi)`` of the flattened *params*."""
    out = torch.empty(hi - lo, dtype=torch.float32)
    off = 0
    for p in _pieces(params):
        a, b = max(lo, off), min(hi, off + p.numel())
        if a < b:
            out[a - lo:b - lo] = p.detach()[a - off:b - off].to(torch.float32)
        off += p.numel()
    if hi > off:
        raise ValueError(f"slice [{lo}, {hi}) beyond the {off} parameters")
    return out


def load_slice_(params: torch.Tensor | Iterable[torch.Tensor], lo: int, values: torch.Tensor) -> None:
    """Copy *values* into the elements ``[lo, lo + len)`` of the flattened *params*, in place."""
    hi = lo + values.numel()
    off = 0
    with torch.no_grad():
        for p in ([params] if isinstance(params, torch.Tensor) else params):
            n = p.numel()
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                vals = values[a - lo:b - lo].to(p.dtype)
                if p.is_contiguous():
                    p.view(-1)[a - off:b - off] = vals
                else:   # a strided parameter: write through a flat copy
                    tmp = p.detach().reshape(-1).clone()
                    tmp[a - off:b - off] = vals
                    p.copy_(tmp.view_as(p))
            off += n
    if hi > off:
        raise ValueError(f"slice [{lo}, {hi}) beyond the {off} parameters")


def read_ranges(params: torch.Tensor | Iterable[torch.Tensor], ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """A NEW fp32 copy of the flat *ranges* of *params*, concatenated."""
    params = params if isinstance(params, torch.Tensor) else list(params)
    if len(ranges) == 1:
        return read_slice(params, *ranges[0])
    return torch.cat([read_slice(params, lo, hi) for lo, hi in ranges]) if ranges else torch.zeros(0)


def load_anchor_(params: torch.Tensor | Iterable[torch.Tensor], anchor: torch.Tensor,
                 ranges: Sequence[tuple[int, int]] = ()) -> None:
    """Load a :class:`BoundaryResult`'s ``anchor``: into the flat *ranges* (one after the other), or
    the whole vector when *ranges* is empty."""
    params = params if isinstance(params, torch.Tensor) else list(params)
    if not ranges:
        if isinstance(params, torch.Tensor):
            load_slice_(params, 0, anchor)
        else:
            load_flat_(params, anchor)
        return
    off = 0
    for lo, hi in ranges:
        load_slice_(params, lo, anchor[off:off + hi - lo])
        off += hi - lo
    if off != anchor.numel():
        raise ValueError(f"{anchor.numel()} values for ranges of {off} elements")


__all__ = ["flatten", "load_anchor_", "load_flat_", "load_slice_", "read_ranges", "read_slice"]
