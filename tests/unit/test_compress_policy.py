"""The AdaTopK ratio choice (ALGORITHMS.md §1.6, tests 10) and its online re-estimation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.compress import LinkCost, RatioEstimator, choose_ratio, plan_ratios
from fusionp2p.errors import ConfigError


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 10**8), alpha=st.floats(0, 0.05), beta=st.floats(1e5, 1e10), target=st.floats(1e-3, 10),
       rho_min=st.sampled_from([0.001, 0.01, 0.05]))
def test_ratio_meets_target_unless_floor(n: int, alpha: float, beta: float, target: float, rho_min: float) -> None:
    link = LinkCost(n=n, alpha=alpha, beta=beta)
    rho = choose_ratio(link, target, rho_min=rho_min)
    assert rho_min <= rho <= 1.0
    if rho == 1.0:
        # dense either meets the target or sparse would not save bytes
        assert link.time(1.0) <= target or (target - alpha) * beta / (n * 8) >= 0.5
    elif rho > rho_min:
        assert link.time(rho) <= target * (1 + 1e-9)
    # monotone non-decreasing in β
    assert choose_ratio(LinkCost(n=n, alpha=alpha, beta=beta * 2), target, rho_min=rho_min) >= rho


def test_dense_when_ratio_over_break_even() -> None:
    link = LinkCost(n=1000, alpha=0.0, beta=1000.0)  # dense takes 4 s; sparse 8 B per kept entry
    assert choose_ratio(link, 2.4) == pytest.approx(0.3)   # 2.4 s · 1000 B/s / 8000 B
    assert choose_ratio(link, 2.0) == pytest.approx(0.25)
    assert choose_ratio(link, 3.9) == pytest.approx(0.4875)  # just under the 0.5 break-even: sparse
    assert choose_ratio(link, 4.1) == 1.0                  # dense already meets the target
    # a floor at or above the break-even b_dense/(b_val+b_idx) = 0.5 means sparse cannot help: dense
    assert choose_ratio(link, 1.0, rho_min=0.5) == 1.0
    assert choose_ratio(link, 1.0, rho_min=0.4) == pytest.approx(0.4)
    # fp16 values + int16 indices: break-even at ρ = 4/4 = 1, so any ρ < 1 is sparse
    assert choose_ratio(LinkCost(n=1000, alpha=0.0, beta=1000.0, b_val=2, b_idx=2), 3.5) == pytest.approx(0.875)


def test_plan_ratios_only_compresses_slow_links() -> None:
    links = {"fast": LinkCost(n=10**6, alpha=0.001, beta=1e9), "slow": LinkCost(n=10**6, alpha=0.01, beta=1e6)}
    r = plan_ratios(links, t_comp=0.1)
    assert r["fast"] == 1.0
    assert 0.01 <= r["slow"] < 0.5
    assert links["slow"].time(r["slow"]) <= 0.1 * (1 + 1e-9) or r["slow"] == 0.01
    assert plan_ratios({}, 1.0) == {}


def test_estimator_follows_measured_bandwidth() -> None:
    est = RatioEstimator(n=10**6, t_comp=0.1, beta0=1e9, every=4)
    assert est.ratio == 1.0
    for _ in range(80):
        est.observe(nbytes=10**6, seconds=1.0)  # the link is really 1 MB/s
    assert est.beta == pytest.approx(1e6, rel=0.05)
    assert est.ratio == pytest.approx(choose_ratio(LinkCost(n=10**6, alpha=0.0, beta=est.beta), 0.1))
    assert est.ratio < 0.05
    for _ in range(80):
        est.observe(nbytes=10**8, seconds=0.01)  # and back to fast
    assert est.ratio == 1.0
    with pytest.raises(ConfigError):
        RatioEstimator(n=1, t_comp=1, beta0=0)
