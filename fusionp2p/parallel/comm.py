"""Process groups of a 4D grid on ``torch.distributed`` and the counted collectives over them.

``ProcessGrid`` creates one process group per (dimension, group) of a
:class:`~fusionp2p.plan.axonn.GridShape` on an initialised default group (gloo on CPU, NCCL on
CUDA; see :mod:`fusionp2p.parallel.rendezvous`). ``Comm`` issues the three collectives the
tensor-parallel layers need over a named dimension, skips groups of one rank (so every term of
the communication model vanishes with its dimension), and records each call as a
:class:`~fusionp2p.plan.axonn.Collective` in an optional :class:`CommCounter`, which the tests
compare with the model's :func:`~fusionp2p.plan.axonn.layer_collectives`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fusionp2p.errors import ConfigError
from fusionp2p.plan.axonn import DIMS, Collective, Dim, GridShape, Op

log = logging.getLogger(__name__)

# torch 2.13 renamed the flat collectives (the old names warn); older releases only have the old ones.
_all_gather_flat: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ProcessGrid:
    """This process's place in a 4D grid and its process groups, one per dimension.

    Every rank of the default group must construct the same grids in the same order (each
    ``dist.new_group`` is itself a collective call). ``shape.world`` must equal the world size.
    """

    def __init__(self, shape: GridShape) -> None:
        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised; call parallel.init_distributed first")
        world, rank = dist.get_world_size(), dist.get_rank()
        if shape.world != world:
            raise ConfigError(f"grid {shape.as_tuple()} needs {shape.world} processes, the world has {world}")
        self.shape = shape
        self.rank = rank
        self.coords = shape.coords(rank)
        self._groups: dict[Dim, Any] = {}
        for dim in DIMS:
            if shape.size(dim) == 1:
                continue
            for members in shape.groups(dim):
                pg = dist.new_group(list(members))
                if rank in members:
                    self._groups[dim] = pg

    def size(self, dim: Dim) -> int:
        return self.shape.size(dim)

    def coord(self, dim: Dim) -> int:
        return self.coords[DIMS.index(dim)]

    def group(self, dim: Dim) -> Any:
        """The process group along ``dim``; ``None`` when the dimension has size 1."""
        return self._groups.get(dim)


class CommCounter:
    """Records every collective issued through a :class:`Comm`, tagged with a label.

    Labels: ``"layer"`` (the collectives of §3.2 inside a tensor-parallel linear), ``"sync"``
    (data-parallel and Z reductions after the backward), ``"layout"`` (conversions between the
    data-parallel layout and the 4D layout around a layer, not part of the model).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, Collective]] = []

    def record(self, label: str, c: Collective) -> None:
        self.calls.append((label, c))

    def collectives(self, *labels: str) -> list[Collective]:
        return [c for lab, c in self.calls if not labels or lab in labels]

    def multiset(self, *labels: str) -> Counter[Collective]:
        return Counter(self.collectives(*labels))

    def clear(self) -> None:
        self.calls.clear()


class Handle:
    """A pending collective; ``wait()`` is idempotent and a no-op for trivial groups."""

    __slots__ = ("_work",)

    def __init__(self, work: Any = None) -> None:
        self._work = work

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


class Comm:
    """Counted collectives over the dimensions of one :class:`ProcessGrid`."""

    def __init__(self, grid: ProcessGrid, counter: CommCounter | None = None) -> None:
        self.grid = grid
        self.counter = counter

    def _count(self, label: str, dim: Dim, op: Op, nbytes: int) -> None:
        if self.counter is not None:
            self.counter.record(label, Collective(dim=dim, op=op, nbytes=nbytes))

    def all_reduce(self, t: torch.Tensor, dim: Dim, *, async_op: bool = False, label: str = "layer") -> Handle:
        """Sum ``t`` in place over ``dim``'s group."""
        if self.grid.size(dim) == 1:
            return Handle()
        self._count(label, dim, "all_reduce", t.numel() * t.element_size())
        return Handle(dist.all_reduce(t, group=self.grid.group(dim), async_op=async_op))

    def all_gather(self, shard: torch.Tensor, dim: Dim, *, async_op: bool = False,
                   label: str = "layer") -> tuple[torch.Tensor, Handle]:
        """Concatenate the flat ``shard`` of every rank of ``dim`` in group order; returns (flat, handle)."""
        g = self.grid.size(dim)
        flat = shard.reshape(-1)
        if g == 1:
            return flat, Handle()
        out = torch.empty(g * flat.numel(), dtype=flat.dtype, device=flat.device)
        self._count(label, dim, "all_gather", out.numel() * out.element_size())
        work = _all_gather_flat(out, flat.contiguous(), group=self.grid.group(dim), async_op=async_op)
        return out, Handle(work)

    def reduce_scatter(self, full: torch.Tensor, dim: Dim, *, async_op: bool = False,
                       label: str = "layer") -> tuple[torch.Tensor, Handle]:
        """Sum the flat ``full`` over ``dim`` and keep this rank's equal piece; returns (piece, handle)."""
        g = self.grid.size(dim)
        flat = full.reshape(-1)
        if g == 1:
            return flat, Handle()
        if flat.numel() % g:
            raise ConfigError(f"reduce_scatter of {flat.numel()} elements over {g} ranks does not divide")
        out = torch.empty(flat.numel() // g, dtype=flat.dtype, device=flat.device)
        self._count(label, dim, "reduce_scatter", flat.numel() * flat.element_size())
        work = _reduce_scatter_flat(out, flat.contiguous(), group=self.grid.group(dim), async_op=async_op)
        return out, Handle(work)

    def all_gather_last(self, t: torch.Tensor, dim: Dim, *, label: str = "layout") -> torch.Tensor:
        """All-gather ``t`` over ``dim`` and concatenate along its last axis (feature gathers)."""
        g = self.grid.size(dim)
        if g == 1:
            return t
        flat, h = self.all_gather(t.contiguous(), dim, label=label)
        h.wait()
        parts = flat.view(g, *t.shape)
        return torch.cat(list(parts.unbind(0)), dim=-1)
