"""Replicas of unequal speed run micro-batches in proportion to it (``Plan.micro``): the step's
``M x R`` micro-batches are dealt out in pipeline order, and the gradient all-reduce weighs each
replica by its count, so a step trains on the same samples with the same gradient as in lockstep."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import trio

from fusionp2p.testing.channels import memory_mesh
from fusionp2p.testing.replicas import final_params, one_stage, replica_workers, run_replicas, seeded_batches
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.worker import StageReport, StageWorker
from tests.integration.test_hostile_training import _Net


def _train(micro: Sequence[int], averaging: CO2 | None = None, *, period: int = 1, steps: int = 3,
           slowdown: float = 1.0, workers_out: list[StageWorker] | None = None,
           ) -> tuple[list[dict[str, torch.Tensor]], set[tuple[int, int]], list[StageReport]]:
    torch.manual_seed(0)
    prog = one_stage(_Net(), (torch.randn(2, 4), torch.tensor([0, 2])))
    batches = seeded_batches(prog, batch=2, features=4, classes=3)
    drawn: set[tuple[int, int]] = set()
    reports: list[StageReport] = []

    def data(step: int, mu: int) -> dict[str, torch.Tensor]:
        assert (step, mu) not in drawn, f"micro-batch {(step, mu)} dealt twice"
        drawn.add((step, mu))
        return batches(step, mu)

    async def report(rep: StageReport) -> None:
        reports.append(rep)

    cfg = TrainConfig(steps=steps, micro_batch=2, micro_batches=2, lr=0.1, replicas=2, averaging=averaging)
    workers = replica_workers(prog, cfg, data=data, report=report, tokens_per_micro=2, recv_timeout=10.0,
                              peers=memory_mesh(2, name="r"), micro=micro, micro_period=period,
                              slowdown=(1.0, slowdown))
    if workers_out is not None:
        workers_out.extend(workers)
    return _run_all(workers), drawn, reports


def _run_all(workers: Sequence[StageWorker]) -> list[dict[str, torch.Tensor]]:
    """Run the replicas' workers to their end (within 60 s); their final parameters."""
    run_replicas(workers, timeout=60)
    return final_params(workers)


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


def test_fractional_shares_deal_each_step_out_and_train_like_lockstep() -> None:
    # 2.5 and 1.5 micro-batches a step (5 and 3 over a period of 2 steps): 3 + 1, then 2 + 2, then 3 + 1.
    # Each step is dealt out whole and the per-step all-reduce weighs each replica by that step's count,
    # so the weights are those of lockstep
    lock, lock_drawn, _ = _train(())
    bal, bal_drawn, reports = _train((5, 3), period=2)
    assert bal_drawn == lock_drawn
    for params in bal:
        for k, v in params.items():
            torch.testing.assert_close(v, lock[0][k], rtol=1e-5, atol=1e-6)
    assert {(r.replica, r.step, r.tokens) for r in reports if not r.eval} == {
        (0, 0, 6), (1, 0, 2), (0, 1, 4), (1, 1, 4), (0, 2, 6), (1, 2, 2)}


def test_fractional_shares_under_co2_end_at_one_consensus() -> None:
    params, _, _ = _train((5, 3), averaging=CO2(tau=1), period=2)
    for k in params[0]:
        torch.testing.assert_close(params[0][k], params[1][k])


def test_replicas_re_deal_by_the_speeds_their_rounds_carry() -> None:
    """Streaming CO2 (the default): each round's shards carry their owners' measured seconds per
    micro-batch, and at the step a round is applied every replica re-deals the micro-batches by them.
    Replica 1 computes 50x slower (``compute_slowdown``): both replicas move to the same deal at the same
    step, replica 0 takes the larger share (at most 4x), no micro-batch is dealt twice or left out, and
    the replicas end at one consensus."""
    workers: list[StageWorker] = []
    lock_drawn = _train((), steps=12)[1]
    params, drawn, reports = _train((2, 2), averaging=CO2(tau=2), period=1, steps=12, slowdown=50.0,
                                    workers_out=workers)
    assert drawn == lock_drawn
    d0, d1 = (w._deal for w in workers)
    assert d0.redeals >= 1 and d1.redeals == d0.redeals
    assert (d0.micro, d0.period) == (d1.micro, d1.period)
    assert d0.share > 2 > d1.share and d0.share <= 4 * d1.share and d0.share + d1.share == 4
    by_step: dict[int, int] = {}
    for r in reports:
        if not r.eval:
            by_step[r.step] = by_step.get(r.step, 0) + r.tokens
    assert set(by_step.values()) == {8}                   # every step trained on its 4 micro-batches of 2
    for k in params[0]:
        torch.testing.assert_close(params[0][k], params[1][k])


def test_micro_batches_that_do_not_deal_out_the_step_are_refused() -> None:
    with pytest.raises(Exception, match="do not deal out"):
        _train((3, 2))
    with pytest.raises(Exception, match="do not deal out"):
        _train((7, 1), period=2)        # under one micro-batch a step for replica 1


class _Held:
    """A replica's channel end whose step-0 gradient waits for *until* (another replica's step-1 send)."""

    def __init__(self, ch: Any, until: trio.Event, *, sets: trio.Event | None = None) -> None:
        self._ch, self._until, self._sets = ch, until, sets

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ch, name)

    async def send(self, msg: Any) -> None:
        if msg.kind == "grad-avg" and msg.step == 0 and self._sets is None:
            await self._until.wait()
        await self._ch.send(msg)
        if self._sets is not None and msg.kind == "grad-avg" and msg.step == 1:
            self._sets.set()


def test_a_gradient_of_the_next_step_may_come_before_a_third_replicas_of_this_one() -> None:
    """Three replicas, per-step all-reduce: replica 2's step-0 gradient to replica 0 is held until
    replica 1, which had every step-0 gradient, has sent replica 0 its step-1 gradient. Replica 0 keeps
    that one for the next step (benchmarks.wan's six-replica warm-up failed on it), and all three end
    with the same weights as without the hold."""
    torch.manual_seed(0)
    prog = one_stage(_Net(), (torch.randn(2, 4), torch.tensor([0, 2])))

    async def report(rep: StageReport) -> None:
        pass

    def run(hold: bool) -> list[dict[str, torch.Tensor]]:
        cfg = TrainConfig(steps=3, micro_batch=2, micro_batches=2, lr=0.1, replicas=3, averaging=None)
        (p01, p02), (p10, p12), (p20, p21) = memory_mesh(3, name="r")
        released = trio.Event()
        peers: list[list[Any]] = [[p01, p02], [_Held(p10, released, sets=released) if hold else p10, p12],
                                  [p21, _Held(p20, released) if hold else p20]]    # replica 2 sends to 1 first
        workers = replica_workers(prog, cfg, data=seeded_batches(prog, batch=2, features=4, classes=3),
                                  report=report, tokens_per_micro=2, recv_timeout=10.0, peers=peers)
        return _run_all(workers)

    plain, held = run(False), run(True)
    for params in held:
        for k, v in params.items():
            torch.testing.assert_close(v, plain[0][k])
