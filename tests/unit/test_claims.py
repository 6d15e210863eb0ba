"""Claims against measurements (train/claims.py): a speed liar is re-dealt by its measured figure."""

from __future__ import annotations

import pytest

from fusionp2p.train.claims import checked, measured
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
