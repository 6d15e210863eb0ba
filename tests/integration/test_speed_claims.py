"""Speed claims checked in the running worker (issue 46): three replicas of one stage under streaming CO2
re-deal their micro-batches by the speeds their rounds carry; replica 2 computes 3x slower than the others
and claims to be 8x faster than it measures (``fusionp2p.testing.speed_liar``). Taken at its word
(``CO2(robust=False)``: the defences off) it is dealt the largest share; checked against when its parts
reach the shards' owners (``train/claims.py``), every replica deals by its measured speed, alike."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
import trio

from fusionp2p.graph import StageExecutor, coarsen, partition, stages_from_fences, trace
from fusionp2p.testing.channels import memory_mesh
from fusionp2p.testing.speed_liar import SpeedLiar
from fusionp2p.train.averager import open_replica_averager
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.worker import StageContext, StageReport, StageWorker
from tests.integration.test_hostile_training import _Net

R = 3
LIAR = R - 1


def _run(monkeypatch: Any, *, robust: bool) -> list[StageWorker]:
    torch.manual_seed(0)
    dag = trace(_Net(), (torch.randn(2, 4), torch.tensor([0, 2])))
    c = coarsen(dag)
    (prog,) = partition(c, stages_from_fences(len(c.units), []))
    names = [r.name for r in prog.recv]
    real = open_replica_averager

    @asynccontextmanager
    async def lying(config: Any, *, me: str, **kw: Any) -> AsyncIterator[Any]:
        async with real(config, me=me, cls=SpeedLiar if me == f"r{LIAR}" else None, **kw) as avg:
            yield avg

    monkeypatch.setattr("fusionp2p.train.worker.open_replica_averager", lying)

    def data(step: int, mu: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 10 + mu)
        return {names[0]: torch.randn(2, 4, generator=g), names[1]: torch.randint(0, 3, (2,), generator=g)}

    async def report(rep: StageReport) -> None:
        pass

    cfg = TrainConfig(steps=10, micro_batch=2, micro_batches=2, lr=0.05, replicas=R,
                      averaging=CO2(tau=2, robust=robust))
    peers = memory_mesh(R)
    workers = [StageWorker(StageContext(job="j", executor=StageExecutor(prog), config=cfg, replica=r, replicas=R,
                                        links={}, peers=peers[r], data=data, tokens_per_micro=2, report=report,
                                        recv_timeout=10.0, micro=(2,) * R, micro_period=1,
                                        compute_slowdown=60.0 if r == LIAR else 20.0))
               for r in range(R)]

    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                for w in workers:
                    n.start_soon(w.run)

    trio.run(main)
    return workers


def _shares(workers: list[StageWorker]) -> list[float]:
    deals = [(w._deal.micro, w._deal.period) for w in workers]
    assert all(d == deals[0] for d in deals), deals          # every replica deals alike
    d = workers[0]._deal
    return [c / d.period for c in d.micro]


# without the defence the liar's slow steps take 10-14 s on the shared 2-core VM (the attack itself)
@pytest.mark.parametrize("robust", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_replica_that_claims_more_speed_is_dealt_by_its_measured_speed(monkeypatch: Any, robust: bool) -> None:
    workers = _run(monkeypatch, robust=robust)
    shares = _shares(workers)
    if not robust:    # the attack is real: the liar took more than the honest replicas
        assert workers[0]._deal.redeals >= 1 and shares[LIAR] > max(shares[:LIAR]), shares
        return
    assert shares[LIAR] <= min(shares[:LIAR]), shares         # dealt by what it does: never more than the others
    for w in workers:
        # the liar is judged by its measurement on every replica alike; an honest replica may be too, when it is
        # the step's last and its overheads (outside the forward and backward it claims) pass the slack
        assert f"r{LIAR}" in w.claims.contradicted and w.claims.contradicted == workers[0].claims.contradicted
        assert f"r{LIAR}" in w.claims.floor and w.claims.floor == workers[0].claims.floor
    rep = workers[0].speed_report()   # what a member answers its leader (jobs/rebalance.py bounded): by peer id
    assert set(rep["peers_s"]) == {"p1", f"p{LIAR}"} and rep["micro_s"] > 0
