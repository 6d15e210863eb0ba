"""Shared builders for the planning tests (workloads, profiles, snapshots) and a brute-force planner.

The brute force is deliberately independent of the planner's code: it evaluates every contiguous
partition of the units and every assignment of stages to distinct devices, straight from the
formulas of docs/planning.md (no prefix sums, no shared helpers besides the data types).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import pytest

from fusionp2p.plan.config import PlannerConfig, in_flight_limit
from fusionp2p.plan.opfence import InfeasiblePlanError, make_plan
from fusionp2p.plan.snapshot import Link, Snapshot
from fusionp2p.types import DeviceProfile, Edge, Unit, WorkloadGraph

GiB = 1 << 30


def chain(n: int, *, flops: float = 1e9, act: int = 1_000_000, params: int = 1_000_000, kind: str = "block") -> WorkloadGraph:
    """A chain of *n* identical units, each passing *act* bytes to the next."""
    units = tuple(Unit(name=f"u{i}", kind=kind, fwd_flops=flops, bwd_flops=2 * flops, param_bytes=params, act_bytes=act)
                  for i in range(n))
    edges = tuple(Edge(src=i, dst=i + 1, nbytes=act) for i in range(n - 1))
    return WorkloadGraph(units=units, edges=edges)


def profile(flops: float = 1e10, memory: int = 16 * GiB) -> DeviceProfile:
    return DeviceProfile(device="cpu", kind="cpu", name="test", flops_fp32=flops, flops_bf16=0.0, memory_bytes=memory)


def peers(n: int) -> list[str]:
    return [f"peer{i:03d}" for i in range(n)]


def snapshot(
    n: int,
    *,
    bw: Callable[[int, int], float] = lambda a, b: 1.25e9,
    lat: float = 1e-4,
    flops: Callable[[int], float] = lambda i: 1e10,
    memory: Callable[[int], int] = lambda i: 16 * GiB,
    job: str = "job",
    epoch: int = 0,
) -> Snapshot:
    ps = peers(n)
    links = {(ps[i], ps[j]): Link(bandwidth_bps=bw(i, j), latency_s=lat) for i in range(n) for j in range(i + 1, n)}
    return Snapshot(job=job, epoch=epoch, members={p: profile(flops(i), memory(i)) for i, p in enumerate(ps)}, links=links)


def brute_force(
    workload: WorkloadGraph, snap: Snapshot, cfg: PlannerConfig, orders: Sequence[Sequence[int]] | None = None,
) -> float | None:
    """Least bottleneck over all contiguous partitions and assignments (None when nothing fits), each stage
    holding the activations of the micro-batches its schedule keeps in flight (``cfg.schedule``).

    *orders*: restrict assignments to order-preserving subsequences of these device orders
    (None: any injective assignment). Compression and replicas are not modelled (turn them off).
    """
    units = workload.units
    n = len(units)
    profs = list(snap.members.values())
    names = snap.peers
    d = len(profs)
    dirs = 1 if cfg.full_duplex else 2

    def stage(i: int, j: int, dev: int, held: int) -> float | None:
        mem = sum(u.param_bytes * cfg.param_memory_factor + u.act_bytes * held for u in units[i:j])
        if cfg.micro_batches > 1:   # the largest tensor's new gradient before accumulation
            mem += max((u.max_param_bytes for u in units[i:j]), default=0)
        if mem > profs[dev].memory_bytes * cfg.memory_headroom:
            return None
        return sum((u.fwd_flops + u.bwd_flops) / (profs[dev].flops_fp32 * cfg.efficiency_of(u.kind)) for u in units[i:j])

    def link(a: int, b: int, fence: int) -> float:
        lk = snap.link(names[a], names[b]) or cfg.missing_link
        return dirs * (lk.latency_s + workload.cut_bytes(fence) / lk.bandwidth_bps)

    if orders is None:
        def assignments(k: int) -> list[tuple[int, ...]]:
            return list(itertools.permutations(range(d), k))
    else:
        def assignments(k):
            return sorted({tuple(o[x] for x in c) for o in orders for c in itertools.combinations(range(d), k)})
    best: float | None = None
    for k in range(1, min(n, d) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            for devs in assignments(k):
                worst = 0.0
                for s in range(k):
                    t = stage(bounds[s], bounds[s + 1], devs[s], in_flight_limit(cfg.schedule, k, s, cfg.micro_batches))
                    if t is None:
                        worst = math.inf
                        break
                    worst = max(worst, t)
                    if s + 1 < k:
                        worst = max(worst, link(devs[s], devs[s + 1], bounds[s + 1]))
                if math.isfinite(worst) and (best is None or worst < best):
                    best = worst
    return best


def assert_matches_brute_force(workload: WorkloadGraph, snap: Snapshot, cfg: PlannerConfig, *,
                               orders: Sequence[Sequence[int]] | None = None, memory: bool = False) -> None:
    """The planner's bottleneck equals the brute force's (an InfeasiblePlanError where nothing fits); with
    *memory*, every stage also fits its first replica's offer."""
    want = brute_force(workload, snap, cfg, orders=orders)
    if want is None:
        with pytest.raises(InfeasiblePlanError):
            make_plan(workload, snap, cfg)
        return
    plan = make_plan(workload, snap, cfg)
    assert plan.bottleneck_s == pytest.approx(want, rel=1e-6)
    if memory:
        for stage in plan.stages:
            assert stage.memory_bytes <= snap.members[stage.replicas[0]].memory_bytes * cfg.memory_headroom


def test_brute_force_on_a_trivial_case() -> None:
    # Two identical devices, two identical units, free links: one unit each halves the time.
    w = chain(2, act=0)
    s = snapshot(2, lat=0.0)
    assert brute_force(w, s, PlannerConfig(compression=False, replicas=False)) == 3e9 / 1e10
