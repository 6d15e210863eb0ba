"""OP-Fence: cut the unit order into pipeline stages over heterogeneous devices (ALGORITHMS.md §1.5).

Theory of operation
-------------------
Objective: minimise the pipeline bottleneck ``T = max(stage compute, fence transfer)`` (seconds per
micro-batch), subject to every device's memory. A stage is a contiguous unit range on one device;
its fence to the next stage costs ``directions * (latency + bytes / bandwidth)`` on the link
between the two devices, where ``bytes`` may shrink to the AdaTopK floor when compression is on.

1. *Search space.* Devices are placed in an order and a plan uses a subsequence of it: stage k+1
   sits on a device that comes after stage k's. With at most ``exact_search_devices`` devices every
   order is searched (a DP over subsets of devices), so the result is the exact optimum over all
   contiguous partitions and all assignments; otherwise the order is the bandwidth-cluster order
   (cluster.py), and the DP is exact over subsequences of it.
2. *Decision procedure.* For a candidate ``T`` a reachability sweep decides whether the units can be
   covered: for each state (a device, with its predecessors) the cuts where a stage may start are
   those reached by a predecessor whose link carries that cut within ``T``; from a start ``i`` a
   stage can end anywhere up to ``rmax(i)``, the last unit that fits ``T * flops`` and the device's
   memory (prefix sums + ``searchsorted``; ``rmax`` is monotone, so the latest start dominates and
   a whole row is one vectorised pass). Cost O(states * predecessors * N) per candidate, i.e.
   O(D * min(D, skip_window) * N) on the cluster order. Memory counts the activations of the
   micro-batches a stage's schedule holds at once (``config.in_flight_limit``): under 1F1B
   ``min(S - stage, M)``, which depends on how many stages follow; where memory binds, each state is
   searched once per level (stages left, capped at ``min(M, D)``; ``_States.levelled``), so the search
   stays exact, at ``min(M, D)`` times the cost. Under GPipe, or where the whole model with every
   micro-batch in flight fits every device, there are no levels.
3. *Bisection* on ``T`` (geometric, to relative 1e-9) between a lower bound (perfect parallelism)
   and an upper bound that is always feasible when memory is; each feasible probe is backtracked
   into stages and ``hi`` snaps down to their real bottleneck, so few probes are needed.
4. *Refinement.* Pairwise rebalancing of neighbouring stages (never raises the bottleneck; it
   spreads the slack of non-bottleneck stages evenly, which also shortens fill and drain).
5. *Replicas.* Devices left over join, one at a time, the stage whose replication lowers the
   bottleneck most (cost model in CostModel.stage_time: r x the slowest replica's speed, as the
   replicas run in lockstep; 5% overhead; CO2's ring all-reduce amortised over the ``tau * M * r``
   micro-batches the group computes between rounds); then step 4 runs again.
6. *Compression.* AdaTopK ratios per fence (predict.choose_ratios).
"""

from __future__ import annotations

import itertools
import logging
import math

import numpy as np
import numpy.typing as npt

from fusionp2p.errors import ConfigError, PlanError
from fusionp2p.plan.cluster import device_order
from fusionp2p.plan.config import PlannerConfig
from fusionp2p.plan.estimator import CostModel
from fusionp2p.plan.plan import Plan
from fusionp2p.plan.predict import Layout, build_plan, choose_ratios
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.types import WorkloadGraph

log = logging.getLogger(__name__)

F64 = npt.NDArray[np.float64]
BoolA = npt.NDArray[np.bool_]
Idx = npt.NDArray[np.intp] | npt.NDArray[np.int64] | int
GiB = float(1 << 30)
REL_TOL = 1e-9


class InfeasiblePlanError(PlanError, ConfigError):
    """The job cannot be placed on the members at all (memory). A PlanError and a ConfigError."""


class _States:
    """DP states in topological order: ``dev[s]`` the device, ``preds[s]`` earlier states, ``first[s]``
    whether a pipeline may start there."""

    def __init__(self, dev: list[int], preds: list[npt.NDArray[np.intp]], first: list[bool]) -> None:
        self.dev = dev
        self.preds = preds
        self.first = first

    @classmethod
    def ordered(cls, order: list[int], window: int | None = None) -> _States:
        """Subsequences of *order*; with *window*, consecutive stages are at most that many apart."""
        w = len(order) if window is None else window
        return cls(list(order), [np.arange(max(0, q - w), q, dtype=np.intp) for q in range(len(order))], [True] * len(order))

    @classmethod
    def subsets(cls, devices: list[int]) -> _States:
        d = len(devices)
        sid: dict[tuple[int, int], int] = {}
        dev: list[int] = []
        preds: list[npt.NDArray[np.intp]] = []
        first: list[bool] = []
        for mask in range(1, 1 << d):
            for q in range(d):
                if not mask >> q & 1:
                    continue
                prev = mask ^ (1 << q)
                sid[(mask, q)] = len(dev)
                dev.append(devices[q])
                preds.append(np.array([sid[(prev, p)] for p in range(d) if prev >> p & 1], dtype=np.intp))
                first.append(prev == 0)
        return cls(dev, preds, first)

    def levelled(self, levels: int) -> tuple[_States, list[int]]:
        """These states, each once per level ``1..levels``: the stages left in the pipeline, this one included
        (capped at *levels*), so that a stage is priced with the micro-batches its 1F1B schedule holds at
        once, ``min(S - stage, M)`` (``config.in_flight_limit``). State ``(q, l)`` follows ``(p, l + 1)`` for
        each predecessor ``p`` of ``q`` (and ``(p, levels)`` at the cap); only level 1 ends a pipeline.
        Returns the states and each one's level; the order stays topological."""
        dev: list[int] = []
        preds: list[npt.NDArray[np.intp]] = []
        first: list[bool] = []
        level: list[int] = []
        for q, d in enumerate(self.dev):
            for lv in range(1, levels + 1):
                preds.append(self.preds[q] * levels + min(lv, levels - 1))   # (p, lv + 1), or (p, levels) at the cap
                dev.append(d)
                first.append(self.first[q])
                level.append(lv)
        return _States(dev, preds, first), level


def _levels(cm: CostModel, states: _States) -> int:
    """How many levels the search needs (:meth:`_States.levelled`); 0 for none, every stage priced with all
    ``M`` micro-batches in flight: under GPipe, and where memory never binds (the whole model with every
    micro-batch in flight fits each device: then the layouts are the same whatever the pricing)."""
    if cm.in_flight(0, 1) == cm.config.micro_batches:
        return 0   # a stage holds every micro-batch whatever the pipeline (GPipe, or one micro-batch a step)
    if float(cm.mem[-1]) + float(cm.range_extra(0, cm.n_units)) <= float(cm.mem_cap.min()):
        return 0
    return min(cm.config.micro_batches, len(set(states.dev)))


class _Search:
    """Decision procedure and backtrack of step 2 for one cost model."""

    def __init__(self, cm: CostModel, states: _States, *, ignore_links: bool = False) -> None:
        self.cm = cm
        levels = _levels(cm, states)
        if levels:
            states, level = states.levelled(levels)
            # a stage at level l holds min(l, M) micro-batches at once: the 1F1B bound of a stage l from the end
            self.held = [cm.in_flight(0, lv) for lv in level]
            self.last = [lv == 1 for lv in level]
        else:
            self.held = [cm.config.micro_batches] * len(states.dev)
            self.last = [True] * len(states.dev)
        self.st = states
        self.n = cm.n_units
        self.ignore_links = ignore_links
        self.cut_eff: F64 = np.zeros(self.n + 1) if ignore_links else cm.cut * cm.min_byte_factor
        self.R: npt.NDArray[np.bool_] = np.zeros((len(states.dev), self.n + 1), dtype=bool)
        self.E: npt.NDArray[np.bool_] = np.zeros((len(states.dev), self.n), dtype=bool)
        self.live: npt.NDArray[np.bool_] = np.zeros(len(states.dev), dtype=bool)
        self.dev: npt.NDArray[np.intp] = np.array(states.dev, dtype=np.intp)
        self.rmax: dict[tuple[int, int], npt.NDArray[np.intp]] = {}   # by (device, micro-batches held)
        self.T = math.inf
        self._mem_limits: dict[tuple[float, int], npt.NDArray[np.intp]] = {}  # independent of T: kept across probes

    def _limit(self, prefix: F64, cap: float, cache: dict[tuple[float, int], npt.NDArray[np.intp]],
               key: int = 0) -> npt.NDArray[np.intp]:
        """For every start i, the last end j with prefix[j] - prefix[i] <= cap (cached by cap and *key*)."""
        got = cache.get((cap, key))
        if got is None:
            got = cache[(cap, key)] = np.searchsorted(prefix, prefix[: self.n] + cap, side="right") - 1
        return got

    def _mem_limit(self, held: int, cap: float) -> npt.NDArray[np.intp]:
        """For every start i, the last end j whose range fits *cap* with *held* micro-batches in flight: the
        prefix sum's limit, then lowered while the range's largest tensor (not a prefix sum) does not fit
        (both terms grow with j, so the first end that fits is the last)."""
        got = self._mem_limits.get((cap, held))
        if got is None:
            prefix = self.cm.mem_prefix(held)
            got = np.searchsorted(prefix, prefix[: self.n] + cap, side="right") - 1
            idx = np.arange(self.n)
            while True:
                bad = (got > idx) & (prefix[got] - prefix[idx] + self.cm.range_extra(idx, got) > cap)
                if not bad.any():
                    break
                got = np.where(bad, got - 1, got)
            self._mem_limits[(cap, held)] = got
        return got

    def thr(self, a: npt.NDArray[np.intp] | int, b: int, T: float) -> F64:
        """Largest cut (effective bytes) a link a->b carries within T."""
        if self.ignore_links:
            return np.full(np.shape(a), np.inf)
        cm = self.cm
        with np.errstate(invalid="ignore"):
            return np.asarray((T / cm.config.directions - cm.lat[a, b]) * cm.bw[a, b], dtype=np.float64)

    def feasible(self, T: float) -> int | None:
        """The first state whose reach covers every unit within *T*, or None."""
        cm, n = self.cm, self.n
        self.T = T
        self.rmax = {}
        self.R[:] = False
        self.E[:] = False
        self.live[:] = False
        ends = np.arange(1, n + 1)
        idx = np.arange(n)
        by_cap: dict[tuple[float, int], npt.NDArray[np.intp]] = {}   # devices of equal speed share one search
        for s, d in enumerate(self.st.dev):
            held = self.held[s]
            rmax = self.rmax.get((d, held))
            if rmax is None:
                rmax = self.rmax[(d, held)] = np.minimum(
                    self._limit(cm.work, T * float(cm.flops[d]), by_cap),
                    self._mem_limit(held, float(cm.mem_cap[d])))
            entry = self.E[s]
            preds = self.st.preds[s]
            if len(preds):
                live = preds[self.live[preds]]
                if len(live):
                    thr = self.thr(self.dev[live], d, T)
                    best = np.where(self.R[live, :n], thr[:, None], -np.inf).max(axis=0)
                    entry |= best >= self.cut_eff[:n]
            entry[0] = self.st.first[s]
            latest = np.maximum.accumulate(np.where(entry, idx, -1))
            self.R[s, 1:] = (latest >= 0) & (rmax[np.maximum(latest, 0)] >= ends)
            self.live[s] = self.R[s].any()
            if self.R[s, n] and self.last[s]:
                return s
        return None

    def bottleneck(self, layout: Layout) -> float:
        """The DP's objective for a one-device-per-stage layout (links at the AdaTopK floor)."""
        cm = self.cm
        worst = max(float(cm.work[j] - cm.work[i]) / float(cm.flops[g[0]]) for i, j, g in layout)
        if not self.ignore_links:
            for (_, j, (a,)), (_, _, (b,)) in itertools.pairwise(layout):
                worst = max(worst, cm.config.directions * (float(cm.lat[a, b]) + float(self.cut_eff[j]) / float(cm.bw[a, b])))
        return worst

    def backtrack(self, s: int) -> Layout:
        """Stages of the reach found by the last :meth:`feasible` call, ending in state *s*."""
        layout: Layout = []
        j = self.n
        while True:
            d = self.st.dev[s]
            starts = np.nonzero(self.E[s, :j] & (self.rmax[(d, self.held[s])][:j] >= j))[0]
            i = int(starts[-1])
            layout.append((i, j, (d,)))
            if i == 0 and self.st.first[s]:
                break
            preds = self.st.preds[s]
            live = preds[self.R[preds, i]]
            thr = self.thr(self.dev[live], d, self.T)
            ok = thr >= self.cut_eff[i]
            s, j = int(live[ok][np.argmax(thr[ok])]), i
        layout.reverse()
        return layout


def _check_memory(cm: CostModel, job: str) -> None:
    units_mem = np.diff(cm.mem)
    cap = float(cm.mem_cap.max())
    worst = int(np.argmax(units_mem)) if len(units_mem) else 0
    total = float(cm.mem[-1])
    raise InfeasiblePlanError(
        f"job {job!r} does not fit the members' memory: it needs {total / GiB:.3g} GiB (parameters x"
        f"{cm.config.param_memory_factor:g} for gradients and optimizer state, plus activations of up to "
        f"{cm.config.micro_batches} micro-batches in flight) and the {cm.n_devices} members offer "
        f"{float(cm.mem_cap.sum()) / GiB:.3g} GiB usable in total; unit {worst} alone needs "
        f"{float(units_mem[worst]) / GiB:.3g} GiB and the largest device has {cap / GiB:.3g} GiB usable. "
        "Add members with more memory, lower micro_batches, or use a smaller model."
    )


def min_bottleneck_layout(cm: CostModel, states: _States, *, job: str = "", ignore_links: bool = False) -> Layout:
    """Steps 2-3: the layout (one device per stage) with the least bottleneck in *states*' space."""
    search = _Search(cm, states, ignore_links=ignore_links)
    if search.feasible(math.inf) is None:
        _check_memory(cm, job)
    total = float(cm.work[-1])
    fmin, fmax, fsum = float(cm.flops.min()), float(cm.flops.max()), float(cm.flops.sum())
    link_worst = 0.0 if ignore_links else cm.config.directions * float(
        np.max(cm.lat) + float(np.max(search.cut_eff)) / float(np.min(cm.bw)))
    hi = max(total / fmin + link_worst, 1e-30) * (1 + 1e-6)
    lo = max(total / fsum, float(np.max(np.diff(cm.work))) / fmax, 1e-30 * hi) * (1 - 1e-9)
    s = search.feasible(hi)
    if s is None:  # pragma: no cover - the bound above is feasible whenever memory is
        hi = math.inf
        s = search.feasible(hi)
        assert s is not None
    best = search.backtrack(s)
    hi = min(hi, search.bottleneck(best))
    # Geometric bisection that snaps to the bottleneck actually achieved: a feasible probe lowers
    # hi to its layout's true bottleneck, often far below the probe.
    while hi / lo > 1 + REL_TOL:
        mid = math.sqrt(lo * hi)
        s = search.feasible(mid)
        if s is None:
            lo = mid
        else:
            best = search.backtrack(s)
            hi = min(mid, search.bottleneck(best))
    return best


# -- refinement and replicas ------------------------------------------------------------------------
def _link_time(cm: CostModel, a: tuple[int, ...], b: tuple[int, ...], cut_eff: F64) -> F64:
    link = cm.group_link(a, b)
    return np.asarray(cm.config.directions * (link.latency_s + cut_eff / link.bandwidth_bps), dtype=np.float64)


def _stage_vec(cm: CostModel, i: Idx, j: Idx, g: tuple[int, ...]) -> F64:
    """Vectorised CostModel.stage_time over arrays of range ends."""
    i_a, j_a = np.asarray(i), np.asarray(j)
    t = cm.replicated_time(np.asarray(cm.work[j_a] - cm.work[i_a], dtype=np.float64),
                           np.asarray(cm.params[j_a] - cm.params[i_a], dtype=np.float64), g)
    return np.asarray(t, dtype=np.float64)


def _mem_ok(cm: CostModel, i: Idx, j: Idx, g: tuple[int, ...], stage: int, stages: int) -> BoolA:
    """Whether ranges ``[i, j)`` fit every device of *g* as *stage* of a *stages*-stage pipeline (the micro-
    batches its schedule holds at once); vectorised over arrays of range ends, at the search's upper bound."""
    i_a, j_a = np.asarray(i), np.asarray(j)
    mem = cm.mem_prefix(cm.in_flight(stage, stages))
    need = mem[j_a] - mem[i_a] + cm.range_extra(i_a, j_a, replicated=len(g) > 1)
    if len(g) > 1:
        need = need + cm.config.replica_memory_factor * (cm.params[j_a] - cm.params[i_a])
    return np.asarray(need <= float(cm.mem_cap[list(g)].min()), dtype=bool)


def refine(cm: CostModel, layout: Layout, cut_eff: F64, *, max_sweeps: int = 50) -> Layout:
    """Step 4: move each fence to balance its two neighbours without raising their max."""
    out = list(layout)
    for _ in range(max_sweeps):
        changed = False
        for k in range(len(out) - 1):
            (a, b, ga), (_, c, gb) = out[k], out[k + 1]
            if c - a < 2:
                continue
            cand = np.arange(a + 1, c)
            ta, tb = _stage_vec(cm, a, cand, ga), _stage_vec(cm, cand, c, gb)
            cost = np.maximum(np.maximum(ta, tb), _link_time(cm, ga, gb, cut_eff[cand]))
            cost = np.where(_mem_ok(cm, a, cand, ga, k, len(out)) & _mem_ok(cm, cand, c, gb, k + 1, len(out)), cost, np.inf)
            spread = np.abs(ta - tb)
            cur = b - a - 1
            best = int(np.lexsort((spread, cost))[0])
            if cost[best] < cost[cur] or (cost[best] == cost[cur] and spread[best] < spread[cur] * (1 - 1e-12)):
                out[k], out[k + 1] = (a, int(cand[best]), ga), (int(cand[best]), c, gb)
                changed = True
        if not changed:
            break
    return out


def _elements(cm: CostModel, layout: Layout, cut_eff: F64) -> list[float]:
    out = [float(_stage_vec(cm, i, j, g)) for i, j, g in layout]
    out += [float(_link_time(cm, layout[k][2], layout[k + 1][2], cut_eff[layout[k][1]])) for k in range(len(layout) - 1)]
    return out


def add_replicas(cm: CostModel, layout: Layout, cut_eff: F64) -> Layout:
    """Step 5: each left-over device (fastest first) joins the stage where it shortens the predicted
    step most — the bottleneck stage when there is one, since the step is ``(M-1) * max + sum`` —
    and stays idle when no stage gains."""
    used = {d for _, _, g in layout for d in g}
    left = sorted((d for d in range(cm.n_devices) if d not in used), key=lambda d: (-float(cm.flops[d]), d))
    out = list(layout)
    s_n = len(out)
    m1 = cm.config.micro_batches - 1
    for d in left:
        elems = _elements(cm, out, cut_eff)
        cur = m1 * max(elems) + math.fsum(elems)
        best: tuple[float, int] | None = None
        for k in range(s_n):
            i, j, g = out[k]
            ng = tuple(sorted((*g, d)))
            if not bool(_mem_ok(cm, i, j, ng, k, s_n)):
                continue
            new = list(elems)
            new[k] = float(_stage_vec(cm, i, j, ng))
            if k > 0:
                new[s_n + k - 1] = float(_link_time(cm, out[k - 1][2], ng, cut_eff[i]))
            if k < s_n - 1:
                new[s_n + k] = float(_link_time(cm, ng, out[k + 1][2], cut_eff[j]))
            if max(new) > max(elems):
                continue
            step = m1 * max(new) + math.fsum(new)
            if step < cur * (1 - 1e-9) and (best is None or step < best[0]):
                best = (step, k)
        if best is not None:
            i, j, g = out[best[1]]
            out[best[1]] = (i, j, tuple(sorted((*g, d))))
    return out


# -- the planner ------------------------------------------------------------------------------------
def make_plan(workload: WorkloadGraph, snapshot: Snapshot, config: PlannerConfig | None = None, seed: int = 0) -> Plan:
    """OP-Fence plan of *workload* on *snapshot*: a pure function of its arguments.

    Raises :class:`InfeasiblePlanError` (a PlanError and a ConfigError) when no placement fits the
    members' memory, and ConfigError for an empty workload.
    """
    cfg = config or PlannerConfig()
    if not workload.units:
        raise ConfigError("the workload has no units")
    cm = CostModel(workload, snapshot, cfg)
    if cm.n_devices <= cfg.exact_search_devices:
        states = _States.subsets(list(range(cm.n_devices)))
    else:
        _, order = device_order(cm.bw, cm.flops, cfg.cluster_theta, seed)
        states = _States.ordered(order, cfg.skip_window)
    layout = min_bottleneck_layout(cm, states, job=snapshot.job)
    cut_eff = cm.cut * cm.min_byte_factor
    layout = refine(cm, layout, cut_eff)
    if cfg.replicas:
        layout = add_replicas(cm, layout, cut_eff)
        layout = refine(cm, layout, cut_eff)
    rhos = choose_ratios(cm, layout)
    plan = build_plan(cm, layout, rhos, job=snapshot.job, epoch=snapshot.epoch,
                      snapshot_hash=snapshot.snapshot_hash(), algorithm="op-fence", seed=seed)
    log.debug("op-fence: %d stages, bottleneck %.4g s, step %.4g s", len(plan.stages), plan.bottleneck_s, plan.step_time_s)
    return plan
