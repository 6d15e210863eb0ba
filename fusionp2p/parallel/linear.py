"""The AxoNN tensor-parallel linear layer, its transposed twin, and the three overlaps (§3.2, §3.3).

Theory of operation. On rank ``(x, y, z, d)`` a *normal* layer ``W ∈ R^{n_out × n_in}`` keeps
piece ``z`` of the flattened block ``W[y-th n_out/G_y rows, x-th n_in/G_x cols]``; its input
``X_loc`` is ``[T, n_in/G_x]`` (slice x, replicated over Y), its output ``[T, n_out/G_y]`` (slice
y, replicated over X). A *transposed* layer swaps X and Y, so normal → transposed chains with no
re-layout. Per step (in_dim/out_dim: the dimensions splitting input/output features)::

    forward:  W_blk = AG_Z(shard);  Y = AR_in(X · W_blkᵀ)  (+ bias slice, sharded over out_dim)
    backward: W_blk = AG_Z(shard);  dX = AR_out(dY · W_blk);  dW = RS_Z(dYᵀ · X)
    after:    AR_data(dW shard); bias grad AR_Z then AR_data      (TensorParallel.sync_gradients)

Overlaps, each switchable in :class:`OverlapConfig`:

* OAR: AR_out(dX) is issued asynchronously and the dW GEMM runs while it is in flight.
* ORS: RS_Z(dW) is issued asynchronously; autograd gets ``None`` for the weight and the pending
  piece is queued; :meth:`TensorParallel.flush` (called when ``optimize_communication`` exits)
  waits and accumulates the queued pieces into ``.grad``.
* OAG: inside ``optimize_communication(model)`` the layers are walked in module order; a layer's
  forward starts the asynchronous AG_Z of the *next* layer before waiting on its own gather.

Contract: enter ``optimize_communication`` after the optimizer step (a prefetch reads the weights
when issued) and run forward and backward inside it. Legend: T tokens on this rank, I/O local
input/output features.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusionp2p.errors import ConfigError
from fusionp2p.parallel.comm import Comm, CommCounter, Handle, ProcessGrid
from fusionp2p.plan.axonn import Dim, LinearSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class OverlapConfig:
    """Which of AxoNN's overlaps are on (all by default)."""

    oar: bool = True    # all-reduce of dX overlapped with the dW GEMM
    ors: bool = True    # asynchronous reduce-scatter of dW, collected at flush()
    oag: bool = True    # one-layer-ahead prefetch of the weight all-gather in forward

    @classmethod
    def off(cls) -> OverlapConfig:
        return cls(oar=False, ors=False, oag=False)


class TensorParallel:
    """The runtime of one process grid: counted collectives and the state of the overlaps.

    ``compute_dtype`` (e.g. ``torch.bfloat16`` on GPUs) is the dtype of the GEMMs and of the
    activation / weight collectives; parameters and their gradients keep their own dtype.
    """

    def __init__(self, grid: ProcessGrid, *, overlap: OverlapConfig | None = None,
                 counter: CommCounter | None = None, compute_dtype: torch.dtype | None = None) -> None:
        self.grid = grid
        self.overlap = overlap if overlap is not None else OverlapConfig()
        self.comm = Comm(grid, counter)
        self.compute_dtype = compute_dtype
        self._pending_rs: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor, Handle]] = []
        self._prefetched: dict[int, tuple[torch.Tensor, Handle]] = {}
        self._next: dict[int, TensorParallelLinear | None] = {}

    # ---- OAG --------------------------------------------------------------------------------
    def _start_gather(self, layer: TensorParallelLinear) -> tuple[torch.Tensor, Handle]:
        shard = layer.weight.detach().to(self.compute_dtype or layer.weight.dtype)
        return self.comm.all_gather(shard, "z", async_op=True)

    def gather_weight(self, layer: TensorParallelLinear, *, forward: bool) -> torch.Tensor:
        """The full block ``[O, I]`` of ``layer`` (from the prefetch cache in an OAG forward)."""
        entry = self._prefetched.pop(id(layer), None) if forward else None
        if forward and self._next:
            nxt = self._next.get(id(layer))
            if nxt is not None and id(nxt) not in self._prefetched:
                self._prefetched[id(nxt)] = self._start_gather(nxt)
        flat, h = entry if entry is not None else self._start_gather(layer)
        h.wait()
        return flat.view(layer.block_shape)

    # ---- ORS --------------------------------------------------------------------------------
    def queue_grad(self, param: nn.Parameter, piece: torch.Tensor, source: torch.Tensor, h: Handle) -> None:
        # ``source`` (the full dW) is kept alive until the asynchronous reduce-scatter is done.
        self._pending_rs.append((param, piece, source, h))

    def flush(self) -> None:
        """Wait for the queued reduce-scatters and accumulate their pieces into ``.grad``."""
        pending, self._pending_rs = self._pending_rs, []
        for param, piece, _src, h in pending:
            h.wait()
            g = piece.to(param.dtype).view_as(param)
            if param.grad is None:
                param.grad = g.clone()
            else:
                param.grad.add_(g)

    @contextmanager
    def optimize_communication(self, model: nn.Module) -> Iterator[None]:
        """Run a training step's forward and backward inside this to enable OAG / collect ORS."""
        layers = [m for m in model.modules() if isinstance(m, TensorParallelLinear) and m.tp is self]
        if self.overlap.oag and layers:
            self._next = {id(a): b for a, b in zip(layers, [*layers[1:], None])}
            self._prefetched[id(layers[0])] = self._start_gather(layers[0])
        try:
            yield
        finally:
            for _buf, h in self._prefetched.values():
                h.wait()
            self._prefetched.clear()
            self._next = {}
            self.flush()

    # ---- after the backward -----------------------------------------------------------------
    def sync_gradients(self, model: nn.Module) -> None:
        """Reduce gradients after the backward (sum convention: local losses are pre-scaled).

        Tensor-parallel weight shards: AR over data. Their biases (replicated over the input
        split and Z): AR over Z then data. Every other parameter (replicated over X, Y, Z): one
        flat bucket all-reduced over Z then data. A missing gradient counts as zero, so that all
        ranks issue the same collectives.
        """
        self.flush()
        tp_params: set[int] = set()
        for m in model.modules():
            if isinstance(m, TensorParallelLinear) and m.tp is self:
                self.comm.all_reduce(_grad_of(m.weight), "data", label="sync")
                tp_params.add(id(m.weight))
                if m.bias is not None:
                    self.comm.all_reduce(_grad_of(m.bias), "z", label="sync")
                    self.comm.all_reduce(_grad_of(m.bias), "data", label="sync")
                    tp_params.add(id(m.bias))
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in tp_params]
        if rest and (self.grid.size("z") > 1 or self.grid.size("data") > 1):
            bucket = torch.cat([_grad_of(p).reshape(-1) for p in rest])
            self.comm.all_reduce(bucket, "z", label="sync")
            self.comm.all_reduce(bucket, "data", label="sync")
            off = 0
            for p in rest:
                n = p.numel()
                _grad_of(p).copy_(bucket[off:off + n].view_as(p))
                off += n


def _grad_of(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


class _TPLinearFn(torch.autograd.Function):
    """``Y_loc = AR_in(X_loc · AG_Z(W_shard)ᵀ)`` with the backward of §3.2."""

    @staticmethod
    def forward(ctx: Any, x_TI: torch.Tensor, w_shard: torch.Tensor, layer: TensorParallelLinear) -> torch.Tensor:
        tp = layer.tp
        cd = tp.compute_dtype or x_TI.dtype
        w_OI = tp.gather_weight(layer, forward=True)
        x_c = x_TI.to(cd)
        y_TO = x_c @ w_OI.t()
        tp.comm.all_reduce(y_TO, layer.spec.in_dim).wait()
        ctx.save_for_backward(x_c)
        ctx.layer = layer
        ctx.in_dtype = x_TI.dtype
        return y_TO

    @staticmethod
    def backward(ctx: Any, dy_TO: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        (x_TI,) = ctx.saved_tensors
        layer: TensorParallelLinear = ctx.layer
        tp, ov = layer.tp, layer.tp.overlap
        w_OI = tp.gather_weight(layer, forward=False)
        dy = dy_TO.to(w_OI.dtype).contiguous()
        dx_TI = dy @ w_OI
        h = tp.comm.all_reduce(dx_TI, layer.spec.out_dim, async_op=ov.oar)
        dw_OI = dy.t() @ x_TI          # OAR: this GEMM runs while the all-reduce is in flight
        h.wait()
        piece, hrs = tp.comm.reduce_scatter(dw_OI, "z", async_op=ov.ors)
        if ov.ors:
            tp.queue_grad(layer.weight, piece, dw_OI, hrs)
            return dx_TI.to(ctx.in_dtype), None, None
        hrs.wait()
        return dx_TI.to(ctx.in_dtype), piece.to(layer.weight.dtype), None


class TensorParallelLinear(nn.Module):
    """A linear layer sharded over a 4D grid; ``transposed=True`` gives the twin with X and Y swapped.

    ``forward(x[..., n_in/G_in]) -> [..., n_out/G_out]`` in the layouts of the module docstring.
    ``weight`` is this rank's flat shard of the block; ``bias`` (optional) its output slice.
    """

    def __init__(self, tp: TensorParallel, in_features: int, out_features: int, *, bias: bool = True,
                 transposed: bool = False, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.spec = LinearSpec(n_in=in_features, n_out=out_features, transposed=transposed, bias=bias)
        shape = tp.grid.shape
        if not self.spec.fits(shape):
            raise ConfigError(f"linear {in_features}->{out_features} (transposed={transposed}) does not split "
                              f"over grid {shape.as_tuple()}: features must divide G_x/G_y and the block G_z")
        g_in, g_out = shape.size(self.spec.in_dim), shape.size(self.spec.out_dim)
        self.block_shape = (out_features // g_out, in_features // g_in)
        n_shard = self.block_shape[0] * self.block_shape[1] // shape.g_z
        self.weight = nn.Parameter(torch.empty(n_shard, dtype=dtype, device=device))
        self.bias = (nn.Parameter(torch.zeros(self.block_shape[0], dtype=dtype, device=device))
                     if bias else None)

    @property
    def in_dim(self) -> Dim:
        return self.spec.in_dim

    @property
    def out_dim(self) -> Dim:
        return self.spec.out_dim

    @torch.no_grad()
    def load_full(self, weight_OI: torch.Tensor, bias_O: torch.Tensor | None = None) -> None:
        """Take this rank's shard of a full ``[n_out, n_in]`` weight (and its bias slice)."""
        if tuple(weight_OI.shape) != (self.spec.n_out, self.spec.n_in):
            raise ConfigError(f"weight of shape {tuple(weight_OI.shape)}, expected {(self.spec.n_out, self.spec.n_in)}")
        grid = self.tp.grid
        o, i = self.block_shape
        yo, xi = grid.coord(self.out_dim), grid.coord(self.in_dim)
        blk = weight_OI[yo * o:(yo + 1) * o, xi * i:(xi + 1) * i].reshape(-1)
        n = self.weight.numel()
        z = grid.coord("z")
        self.weight.copy_(blk[z * n:(z + 1) * n])
        if self.bias is not None:
            if bias_O is None:
                raise ConfigError("layer has a bias; pass bias_O")
            self.bias.copy_(bias_O[yo * o:(yo + 1) * o])

    @classmethod
    def from_linear(cls, tp: TensorParallel, linear: nn.Linear, *, transposed: bool = False) -> TensorParallelLinear:
        """A parallel copy of ``linear`` (same values, sharded for this rank)."""
        w = linear.weight
        layer = cls(tp, linear.in_features, linear.out_features, bias=linear.bias is not None,
                    transposed=transposed, dtype=w.dtype, device=w.device)
        layer.load_full(w.detach(), None if linear.bias is None else linear.bias.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y: torch.Tensor = _TPLinearFn.apply(x.reshape(-1, x.shape[-1]), self.weight, self)  # type: ignore[no-untyped-call]
        y = y.view(*lead, y.shape[-1])
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype) if self.tp.compute_dtype is not None else y

    def extra_repr(self) -> str:
        s = self.spec
        return f"in={s.n_in}, out={s.n_out}, transposed={s.transposed}, bias={s.bias}, block={self.block_shape}"
