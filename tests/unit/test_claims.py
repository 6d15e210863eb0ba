"""Claims against measurements (train/claims.py): a speed liar is re-dealt by its measured figure."""

from __future__ import annotations

import pytest

from fusionp2p.train.claims import SpeedCheck, checked, measured, shared
from fusionp2p.train.deal import Deal

R, M = 4, 4
TRUE = (0.1, 0.1, 0.1, 0.1)     # seconds per micro-batch each replica really takes


def _run(liar_claim: float, *, defended: bool, steps: int = 40) -> tuple[float, set[str]]:
    """Replicas re-deal by the speeds they announce (replica 3 announces *liar_claim*); the observer
    sees each replica's part of a step arrive after its true step time (plus 2 ms on the wire). The
    mean step time (the slowest replica's) over the last 8 steps, and the replicas found lying."""
    deal = Deal((M,) * R, 1, replica=0, replicas=R, micro_batches=M)
    flagged: set[str] = set()
    times = []
    for step in range(steps):
        counts = deal.counts(step)
        claims = [(f"r{k}", liar_claim if k == 3 else TRUE[k]) for k in range(R)]
        arrived = {f"r{k}": 5.0 + TRUE[k] * counts[k] + 0.002 for k in range(R)}   # start at 5.0 s
        speeds = claims
        if defended:
            speeds, liars = checked(claims, measured(dict(claims), {f"r{k}": counts[k] for k in range(R)}, arrived))
            flagged.update(liars)
        deal.redeal(speeds)
        times.append(max(t * c for t, c in zip(TRUE, counts, strict=True)))
    return sum(times[-8:]) / 8, flagged


def test_a_speed_liar_is_dealt_by_its_measured_speed() -> None:
    even = M * 0.1
    off, _ = _run(0.025, defended=False)
    on, flagged = _run(0.025, defended=True)
    assert off > 1.5 * even            # the attack is real: the liar takes work it cannot do, everyone waits
    assert on == pytest.approx(even, rel=0.05) and flagged == {"r3"}
    honest, flagged = _run(0.1, defended=True)
    assert honest == pytest.approx(even, rel=0.05) and flagged == set()


def test_measured_is_robust_to_one_liar_and_checked_keeps_true_claims() -> None:
    claimed = {"a": 0.1, "b": 0.2, "c": 0.1, "d": 0.01}
    micros = {"a": 4, "b": 2, "c": 4, "d": 4}
    arrived = {"a": 1.4, "b": 1.41, "c": 1.39, "d": 1.8}      # d claims 0.01 s and took 0.2 s
    got = measured(claimed, micros, arrived)
    assert got["d"] == pytest.approx(0.2, abs=0.01) and got["a"] == pytest.approx(0.1, abs=0.01)
    speeds, liars = checked(list(claimed.items()), got)
    assert liars == ("d",) and dict(speeds)["d"] == got["d"] and dict(speeds)["b"] == 0.2
    assert measured(claimed, {}, arrived) == {}
    # a replica claiming to be slower than it is is not contradicted (it may hold its part back to match)
    assert checked([("a", 1.0)], {"a": 0.1}) == ([("a", 1.0)], ())


def _arrivals(true: dict[str, float], micros: dict[str, int], *, offsets: dict[str, float],
              liar_owner: str | None = None) -> list[tuple[str, list[tuple[str, float]]]]:
    """Every owner's arrival times (its own clock: *offsets*) of each replica's part: its true step time
    after a common start, 2 ms on the wire; *liar_owner* reports every other replica 1 s late."""
    out = []
    for owner in true:
        row = []
        for k in true:
            t = offsets[owner] + true[k] * micros[k] + (0.002 if k != owner else 0.0)
            row.append((k, t + (1.0 if owner == liar_owner and k != owner else 0.0)))
        out.append((owner, row))
    return out


def test_shared_takes_the_other_owners_lower_median_whatever_their_clocks() -> None:
    true = {"r0": 0.1, "r1": 0.1, "r2": 0.3}
    micros = {"r0": 2, "r1": 2, "r2": 2}
    claimed = {"r0": 0.1, "r1": 0.1, "r2": 0.03}            # r2 claims 10x faster than it is
    offsets = {"r0": 100.0, "r1": -7.0, "r2": 3.5}          # the owners' clocks do not agree
    got = shared(claimed, micros, _arrivals(true, micros, offsets=offsets))
    assert got["r2"] == pytest.approx(0.3, abs=0.01) and got["r0"] == pytest.approx(0.1, abs=0.01)
    # the liar also reports the honest replicas 1 s late: the lower median of the other two owners is honest's
    lied = shared(claimed, micros, _arrivals(true, micros, offsets=offsets, liar_owner="r2"))
    assert lied["r0"] <= 0.11 and lied["r1"] <= 0.11 and lied["r2"] == pytest.approx(0.3, abs=0.01)
    speeds, liars = checked(list(claimed.items()), lied)
    assert liars == ("r2",) and dict(speeds)["r0"] == 0.1


def test_the_speed_check_deals_by_the_measurement_of_the_round_it_launched() -> None:
    true = {"r0": 0.1, "r1": 0.1, "r2": 0.3}
    claimed = [("r0", 0.1), ("r1", 0.1), ("r2", 0.03)]
    sc = SpeedCheck()
    sc.launched(7, (2, 2, 2))
    sc.launched(8, (1, 1, 4))
    arr = _arrivals(true, {"r0": 2, "r1": 2, "r2": 2}, offsets=dict.fromkeys(true, 0.0))
    assert sc.check(9, claimed, arr) == claimed                  # a round whose deal it does not know: as claimed
    got = dict(sc.check(7, claimed, arr))
    assert got["r2"] == pytest.approx(0.3, abs=0.01) and got["r0"] == 0.1 and sc.contradicted == {"r2": 1}
    assert sc.check(7, claimed, arr) == claimed                  # consumed once
    assert sc.check(8, [("r0", 0.1), ("r1", 0.0), ("r2", 0.1)], arr)[1] == ("r1", 0.0)   # r1 not measured yet
    off = SpeedCheck(enabled=False)
    off.launched(7, (2, 2, 2))
    assert off.check(7, claimed, arr) == claimed
    for r in range(100):
        sc.launched(r + 100, (2, 2, 2))
    assert len(sc._micros) == SpeedCheck.MAX_ROUNDS


def test_the_leader_plans_a_member_by_its_neighbours_measurement_not_its_own_claim() -> None:
    """jobs/rebalance.py ``bounded``: each member answers its own seconds per micro-batch and what its averaging
    rounds measured of its replica peers; a member's own figure that the lower median of the others'
    contradicts is replaced by it. A member cannot vouch for itself, and one liar cannot slow an honest one."""
    from fusionp2p.jobs.rebalance import bounded

    own = {"a": 0.1, "b": 0.1, "c": 0.02}      # c claims 5x faster than it is
    answers = {"a": {"peers_s": {"b": 0.1, "c": 0.1}}, "b": {"peers_s": {"a": 0.1, "c": 0.11}},
               "c": {"peers_s": {"a": 5.0, "b": 5.0, "c": 0.01}}}   # c's answer also accuses both and vouches for itself
    got, liars = bounded(own, answers)
    assert liars == ("c",) and got["c"] == pytest.approx(0.1) and got["a"] == 0.1 and got["b"] == 0.1
    assert bounded(own, {"a": {"peers_s": "junk"}, "b": {"peers_s": {"c": float("nan"), "x": 9.0}}}) == (own, ())


def test_only_the_steps_last_replica_is_judged_and_a_contradicted_one_keeps_its_floor() -> None:
    """An honest replica that ran ahead (its part early, its measurement meaningless) is never judged; the
    liar, judged when it is the step's last, is dealt by at least its measured figure from then on, even
    when, dealt less, it arrives early and its claim alone would win the work back."""
    sc = SpeedCheck()
    claimed = [("r0", 0.1), ("r1", 0.1), ("r2", 0.01)]
    sc.launched(1, (2, 2, 2))
    arr = _arrivals({"r0": 0.1, "r1": 0.25, "r2": 0.3}, {"r0": 2, "r1": 2, "r2": 2}, offsets=dict.fromkeys(("r0", "r1", "r2"), 0.0))
    got = dict(sc.check(1, claimed, arr))
    assert got["r1"] == 0.1 and got["r2"] > 0.125 and sc.contradicted == {"r2": 1}   # r1 is slow too, but not last
    sc.launched(2, (3, 3, 0 + 1))
    early = _arrivals({"r0": 0.1, "r1": 0.1, "r2": 0.01}, {"r0": 3, "r1": 3, "r2": 1}, offsets=dict.fromkeys(("r0", "r1", "r2"), 0.0))
    assert dict(sc.check(2, claimed, early))["r2"] == got["r2"]     # the floor holds
