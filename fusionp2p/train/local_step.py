"""A step of a stage that talks to no other stage, in one worker-thread call.

A replica of the whole model (a single-stage plan, as the planner elects for most swarms of small hosts)
receives nothing but data and sends nothing. Run through the pipeline loop of ``StageWorker._train_step``,
each of its micro-batches' forward and backward is a separate ``trio.to_thread.run_sync`` call: a handoff
to the worker thread and one back to the event loop, each with its wake-ups, cancel scopes and GIL
transfers, about 2M + 1 a step. On benchmarks.wan's half-core hosts the event loop's share of the quota
is compute lost. :func:`local_actions` works the stage's schedule out once, without waiting for anything
(no event of a local stage comes from a peer); :func:`run_local` then runs those actions in order in the
calling (worker) thread: the same order, the same arithmetic, the same slowdown emulation per call.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionp2p.errors import JobError
from fusionp2p.graph.executor import StageExecutor
from fusionp2p.graph.program import DATA, StageProgram
from fusionp2p.train.schedule import (
    BackwardDone,
    ForwardDone,
    OptimizerStep,
    RunBackward,
    RunForward,
    StageSchedule,
)

Slowed = Callable[[Callable[..., Any]], Callable[..., Any]]


def is_local(prog: StageProgram) -> bool:
    """Whether *prog* neither receives from nor sends to another stage."""
    return prog.num_stages == 1 and not prog.send and all(r.src == DATA for r in prog.recv)


def local_actions(sched: StageSchedule) -> list[RunForward | RunBackward | OptimizerStep]:
    """A local stage's (unstarted) schedule driven to its end, every forward and backward done as soon as
    asked: its actions in the order it emits them."""
    pending, out = list(sched.start()), []
    while pending:
        act = pending.pop(0)
        if isinstance(act, RunForward):
            pending += sched.handle(ForwardDone(micro=act.micro))
        elif isinstance(act, RunBackward):
            pending += sched.handle(BackwardDone(micro=act.micro))
        elif not isinstance(act, OptimizerStep):
            raise AssertionError(f"a local stage's schedule asked for {act!r}")
        out.append(act)
    return out


def nonfinite_loss(where: str, micro: int, loss: float) -> JobError:
    """The error of a non-finite loss under ``on_nonfinite='fail'``."""
    return JobError(f"{where}, micro-batch {micro}: the loss is {loss}; training diverged (lower lr, set "
                    "grad_clip) or the data holds values the model cannot take; on_nonfinite='skip' skips such steps")


@dataclass(slots=True)
class LocalResult:
    losses: dict[int, float] = field(default_factory=dict)
    fb_s: float = 0.0           # forward and backward seconds (slowdown included)
    optimizer_s: float = 0.0    # the optimizer step's seconds (0 when it was not run here)
    stepped: bool = False       # whether the optimizer step ran


def run_local(ex: StageExecutor, actions: list[RunForward | RunBackward | OptimizerStep],
              inputs: dict[int, dict[str, torch.Tensor]], *, scale: float, slowed: Slowed, fail_nonfinite: bool,
              where: str, optimizer: Callable[[], None] | None) -> LocalResult:
    """Run *actions* (:func:`local_actions`) in this thread. The optimizer step runs here only when
    *optimizer* is given (otherwise the caller runs it: tied sums and the all-reduce come first)."""
    res, prog = LocalResult(), ex.program
    fwd, bwd = slowed(ex.forward), slowed(ex.backward)
    for act in actions:
        t = time.perf_counter()
        if isinstance(act, RunForward):
            out = fwd(act.micro, inputs.pop(act.micro))
            if prog.loss is not None:
                loss = res.losses[act.micro] = float(out[prog.loss])
                if not math.isfinite(loss) and fail_nonfinite:
                    raise nonfinite_loss(where, act.micro, loss)
            res.fb_s += time.perf_counter() - t
        elif isinstance(act, RunBackward):
            bwd(act.micro, {}, loss_scale=scale)
            res.fb_s += time.perf_counter() - t
        elif optimizer is not None:
            slowed(optimizer)()
            res.optimizer_s, res.stepped = time.perf_counter() - t, True
    return res
