"""Replicas of unequal speed run micro-batches in proportion to it (``Plan.micro``): the step's
``M x R`` micro-batches are dealt out in pipeline order, and the gradient all-reduce weighs each
replica by its count, so a step trains on the same samples with the same gradient as in lockstep."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import trio

from fusionp2p.graph import StageExecutor, coarsen, partition, stages_from_fences, trace
from fusionp2p.testing.channels import memory_channel_pair
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.worker import StageContext, StageReport, StageWorker
from tests.integration.test_hostile_training import _Net


def _train(micro: Sequence[int], averaging: CO2 | None = None) -> tuple[list[dict[str, torch.Tensor]],
                                                                      set[tuple[int, int]], list[StageReport]]:
    torch.manual_seed(0)
    dag = trace(_Net(), (torch.randn(2, 4), torch.tensor([0, 2])))
    c = coarsen(dag)
    (prog,) = partition(c, stages_from_fences(len(c.units), []))
    names = [r.name for r in prog.recv]
    drawn: set[tuple[int, int]] = set()
    reports: list[StageReport] = []

    def data(step: int, mu: int) -> dict[str, torch.Tensor]:
        drawn.add((step, mu))
        g = torch.Generator().manual_seed(step * 10 + mu)
        return {names[0]: torch.randn(2, 4, generator=g), names[1]: torch.randint(0, 3, (2,), generator=g)}

    async def report(rep: StageReport) -> None:
        reports.append(rep)

    cfg = TrainConfig(steps=3, micro_batch=2, micro_batches=2, lr=0.1, replicas=2, averaging=averaging)
    a, b = memory_channel_pair("r0", "r1", window=8)
    workers = [StageWorker(StageContext(job="j", executor=StageExecutor(prog), config=cfg, replica=r, replicas=2,
                                        links={}, peers=[ch], data=data, tokens_per_micro=2, report=report,
                                        recv_timeout=10.0, micro=micro))
               for r, ch in ((0, a), (1, b))]

    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                for w in workers:
                    n.start_soon(w.run)

    trio.run(main)
    return [{k: v.detach().clone() for k, v in w.ex.parameters().items()} for w in workers], drawn, reports


def test_a_balanced_step_trains_like_lockstep_on_the_same_samples() -> None:
    lock, lock_drawn, _ = _train(())
    bal, bal_drawn, reports = _train((3, 1))
    assert bal_drawn == lock_drawn                       # the same micro-batches, dealt out differently
    for params in bal:
        for k, v in params.items():
            torch.testing.assert_close(v, lock[0][k], rtol=1e-5, atol=1e-6)
    tokens = {(r.replica, r.tokens) for r in reports if not r.eval}
    assert tokens == {(0, 6), (1, 2)}


def test_balanced_replicas_under_co2_end_at_one_consensus() -> None:
    # CO2's rounds weigh each replica by its micro-batches (AveragerConfig.weight); the final average is
    # the same on both
    params, _, reports = _train((3, 1), averaging=CO2(tau=1))
    for k in params[0]:
        torch.testing.assert_close(params[0][k], params[1][k])
    assert {(r.replica, r.tokens) for r in reports if not r.eval} == {(0, 6), (1, 2)}


def test_micro_batches_that_do_not_deal_out_the_step_are_refused() -> None:
    with pytest.raises(Exception, match="do not deal out"):
        _train((3, 2))
