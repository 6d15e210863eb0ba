"""The planner's view of a model: coarse units in topological order and the bytes between them.

Produced from a coarsened OpDAG by :func:`fusionp2p.graph.workload.to_workload`; consumed by the
estimator and OP-Fence. Pure data: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Unit:
    """One coarse operator (e.g. a transformer block)."""

    name: str
    kind: str               # "embedding", "block", "head", "loss", "conv", "linear", ...
    fwd_flops: float        # per micro-batch
    bwd_flops: float        # per micro-batch (≈ 2 × forward when unknown)
    param_bytes: int        # parameters (fp32 unless stated)
    act_bytes: int          # activation memory kept for backward, per micro-batch

    def __post_init__(self) -> None:
        if self.fwd_flops < 0 or self.bwd_flops < 0 or self.param_bytes < 0 or self.act_bytes < 0:
            raise ValueError(f"unit {self.name}: negative cost")


@dataclass(frozen=True, slots=True, kw_only=True)
class Edge:
    """A data dependency: *nbytes* of activation per micro-batch forward (the same backward)."""

    src: int    # index into WorkloadGraph.units
    dst: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.src >= self.dst:
            raise ValueError(f"edge {self.src}->{self.dst} does not go forward in topological order")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadGraph:
    units: tuple[Unit, ...]
    edges: tuple[Edge, ...]
    micro_batch: int = 1

    def __post_init__(self) -> None:
        n = len(self.units)
        for e in self.edges:
            if not (0 <= e.src < n and 0 <= e.dst < n):
                raise ValueError(f"edge {e.src}->{e.dst} refers to a missing unit")

    def cut_bytes(self, fence: int) -> int:
        """Bytes per micro-batch crossing a fence placed before unit *fence* (skip edges included)."""
        return sum(e.nbytes for e in self.edges if e.src < fence <= e.dst)
