"""Applying tensor parallelism to plain modules: layout helpers, a parallel MLP, a GPT-2 block.

Two ways to run a linear layer on the grid (§3.2):

* *Expert* chains: a normal layer followed by its transposed twin (an MLP) consume and produce
  the 4D layout directly; only the ends convert (:class:`ParallelMLP`).
* *Non-expert* wrapping (:class:`ParallelLinearIO`): the surrounding code is data parallel (full
  features, the tokens of this rank's (z, d) batch piece, replicated over X and Y); the wrapper
  slices the input features for the layer and all-gathers its output features. Used for the
  attention projections of a GPT-2 block, whose attention needs whole rows.

Feature conversions are autograd-aware: slicing backward is an all-gather over the same
dimension, gathering backward is slicing (the gradient is replicated across that group). They
are counted under the ``"layout"`` label, outside the model's volumes.

Tokens: the batch is cut along dim 0 into ``G_data·G_z`` pieces; rank (z, d) takes piece
``d·G_z + z`` (:func:`shard_batch`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fusionp2p.errors import ConfigError
from fusionp2p.parallel.linear import TensorParallel, TensorParallelLinear
from fusionp2p.plan.axonn import Dim

log = logging.getLogger(__name__)


def _slice_last(t: torch.Tensor, tp: TensorParallel, dim: Dim) -> torch.Tensor:
    g, c = tp.grid.size(dim), tp.grid.coord(dim)
    n = t.shape[-1]
    if n % g:
        raise ConfigError(f"{n} features do not split over {g} ranks of {dim}")
    return t[..., c * (n // g):(c + 1) * (n // g)]


class _ScatterFeatures(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel, dim: Dim) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return _slice_last(x, tp, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.tp.comm.all_gather_last(g.contiguous(), ctx.dim), None, None


class _GatherFeatures(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel, dim: Dim) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return tp.comm.all_gather_last(x.contiguous(), dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _slice_last(g, ctx.tp, ctx.dim).contiguous(), None, None


def scatter_features(x: torch.Tensor, tp: TensorParallel, dim: Dim) -> torch.Tensor:
    """This rank's slice of the last axis over ``dim`` (backward: all-gather over ``dim``)."""
    out: torch.Tensor = _ScatterFeatures.apply(x, tp, dim)  # type: ignore[no-untyped-call]
    return out


def gather_features(x: torch.Tensor, tp: TensorParallel, dim: Dim) -> torch.Tensor:
    """All-gather the last axis over ``dim`` (backward: keep this rank's slice)."""
    out: torch.Tensor = _GatherFeatures.apply(x, tp, dim)  # type: ignore[no-untyped-call]
    return out


def shard_batch(t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's piece (``d·G_z + z``) of a full batch along dim 0 (plain, differentiable slicing)."""
    shape = tp.grid.shape
    k = shape.batch_split
    if t.shape[0] % k:
        raise ConfigError(f"batch of {t.shape[0]} does not split over G_data·G_z = {k}")
    i = tp.grid.coord("data") * shape.g_z + tp.grid.coord("z")
    n = t.shape[0] // k
    return t[i * n:(i + 1) * n]


def gather_batch(t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Inverse of :func:`shard_batch` (no autograd): the full batch on every rank."""
    shape = tp.grid.shape
    if shape.batch_split == 1:
        return t
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, t.contiguous())
    order = [shape.rank(0, 0, i % shape.g_z, i // shape.g_z) for i in range(shape.batch_split)]
    return torch.cat([pieces[r] for r in order], dim=0)


def shard_input(x_full: torch.Tensor, tp: TensorParallel, *, transposed: bool = False) -> torch.Tensor:
    """The 4D input layout of a normal (or transposed) layer from a full ``[B, ..., n_in]`` batch."""
    return _slice_last(shard_batch(x_full, tp), tp, "y" if transposed else "x")


def gather_output(y_loc: torch.Tensor, tp: TensorParallel, *, transposed: bool = False) -> torch.Tensor:
    """Full output features of a normal (or transposed) layer, this rank's tokens (autograd-aware)."""
    return gather_features(y_loc, tp, "x" if transposed else "y")


@torch.no_grad()
def gather_full_weight(layer: TensorParallelLinear, *, grad: bool = False) -> torch.Tensor:
    """The full ``[n_out, n_in]`` weight (or its gradient) reassembled on every rank (tests, checkpoints)."""
    tp, spec = layer.tp, layer.spec
    src = layer.weight.grad if grad else layer.weight
    if src is None:
        raise ConfigError("the layer has no gradient yet")
    blk, h = tp.comm.all_gather(src.detach(), "z", label="layout")
    h.wait()
    blk = blk.view(layer.block_shape)
    rows = tp.comm.all_gather_last(blk.t().contiguous(), spec.out_dim).t()   # gather output rows
    return tp.comm.all_gather_last(rows.contiguous(), spec.in_dim)


class ParallelLinearIO(nn.Module):
    """A tensor-parallel linear with data-parallel input and output (full features, local tokens)."""

    def __init__(self, layer: TensorParallelLinear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.layer.tp
        y = self.layer(scatter_features(x, tp, self.layer.in_dim))
        return gather_features(y, tp, self.layer.out_dim)


class ParallelMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with fc1 normal and fc2 transposed, chained in the 4D layout."""

    def __init__(self, fc1: TensorParallelLinear, fc2: TensorParallelLinear,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        if fc1.spec.transposed or not fc2.spec.transposed:
            raise ConfigError("ParallelMLP needs a normal fc1 and a transposed fc2")
        self.fc1, self.fc2, self.act = fc1, fc2, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: full features of this rank's tokens; returns the same layout."""
        tp = self.fc1.tp
        h = self.act(self.fc1(scatter_features(x, tp, "x")))
        return gather_features(self.fc2(h), tp, "x")


def _gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    return F.gelu(t, approximate="tanh")


def parallelize_linears(module: nn.Module, tp: TensorParallel) -> nn.Module:
    """Replace every ``nn.Linear`` under ``module`` by a :class:`ParallelLinearIO`, in place.

    Layers alternate normal / transposed in module order, so that weights of successive layers
    are laid out as AxoNN lays them (and the communication pattern alternates X and Y).
    """
    targets = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    for i, (name, lin) in enumerate(targets):
        assert isinstance(lin, nn.Linear)
        _set(module, name, ParallelLinearIO(TensorParallelLinear.from_linear(tp, lin, transposed=i % 2 == 1)))
    return module


def parallelize_gpt2_block(block: nn.Module, tp: TensorParallel) -> nn.Module:
    """Split a GPT-2 ``Block`` (``fusionp2p.models.gpt2``) over the grid, in place.

    The MLP becomes a chained :class:`ParallelMLP` (``c_fc`` normal, ``c_proj`` transposed,
    tanh-GELU between); the attention projections become :class:`ParallelLinearIO` (``c_attn``
    normal, ``c_proj`` transposed). Layer norms stay replicated; their gradients are reduced by
    :meth:`TensorParallel.sync_gradients`. Input and output: full features of this rank's batch piece.
    """
    mlp, attn = getattr(block, "mlp", None), getattr(block, "attn", None)
    if mlp is None or attn is None or not all(hasattr(m, a) for m, a in
                                              ((mlp, "c_fc"), (mlp, "c_proj"), (attn, "c_attn"), (attn, "c_proj"))):
        raise ConfigError("not a GPT-2 block: expected .attn.{c_attn,c_proj} and .mlp.{c_fc,c_proj}")
    attn.c_attn = ParallelLinearIO(TensorParallelLinear.from_linear(tp, attn.c_attn))
    attn.c_proj = ParallelLinearIO(TensorParallelLinear.from_linear(tp, attn.c_proj, transposed=True))
    block.mlp = ParallelMLP(TensorParallelLinear.from_linear(tp, mlp.c_fc),
                            TensorParallelLinear.from_linear(tp, mlp.c_proj, transposed=True), _gelu_tanh)
    return block


def _set(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, attr = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, new)
