"""The planner's one frozen config (STYLE.md 8). Every knob of the cost model is here, with its unit."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fusionp2p.errors import ConfigError
from fusionp2p.plan.plan import MAX_MICRO_PERIOD
from fusionp2p.plan.snapshot import Link
from fusionp2p.plan.wirebytes import dense_ratio

SCHEDULE_KINDS = ("gpipe", "1f1b")


def in_flight_limit(kind: str, stages: int, stage: int, micro_batches: int, max_in_flight: int | None = None) -> int:
    """Most micro-batches *stage* of *stages* stashes at once under schedule *kind*: all of them under
    GPipe, ``S - stage`` under 1F1B. The one figure the stage workers run under (``train/schedule.py``),
    the planner's search prices (``plan/estimator.py``) and a node holds a stage against (``jobs/weights.py``)."""
    if kind == "gpipe":
        return micro_batches
    bound = max_in_flight if max_in_flight is not None else stages - stage
    return min(bound, micro_batches)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    """Cost model and search options of OP-Fence (ALGORITHMS.md §1.4-1.6).

    Memory of one replica of a stage holding units [i, j)::

        param_bytes * (param_memory_factor + replica_memory_factor if replicated else 0)
        + act_bytes * in_flight_limit(schedule, stages, stage, micro_batches)
        + replica_boundary_steps * micro_batches * 2 * (its two fences' bytes) if replicated
        + the largest trainable tensor of [i, j) when micro_batches > 1 (its new gradient before accumulation)
        <= memory_bytes * memory_headroom

    The activations are those of the micro-batches the stage's schedule keeps in flight at once
    (:func:`in_flight_limit`: all ``M`` under GPipe, ``min(S - stage, M)`` under 1F1B), the bound the
    nodes' stage workers run under (``train/schedule.py``) and check (``jobs/weights.py``).
    """

    micro_batches: int = 8                  # M: micro-batches per step (GPipe flush)
    efficiency: tuple[tuple[str, float], ...] = ()   # per Unit.kind: achieved fraction of flops_fp32
    default_efficiency: float = 1.0         # flops_fp32 is a measured matmul rate, so ~1 for matmul-bound units
    param_memory_factor: float = 4.0        # weights + grads + Adam m and v (fp32)
    replica_memory_factor: float = 2.0      # CO2 anchor + outer momentum, only for replicated stages
    # steps of every micro-batch's boundary tensors (received and sent, and their gradients) a replicated
    # stage keeps besides its activations: the spot checks' transcripts (jobs/build.py: planner_config)
    replica_boundary_steps: int = 0
    # every device of the search is a replica group (plan/joint.py, plan/baselines.py: groups as super-devices,
    # CO2's state folded into param_memory_factor): each range is charged its replica_boundary_steps as well
    replicated_devices: bool = False
    memory_headroom: float = 0.9            # keep 10% of memory_bytes free
    full_duplex: bool = False               # False: activations and gradients share a link (cost x2)
    compression: bool = True                # AdaTopK on links slower than the compute bottleneck
    rho_min: float = 0.3                    # AdaTopK floor of the kept fraction (see train/config.py AdaTopK)
    value_bytes: int = 4                    # fp32 values on the wire
    # TrainConfig.precision bf16/fp16: compute priced at the devices' measured flops_bf16 (flops_fp32 where
    # they measured none), and the boundary tensors, traced in fp32, cross the fences at half their bytes
    half_precision: bool = False
    index_bytes: int = 4                    # int32 indices of sparse payloads (the codec's type for 2^15 < n <= 2^31)
    replicas: bool = True                   # add data-parallel replicas with left-over devices
    replica_overhead: float = 0.05          # compute slowdown charged to a replicated stage (CO2 overlap)
    co2_tau: int = 48                       # local steps between CO2 averaging rounds
    overlap_averaging: bool = True          # False: the round blocks the step (per-step all-reduce, CO2 sync)
    balance_micro: bool = True              # data-parallel replicas of unequal speed: micro-batches by speed
    # ... dealt over this many steps (Plan.micro_period): a replica may run 4.75 a step (5, 5, 5, 4) where the
    # averaging does not block the step; 1 where it does (each step lasts as long as its slowest replica)
    micro_period: int = 1
    stream_averaging: bool = False          # streaming CO2: a fragment's round every step (its latency each step)
    averaging_wire: float = 1.0             # bytes a CO2 round sends per fp32 byte of parameters (0.5: CO2.wire "bf16")
    # no CO2: the per-step gradient all-reduce, in which every replica sends its whole gradient to every other
    # (train/worker.py _allreduce_grads): r-1 times the bytes in one hop, not CO2's butterfly
    gradient_exchange: bool = False
    cluster_theta: float = 0.25             # merge clusters while inter-bandwidth >= theta * intra
    exact_search_devices: int = 5           # up to this many devices: search every device order
    skip_window: int = 32                   # cluster order: next stage at most this many devices later
    missing_link: Link = field(default_factory=lambda: Link(bandwidth_bps=125_000.0, latency_s=0.5))
    # activation recomputation in every stage (TrainConfig.recompute): a stage keeps only its boundary
    # tensors per micro-batch in flight and recomputes its forward in backward (plan/estimator.py)
    recompute: bool = False
    # the pipeline schedule (TrainConfig.schedule): how many micro-batches' activations a stage holds at once
    schedule: str = "gpipe"

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise ConfigError("micro_batches must be >= 1")
        if self.schedule not in SCHEDULE_KINDS:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULE_KINDS)}, got {self.schedule!r}")
        if not 1 <= self.micro_period <= MAX_MICRO_PERIOD:
            raise ConfigError(f"micro_period must be in [1, {MAX_MICRO_PERIOD}]")
        if not 0 < self.averaging_wire <= 1:
            raise ConfigError("averaging_wire must be in (0, 1]")
        for kind, eff in self.efficiency:
            if not (0 < eff <= 1.0):
                raise ConfigError(f"efficiency of {kind!r} must be in (0, 1]")
        if not (0 < self.default_efficiency <= 1.0):
            raise ConfigError("default_efficiency must be in (0, 1]")
        if self.param_memory_factor < 1 or self.replica_memory_factor < 0:
            raise ConfigError("param_memory_factor must be >= 1 and replica_memory_factor >= 0")
        if not 0 <= self.replica_boundary_steps <= 64:
            raise ConfigError("replica_boundary_steps must be in [0, 64]")
        if not (0 < self.memory_headroom <= 1):
            raise ConfigError("memory_headroom must be in (0, 1]")
        if not (0 < self.rho_min <= 1):
            raise ConfigError("rho_min must be in (0, 1]")
        if self.value_bytes < 1 or self.index_bytes < 1:
            raise ConfigError("value_bytes and index_bytes must be >= 1")
        if not (0 <= self.replica_overhead < 1) or not math.isfinite(self.replica_overhead):
            raise ConfigError("replica_overhead must be in [0, 1)")
        if self.co2_tau < 1:
            raise ConfigError("co2_tau must be >= 1")
        if not (0 < self.cluster_theta <= 1):
            raise ConfigError("cluster_theta must be in (0, 1]")
        if self.skip_window < 1:
            raise ConfigError("skip_window must be >= 1")
        if not (0 <= self.exact_search_devices <= 8):
            raise ConfigError("exact_search_devices must be in [0, 8] (the search is exponential)")

    @property
    def directions(self) -> int:
        """How many times a fence's bytes cross its link per micro-batch on the critical resource."""
        return 1 if self.full_duplex else 2

    @property
    def dense_ratio(self) -> float:
        """A kept fraction at or above this is sent dense, for large tensors: the sparse payload
        (values + indices or bitmap, ``plan.wirebytes``) would be no smaller. 31/32 for fp32 and int32;
        the exact, per-size decision is ``wirebytes.sends_dense``."""
        return dense_ratio(dense_bytes=self.value_bytes, value_bytes=self.value_bytes, index_bytes=self.index_bytes)

    def efficiency_of(self, kind: str) -> float:
        for k, eff in self.efficiency:
            if k == kind:
                return eff
        return self.default_efficiency
