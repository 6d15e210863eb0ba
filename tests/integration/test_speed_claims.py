"""Speed claims checked in the running worker (issue 46): three replicas of one stage under streaming CO2
re-deal their micro-batches by the speeds their rounds carry; replica 2 computes 3x slower than the others
and claims to be 8x faster than it measures (``fusionp2p.testing.speed_liar``). Taken at its word
(``CO2(robust=False)``: the defences off) it is dealt the largest share; checked against when its parts
reach the shards' owners (``train/claims.py``), every replica deals by its measured speed, alike."""

from __future__ import annotations

import pytest
import torch

from fusionp2p.testing.replicas import (
    one_stage,
    replica_averagers,
    replica_workers,
    run_replicas,
    seeded_batches,
)
from fusionp2p.testing.speed_liar import SpeedLiar
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.worker import StageReport, StageWorker
from tests.integration.test_hostile_training import _Net

R = 3
LIAR = R - 1


def _run(*, robust: bool) -> list[StageWorker]:
    torch.manual_seed(0)
    prog = one_stage(_Net(), (torch.randn(2, 4), torch.tensor([0, 2])))

    async def report(rep: StageReport) -> None:
        pass

    cfg = TrainConfig(steps=10, micro_batch=2, micro_batches=2, lr=0.05, replicas=R,
                      averaging=CO2(tau=2, robust=robust))
    workers = replica_workers(prog, cfg, data=seeded_batches(prog, batch=2, features=4, classes=3), report=report,
                              tokens_per_micro=2, recv_timeout=10.0, micro=(2,) * R, micro_period=1,
                              slowdown=[60.0 if r == LIAR else 20.0 for r in range(R)])
    with replica_averagers(lambda me: SpeedLiar if me == f"r{LIAR}" else None):
        run_replicas(workers, timeout=60)
    return workers


def _shares(workers: list[StageWorker]) -> list[float]:
    deals = [(w._deal.micro, w._deal.period) for w in workers]
    assert all(d == deals[0] for d in deals), deals          # every replica deals alike
    d = workers[0]._deal
    return [c / d.period for c in d.micro]


# without the defence the liar's slow steps take 10-14 s on the shared 2-core VM (the attack itself)
@pytest.mark.parametrize("robust", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_replica_that_claims_more_speed_is_dealt_by_its_measured_speed(robust: bool) -> None:
    workers = _run(robust=robust)
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
