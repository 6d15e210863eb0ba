"""The AdaTopK ratio choice (ALGORITHMS.md §1.6, tests 10) and its online re-estimation."""

from __future__ import annotations

import math

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
        # dense either meets the target or the codec would send even the floor dense (tiny n)
        assert link.time(1.0) <= target or link.sends_dense(rho_min)
    elif rho > rho_min:
        assert link.time(rho) <= target * (1 + 1e-9)
        k = math.ceil(rho * n - 1e-9)
        assert k == n or link.time((k + 1) / n) > target  # just enough: one more kept entry misses it
    # monotone non-decreasing in β
    assert choose_ratio(LinkCost(n=n, alpha=alpha, beta=beta * 2), target, rho_min=rho_min) >= rho


def test_ratio_follows_the_wire_format() -> None:
    link = LinkCost(n=1000, alpha=0.0, beta=1000.0)  # dense: 4000 B = 4 s; bitmap: 125 B
    # index form below ρ = 1/32: 8 B per kept entry
    assert choose_ratio(link, 0.2, rho_min=0.01) == pytest.approx(0.025)   # 200 B / 8
    assert choose_ratio(link, 0.2) == pytest.approx(0.1)     # the default floor (accuracy) wins
    assert link.wire_bytes(0.025) == 200
    # bitmap form above: 4 B per kept value + 125 B
    assert choose_ratio(link, 2.4) == pytest.approx(0.568)   # (2400 - 125) / 4 = 568.75
    assert link.wire_bytes(0.568) == 568 * 4 + 125
    assert choose_ratio(link, 2.0) == pytest.approx(0.468)
    assert choose_ratio(link, 3.9) == pytest.approx(0.943)   # was dense under the old 0.5 break-even
    assert choose_ratio(link, 4.1) == 1.0                    # dense already meets the target
    # break-even for n = 1000: 968 kept is 3997 B (sparse), 969 is 4001 B (dense), like the codec
    assert not link.sends_dense(0.968) and link.sends_dense(0.969)
    assert choose_ratio(link, 1.0, rho_min=0.968) == pytest.approx(0.968)
    assert choose_ratio(link, 1.0, rho_min=0.969) == 1.0
    assert link.time(0.969) == link.time(1.0) == 4.0
    # fp16 values of fp32 tensors: never dense below ρ = 1; all but one entry fits 3.5 s
    half = LinkCost(n=1000, alpha=0.0, beta=1000.0, b_val=2, b_idx=2)
    assert choose_ratio(half, 3.5) == pytest.approx(0.999)
    assert choose_ratio(half, 1.0) == pytest.approx(0.437)  # floor((1000 - 125) / 2) kept
    assert choose_ratio(half, 3.5, rho_min=1.0) == 1.0


def test_plan_ratios_only_compresses_slow_links() -> None:
    links = {"fast": LinkCost(n=10**6, alpha=0.001, beta=1e9), "slow": LinkCost(n=10**6, alpha=0.01, beta=1e6)}
    r = plan_ratios(links, t_comp=0.1, rho_min=0.01)
    assert r["fast"] == 1.0
    assert r["slow"] == pytest.approx(0.01125)  # (0.1 - 0.01) s · 1e6 B/s / 8 B (index form)
    assert links["slow"].time(r["slow"]) <= 0.1 * (1 + 1e-9) or r["slow"] == 0.01
    assert plan_ratios({}, 1.0) == {}


def test_estimator_follows_measured_bandwidth() -> None:
    est = RatioEstimator(n=10**6, t_comp=0.1, beta0=1e9, every=4, rho_min=0.01)
    assert est.ratio == 1.0
    for _ in range(80):
        est.observe(nbytes=10**6, seconds=1.0)  # the link is really 1 MB/s
    assert est.beta == pytest.approx(1e6, rel=0.05)
    assert est.ratio == pytest.approx(choose_ratio(LinkCost(n=10**6, alpha=0.0, beta=est.beta), 0.1, rho_min=0.01))
    assert est.ratio < 0.05
    for _ in range(80):
        est.observe(nbytes=10**8, seconds=0.01)  # and back to fast
    assert est.ratio == 1.0
    with pytest.raises(ConfigError):
        RatioEstimator(n=1, t_comp=1, beta0=0)
