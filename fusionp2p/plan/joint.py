"""Stages, replicas and AdaTopK ratios chosen together (ALGORITHMS.md §1.5-1.6, issue 20).

Theory of operation
-------------------
OP-Fence (opfence.py) places one device per stage and then hands left-over devices to the stage
where one more replica gains most; it never weighs *r pipelines of S stages* against *one pipeline
of r*S stages* as a whole, and a pipeline job needs the same number of replicas on every stage. This
module searches that grid and keeps OP-Fence as the inner solver:

1. *Candidates.* For every replica count ``r`` in ``1 .. r_max``:

   * ``r = 1``: OP-Fence itself over all devices (exact over device orders up to
     ``exact_search_devices``, the bandwidth-cluster order above); it may use fewer devices.
   * ``r > 1``: the devices, in the cluster order of ``cluster.device_order``, are dealt into
     ``D // r`` replica groups of ``r`` devices in two arrangements: *stage-major* (a group is ``r``
     consecutive devices: a stage's replicas sit in one cluster, the pipeline crosses clusters) and
     *pipeline-major* (``r`` blocks of ``D // r`` consecutive devices, group k takes the k-th device
     of every block: each block is a pipeline, e.g. one per site, and the averaging crosses the slow
     links, amortised over ``co2_tau`` steps). Each group is a super-device (``r x`` its slowest member's speed, less
     ``replica_overhead``; the smallest member's memory, less CO2's anchor and momentum; group links
     as ``CostModel.group_link``) and OP-Fence's search cuts the units over the super-devices; it may
     leave groups out (fewer stages, idle devices).
   * OP-Fence's own greedy replication (``add_replicas``), trimmed to the smallest count.
   * One stage (no pipeline) on the group that runs the whole model fastest, per arrangement, and
     one stage on the ``r`` fastest devices wherever they sit (``how = "fastest"``).

2. *Ratios and score.* Each candidate layout is refined under the real cost model (replica groups,
   the averaging round's floor), gets its AdaTopK ratios from the policy (``predict.choose_ratios``)
   and is scored by its predicted step time per ``M`` micro-batches of data
   (``Plan.step_time_s``: stage and fence times are throughput-equivalent, so ``r`` pipelines that
   each run ``M`` micro-batches per step count ``r`` times the data), its stages' compute multiplied by
   the cores their nodes share on one host (``predict.with_host_shares``).

3. *Choice.* The lowest score wins. A hint ``r_hint`` (the job's ``replicas``) is also the upper
   bound ``r_max``; another ``r`` must be predicted faster by more than ``HINT_MARGIN`` to beat it.
   Candidates within ``NEAR_TIE`` (5%) of the best score count as equals, and among them the one
   whose slowest link in use (fences, averaging rings) is fastest wins: the measured speeds move by
   more than that under load, and on ``benchmarks.wan``'s ``mixed`` swarm a pair behind a 10 Mbit/s
   link won by 0.4% of compute speed over the 1 Gbit/s pair (and trained 5x slower in that run).
   Remaining ties are broken by fewer replicas, then by the candidates' fixed order, so the result is
   a pure function of (workload, snapshot, config, seed): every member elects the same plan.
"""

from __future__ import annotations

import dataclasses
import logging

from fusionp2p.errors import ConfigError
from fusionp2p.plan.cluster import device_order
from fusionp2p.plan.config import PlannerConfig
from fusionp2p.plan.estimator import CostModel
from fusionp2p.plan.opfence import InfeasiblePlanError, _States, add_replicas, min_bottleneck_layout, refine
from fusionp2p.plan.plan import Candidate, Plan
from fusionp2p.plan.predict import Layout, build_plan, choose_ratios, layout_fits, with_host_shares
from fusionp2p.plan.snapshot import Link, Snapshot
from fusionp2p.types import DeviceProfile, WorkloadGraph

log = logging.getLogger(__name__)

HINT_MARGIN = 0.10       # another replica count must be predicted this much faster than the hint
NEAR_TIE = 0.05          # candidates predicted within this of the best count as equally fast
MAX_GRID_DEVICES = 64    # above this many devices only r in {1, 2, 4, 8, ...} and the hint are tried


def replica_groups(order: list[int], r: int, arrangement: str) -> list[tuple[int, ...]]:
    """``len(order) // r`` groups of *r* devices dealt from *order* (see the module docstring)."""
    n = len(order) // r
    if arrangement == "stage-major":
        return [tuple(order[k * r:(k + 1) * r]) for k in range(n)]
    if arrangement == "pipeline-major":
        return [tuple(order[p * n + k] for p in range(r)) for k in range(n)]
    raise ValueError(f"unknown arrangement {arrangement!r}")


def _group_layout(cm: CostModel, workload: WorkloadGraph, groups: list[tuple[int, ...]], job: str) -> Layout:
    """OP-Fence's search over the replica groups as super-devices; the layout in real device indices."""
    cfg = cm.config
    r = len(groups[0])
    names = [f"g{k:05d}" for k in range(len(groups))]
    members = {}
    for name, g in zip(names, groups):
        speed = cm.group_speed(g) / (1.0 + cfg.replica_overhead)
        mem = float(cm.mem_cap[list(g)].min()) / cfg.memory_headroom
        members[name] = DeviceProfile(device="group", kind="group", name=name, flops_fp32=speed, flops_bf16=0.0,
                                      act_rate=speed / cm.act_flops if cm.act_flops > 0 else 0.0,
                                      memory_bytes=max(1, int(mem)))
    links = {}
    for a in range(len(groups)):
        for b in range(a + 1, len(groups)):
            lk = cm.group_link(groups[a], groups[b])
            links[(names[a], names[b])] = Link(bandwidth_bps=min(lk.bandwidth_bps, 1e30), latency_s=lk.latency_s)
    gcfg = dataclasses.replace(cfg, param_memory_factor=cfg.param_memory_factor + (cfg.replica_memory_factor if r > 1 else 0.0),
                               replicated_devices=r > 1)
    gsnap = Snapshot(job=job, epoch=0, members=members, links=links)
    gcm = CostModel(workload, gsnap, gcfg)
    n = len(groups)
    states = _States.subsets(list(range(n))) if n <= cfg.exact_search_devices else _States.ordered(list(range(n)), cfg.skip_window)
    layout = min_bottleneck_layout(gcm, states, job=job)
    return [(i, j, groups[g[0]]) for i, j, g in layout]


def _slowest_link(cm: CostModel, plan: Plan) -> float:
    """Bandwidth of the slowest link *plan* depends on: its fences' group links and every replicated
    stage's averaging ring (inf for one device alone)."""
    bws = [f.bandwidth_bps for f in plan.fences]
    for st in plan.stages:
        idx = [cm.index[p] for p in st.replicas]
        bws.extend(float(cm.bw[a, b]) for k, a in enumerate(idx) for b in idx[k + 1:])
    return min(bws, default=float("inf"))


def _trimmed(layout: Layout, r: int) -> Layout:
    return [(i, j, tuple(sorted(g)[:r])) for i, j, g in layout]


def plan_joint(workload: WorkloadGraph, snapshot: Snapshot, config: PlannerConfig | None = None, *,
               replicas: int | None = None, stages: int | None = None, seed: int = 0) -> Plan:
    """The best plan over stages x replicas with AdaTopK ratios (module docstring). *replicas* is the
    job's hint and bound (None: any count up to the number of members); *stages* the only stage count
    considered (None: any).

    Raises :class:`InfeasiblePlanError` when no candidate fits the members' memory.
    """
    cfg = config or PlannerConfig()
    if not workload.units:
        raise ConfigError("the workload has no units")
    if replicas is not None and replicas < 1:
        raise ConfigError("replicas must be >= 1")
    cm = CostModel(workload, snapshot, cfg)
    d = cm.n_devices
    r_max = d if replicas is None else min(replicas, d)
    rs = list(range(1, r_max + 1))
    if d > MAX_GRID_DEVICES:
        rs = sorted({r for r in rs if r & (r - 1) == 0} | {r_max})
    _, order = device_order(cm.bw, cm.flops, cfg.cluster_theta, seed)

    # The layout searches price every fence at the floor's bytes (``min_byte_factor``) when compression
    # is on, which favours extra fences that the ratios actually chosen then make slower than a plan with
    # fewer. So with compression the layouts are also searched with dense fences, and every candidate is
    # scored under the real model (ratios from ``choose_ratios``): allowing AdaTopK only adds options.
    layouts: list[tuple[str, Layout, CostModel]] = []
    infeasible: InfeasiblePlanError | None = None
    states = _States.subsets(list(range(d))) if d <= cfg.exact_search_devices else _States.ordered(order, cfg.skip_window)
    grouped = [(arrangement, replica_groups(order, r, arrangement)) for r in rs if r > 1
               for arrangement in ("stage-major", "pipeline-major")
               if not (r == d and arrangement == "pipeline-major")]   # one group of every device: stage-major's
    variants = [cm] if not cfg.compression else [cm, CostModel(workload, snapshot, dataclasses.replace(cfg, compression=False))]
    for vcm in variants:
        one = CostModel(workload, snapshot, dataclasses.replace(vcm.config, replicas=False))
        try:
            base = refine(vcm, min_bottleneck_layout(one, states, job=snapshot.job), vcm.cut * vcm.min_byte_factor)
            layouts.append(("op-fence", base, vcm))
            if r_max > 1 and d > 1:
                greedy = add_replicas(vcm, base, vcm.cut * vcm.min_byte_factor)
                r_g = min(r_max, min(len(g) for _, _, g in greedy))
                if r_g > 1:
                    layouts.append(("op-fence+replicas", _trimmed(greedy, r_g), vcm))
        except InfeasiblePlanError as exc:
            infeasible = infeasible or exc
        for arrangement, groups in grouped:
            try:
                layouts.append((arrangement, _group_layout(vcm, workload, groups, snapshot.job), vcm))
            except InfeasiblePlanError as exc:
                infeasible = infeasible or exc
            if vcm is cm:
                # the searches minimise the bottleneck, not the step (fill and drain count too): the whole
                # model on the group that runs it fastest is always a candidate, so a pipeline must beat it
                # (it has no fence, so the fence pricing of the variants does not change it: added once).
                # Fastest under the whole cost model, its averaging ring included: the group of the
                # fastest devices may sit behind slow links
                n_u = len(workload.units)
                fastest = min(groups, key=lambda g: (cm.stage_time(0, n_u, g), min(g)))
                layouts.append((arrangement, [(0, n_u, fastest)], cm))
    # Data parallel on the r fastest devices wherever they sit (r = 2 .. r_max): the replicas run in
    # lockstep, so these are the best r for compute, and whether their averaging ring (across sites,
    # amortised over tau steps) pays for itself is for the cost model to say. Neither arrangement
    # forms this group when the fast devices are spread over clusters.
    by_speed = sorted(range(d), key=lambda x: (-float(cm.flops[x]), x))
    layouts.extend(("fastest", [(0, len(workload.units), tuple(by_speed[:r]))], cm) for r in rs if r > 1)
    scored: list[tuple[float, int, int, str, Plan]] = []
    seen: set[tuple[tuple[int, int, tuple[int, ...]], ...]] = set()
    for idx, (how, layout, vcm) in enumerate(layouts):
        layout = refine(vcm, layout, vcm.cut * vcm.min_byte_factor)
        key = tuple((i, j, tuple(sorted(g))) for i, j, g in layout)
        if key in seen or not layout_fits(cm, layout) or (stages is not None and len(layout) != stages):
            continue
        seen.add(key)
        # scored with the cores its nodes share (predict.with_host_shares): four 1-thread nodes of a 2-core host
        # run a 2 x 2 plan at half the speed their benchmarks give, two of them a 1 x 2 plan at full speed
        plan = with_host_shares(build_plan(cm, layout, choose_ratios(cm, layout), job=snapshot.job, epoch=snapshot.epoch,
                                           snapshot_hash=snapshot.snapshot_hash(), algorithm="op-fence", seed=seed,
                                           balance=cfg.balance_micro), cm)
        r = len(layout[0][2])
        adj = plan.step_time_s if (replicas is None or r == r_max) else plan.step_time_s / (1.0 - HINT_MARGIN)
        scored.append((adj, r, idx, how, plan))
    if not scored:
        if stages is not None:
            raise InfeasiblePlanError(f"job {snapshot.job!r}: no layout of {stages} stage(s) among those the planner "
                                      f"considers for {d} member(s) fits their memory (TrainConfig.stages)")
        if infeasible is not None:
            raise infeasible
        raise InfeasiblePlanError(f"job {snapshot.job!r}: no stage layout fits the members' memory")
    scored.sort(key=lambda t: (t[0], t[1], t[2]))
    # Candidates within NEAR_TIE of the best are equals (measured speeds move by more than that under
    # load): among them the one whose slowest link in use (fences and averaging rings) is fastest wins
    near = [t for t in scored if t[0] <= scored[0][0] * (1.0 + NEAR_TIE)]
    pick = min(near, key=lambda t: (-_slowest_link(cm, t[4]), t[0], t[1], t[2]))
    scored.remove(pick)
    scored.insert(0, pick)
    best = scored[0][4]
    considered = tuple(Candidate(replicas=r, stages=len(p.stages), how=how, step_time_s=p.step_time_s)
                       for _, r, _, how, p in scored[: Plan.MAX_CANDIDATES])
    best = dataclasses.replace(best, considered=considered, how=scored[0][3])
    log.debug("joint plan: %d stages x %d replicas (%s), step %.4g s, %d candidates", len(best.stages),
              len(best.stages[0].replicas), best.how, best.step_time_s, len(scored))
    return best


__all__ = ["HINT_MARGIN", "NEAR_TIE", "plan_joint", "replica_groups"]
