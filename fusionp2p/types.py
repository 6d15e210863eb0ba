"""Plain data types shared by several layers (a leaf module: imports nothing of fusionp2p).

* :class:`DeviceProfile`: what a node measured about its device; published in its signed NodeRecord.
* :class:`AveragingStats`: a replica averager's rounds so far (for status and metrics).
* :class:`Unit`, :class:`Edge`, :class:`WorkloadGraph`: the planner's view of a model, coarse units in
  topological order and the bytes between them. Produced from a coarsened OpDAG by
  :func:`fusionp2p.graph.workload.to_workload`; consumed by the estimator and OP-Fence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """What a node measured about its device. The ``wire`` metadata bounds what a peer may claim
    (decoded by ``fusionp2p.wire.codec``; an H100 does ~1e15 FLOP/s)."""

    device: str = field(metadata={"wire": {"max_len": 64}})         # "cpu", "cuda:0", ...
    kind: str = field(metadata={"wire": {"max_len": 16}})           # "cpu" | "cuda"
    name: str = field(metadata={"wire": {"max_len": 256}})          # e.g. "x86_64 (2 threads)" or "NVIDIA H100 80GB HBM3"
    flops_fp32: float = field(metadata={"wire": {"lo": 5e-324, "hi": 1e20}})   # measured matmul FLOP/s
    flops_bf16: float = field(metadata={"wire": {"lo": 0.0, "hi": 1e20}})      # measured, 0.0 where unsupported
    memory_bytes: int = field(metadata={"wire": {"lo": 1, "hi": 1 << 60}})     # memory usable for training
    threads: int = field(default=1, metadata={"wire": {"lo": 1, "hi": 1 << 16, "optional": True}})
    # measured rate of activation-bound work: forward output bytes of element-wise ops per second of
    # their forward + backward (swarm/device.py); 0.0 = not measured (older nodes; then left out on the wire)
    act_rate: float = field(default=0.0, metadata={"wire": {"lo": 0.0, "hi": 1e20, "optional": True, "omit_default": True}})
    versions: tuple[tuple[str, str], ...] = field(       # (("torch", "2.13.0"), ("python", "3.11.7"), ...)
        default=(), metadata={"wire": {"max_len": 16, "optional": True, "item": {"max_len": 64}}})
    # which machine it runs on, as the node says (swarm/device.py host_identity: a hash, "" = not said), and
    # the CPUs that machine gives it: nodes of one host share its cores, though each benchmarked them alone.
    # A hint used only to be pessimistic (plan/predict.py host_shares): a CPU stage's time grows with the
    # threads the plan puts on its host; a lie makes plans with the liar in them look slower, nothing else
    host: str = field(default="", metadata={"wire": {"max_len": 64, "optional": True, "omit_default": True}})
    host_cpus: int = field(default=0, metadata={"wire": {"lo": 0, "hi": 1 << 16, "optional": True, "omit_default": True}})

    def __post_init__(self) -> None:
        if self.flops_fp32 <= 0:
            raise ValueError("flops_fp32 must be positive")
        if self.memory_bytes <= 0:
            raise ValueError("memory_bytes must be positive")
        if not self.act_rate >= 0:
            raise ValueError("act_rate must not be negative")

    def slowed(self, factor: float) -> DeviceProfile:
        """This profile of a device *factor* times slower (``--emulate-slowdown``; ``factor`` 1: itself)."""
        if factor == 1.0:
            return self
        return replace(self, flops_fp32=self.flops_fp32 / factor, flops_bf16=self.flops_bf16 / factor,
                       act_rate=self.act_rate / factor)

    def to_wire(self) -> dict[str, Any]:
        """The map in signed node records and snapshots (decoded by ``wire.records.decode_profile``)."""
        return {
            "device": self.device, "kind": self.kind, "name": self.name,
            "flops_fp32": float(self.flops_fp32), "flops_bf16": float(self.flops_bf16),
            "memory_bytes": int(self.memory_bytes), "threads": int(self.threads),
            "versions": [list(v) for v in self.versions],
        } | ({"act_rate": float(self.act_rate)} if self.act_rate > 0 else {}) \
          | ({"host": self.host, "host_cpus": int(self.host_cpus)} if self.host else {})


@dataclass(frozen=True, slots=True, kw_only=True)
class AveragingStats:
    """Averaging rounds of one stage replica so far: completed, skipped (lost peers, deadline), and
    their durations in seconds (launch to result)."""

    rounds: int = 0
    skipped: int = 0
    seconds: float = 0.0        # summed over every finished round
    last_s: float = 0.0         # the latest finished round


@dataclass(frozen=True, slots=True, kw_only=True)
class Unit:
    """One coarse operator (e.g. a transformer block)."""

    name: str
    kind: str               # "embedding", "block", "head", "loss", "conv", "linear", ...
    fwd_flops: float        # per micro-batch
    bwd_flops: float        # per micro-batch (≈ 2 × forward when unknown)
    param_bytes: int        # parameters (fp32 unless stated)
    act_bytes: int          # activation memory kept for backward, per micro-batch
    # the largest trainable tensor: from a step's second micro-batch on, its new gradient is held whole
    # before autograd adds it into the accumulated one (a transient the planner prices per stage)
    max_param_bytes: int = 0

    def __post_init__(self) -> None:
        if (self.fwd_flops < 0 or self.bwd_flops < 0 or self.param_bytes < 0 or self.act_bytes < 0
                or self.max_param_bytes < 0):
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


def short_peer(peer: str) -> str:
    """A peer id as logs, status and events print it: its last 8 characters. Every libp2p Ed25519 id
    starts with the same ``12D3KooW``, so the end is what tells peers apart; one form everywhere lets
    a reader match a peer in ``status`` to the same peer in a node's log by eye."""
    return peer[-8:] if len(peer) > 8 else peer
