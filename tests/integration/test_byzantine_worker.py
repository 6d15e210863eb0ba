"""The stage worker's side of robust averaging (issue 46): four replicas of one stage under CO2 (robust by
default), replica 3's averager lying (``fusionp2p.testing.byzantine``); each honest worker reports the liar
once in its ``StageReport.outliers`` (the job turns it into an ``AveragingOutlier`` event), and the honest
replicas end at one consensus."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
import trio

from fusionp2p.graph import StageExecutor, coarsen, partition, stages_from_fences, trace
from fusionp2p.testing.byzantine import LyingAverager
from fusionp2p.testing.channels import memory_mesh
from fusionp2p.train.averager import open_replica_averager
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.worker import StageContext, StageReport, StageWorker
from tests.integration.test_hostile_training import _Net

R = 4


@pytest.mark.slow   # 16 s on the shared 2-core VM
def test_honest_workers_report_the_lying_replica_once(monkeypatch: Any) -> None:
    torch.manual_seed(0)
    dag = trace(_Net(), (torch.randn(2, 4), torch.tensor([0, 2])))
    c = coarsen(dag)
    (prog,) = partition(c, stages_from_fences(len(c.units), []))
    names = [r.name for r in prog.recv]
    reports: list[StageReport] = []
    real = open_replica_averager

    @asynccontextmanager
    async def lying(config: Any, *, me: str, **kw: Any) -> AsyncIterator[Any]:
        async with real(config, me=me, cls=LyingAverager, **kw) as avg:
            assert isinstance(avg, LyingAverager)
            avg.attack = "scale" if me == f"r{R - 1}" else None   # replica 3 lies, the others run as shipped
            yield avg

    monkeypatch.setattr("fusionp2p.train.worker.open_replica_averager", lying)

    def data(step: int, mu: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 10 + mu)
        return {names[0]: torch.randn(2, 4, generator=g), names[1]: torch.randint(0, 3, (2,), generator=g)}

    async def report(rep: StageReport) -> None:
        reports.append(rep)

    cfg = TrainConfig(steps=10, micro_batch=2, micro_batches=1, lr=0.05, replicas=R, averaging=CO2(tau=1))
    peers = memory_mesh(R)
    workers = [StageWorker(StageContext(job="j", executor=StageExecutor(prog), config=cfg, replica=r, replicas=R,
                                        links={}, peers=peers[r], data=functools.partial(lambda r, s, m: data(s * R + r, m), r),
                                        tokens_per_micro=2, report=report, recv_timeout=10.0)) for r in range(R)]

    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(workers[-1].run)
                async with trio.open_nursery() as honest:
                    for w in workers[:-1]:
                        honest.start_soon(w.run)
                n.cancel_scope.cancel()   # the liar, dropped by the others, would wait for them until its deadline

    trio.run(main)
    told = sorted((r.replica, p) for r in reports for p in r.outliers)
    assert told == [(0, "p3"), (1, "p3"), (2, "p3")], told
    final = [torch.cat([p.detach().reshape(-1) for p in w.ex.parameters().values()]) for w in workers[:3]]
    for f in final[1:]:
        torch.testing.assert_close(f, final[0])
