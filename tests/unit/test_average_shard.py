"""Sharded outer state equals the unsharded update; the all-reduce state machine (pure)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.average.allreduce import AllReduceRound, Finished, Reduced, RoundMsg, RoundResult, Send
from fusionp2p.average.outer import OuterConfig, OuterOptimizer
from fusionp2p.average.shard import ShardedOuter, all_finite, shard_bounds, weighted_mean
from fusionp2p.errors import ConfigError, LocalProtocolError, RemoteProtocolError

torch.set_num_threads(1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("at", [0, 5, 999])
def test_all_finite_finds_one_bad_value_anywhere(bad: float, at: int) -> None:
    x = torch.randn(1000)
    assert all_finite(x)
    x[at] = bad
    assert not all_finite(x)


def test_all_finite_is_exact_where_the_sum_overflows() -> None:
    # finite values whose fp32 sum is inf (the fast path's sum) are still finite
    big = torch.full((8,), 3e38)
    assert not torch.isfinite(big.sum())
    assert all_finite(big)
    assert all_finite(torch.cat([big, -big]))
    assert all_finite(torch.zeros(0))
    big[3] = float("nan")
    assert not all_finite(big)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 200), r=st.integers(1, 9))
def test_shard_bounds_tile_the_vector(n: int, r: int) -> None:
    b = shard_bounds(n, r)
    assert len(b) == r
    assert b[0][0] == 0
    assert b[-1][1] == n
    assert all(b[i][1] == b[i + 1][0] for i in range(r - 1))
    sizes = [hi - lo for lo, hi in b]
    assert max(sizes) - min(sizes) <= 1


CONFIGS = [
    OuterConfig(outer_lr=0.7, outer_momentum=0.5),
    OuterConfig(outer_lr=1.0, outer_momentum=0.9, nesterov=True, sync=False, clip="elementwise", clip_threshold=0.3),
    OuterConfig(outer_momentum=0.5, sync=False, penalty="elementwise", penalty_value=1.5),
    OuterConfig(outer_momentum=0.2, penalty="lr_ratio"),
]


@pytest.mark.parametrize("replicas", [1, 2, 3, 7])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["slowmo", "async-nesterov-clip", "async-elementwise", "lr-ratio"])
def test_sharded_equals_unsharded(replicas: int, cfg: OuterConfig) -> None:
    g = torch.Generator().manual_seed(replicas)
    dim = 101  # not divisible by 2, 3 or 7
    init = torch.randn(dim, generator=g)
    sharded = ShardedOuter(cfg, init, replicas)
    whole = OuterOptimizer(cfg, init)
    if not cfg.sync:
        sharded.hold()
        whole.hold()
    for t in range(6):
        snaps = [whole.anchor + 0.3 * torch.randn(dim, generator=g) for _ in range(replicas)]
        lr = 0.1 / (t + 1)
        a = sharded.step(snaps, lr=lr)
        b = whole.step(weighted_mean(snaps, [1.0] * replicas), lr=lr).anchor
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
        assert torch.allclose(sharded.momentum, whole.momentum, atol=1e-6, rtol=0)
    sizes = sharded.state_floats_per_replica()
    assert sum(sizes) == 3 * dim
    assert max(sizes) <= 3 * (dim // replicas + 1)


def test_sharded_global_norm_clip_refused() -> None:
    with pytest.raises(ConfigError):
        ShardedOuter(OuterConfig(clip="global_norm", clip_threshold=1.0), torch.zeros(10), 2)


# --------------------------------------------------------------------------- the all-reduce machine
def _simulate(
    n: int, dim: int, *, seed: int, lost: dict[str, str] | None = None, weights: list[float] | None = None
) -> tuple[dict[str, RoundResult], list[torch.Tensor]]:
    """Run n AllReduceRounds with messages delivered in a random order.

    ``lost`` maps a peer to when it dies: "before" (sends nothing) or "after_scatter" (its scatter parts
    go out, it never publishes). The owner step here is the identity (publish the mean).
    """
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    peers = [f"p{i}" for i in range(n)]
    lost = lost or {}
    w = weights or [1.0] * n
    snaps = [torch.randn(dim, generator=g) for _ in range(n)]
    sms = {p: AllReduceRound(peers=peers, me=p, n_elems=dim, round_id=7, epoch="e") for p in peers}
    wire: list[tuple[str, str, RoundMsg]] = []   # (src, dst, msg)
    results: dict[str, RoundResult] = {}

    def handle(p: str, actions: list[Send | Reduced | Finished]) -> None:
        for a in actions:
            if isinstance(a, Send):
                if lost.get(p) == "before" or (lost.get(p) == "after_scatter" and a.msg.phase == "gather"):
                    continue
                wire.append((p, a.peer, a.msg))
            elif isinstance(a, Reduced):
                if lost.get(p) == "after_scatter":
                    continue
                handle(p, sms[p].publish(a.mean.clone()))
            else:
                results[p] = a.result

    for i, p in enumerate(peers):
        handle(p, sms[p].start(snaps[i], w[i]))
    while True:
        while wire:
            src, dst, msg = wire.pop(rng.randrange(len(wire)))
            if dst not in lost:
                handle(dst, sms[dst].receive(src, msg))
        # the shell's deadline: a live peer still awaited once the wire is quiet is lost
        # (a live peer answers before any deadline, so only the dead ones are ever timed out)
        stuck = [(p, q) for p in peers if p not in lost for q in sorted(sms[p].awaiting()) if q in lost]
        if not stuck:
            break
        p, q = stuck[0]
        handle(p, sms[p].peer_lost(q))
    return results, snaps


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 7), dim=st.integers(1, 40), seed=st.integers(0, 10_000))
def test_allreduce_any_order_gives_identical_means(n: int, dim: int, seed: int) -> None:
    results, snaps = _simulate(n, dim, seed=seed)
    assert len(results) == n
    ref = weighted_mean(snaps, [1.0] * n)
    first = results["p0"].vector
    assert first is not None
    assert torch.allclose(first, ref, atol=1e-6, rtol=0)
    for r in results.values():
        assert r.complete
        assert r.vector is not None
        assert torch.equal(r.vector, first)


def test_weighted_mean_over_peers() -> None:
    # weights within the default max_weight_ratio (4) of each other: a wider spread is refused
    results, snaps = _simulate(3, 10, seed=1, weights=[1.0, 2.0, 4.0])
    ref = (snaps[0] + 2 * snaps[1] + 4 * snaps[2]) / 7
    v = results["p1"].vector
    assert v is not None
    assert torch.allclose(v, ref, atol=1e-6)


def test_replica_dead_before_round_skips_everyone() -> None:
    results, _ = _simulate(4, 23, seed=2, lost={"p2": "before"})
    assert set(results) == {"p0", "p1", "p3"}
    for r in results.values():
        assert not r.complete
        assert "p2" in r.reason
        assert r.lost == frozenset({"p2"})
        assert r.contributors
        assert "p2" not in r.contributors


def test_survivor_shards_use_survivor_weights() -> None:
    """An owner that died after scattering: the others' own shards are means over who reached them."""
    n, dim = 4, 20
    peers = [f"p{i}" for i in range(n)]
    snaps = [torch.full((dim,), float(i)) for i in range(n)]
    sm = AllReduceRound(peers=peers, me="p0", n_elems=dim, round_id=0, epoch="e")
    sm.start(snaps[0])
    lo, hi = sm.my_bounds
    for i in (1, 2):
        sm.receive(peers[i], RoundMsg(round_id=0, epoch="e", phase="scatter", lo=lo, hi=hi, data=snaps[i][lo:hi]))
    (red,) = [a for a in sm.peer_lost("p3") if isinstance(a, Reduced)]
    assert red.contributors == ("p0", "p1", "p2")
    assert torch.allclose(red.mean, torch.full((hi - lo,), 1.0))  # (0+1+2)/3, not /4


def test_epoch_mismatch_skips_without_declaring_death() -> None:
    peers = ["a", "b"]
    sm = AllReduceRound(peers=peers, me="a", n_elems=4, round_id=0, epoch="e1")
    sm.start(torch.zeros(4))
    acts = sm.receive("b", RoundMsg(round_id=0, epoch="e0", phase="scatter", lo=0, hi=4, data=torch.zeros(4)))
    assert any(isinstance(a, Reduced) for a in acts)
    sm.publish(torch.zeros(2))
    (fin,) = [a for a in sm.receive("b", RoundMsg(round_id=0, epoch="e0", phase="gather", lo=0, hi=2, data=torch.zeros(2))) if isinstance(a, Finished)]
    assert not fin.result.complete
    assert "epoch" in fin.result.reason
    assert not fin.result.lost


@pytest.mark.parametrize(
    "bad",
    [
        {"lo": 0, "hi": 3},                                   # wrong slice
        {"data": torch.zeros(2, dtype=torch.float64)},        # wrong dtype
        {"data": torch.zeros(3)},                             # wrong length
        {"weight": float("nan")},
        {"phase": "nope"},
    ],
)
def test_malformed_parts_raise_remote_protocol_error(bad: dict[str, object]) -> None:
    sm = AllReduceRound(peers=["a", "b"], me="a", n_elems=4, round_id=0, epoch="e")
    sm.start(torch.zeros(4))
    fields: dict[str, object] = {"round_id": 0, "epoch": "e", "phase": "scatter", "lo": 0, "hi": 2, "data": torch.zeros(2)}
    fields.update(bad)
    with pytest.raises(RemoteProtocolError):
        sm.receive("b", RoundMsg(**fields))  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError):
        sm.receive("stranger", RoundMsg(round_id=0, epoch="e", phase="scatter", lo=0, hi=2, data=torch.zeros(2)))


def test_duplicate_part_rejected() -> None:
    sm = AllReduceRound(peers=["a", "b", "c"], me="a", n_elems=6, round_id=0, epoch="e")
    sm.start(torch.zeros(6))
    msg = RoundMsg(round_id=0, epoch="e", phase="scatter", lo=0, hi=2, data=torch.zeros(2))
    sm.receive("b", msg)
    with pytest.raises(RemoteProtocolError):
        sm.receive("b", msg)


def test_round_gathers_into_the_given_vector_and_keeps_no_peer_buffer() -> None:
    """``out``: the finished vector is the buffer the shell handed in, each shard copied in as it came (a
    peer's message buffer is free again at once: changing it afterwards changes nothing)."""
    peers = ["a", "b"]
    out = torch.full((6,), float("nan"))
    sm = AllReduceRound(peers=peers, me="a", n_elems=6, round_id=0, epoch="e", out=out)
    b = AllReduceRound(peers=peers, me="b", n_elems=6, round_id=0, epoch="e")
    sends = [x for x in sm.start(torch.arange(6.0)) if isinstance(x, Send)]
    b_sends = [x for x in b.start(torch.arange(6.0) + 10) if isinstance(x, Send)]
    acts = sm.receive("b", b_sends[0].msg)
    red = next(x for x in acts if isinstance(x, Reduced))
    sm.publish(red.mean)
    (b_red,) = [x for x in b.receive("a", sends[0].msg) if isinstance(x, Reduced)]
    gather = next(x for x in b.publish(b_red.mean) if isinstance(x, Send)).msg
    (fin,) = [x for x in sm.receive("b", gather) if isinstance(x, Finished)]
    gather.data.fill_(-1.0)   # the peer's buffer, reused for its next message
    assert fin.result.vector is out
    assert torch.equal(out, torch.arange(6.0) + 5)
    with pytest.raises(LocalProtocolError, match="flat fp32 vector of 6"):
        AllReduceRound(peers=peers, me="a", n_elems=6, round_id=0, epoch="e", out=torch.zeros(5))
