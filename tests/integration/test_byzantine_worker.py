"""The stage worker's side of robust averaging (issue 46): four replicas of one stage under CO2 (robust by
default), replica 3's averager lying (``fusionp2p.testing.byzantine``); each honest worker reports the liar
once in its ``StageReport.outliers`` (the job turns it into an ``AveragingOutlier`` event), and the honest
replicas end at one consensus."""

from __future__ import annotations

import functools

import pytest
import torch
import trio

from fusionp2p.testing.byzantine import LyingAverager
from fusionp2p.testing.replicas import one_stage, replica_averagers, replica_workers, seeded_batches
from fusionp2p.train.averager import ReplicaAverager
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.worker import StageReport
from tests.integration.test_hostile_training import _Net

R = 4


def _lie(me: str, avg: ReplicaAverager) -> None:
    assert isinstance(avg, LyingAverager)
    avg.attack = "scale" if me == f"r{R - 1}" else None   # replica 3 lies, the others run as shipped


@pytest.mark.slow   # 16 s on the shared 2-core VM
def test_honest_workers_report_the_lying_replica_once() -> None:
    torch.manual_seed(0)
    prog = one_stage(_Net(), (torch.randn(2, 4), torch.tensor([0, 2])))
    data = seeded_batches(prog, batch=2, features=4, classes=3)
    reports: list[StageReport] = []

    async def report(rep: StageReport) -> None:
        reports.append(rep)

    cfg = TrainConfig(steps=10, micro_batch=2, micro_batches=1, lr=0.05, replicas=R, averaging=CO2(tau=1))
    workers = replica_workers(prog, cfg, data=[functools.partial(lambda r, s, m: data(s * R + r, m), r) for r in range(R)],
                              report=report, tokens_per_micro=2, recv_timeout=10.0)

    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(workers[-1].run)
                async with trio.open_nursery() as honest:
                    for w in workers[:-1]:
                        honest.start_soon(w.run)
                n.cancel_scope.cancel()   # the liar, dropped by the others, would wait for them until its deadline

    with replica_averagers(lambda me: LyingAverager, _lie):
        trio.run(main)
    told = sorted((r.replica, p) for r in reports for p in r.outliers)
    assert told == [(0, "p3"), (1, "p3"), (2, "p3")], told
    final = [torch.cat([p.detach().reshape(-1) for p in w.ex.parameters().values()]) for w in workers[:3]]
    for f in final[1:]:
        torch.testing.assert_close(f, final[0])
