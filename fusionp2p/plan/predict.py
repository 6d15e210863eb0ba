"""Evaluate a layout or a plan under the cost model, and choose AdaTopK ratios (ALGORITHMS.md §1.6).

A *layout* is the planners' internal form of a plan: ``[(start, end, device indices), ...]`` in
pipeline order, device indices into ``CostModel.peers``. :func:`build_plan` turns a layout and its
kept ratios into a :class:`~fusionp2p.plan.plan.Plan` with every prediction filled in;
:func:`predict` re-evaluates any plan (ours or a baseline) on a snapshot, which is what the
benchmarks compare with measured step times.

AdaTopK policy (:func:`choose_ratios`): with ``T_comp`` the slowest stage and ``T_floor`` the
slowest link's best achievable time (at ``rho_min``), the target is ``T* = max(T_comp, T_floor)``.
A link with dense time ``<= T*`` is not compressed (ratio 1.0); a slower one keeps just enough: the
largest ratio whose sparse bytes fit ``B = (T*/dirs - latency) * bandwidth``
(``wirebytes.max_ratio``: ``max(floor(B / (b_val + b_idx)), floor((B - ceil(n/8)) / b_val)) / n``,
index form below ``rho = 1/(8 b_idx)``, bitmap form above), clipped to ``[rho_min, 1]``, rounded
down to the 1e-4 grid, and sent dense when the codec would (``wirebytes.sends_dense``: sparse no
smaller than dense, from ``rho`` ~ 31/32 for fp32).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fusionp2p.plan.config import PlannerConfig
from fusionp2p.plan.estimator import CostModel, compressed_bytes
from fusionp2p.plan.plan import Fence, Plan, Stage, quantize_rho
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.plan.wirebytes import max_ratio, sends_dense
from fusionp2p.types import WorkloadGraph

Layout = list[tuple[int, int, tuple[int, ...]]]
BALANCE_MIN_GAIN = 0.05   # micro-batches by speed only where that is predicted at least 5% faster than lockstep


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """Predicted times of a plan, seconds per micro-batch except ``step_time_s`` (one step of M)."""

    stage_s: tuple[float, ...]
    fence_s: tuple[float, ...]
    bottleneck_s: float
    step_time_s: float
    throughput: float               # micro-batches per second over a whole step


def step_time(stage_s: Sequence[float], fence_s: Sequence[float], micro_batches: int) -> tuple[float, float]:
    """(bottleneck, GPipe step time) = (max element, (M-1)*bottleneck + sum of all elements)."""
    elems = [*stage_s, *fence_s]
    bottleneck = max(elems)
    return bottleneck, (micro_batches - 1) * bottleneck + math.fsum(elems)


def fence_time(cm: CostModel, layout: Layout, k: int, rho: float) -> tuple[float, float, float]:
    """(dense bytes, time, dense time) of the fence after stage *k* of *layout* with ratio *rho*."""
    cfg = cm.config
    link = cm.group_link(layout[k][2], layout[k + 1][2])
    dense = float(cm.cut[layout[k][1]])
    t = cfg.directions * link.time(compressed_bytes(dense, rho, cfg))
    return dense, t, cfg.directions * link.time(dense)


def choose_ratios(cm: CostModel, layout: Layout) -> list[float]:
    """AdaTopK kept ratio per fence of *layout* (1.0 everywhere when compression is off)."""
    cfg = cm.config
    n_f = len(layout) - 1
    if not cfg.compression or n_f == 0:
        return [1.0] * n_f
    t_comp = max(cm.stage_time(i, j, g) for i, j, g in layout)
    dense_t = [fence_time(cm, layout, k, 1.0)[1] for k in range(n_f)]
    floor_t = [min(dense_t[k], fence_time(cm, layout, k, cfg.rho_min)[1]) for k in range(n_f)]
    target = max(t_comp, *floor_t)
    rhos: list[float] = []
    for k in range(n_f):
        if dense_t[k] <= target:
            rhos.append(1.0)
            continue
        link = cm.group_link(layout[k][2], layout[k + 1][2])
        n = math.ceil(float(cm.cut[layout[k][1]]) / cfg.value_bytes)
        budget = (target / cfg.directions - link.latency_s) * link.bandwidth_bps
        rho = max_ratio(n, budget, value_bytes=cfg.value_bytes, index_bytes=cfg.index_bytes)
        rho = max(cfg.rho_min, quantize_rho(min(1.0, max(cfg.rho_min, rho))))
        dense = sends_dense(n, rho, dense_bytes=cfg.value_bytes, value_bytes=cfg.value_bytes,
                            index_bytes=cfg.index_bytes)
        rhos.append(1.0 if dense else rho)
    return rhos


def host_shares(cm: CostModel, devices: Sequence[int]) -> dict[int, float]:
    """How many times over the plan's *devices* book the cores of each one's host: the threads of the
    plan's CPU devices that name the same host (``DeviceProfile.host``) over that host's CPUs, at least 1.

    Each node benchmarks its device alone; nodes of one machine (``make demo``'s four on a 2-core host)
    then share its cores while they train, and a plan that counted each at its benchmarked rate predicted
    steps 4-15x too short (issue 44). Stages of a pipeline compute at the same time in the steady state of
    the schedule, so the sharing is counted in full: a pessimistic figure, as a host's word deserves (a
    node that names another's host slows only the predictions of plans that hold both)."""
    load: dict[str, int] = {}
    cpus: dict[str, int] = {}
    for d in devices:
        h = cm.hosts[d]
        if h:
            load[h] = load.get(h, 0) + cm.threads[d]
            cpus[h] = max(cpus.get(h, 0), cm.host_cpus[d])
    return {d: max(1.0, load[h] / cpus[h]) if (h := cm.hosts[d]) and cpus[h] > 0 else 1.0 for d in devices}


def with_host_shares(plan: Plan, cm: CostModel) -> Plan:
    """*plan* with its predicted stage and step times counting the cores its nodes share (:func:`host_shares`;
    the group runs in lockstep at the pace of its most crowded host). The planner scores every candidate
    with it (plan/joint.py). Measured on the 2-core machine with the demo's processes in a cpu cgroup of
    their own (cpu.shares 262144: the machine as good as idle to them, 2026-11-30): 1 stage x 2 replicas on
    2 of the 4 nodes 0.164 s a step, 2 x 2 on all 4 0.212 s; priced without the shares the 2 x 2 plan
    scored 11% faster and won. (Under other processes' heavy load the reverse can happen: a swarm's share
    of a busy machine grows with its process count, which a core count cannot see; at load 22-35 on
    2026-11-29 the 2-node plan measured 7.9 s a step, the 4-node one 2.66 s, both with the device profiles
    of that time, which read the load itself: swarm/device.py.)"""
    index = cm.index
    share = host_shares(cm, [index[p] for st in plan.stages for p in st.replicas])
    if all(v == 1.0 for v in share.values()):
        return plan
    stages = tuple(dataclasses.replace(st, compute_s=st.compute_s * max(share[index[p]] for p in st.replicas))
                   for st in plan.stages)
    bottleneck, step = step_time([s.compute_s for s in stages], [f.time_s for f in plan.fences], plan.micro_batches)
    return dataclasses.replace(plan, stages=stages, bottleneck_s=bottleneck, step_time_s=step)


def build_plan(
    cm: CostModel, layout: Layout, rhos: Sequence[float], *,
    job: str, epoch: int, snapshot_hash: str, algorithm: str, seed: int, balance: bool = False,
) -> Plan:
    """A :class:`Plan` for *layout* with every prediction computed under *cm*. With *balance*, a
    one-stage layout whose replicas differ in speed gives each replica micro-batches in proportion to
    its speed (``Plan.micro`` per ``Plan.micro_period`` steps, :meth:`CostModel.split_micro`) instead of
    running them in lockstep."""
    order = pipeline_order(cm, layout)
    dealt = cm.split_micro(order[0]) if balance and len(layout) == 1 else None
    micro, period = dealt if dealt is not None else (None, 1)
    if micro is not None:
        i, j, g = layout[0][0], layout[0][1], order[0]
        if cm.stage_time(i, j, g, micro) > (1.0 - BALANCE_MIN_GAIN) * cm.stage_time(i, j, g):
            micro, period = None, 1     # within the noise of measured speeds: lockstep (equal machines stay equal)
    stages = []
    for k, ((i, j, _), g) in enumerate(zip(layout, order)):
        reps = tuple(cm.peers[d] for d in g)
        stages.append(Stage(start=i, end=j, replicas=reps, compute_s=cm.stage_time(i, j, g, micro),
                            memory_bytes=cm.range_memory(i, j, replicated=len(g) > 1,
                                                         in_flight=cm.in_flight(k, len(layout)))))
    fences = []
    for k in range(len(layout) - 1):
        dense, t, dt = fence_time(cm, layout, k, rhos[k])
        link = cm.group_link(layout[k][2], layout[k + 1][2])
        fences.append(Fence(index=k, unit=layout[k][1], dense_bytes=dense, rho=rhos[k], time_s=t, dense_time_s=dt,
                            bandwidth_bps=min(link.bandwidth_bps, 1e30), latency_s=link.latency_s))
    bottleneck, step = step_time([s.compute_s for s in stages], [f.time_s for f in fences], cm.config.micro_batches)
    return Plan(job=job, epoch=epoch, snapshot_hash=snapshot_hash, algorithm=algorithm, seed=seed,
                n_units=cm.n_units, micro_batches=cm.config.micro_batches, stages=tuple(stages),
                fences=tuple(fences), bottleneck_s=bottleneck, step_time_s=step, micro=micro or (),
                micro_period=period)


def pipeline_order(cm: CostModel, layout: Layout) -> list[tuple[int, ...]]:
    """Each stage's replicas ordered so that replica r of consecutive stages are the pairs of
    :meth:`CostModel.pairing` (pipeline r runs over the fast pairs); unpaired replicas go last.

    The first stage is in peer-id order; the order is part of the plan (and of its hash).
    """
    out: list[tuple[int, ...]] = []
    for k, (_, _, g) in enumerate(layout):
        if k == 0:
            out.append(tuple(sorted(g, key=lambda d: cm.peers[d])))
            continue
        partner = dict(cm.pairing(out[-1], g))
        paired = [partner[x] for x in out[-1] if x in partner]
        rest = sorted((d for d in g if d not in paired), key=lambda d: cm.peers[d])
        out.append((*paired, *rest))
    return out


def layout_of(plan: Plan, cm: CostModel) -> Layout:
    """The layout of *plan* in *cm*'s device indices (KeyError if a replica is not a member)."""
    return [(s.start, s.end, tuple(cm.index[p] for p in s.replicas)) for s in plan.stages]


def predict(plan: Plan, workload: WorkloadGraph, snapshot: Snapshot, config: PlannerConfig | None = None) -> Prediction:
    """Predicted times of *plan* (with its own ratios) on *snapshot*; ValueError if it does not fit."""
    cfg = config or PlannerConfig(micro_batches=plan.micro_batches)
    if plan.n_units != len(workload.units):
        raise ValueError("the plan was made for a different workload")
    cm = CostModel(workload, snapshot, cfg)
    try:
        layout = layout_of(plan, cm)
    except KeyError as exc:
        raise ValueError(f"plan names a peer outside the snapshot: {exc}") from None
    share = host_shares(cm, [d for _, _, g in layout for d in g])
    stage_s = tuple(cm.stage_time(i, j, g, plan.micro or None) * max(share[d] for d in g) for i, j, g in layout)
    fence_s = tuple(fence_time(cm, layout, k, f.rho)[1] for k, f in enumerate(plan.fences))
    bottleneck, step = step_time(stage_s, fence_s, cfg.micro_batches)
    return Prediction(stage_s=stage_s, fence_s=fence_s, bottleneck_s=bottleneck, step_time_s=step,
                      throughput=cfg.micro_batches / step if step > 0 else math.inf)


def layout_fits(cm: CostModel, layout: Layout) -> bool:
    """True when every replica of every stage has the memory for it (with the micro-batches its schedule
    holds at once)."""
    for k, (i, j, g) in enumerate(layout):
        need = cm.range_memory(i, j, replicated=len(g) > 1, in_flight=cm.in_flight(k, len(layout)))
        if need > float(cm.mem_cap[list(g)].min()):
            return False
    return True
