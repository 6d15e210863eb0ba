"""Baseline planners for benchmarks: same signature as :func:`~fusionp2p.plan.opfence.make_plan`.

* :func:`plan_even_layers` — GPipe-style: ``min(N, D)`` stages with equal unit counts, devices
  taken in peer-id order (i.e. placement blind to both speed and bandwidth), no compression.
* :func:`plan_even_flops` — compute-balanced: stages chosen to minimise the slowest stage's compute
  on the devices in peer-id order (faster devices get proportionally more FLOPs), *ignoring
  bandwidth*; no compression. This is OP-Fence's own decision procedure with every
  link treated as free, so the two differ only in what the network is allowed to change.

With ``replicas=r`` (default 1) both first deal the devices, in peer-id order, into ``D // r``
replica groups of ``r`` consecutive devices (blind to the links, as a user who lists machines would)
and place one group per stage. A job selects them with ``TrainConfig.planner`` (``jobs/build.py``),
which is how the WAN benchmark's baselines run on the product.

Both raise :class:`~fusionp2p.plan.opfence.InfeasiblePlanError` when their split does not fit memory.
"""

from __future__ import annotations

import dataclasses

from fusionp2p.errors import ConfigError
from fusionp2p.plan.config import PlannerConfig
from fusionp2p.plan.estimator import CostModel
from fusionp2p.plan.opfence import InfeasiblePlanError, _States, min_bottleneck_layout
from fusionp2p.plan.plan import Plan
from fusionp2p.plan.predict import Layout, build_plan, layout_fits
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.types import DeviceProfile, WorkloadGraph


def id_groups(n_devices: int, replicas: int) -> list[tuple[int, ...]]:
    """``n_devices // replicas`` groups of consecutive device indices (peer-id order)."""
    if replicas < 1:
        raise ConfigError("replicas must be >= 1")
    r = min(replicas, n_devices)
    return [tuple(range(k * r, (k + 1) * r)) for k in range(n_devices // r)]


def plan_even_layers(workload: WorkloadGraph, snapshot: Snapshot, config: PlannerConfig | None = None, seed: int = 0,
                     *, replicas: int = 1) -> Plan:
    """Equal unit counts per stage (the first ``N mod S`` stages get one more), one replica group each."""
    cfg = config or PlannerConfig()
    n = len(workload.units)
    if n == 0:
        raise ConfigError("the workload has no units")
    cm = CostModel(workload, snapshot, cfg)
    groups = id_groups(cm.n_devices, replicas)
    s = min(n, len(groups))
    base, extra = divmod(n, s)
    layout: Layout = []
    start = 0
    for k in range(s):
        end = start + base + (1 if k < extra else 0)
        layout.append((start, end, groups[k]))
        start = end
    if not layout_fits(cm, layout):
        raise InfeasiblePlanError(f"job {snapshot.job!r}: an even split by layers over {s} devices exceeds a device's memory")
    return build_plan(cm, layout, [1.0] * (s - 1), job=snapshot.job, epoch=snapshot.epoch,
                      snapshot_hash=snapshot.snapshot_hash(), algorithm="even-layers", seed=seed)


def plan_even_flops(workload: WorkloadGraph, snapshot: Snapshot, config: PlannerConfig | None = None, seed: int = 0,
                    *, replicas: int = 1) -> Plan:
    """Compute-balanced stages on the devices (replica groups) in peer-id order, ignoring the network."""
    cfg = config or PlannerConfig()
    if not workload.units:
        raise ConfigError("the workload has no units")
    cm = CostModel(workload, snapshot, cfg)
    groups = id_groups(cm.n_devices, replicas)
    if len(groups[0]) == 1:
        layout = min_bottleneck_layout(cm, _States.ordered(list(range(cm.n_devices))), job=snapshot.job, ignore_links=True)
    else:
        layout = _group_flops_layout(cm, workload, groups, snapshot.job)
    return build_plan(cm, layout, [1.0] * (len(layout) - 1), job=snapshot.job, epoch=snapshot.epoch,
                      snapshot_hash=snapshot.snapshot_hash(), algorithm="even-flops", seed=seed)


def _group_flops_layout(cm: CostModel, workload: WorkloadGraph, groups: list[tuple[int, ...]], job: str) -> Layout:
    """The compute-balanced layout over replica groups as super-devices (``CostModel.group_speed``, less
    ``replica_overhead``; the smallest member's memory), links ignored; in real device indices."""
    cfg = cm.config
    names = [f"g{k:05d}" for k in range(len(groups))]
    members = {}
    for name, g in zip(names, groups, strict=True):
        speed = cm.group_speed(g) / (1.0 + cfg.replica_overhead)
        mem = float(cm.mem_cap[list(g)].min()) / cfg.memory_headroom
        members[name] = DeviceProfile(device="group", kind="group", name=name, flops_fp32=speed, flops_bf16=0.0,
                                      act_rate=speed / cm.act_flops if cm.act_flops > 0 else 0.0,
                                      memory_bytes=max(1, int(mem)))
    gcfg = dataclasses.replace(cfg, param_memory_factor=cfg.param_memory_factor + cfg.replica_memory_factor,
                               replicated_devices=len(groups[0]) > 1)
    gcm = CostModel(workload, Snapshot(job=job, epoch=0, members=members, links={}), gcfg)
    layout = min_bottleneck_layout(gcm, _States.ordered(list(range(len(groups)))), job=job, ignore_links=True)
    return [(i, j, groups[g[0]]) for i, j, g in layout]
