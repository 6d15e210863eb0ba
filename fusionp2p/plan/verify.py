"""Whether a plan's estimated links decide its layout, and which pairs to measure before it is adopted.

A node measures a bounded set of its pairs (docs/swarm.md, "Bounded probing") and the others are estimated
from the two ends' announced capacities (``BandwidthTable.estimate``). An estimate can be wrong by the
slack the table grants an announcement over what others measured (``CAPACITY_SLACK``, 4x), and by any
amount for a node nobody measured yet. So before a plan is adopted (the publisher's first plan:
``jobs/verify_links.py``) the links it depends on are checked:

1. :func:`plan_pairs`: the pairs the plan runs on: each pipeline's consecutive stages (pipeline ``r`` runs
   over ``stages[k].replicas[r]`` and ``stages[k + 1].replicas[r]``) and every pair of a stage's replicas
   (the averaging's all-to-all). The pairs among them whose figure is an estimate are the plan's
   *estimated pairs*.
2. :func:`check`: the plan is made again with those pairs at the low end of their estimate
   (:func:`pessimistic`: the estimate over ``ESTIMATE_ERROR``, and never above the median of the
   snapshot's measured links, so that an absurd announcement nobody has measured yet is tested at a rate
   the swarm has actually shown), but not below a rate the pair is known to reach (*floors*: the caller's;
   the publisher's is the smaller of the best rates others measured on a link of each end, a lower bound
   of the pair's rate where a pair's rate is its two ends' access links, the model the estimates assume). If the layout (each stage's units and members) is the same, the estimate
   does not decide the choice and the plan stands; so too when the plan, priced at those low ends, is
   predicted at most ``MARGIN`` (5%) slower than the layout that won there. Otherwise the estimated pairs are to be measured, at
   most ``MAX_PAIRS`` of them, the highest estimates first (the likeliest to be announcements nobody
   backs).
3. :func:`with_measured`: the snapshot with the measured figures in place of the estimates (a measurement
   always wins over an estimate; a pair not measured keeps its estimate), which is then planned once more
   and adopted. There is no second round: the measured plan may depend on other estimated pairs, which
   are left as they are (bounded work, stated in the log).

Pure: no trio, no sockets, no clock; the caller passes the planner (``replan``) so that the check plans
exactly as the adoption does.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from fusionp2p.plan.plan import Plan
from fusionp2p.plan.snapshot import Link, Snapshot

Pair = tuple[str, str]

MAX_PAIRS = 16          # pairs measured before a plan is adopted, at most
# the low end of an estimate: the table takes an announced capacity up to CAPACITY_SLACK (swarm/membership.py,
# 4x) over the best rate others measured of the node, so a link estimated from it may be that much slower
ESTIMATE_ERROR = 4.0
# the plan at its estimates' low end predicted at most this much slower than the layout that wins there: the
# estimate does not decide (within the noise of measured speeds, as the planner's BALANCE_MIN_GAIN)
MARGIN = 0.05


def pair(a: str, b: str) -> Pair:
    return (a, b) if a <= b else (b, a)


def plan_pairs(plan: Plan) -> set[Pair]:
    """The member pairs *plan* runs on: each pipeline's consecutive stages and each stage's replicas."""
    out: set[Pair] = set()
    for k in range(len(plan.stages) - 1):
        here, there = plan.stages[k].replicas, plan.stages[k + 1].replicas
        for r in range(min(len(here), len(there))):
            if here[r] != there[r]:
                out.add(pair(here[r], there[r]))
    for st in plan.stages:
        for i, a in enumerate(st.replicas):
            out.update(pair(a, b) for b in st.replicas[i + 1:] if a != b)
    return out


def layout(plan: Plan) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """What the check compares: each stage's units and members (not its ratios, nor its predicted times)."""
    return tuple((st.start, st.end, st.replicas) for st in plan.stages)


def measured_median(snap: Snapshot, estimated: Collection[Pair]) -> float:
    """The median bandwidth of *snap*'s links that are not estimates (0: none)."""
    est = {pair(*p) for p in estimated}
    rates = [lk.bandwidth_bps for k, lk in snap.links.items() if k not in est]
    return statistics.median(rates) if rates else 0.0


def pessimistic(est: Link, ceiling: float) -> Link:
    """The low end of an estimated link: its rate over ``ESTIMATE_ERROR``, at most *ceiling* (when > 0)."""
    bw = est.bandwidth_bps / ESTIMATE_ERROR
    if ceiling > 0:
        bw = min(bw, ceiling)
    return Link(bandwidth_bps=bw, latency_s=est.latency_s)


def low_end(est: Link, ceiling: float, floor: float) -> Link:
    """Where an estimated link is checked: :func:`pessimistic`, but not below *floor* (a rate the pair is
    known to reach: ``jobs/verify_links.floors``, from what others measured of its two ends), nor above the
    estimate."""
    low = pessimistic(est, ceiling)
    if floor > low.bandwidth_bps:
        return Link(bandwidth_bps=min(floor, est.bandwidth_bps), latency_s=est.latency_s)
    return low


@dataclass(frozen=True, slots=True)
class PairCheck:
    """What :func:`check` found: the plan's estimated pairs, whether they decide its layout, and the pairs to
    measure (empty when they do not decide)."""

    depends: tuple[Pair, ...] = ()     # estimated pairs the plan runs on (sorted)
    decides: bool = False              # at their low end another layout wins
    ask: tuple[Pair, ...] = ()         # to measure, at most MAX_PAIRS: the highest estimates first
    alternative: str = ""              # the layout that won at the low end (for the log)

    def explain(self) -> str:
        if not self.depends:
            return "every pair the plan runs on is measured"
        if not self.decides:
            return (f"{len(self.depends)} estimated pair(s) the plan runs on do not decide it (at their low end "
                    + (f"{self.alternative} wins by too little)" if self.alternative else "the same layout wins)"))
        left = len(self.depends) - len(self.ask)
        return (f"{len(self.depends)} estimated pair(s) decide the plan (at their low end: {self.alternative}); "
                f"{len(self.ask)} to measure" + (f", {left} beyond the bound of {MAX_PAIRS} keep their estimate"
                                                  if left else ""))


def describe(plan: Plan) -> str:
    return " | ".join(f"[{st.start},{st.end}) x{len(st.replicas)}" for st in plan.stages)


def check(plan: Plan, snap: Snapshot, estimated: Collection[Pair], replan: Callable[[Snapshot], Plan], *,
          score: Callable[[Plan, Snapshot], float] | None = None, floors: Mapping[Pair, float] | None = None,
          max_pairs: int = MAX_PAIRS) -> PairCheck:
    """Whether *plan* (made on *snap*) depends on pairs of *estimated* (links of *snap* that are estimates)
    and whether their estimate decides its layout: *replan* on *snap* with those pairs at their low end
    (:func:`pessimistic`) gives another layout, and (with *score*, a plan's predicted step time on a
    snapshot) *plan* is predicted more than ``MARGIN`` slower than that layout there. *floors*: a rate each
    pair is known to reach (:func:`low_end`). At most one extra plan, and none when the plan runs on measured
    pairs only."""
    est = {pair(*p) for p in estimated}
    depends = tuple(sorted(p for p in plan_pairs(plan) if p in est and p in snap.links))
    if not depends:
        return PairCheck()
    ceiling = measured_median(snap, est)
    links = dict(snap.links)
    for p in depends:
        links[p] = low_end(links[p], ceiling, (floors or {}).get(p, 0.0))
    if score is not None and all(links[p].bandwidth_bps * (1 + MARGIN) >= snap.links[p].bandwidth_bps for p in depends):
        # no link of the plan's is more than 1 + MARGIN slower at its low end, so neither is the plan (its
        # predicted time is a sum and maximum of transfer times), and no layout beats it there by more
        return PairCheck(depends=depends)
    low = Snapshot(job=snap.job, epoch=snap.epoch, members=snap.members, links=links)
    alt = replan(low)
    if layout(alt) == layout(plan):
        return PairCheck(depends=depends)
    if score is not None:
        try:
            mine, theirs = score(plan, low), score(alt, low)
        except ValueError:   # not priced on the low snapshot: the estimate decides
            mine, theirs = math.inf, 0.0
        if mine <= (1 + MARGIN) * theirs:
            return PairCheck(depends=depends, alternative=f"{describe(alt)}, within {MARGIN:.0%}")
    ask = sorted(depends, key=lambda p: (-snap.links[p].bandwidth_bps, p))[:max(0, max_pairs)]
    return PairCheck(depends=depends, decides=True, ask=tuple(ask), alternative=describe(alt))


def with_measured(snap: Snapshot, measured: Mapping[Pair, Link]) -> Snapshot:
    """*snap* with the *measured* figures in place of its links (a measurement wins over an estimate)."""
    links = dict(snap.links)
    for (a, b), lk in measured.items():
        if a != b and a in snap.members and b in snap.members:
            links[pair(a, b)] = lk
    return Snapshot(job=snap.job, epoch=snap.epoch, members=snap.members, links=links)


__all__ = ["ESTIMATE_ERROR", "MARGIN", "MAX_PAIRS", "PairCheck", "check", "layout", "low_end", "pessimistic", "plan_pairs",
           "with_measured"]
