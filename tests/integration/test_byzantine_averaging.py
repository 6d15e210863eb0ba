"""One replica of four lies plausibly in CO2 averaging (issue 46): real ReplicaAveragers over the in-memory
channel pair (real wire encoding, the bf16 wire), streaming CO2 as the product runs it.

Each replica trains a quadratic: ``x <- x - lr * (x - t - e_i - noise)`` toward a common target ``t`` plus
its own offset ``e_i`` (its data). Each attack of fusionp2p.testing.byzantine is run with the defence off
(the plain mean: the attack moves the honest replicas' final vector far from where an all-honest run ends)
and on (CenteredClip: it ends near it, and every honest replica dropped the liar from its averaging).
The liar's first round of each fragment is honest (it lies about an update, and has no average to
start from yet); it is clipped from the second on and dropped after ``RobustConfig.strikes`` rounds.
"""

from __future__ import annotations

import pytest
import torch
import trio

from fusionp2p.average.outer import OuterConfig
from fusionp2p.average.robust import RobustConfig
from fusionp2p.net.channel import TensorChannel
from fusionp2p.testing.byzantine import ATTACKS, LyingAverager
from fusionp2p.testing.channels import memory_channel_pair
from fusionp2p.train.averager import AveragerConfig, ReplicaAverager, load_anchor_, open_replica_averager

torch.set_num_threads(1)
PEERS = [f"r{i}" for i in range(4)]
D, STEPS, LR = 1024, 16, 0.2


def _target() -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    t = 3 * torch.randn(D, generator=g)
    return t, [0.02 * torch.randn(D, generator=g) for _ in PEERS]


async def _run(attack: str | None, robust: bool) -> tuple[list[torch.Tensor], list[ReplicaAverager]]:
    """Train every replica STEPS steps (r3 lies with *attack*); the final vectors of r0..r2, and the averagers."""
    t, offsets = _target()
    mesh: dict[str, dict[str, TensorChannel]] = {p: {} for p in PEERS}
    for i, a in enumerate(PEERS):
        for b in PEERS[i + 1:]:
            mesh[a][b], mesh[b][a] = memory_channel_pair(a, b, window=16)
    outer = OuterConfig(tau=4, sync=False, stream=True)
    finals: dict[str, torch.Tensor] = {}
    avgs: dict[str, ReplicaAverager] = {}

    async def replica(rank: int, me: str) -> None:
        x = torch.zeros(D)
        cfg = AveragerConfig(outer=outer, job="j", round_timeout=20.0, wire="bf16",
                             robust=RobustConfig() if robust else None)
        g = torch.Generator().manual_seed(rank)
        async with open_replica_averager(cfg, peers=PEERS, me=me, channels=mesh[me], initial=x,
                                         cls=LyingAverager) as avg:
            assert isinstance(avg, LyingAverager)
            avg.attack, avg.seed = (attack if me == "r3" else None), rank
            avgs[me] = avg
            for s in range(STEPS):
                x -= LR * (x - t - offsets[rank] - 0.1 * torch.randn(D, generator=g))
                await trio.lowlevel.checkpoint()
                if s + 1 < STEPS:
                    res = await avg.round_boundary(x)
                    if res.anchor is not None:
                        load_anchor_(x, res.anchor, res.ranges)
                else:
                    fin = await avg.finalize(x)
                    if fin is not None and fin.anchor is not None:
                        load_anchor_(x, fin.anchor, fin.ranges)
        finals[me] = x

    async def honest(rank: int, me: str, done: trio.Event) -> None:
        await replica(rank, me)
        done.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            n.start_soon(replica, 3, "r3")
            dones = [trio.Event() for _ in PEERS[:3]]
            async with trio.open_nursery() as h:
                for i, p in enumerate(PEERS[:3]):
                    h.start_soon(honest, i, p, dones[i])
            n.cancel_scope.cancel()   # the liar, dropped by the others, may wait for them until its deadline
    return [finals[p] for p in PEERS[:3]], [avgs[p] for p in PEERS]


def _gap(attack: str | None, robust: bool) -> tuple[float, list[ReplicaAverager]]:
    """Distance of the honest replicas' final vector from the target, over the all-honest run's."""
    t, offsets = _target()
    optimum = t + sum(offsets) / len(offsets)
    finals, avgs = trio.run(_run, attack, robust)
    for f in finals[1:]:
        assert torch.allclose(f, finals[0], atol=1e-5)   # the honest replicas agree, attacked or not
    return float((finals[0] - optimum).norm()), avgs


_HONEST: dict[bool, float] = {}


def _honest(robust: bool) -> float:
    if robust not in _HONEST:
        _HONEST[robust], avgs = _gap(None, robust)
        assert all(not a.dropped_outliers for a in avgs)   # no honest replica is dropped
    return _HONEST[robust]


def test_the_defence_costs_nothing_when_all_are_honest() -> None:
    assert _honest(True) == pytest.approx(_honest(False), rel=0.02)


# sign flips in the default suite (the lie no norm bound catches: it has the honest norm), the rest slow
@pytest.mark.parametrize("attack", [a if a == "signflip" else pytest.param(a, marks=pytest.mark.slow) for a in ATTACKS])
def test_each_attack_bites_without_the_defence_and_not_with_it(attack: str) -> None:
    plain, _ = _gap(attack, robust=False)
    defended, avgs = _gap(attack, robust=True)
    honest = _honest(True)
    assert plain > 1.5 * honest, (attack, plain, honest)        # the attack is real
    assert defended < 1.15 * honest, (attack, defended, honest)
    for a in avgs[:3]:   # every honest replica stopped averaging with the liar, and with no one else
        assert a.dropped_outliers == ["r3"], (attack, a.dropped_outliers)
