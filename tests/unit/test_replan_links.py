"""replan.fill_unmeasured: after a loss, a pair of the job's nodes without a link figure is planned at the
slowest measured one, not at the planner's missing_link (which left an unmeasured standby out)."""

from __future__ import annotations

from fusionp2p.jobs.replan import fill_unmeasured
from fusionp2p.plan.snapshot import Link

FAST = Link(bandwidth_bps=1e9, latency_s=1e-4)
SLOW = Link(bandwidth_bps=2e8, latency_s=3e-3)


def test_each_missing_pair_gets_the_slowest_measured_link() -> None:
    links = [("a", "b", FAST), ("a", "c", SLOW), ("b", "c", Link(bandwidth_bps=5e8, latency_s=1e-2))]
    out, n = fill_unmeasured(["a", "b", "c", "d"], links)
    assert n == 3 and out[:3] == links
    slowest = Link(bandwidth_bps=2e8, latency_s=1e-2)   # the smallest bandwidth and the largest latency
    assert sorted((a, b) for a, b, lk in out[3:] if lk == slowest) == [("a", "d"), ("b", "d"), ("c", "d")]


def test_a_pair_measured_either_way_is_kept_and_nothing_measured_fills_nothing() -> None:
    assert fill_unmeasured(["a", "b"], [("b", "a", FAST)]) == ([("b", "a", FAST)], 0)
    assert fill_unmeasured(["a", "b", "c"], []) == ([], 0)
