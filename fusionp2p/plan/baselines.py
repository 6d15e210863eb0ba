"""Baseline planners for benchmarks: same signature as :func:`~fusionp2p.plan.opfence.make_plan`.

* :func:`plan_even_layers` — GPipe-style: ``min(N, D)`` stages with equal unit counts, devices
  taken in peer-id order (i.e. placement blind to both speed and bandwidth), no replicas, no
  compression.
* :func:`plan_even_flops` — compute-balanced: stages chosen to minimise the slowest stage's compute
  on the devices in peer-id order (faster devices get proportionally more FLOPs), *ignoring
  bandwidth*; no replicas, no compression. This is OP-Fence's own decision procedure with every
  link treated as free, so the two differ only in what the network is allowed to change.

Both raise :class:`~fusionp2p.plan.opfence.InfeasiblePlanError` when their split does not fit memory.
"""

from __future__ import annotations

from fusionp2p.errors import ConfigError
from fusionp2p.plan.config import PlannerConfig
from fusionp2p.plan.estimator import CostModel
from fusionp2p.plan.opfence import InfeasiblePlanError, _States, min_bottleneck_layout
from fusionp2p.plan.plan import Plan
from fusionp2p.plan.predict import Layout, build_plan, layout_fits
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.types import WorkloadGraph


def plan_even_layers(workload: WorkloadGraph, snapshot: Snapshot, config: PlannerConfig | None = None, seed: int = 0) -> Plan:
    """Equal unit counts per stage (the first ``N mod S`` stages get one more), one device each."""
    cfg = config or PlannerConfig()
    n = len(workload.units)
    if n == 0:
        raise ConfigError("the workload has no units")
    cm = CostModel(workload, snapshot, cfg)
    s = min(n, cm.n_devices)
    base, extra = divmod(n, s)
    layout: Layout = []
    start = 0
    for k in range(s):
        end = start + base + (1 if k < extra else 0)
        layout.append((start, end, (k,)))
        start = end
    if not layout_fits(cm, layout):
        raise InfeasiblePlanError(f"job {snapshot.job!r}: an even split by layers over {s} devices exceeds a device's memory")
    return build_plan(cm, layout, [1.0] * (s - 1), job=snapshot.job, epoch=snapshot.epoch,
                      snapshot_hash=snapshot.snapshot_hash(), algorithm="even-layers", seed=seed)


def plan_even_flops(workload: WorkloadGraph, snapshot: Snapshot, config: PlannerConfig | None = None, seed: int = 0) -> Plan:
    """Compute-balanced stages on the devices in peer-id order, ignoring the network."""
    cfg = config or PlannerConfig()
    if not workload.units:
        raise ConfigError("the workload has no units")
    cm = CostModel(workload, snapshot, cfg)
    layout = min_bottleneck_layout(cm, _States.ordered(list(range(cm.n_devices))), job=snapshot.job, ignore_links=True)
    return build_plan(cm, layout, [1.0] * (len(layout) - 1), job=snapshot.job, epoch=snapshot.epoch,
                      snapshot_hash=snapshot.snapshot_hash(), algorithm="even-flops", seed=seed)
