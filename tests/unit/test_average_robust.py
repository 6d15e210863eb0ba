"""Robust reduction of an averaging shard (average/robust.py) and the plausible lies it bounds.

Each attack of fusionp2p.testing.byzantine is run on a shard twice: with the plain mean (the defence off)
its part moves the shard far from the honest replicas' mean, and with CenteredClip it does not.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fusionp2p.average.allreduce import AllReduceRound, Finished, Reduced, RoundMsg
from fusionp2p.average.robust import (
    ClipBook,
    RobustConfig,
    clipped_by_majority,
    coordinate_median,
    robust_mean,
)
from fusionp2p.average.shard import weighted_mean
from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.testing.byzantine import ATTACKS, STALE, lie
from fusionp2p.train.averager import from_message, to_message

D = 4096
CFG = RobustConfig()


def _honest(n: int, seed: int, *, spread: float = 0.2) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The last average, the averages before it (oldest first), and *n* honest snapshots: a common update
    of norm 1 plus each replica's own noise (its data) of norm *spread*."""
    g = torch.Generator().manual_seed(seed)
    prev = torch.randn(D, generator=g)
    step = torch.randn(D, generator=g)
    step /= step.norm()
    history = [prev - (STALE - k) * step for k in range(STALE)] + [prev]
    snaps = []
    for _ in range(n):
        e = torch.randn(D, generator=g)
        snaps.append(prev + step + spread * e / e.norm())
    return prev, history, snaps


def test_all_honest_gives_the_exact_mean_bit_for_bit() -> None:
    for n in (3, 4, 5, 8):
        for seed in range(3):
            _, _, snaps = _honest(n, seed)
            weights = [1.0 + 0.5 * (i % 3) for i in range(n)]
            got = robust_mean(snaps, weights, CFG)
            assert got.clipped == ()
            assert torch.equal(got.mean, weighted_mean(snaps, weights))   # no one clipped: the mean itself
            assert math.isfinite(got.radius) and got.radius > 0


def test_two_parts_and_empty_shards_are_the_plain_mean() -> None:
    a, b = torch.zeros(5), torch.full((5,), 100.0)
    assert torch.equal(robust_mean([a, b], [1.0, 1.0], CFG).mean, weighted_mean([a, b], [1.0, 1.0]))
    e = torch.zeros(0)
    assert robust_mean([e, e, e], [1.0] * 3, CFG).mean.numel() == 0


def test_identical_majority_wins_against_any_outlier() -> None:
    x = torch.ones(7)
    got = robust_mean([x, x, x, torch.full((7,), 1e6)], [1.0] * 4, CFG)
    assert torch.equal(got.mean, x) and got.clipped == (3,)


def test_coordinate_median_even_and_odd() -> None:
    x = torch.tensor([[1.0, 5.0], [2.0, 0.0], [10.0, 1.0], [3.0, 2.0]])
    assert torch.equal(coordinate_median(x), torch.tensor([2.5, 1.5]))
    assert torch.equal(coordinate_median(x[:3]), torch.tensor([2.0, 1.0]))


@pytest.mark.parametrize("attack", ATTACKS)
def test_each_attack_bites_without_the_defence_and_not_with_it(attack: str) -> None:
    """One replica of four lies; distance of the shard from the three honest replicas' mean, in units of the
    honest update's norm (1)."""
    for seed in range(3):
        _, history, snaps = _honest(4, seed)
        honest_mean = weighted_mean(snaps[:3], [1.0] * 3)
        parts = [*snaps[:3], lie(attack, snaps[3], history, torch.Generator().manual_seed(seed))]
        plain = float((weighted_mean(parts, [1.0] * 4) - honest_mean).norm())
        robust = robust_mean(parts, [1.0] * 4, CFG)
        defended = float((robust.mean - honest_mean).norm())
        assert plain > 0.3, (attack, plain)            # the attack is real: a third of an update or more
        # bounded by the honest spread (0.2 here): at CenteredClip's fixed point a clipped liar of weight w
        # shifts the shard by w / (W - w) * rho, rho / 3 here
        assert defended <= robust.radius / 3 * 1.05 and defended < 0.14, (attack, defended, robust.radius)
        assert robust.clipped == (3,), (attack, robust.clipped)


@pytest.mark.parametrize("attack", ["signflip", "stale", "noise"])
def test_lies_within_a_noisy_honest_spread_are_caught_by_their_direction(attack: str) -> None:
    """Noise-dominated updates (each replica's own noise 3x the common update, as GPT-2's are): a sign flip,
    a stale replay and noise at the honest norm lie inside the clip radius, so CenteredClip alone takes them
    whole; the test of direction against the last average leaves them out."""
    caught = 0
    for seed in range(20):
        prev, history, snaps = _honest(4, seed, spread=3.0)
        honest_mean = weighted_mean(snaps[:3], [1.0] * 3)
        parts = [*snaps[:3], lie(attack, snaps[3], history, torch.Generator().manual_seed(seed))]
        assert robust_mean(parts, [1.0] * 4, CFG).clipped == ()   # without the test: the plain mean
        got = robust_mean(parts, [1.0] * 4, CFG, reference=prev)
        assert got.clipped in ((), (3,)), (attack, seed, got.clipped)
        if got.clipped:
            caught += 1
            assert float((got.mean - honest_mean).norm()) < 0.5 * float((weighted_mean(parts, [1.0] * 4) - honest_mean).norm())
        honest = robust_mean(snaps, [1.0] * 4, CFG, reference=prev)   # four honest: never one left out
        assert honest.clipped == () and torch.equal(honest.mean, weighted_mean(snaps, [1.0] * 4))
    assert caught >= (18 if attack == "noise" else 20), (attack, caught)   # noise: in 98% of rounds


def test_a_liar_within_the_radius_moves_the_shard_by_a_fraction_of_it() -> None:
    """The bound that holds whatever the liar sends: a part at the edge of the radius (not clipped, or
    barely) moves the result by at most rho / (n - 1) from the honest mean."""
    _, _, snaps = _honest(4, 7)
    honest = weighted_mean(snaps[:3], [1.0] * 3)
    direction = torch.randn(D, generator=torch.Generator().manual_seed(1))
    direction /= direction.norm()
    for k in (0.5, 1.0, 2.0, 5.0, 50.0):
        parts = [*snaps[:3], honest + k * direction]
        got = robust_mean(parts, [1.0] * 4, CFG)
        assert float((got.mean - honest).norm()) <= got.radius / 3 * 1.05


def test_clip_book_drops_a_peer_after_strikes_in_window() -> None:
    book = ClipBook(RobustConfig(strikes=3, window=5))
    peers = ["a", "b", "c"]
    assert book.record(peers, ["c"]) == []
    assert book.record(peers, []) == []
    assert book.record(peers, ["c", "a"]) == []
    assert book.record(peers, ["c"]) == ["c"]           # 3 of its last 5
    assert book.record(peers, ["c"]) == []              # reported once
    assert book.clipped == {"c": 4, "a": 1}
    # an honest peer clipped now and then never reaches the threshold
    for i in range(20):
        assert "a" not in book.record(peers, ["a"] if i % 3 == 0 else [])


def test_robust_config_is_validated() -> None:
    for bad in ({"radius": 0.5}, {"radius": math.inf}, {"iters": 0}, {"strikes": 5, "window": 4}, {"strikes": 0}):
        with pytest.raises(ConfigError):
            RobustConfig(**bad)   # type: ignore[arg-type]


def test_the_round_reduces_robustly_and_names_the_clipped_peer() -> None:
    """AllReduceRound with ``robust``: the owner's Reduced is CenteredClip's and names the outlier."""
    peers = ["a", "b", "c", "d"]
    _, history, snaps = _honest(4, 3)
    snaps[3] = lie("scale", snaps[3], history, torch.Generator())
    for robust in (None, CFG):
        sm = AllReduceRound(peers=peers, me="a", n_elems=D, round_id=0, epoch="e", robust=robust)
        sm.start(snaps[0])
        lo, hi = sm.my_bounds
        out = []
        for p, s in zip(peers[1:], snaps[1:]):
            out += sm.receive(p, RoundMsg(round_id=0, epoch="e", phase="scatter", lo=lo, hi=hi, data=s[lo:hi]))
        red = [a for a in out if isinstance(a, Reduced)]
        assert len(red) == 1
        if robust is None:
            assert red[0].clipped == () and torch.equal(red[0].mean, weighted_mean([s[lo:hi] for s in snaps], [1.0] * 4))
        else:
            assert red[0].clipped == ("d",)
            assert float((red[0].mean - weighted_mean([s[lo:hi] for s in snaps[:3]], [1.0] * 3)).norm()) < 0.1


def test_a_peer_counts_as_clipped_when_most_other_owners_clipped_it() -> None:
    rounds = (("a", ("d",)), ("b", ("d", "a")), ("c", ("d",)), ("d", ("a", "b", "c")))
    # d: clipped by a, b, c (3 of 3 others); a: by b and d (2 of 3); b, c: by d only (the liar alone frames no one)
    assert clipped_by_majority(rounds) == {"d", "a"}
    assert clipped_by_majority((("a", ("a",)), ("b", ()), ("c", ()))) == set()   # its own clip does not count


def test_the_owners_clip_lists_travel_with_their_shards() -> None:
    """Each owner publishes whom it clipped with its shard (ranks on the wire); every replica's result lists
    them per owner, the same everywhere; a bad list is a protocol error."""
    peers = ["a", "b"]
    sm = AllReduceRound(peers=peers, me="a", n_elems=4, round_id=0, epoch="e")
    sm.start(torch.zeros(4))
    sm.receive("b", RoundMsg(round_id=0, epoch="e", phase="scatter", lo=0, hi=2, data=torch.zeros(2)))
    sm.publish(torch.zeros(2), clipped=("b",))
    with pytest.raises(RemoteProtocolError, match="clipped ranks"):
        _gather_copy(sm).receive("b", RoundMsg(round_id=0, epoch="e", phase="gather", lo=2, hi=4, data=torch.zeros(2),
                                               clipped=(2,)))
    out = sm.receive("b", RoundMsg(round_id=0, epoch="e", phase="gather", lo=2, hi=4, data=torch.zeros(2), clipped=(0,)))
    res = next(a for a in out if isinstance(a, Finished)).result
    assert res.complete and res.clipped == (("a", ("b",)), ("b", ("a",)))
    # on the wire: ranks in the meta map, only when there are any
    tm = to_message("j", 0, RoundMsg(round_id=0, epoch="e", phase="gather", lo=2, hi=4, data=torch.zeros(2), clipped=(0,)))
    assert from_message(tm).clipped == (0,) and tm.meta["c"] == [0]
    assert "c" not in to_message("j", 0, RoundMsg(round_id=0, epoch="e", phase="gather", lo=2, hi=4,
                                                  data=torch.zeros(2))).meta
    with pytest.raises(RemoteProtocolError):
        from_message(dataclasses.replace(tm, meta={**tm.meta, "c": ["x"]}))
    sm2 = AllReduceRound(peers=peers, me="a", n_elems=4, round_id=0, epoch="e")
    sm2.start(torch.zeros(4))
    with pytest.raises(RemoteProtocolError, match="clipped ranks"):   # a scatter part names none
        sm2.receive("b", RoundMsg(round_id=0, epoch="e", phase="scatter", lo=0, hi=2, data=torch.zeros(2), clipped=(0,)))


def _gather_copy(sm: AllReduceRound) -> AllReduceRound:
    """A round in the same state as *sm* after it published (for one refused message)."""
    other = AllReduceRound(peers=list(sm.peers), me=sm.me, n_elems=sm.n_elems, round_id=0, epoch="e")
    other.start(torch.zeros(sm.n_elems))
    other.receive("b", RoundMsg(round_id=0, epoch="e", phase="scatter", lo=0, hi=2, data=torch.zeros(2)))
    other.publish(torch.zeros(2))
    return other
