"""A stage that talks to no other stage runs its step in one worker-thread call (train/local_step.py): the
schedule's order, the same gradients and losses as one forward and backward at a time, the optimizer step
in the same call only when asked, and a non-finite loss still fails the step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fusionp2p.errors import JobError
from fusionp2p.graph import StageExecutor, coarsen, partition, single_stage, stages_from_fences, trace
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.train.local_step import is_local, local_actions, run_local
from fusionp2p.train.schedule import OptimizerStep, RunBackward, RunForward, ScheduleConfig, StageSchedule


def _unslowed(fn: Any) -> Any:
    return fn


def _setup(m: int) -> tuple[StageExecutor, list[dict[str, torch.Tensor]], Any]:
    torch.manual_seed(0)
    model = GPT2(GPT2Config.tiny(n_layer=2, n_embd=32, block_size=16))
    batches = [(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))) for _ in range(m)]
    dag = trace(model, example_inputs=batches[0])
    ex = StageExecutor(single_stage(dag))
    return ex, [dict(zip(dag.data_inputs, b, strict=True)) for b in batches], dag


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_the_actions_are_the_schedules_with_the_optimizer_last(kind: str) -> None:
    acts = local_actions(StageSchedule(ScheduleConfig(kind=kind, stages=1, micro_batches=3, stage=0)))
    assert isinstance(acts[-1], OptimizerStep) and sum(isinstance(a, OptimizerStep) for a in acts) == 1
    assert [a.micro for a in acts if isinstance(a, RunForward)] == [0, 1, 2]
    assert [a.micro for a in acts if isinstance(a, RunBackward)] == [0, 1, 2]
    for a in acts:   # every backward after its forward
        if isinstance(a, RunBackward):
            assert acts.index(RunForward(micro=a.micro)) < acts.index(a)


def test_only_a_single_stage_that_sends_nothing_is_local() -> None:
    ex, _, dag = _setup(1)
    assert is_local(ex.program)
    stages = partition(coarsen(dag), stages_from_fences(len(coarsen(dag).units), [2]))
    assert not any(is_local(p) for p in stages)


def test_one_call_gives_the_gradients_and_losses_of_one_micro_batch_at_a_time() -> None:
    m = 3
    ex, feeds, _ = _setup(m)
    ref, _, _ = _setup(m)   # the same seed: the same weights and batches, its own parameters
    ref_losses = []
    assert all(p is not ref.parameters()[n] for n, p in ex.parameters().items())
    loss = ex.program.loss
    assert loss is not None
    for mu, feed in enumerate(feeds):
        out = ref.forward(mu, dict(feed))
        ref_losses.append(float(out[loss]))
        ref.backward(mu, {}, loss_scale=1 / m)
    stepped: list[int] = []
    res = run_local(ex, local_actions(StageSchedule(ScheduleConfig(kind="1f1b", stages=1, micro_batches=m, stage=0))),
                    {mu: dict(f) for mu, f in enumerate(feeds)}, scale=1 / m, slowed=_unslowed, fail_nonfinite=True,
                    where="stage 0, step 0", optimizer=lambda: stepped.append(1))
    assert [res.losses[mu] for mu in range(m)] == ref_losses
    for name, p in ex.parameters().items():
        torch.testing.assert_close(p.grad, ref.parameters()[name].grad, rtol=0, atol=0)
    assert stepped == [1] and res.stepped and res.fb_s > 0


def test_without_an_optimizer_the_caller_steps_and_a_nonfinite_loss_fails() -> None:
    ex, feeds, _ = _setup(2)
    acts = local_actions(StageSchedule(ScheduleConfig(kind="gpipe", stages=1, micro_batches=2, stage=0)))
    res = run_local(ex, acts, {mu: dict(f) for mu, f in enumerate(feeds)}, scale=0.5, slowed=_unslowed,
                    fail_nonfinite=True, where="stage 0, step 0", optimizer=None)
    assert not res.stepped and res.optimizer_s == 0.0
    with torch.no_grad():
        next(iter(ex.parameters().values())).fill_(float("nan"))
    res = run_local(ex, acts, {mu: dict(f) for mu, f in enumerate(feeds)}, scale=0.5, slowed=_unslowed,
                    fail_nonfinite=False, where="stage 0, step 1", optimizer=None)
    assert all(v != v for v in res.losses.values())   # nan, reported for the guard to skip the step
    with pytest.raises(JobError, match="stage 0, step 2, micro-batch 0: the loss is nan"):
        run_local(ex, acts, {mu: dict(f) for mu, f in enumerate(feeds)}, scale=0.5, slowed=_unslowed,
                  fail_nonfinite=True, where="stage 0, step 2", optimizer=None)
