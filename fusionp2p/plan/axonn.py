"""AxoNN's analytical communication model and configuration search (ALGORITHMS.md §3.4).

Theory of operation. A cluster of ``G`` devices is split as ``G = G_x·G_y·G_z·G_data`` (§3.1):
X splits a linear layer's input features, Y its output features, Z shards the weight block *and*
splits the batch, and data is plain data parallelism. Rank layout, X fastest::

    rank = x + G_x·(y + G_y·(z + G_z·d))

Every linear layer issues a fixed list of collectives per training step (§3.2), which
:func:`layer_collectives` enumerates as :class:`Collective` records ``(dim, op, nbytes)``, where
``nbytes`` is the size of the *message* (the all-reduced tensor, the gathered output, the
reduce-scattered input), i.e. the volume "before the ring factors". The runtime in
``fusionp2p.parallel`` records exactly the same tuples, so tests compare the two lists.

The time of a collective over ``p`` ranks (ring algorithm) is ``α·p + f(p)·V/β`` with
``f = (p−1)/p`` for all-gather / reduce-scatter and ``2(p−1)/p`` for all-reduce; a group of one
rank issues nothing and costs nothing. The bandwidth ``β`` of a group follows the hierarchy rule of
:meth:`BandwidthModel.beta`. :func:`search` enumerates the factorisations of ``G``, drops those
that break memory or divisibility constraints and returns them sorted by predicted time: the model
*prunes*; the caller benchmarks the top few and picks the fastest (``fusionp2p.parallel.search``).

Pure: no torch, no clock, no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from fusionp2p.errors import ConfigError

log = logging.getLogger(__name__)

Dim = Literal["x", "y", "z", "data"]
Op = Literal["all_reduce", "all_gather", "reduce_scatter"]
DIMS: tuple[Dim, ...] = ("x", "y", "z", "data")


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class GridShape:
    """The sizes ``(G_x, G_y, G_z, G_data)`` of a 4D decomposition, and the rank layout arithmetic."""

    g_x: int = 1
    g_y: int = 1
    g_z: int = 1
    g_data: int = 1

    def __post_init__(self) -> None:
        for name in ("g_x", "g_y", "g_z", "g_data"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"GridShape.{name} must be a positive integer, got {v!r}")

    @property
    def world(self) -> int:
        return self.g_x * self.g_y * self.g_z * self.g_data

    @property
    def tp(self) -> int:
        """The tensor-parallel degree ``G_x·G_y·G_z`` (how many devices share one weight)."""
        return self.g_x * self.g_y * self.g_z

    @property
    def batch_split(self) -> int:
        """Into how many pieces the batch is cut (``G_data·G_z``)."""
        return self.g_data * self.g_z

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.g_x, self.g_y, self.g_z, self.g_data)

    def size(self, dim: Dim) -> int:
        return {"x": self.g_x, "y": self.g_y, "z": self.g_z, "data": self.g_data}[dim]

    def inner(self, dim: Dim) -> int:
        """``ip``: the product of the sizes of the dimensions inside ``dim`` (X innermost)."""
        return {"x": 1, "y": self.g_x, "z": self.g_x * self.g_y, "data": self.tp}[dim]

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """``(x, y, z, d)`` of ``rank``."""
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} outside a world of {self.world}")
        x, r = rank % self.g_x, rank // self.g_x
        y, r = r % self.g_y, r // self.g_y
        z, d = r % self.g_z, r // self.g_z
        return (x, y, z, d)

    def rank(self, x: int, y: int, z: int, d: int) -> int:
        return x + self.g_x * (y + self.g_y * (z + self.g_z * d))

    def groups(self, dim: Dim) -> list[tuple[int, ...]]:
        """Every group along ``dim`` (ranks ascending), in a fixed order that all ranks share."""
        idx = DIMS.index(dim)
        sizes = self.as_tuple()
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world):
            c = list(self.coords(rank))
            members = []
            for v in range(sizes[idx]):
                c[idx] = v
                members.append(self.rank(*c))
            seen.setdefault(tuple(members), None)
        return list(seen)

    def group_of(self, dim: Dim, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``dim``."""
        idx = DIMS.index(dim)
        c = list(self.coords(rank))
        out = []
        for v in range(self.as_tuple()[idx]):
            c[idx] = v
            out.append(self.rank(*c))
        return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearSpec:
    """One linear layer ``W ∈ R^{n_out × n_in}``; ``transposed`` swaps the roles of X and Y (§3.2)."""

    n_in: int
    n_out: int
    transposed: bool = False
    bias: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if self.n_in < 1 or self.n_out < 1:
            raise ConfigError(f"LinearSpec {self.name!r}: n_in and n_out must be positive")

    @property
    def in_dim(self) -> Dim:
        """The grid dimension that splits the input features."""
        return "y" if self.transposed else "x"

    @property
    def out_dim(self) -> Dim:
        """The grid dimension that splits the output features."""
        return "x" if self.transposed else "y"

    def fits(self, grid: GridShape) -> bool:
        """Whether the weight divides evenly: features over X/Y, then the block over Z."""
        g_in, g_out = grid.size(self.in_dim), grid.size(self.out_dim)
        if self.n_in % g_in or self.n_out % g_out:
            return False
        return (self.n_in // g_in) * (self.n_out // g_out) % grid.g_z == 0


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class Collective:
    """One collective call: its group dimension, its operation and its message size in bytes."""

    dim: Dim
    op: Op
    nbytes: int


def ring_factor(op: Op, p: int) -> float:
    """Bytes sent per rank per message byte by a ring collective over ``p`` ranks."""
    if p <= 1:
        return 0.0
    return (2.0 if op == "all_reduce" else 1.0) * (p - 1) / p


def tokens_per_rank(grid: GridShape, global_tokens: int) -> int:
    """``T = B·S/(G_data·G_z)``; raises ConfigError when it does not divide."""
    if global_tokens % grid.batch_split:
        raise ConfigError(f"{global_tokens} tokens do not split over G_data·G_z = {grid.batch_split}")
    return global_tokens // grid.batch_split


def layer_collectives(grid: GridShape, spec: LinearSpec, tokens: int, *, act_bytes: int = 2,
                      grad_bytes: int = 4) -> list[Collective]:
    """The collectives one training step (forward + backward + data sync) of ``spec`` issues per rank.

    ``tokens`` is ``T``, the tokens per rank. Order: forward AG_Z, forward AR over the input
    split, backward AG_Z, backward AR of dX over the output split, RS_Z of dW, then (after the
    backward) AR_data of the dW shard; with a bias, its gradient is all-reduced over Z and data.
    Groups of one rank are omitted (they cost nothing), so each term vanishes with its dimension.
    """
    g_in, g_out = grid.size(spec.in_dim), grid.size(spec.out_dim)
    blk = (spec.n_in // g_in) * (spec.n_out // g_out)
    cand: list[Collective] = [
        Collective(dim="z", op="all_gather", nbytes=blk * act_bytes),
        Collective(dim=spec.in_dim, op="all_reduce", nbytes=tokens * (spec.n_out // g_out) * act_bytes),
        Collective(dim="z", op="all_gather", nbytes=blk * act_bytes),
        Collective(dim=spec.out_dim, op="all_reduce", nbytes=tokens * (spec.n_in // g_in) * act_bytes),
        Collective(dim="z", op="reduce_scatter", nbytes=blk * act_bytes),
        Collective(dim="data", op="all_reduce", nbytes=blk // grid.g_z * grad_bytes),
    ]
    if spec.bias:
        b = spec.n_out // g_out * grad_bytes
        cand += [Collective(dim="z", op="all_reduce", nbytes=b), Collective(dim="data", op="all_reduce", nbytes=b)]
    return [c for c in cand if grid.size(c.dim) > 1]


def message_bytes(colls: Iterable[Collective]) -> dict[Dim, int]:
    """Message bytes per dimension (the volumes V_X..V_D before the ring factors)."""
    out: dict[Dim, int] = dict.fromkeys(DIMS, 0)
    for c in colls:
        out[c.dim] += c.nbytes
    return out


def ring_volumes(grid: GridShape, colls: Iterable[Collective]) -> dict[Dim, float]:
    """Bytes each rank sends per dimension (V_X..V_D of §3.4, ring factors applied)."""
    out: dict[Dim, float] = dict.fromkeys(DIMS, 0.0)
    for c in colls:
        out[c.dim] += ring_factor(c.op, grid.size(c.dim)) * c.nbytes
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class BandwidthModel:
    """Bandwidths of one cluster, in bytes/s, with the hierarchy rule of §3.4.

    ``intra`` is the measured intra-node table ``((ip, g, bytes_per_s), ...)``; pairs missing
    from it fall back to ``intra_default``. ``inter`` is one node's NIC bandwidth. ``alpha`` is the
    per-rank latency term (seconds) applied once per collective as ``α·p``.
    """

    devices_per_node: int
    inter: float
    intra: tuple[tuple[int, int, float], ...] = ()
    intra_default: float | None = None
    alpha: float = 9e-6

    def __post_init__(self) -> None:
        if self.devices_per_node < 1:
            raise ConfigError("BandwidthModel.devices_per_node must be >= 1")
        if self.inter <= 0 or (self.intra_default is not None and self.intra_default <= 0):
            raise ConfigError("BandwidthModel: bandwidths must be positive")
        if any(b <= 0 or ip < 1 or g < 1 for ip, g, b in self.intra):
            raise ConfigError("BandwidthModel.intra entries must be (ip >= 1, g >= 1, bytes/s > 0)")
        if self.alpha < 0:
            raise ConfigError("BandwidthModel.alpha must be >= 0")

    @classmethod
    def uniform(cls, bytes_per_s: float, *, devices: int, alpha: float = 0.0) -> BandwidthModel:
        """A single node of ``devices`` whose groups all see ``bytes_per_s`` (a measured CPU cluster)."""
        return cls(devices_per_node=devices, inter=bytes_per_s, intra_default=bytes_per_s, alpha=alpha)

    def beta(self, ip: int, g: int) -> float:
        """Bandwidth of a group of ``g`` ranks whose inner dimensions multiply to ``ip``.

        Inside one node (``ip·g ≤ devices_per_node``) the intra table applies; otherwise the
        node's NIC is shared by the ``min(devices_per_node, ip)`` rings of this group leaving it.
        """
        if ip * g <= self.devices_per_node:
            for i, gg, b in self.intra:
                if (i, gg) == (ip, g):
                    return b
            if self.intra_default is None:
                raise ConfigError(f"no intra-node bandwidth for (ip={ip}, g={g}) and no intra_default")
            return self.intra_default
        return self.inter / min(self.devices_per_node, ip)

    def beta_of(self, grid: GridShape, dim: Dim) -> float:
        return self.beta(grid.inner(dim), grid.size(dim))


def collectives_time(grid: GridShape, colls: Iterable[Collective], bw: BandwidthModel) -> float:
    """Predicted seconds of ``colls``: Σ α·p + f(p)·V/β over the non-trivial groups."""
    t = 0.0
    for c in colls:
        p = grid.size(c.dim)
        if p > 1:
            t += bw.alpha * p + ring_factor(c.op, p) * c.nbytes / bw.beta_of(grid, c.dim)
    return t


def step_collectives(grid: GridShape, layers: Sequence[LinearSpec], global_tokens: int, *,
                     act_bytes: int = 2, grad_bytes: int = 4) -> list[Collective]:
    """All collectives of one training step of ``layers`` (no repetition factor)."""
    tokens = tokens_per_rank(grid, global_tokens)
    out: list[Collective] = []
    for spec in layers:
        out += layer_collectives(grid, spec, tokens, act_bytes=act_bytes, grad_bytes=grad_bytes)
    return out


def transformer_layers(hidden: int, intermediate: int, *, g_qa: int = 1, swiglu: bool = False,
                       bias: bool = False) -> tuple[LinearSpec, ...]:
    """The four linear layers of a transformer layer, alternating normal / transposed (§3.4)."""
    if hidden % g_qa:
        raise ConfigError("hidden must be divisible by g_qa")
    return (
        LinearSpec(n_in=hidden, n_out=hidden + 2 * hidden // g_qa, bias=bias, name="qkv"),
        LinearSpec(n_in=hidden, n_out=hidden, transposed=True, bias=bias, name="attn_out"),
        LinearSpec(n_in=hidden, n_out=intermediate * (2 if swiglu else 1), bias=bias, name="mlp_up"),
        LinearSpec(n_in=intermediate, n_out=hidden, transposed=True, bias=bias, name="mlp_down"),
    )


def script_transformer_time(grid: GridShape, hidden: int, intermediate: int, global_tokens: int,
                            bw: BandwidthModel, *, g_qa: int = 1, act_bytes: int = 2,
                            grad_bytes: int = 4) -> float:
    """The group's script variant, kept as a regression reference (§3.4, note).

    It prices a transposed layer by calling the normal-layer formula on the grid with ``G_x`` and
    ``G_y`` swapped, and prices the MLP down projection as ``(n_in, n_out) = (H, I)``. It agrees
    with :func:`step_collectives` + :func:`collectives_time` when ``G_x = G_y`` and all groups see
    one bandwidth; elsewhere the principled swap is the one to trust.
    """
    swapped = GridShape(g_x=grid.g_y, g_y=grid.g_x, g_z=grid.g_z, g_data=grid.g_data)
    tokens = tokens_per_rank(grid, global_tokens)
    parts = [
        (grid, LinearSpec(n_in=hidden, n_out=hidden + 2 * hidden // g_qa)),
        (swapped, LinearSpec(n_in=hidden, n_out=hidden)),
        (grid, LinearSpec(n_in=hidden, n_out=intermediate)),
        (swapped, LinearSpec(n_in=hidden, n_out=intermediate)),
    ]
    return sum(collectives_time(g, layer_collectives(g, s, tokens, act_bytes=act_bytes, grad_bytes=grad_bytes), bw)
               for g, s in parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankedConfig:
    """One candidate configuration with its predicted communication time per step."""

    grid: GridShape
    predicted_s: float
    volumes: tuple[tuple[Dim, float], ...]   # ring bytes sent per rank, per dimension


def factorizations(world: int, *, powers_of_two: bool = False) -> list[GridShape]:
    """Every ordered ``(G_x, G_y, G_z, G_data)`` with product ``world`` (optionally powers of two)."""
    if world < 1:
        raise ConfigError("world must be >= 1")
    divs = [d for d in range(1, world + 1) if world % d == 0 and (not powers_of_two or d & (d - 1) == 0)]
    out = []
    for gx in divs:
        for gy in divs:
            for gz in divs:
                rest, rem = divmod(world, gx * gy * gz)
                if rem == 0 and rest in divs:
                    out.append(GridShape(g_x=gx, g_y=gy, g_z=gz, g_data=rest))
    return out


def feasible(grid: GridShape, layers: Sequence[LinearSpec], batch: int, *, min_tp: int = 1) -> bool:
    """The search's constraints: memory (``G_x·G_y·G_z ≥ min_tp``), batch and weight divisibility."""
    return grid.tp >= min_tp and batch % grid.batch_split == 0 and all(s.fits(grid) for s in layers)


def search(world: int, layers: Sequence[LinearSpec], *, batch: int, seq_len: int, bw: BandwidthModel,
           min_tp: int = 1, top_k: int = 5, n_layers: int = 1, act_bytes: int = 2, grad_bytes: int = 4,
           powers_of_two: bool = True) -> list[RankedConfig]:
    """The ``top_k`` feasible configurations of ``world`` devices, cheapest predicted first.

    ``layers`` are the linear layers of one repeated layer (e.g. :func:`transformer_layers`);
    their cost is multiplied by ``n_layers``. ``batch`` counts samples (each ``seq_len`` tokens):
    it must split over ``G_data·G_z``. Ties are broken by the grid tuple, so every node computes
    the same list. Raises :class:`~fusionp2p.errors.ConfigError` when nothing is feasible.
    """
    if top_k < 1 or n_layers < 1 or batch < 1 or seq_len < 1:
        raise ConfigError("top_k, n_layers, batch and seq_len must be >= 1")
    ranked = []
    for grid in factorizations(world, powers_of_two=powers_of_two):
        if not feasible(grid, layers, batch, min_tp=min_tp):
            continue
        colls = step_collectives(grid, layers, batch * seq_len, act_bytes=act_bytes, grad_bytes=grad_bytes)
        vols = ring_volumes(grid, colls)
        ranked.append(RankedConfig(grid=grid, predicted_s=n_layers * collectives_time(grid, colls, bw),
                                   volumes=tuple((d, n_layers * v) for d, v in vols.items())))
    if not ranked:
        raise ConfigError(f"no (G_x, G_y, G_z, G_data) of {world} devices fits min_tp={min_tp}, batch={batch} "
                          "and the layer sizes; lower min_tp or change the batch")
    ranked.sort(key=lambda r: (r.predicted_s, r.grid.as_tuple()))
    log.debug("axonn search over %d devices: best %s", world, ranked[0])
    return ranked[:top_k]
