"""Run several stage programs in one process: the reference driver for tests and benchmarks.

:class:`LocalPipeline` is what the job runtime does across nodes, without a network: it moves
boundary tensors between :class:`StageExecutor` s through :class:`Inbox` es. Messages are delivered
first-in first-out, or in a shuffled order drawn from a seeded ``random.Random`` (to show that results
do not depend on arrival order). No threads, no clock.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fusionp2p.graph.executor import Inbox, StageExecutor, tied_sum
from fusionp2p.graph.program import DATA, StageProgram


@dataclass(frozen=True, slots=True)
class _Msg:
    grad: bool
    dst: int
    micro: int
    name: str
    src: int
    tensor: torch.Tensor


class LocalPipeline:
    """One executor per stage program, wired together in memory."""

    def __init__(self, programs: Sequence[StageProgram], *, device: str | torch.device = "cpu",
                 recompute: bool = False) -> None:
        self.programs = list(programs)
        self.executors = [StageExecutor(p, device=device, recompute=recompute) for p in self.programs]
        self.bytes_moved = 0   # boundary bytes (activations + gradients), data inputs excluded

    def parameters(self) -> dict[str, torch.nn.Parameter]:
        """Every parameter by name (a tied parameter: its first holder's copy)."""
        out: dict[str, torch.nn.Parameter] = {}
        for ex in reversed(self.executors):
            out.update(ex.parameters())
        return out

    def all_parameters(self) -> list[torch.nn.Parameter]:
        """Every stage's parameters, tied copies included (what an optimizer of the pipeline steps)."""
        return [p for ex in self.executors for p in ex.parameters().values()]

    def sum_tied(self) -> None:
        """Give every copy of a tied parameter the sum of the copies' gradients, in stage order."""
        for prog in self.programs:
            for tp in prog.tied:
                if tp.stages[0] != prog.stage:
                    continue
                grads = [self.executors[s].parameters()[tp.name].grad for s in tp.stages]
                total = tied_sum(grads)
                for s in tp.stages:
                    self.executors[s].parameters()[tp.name].grad = None if total is None else total.clone()

    def zero_grad(self) -> None:
        for ex in self.executors:
            ex.zero_grad()

    def step(self, micro_batches: Sequence[Mapping[str, torch.Tensor]], *, loss_scale: float | None = None,
             rng: random.Random | None = None) -> list[float]:
        """Forward and backward every micro-batch; return the losses (in micro-batch order).

        Gradients accumulate into the executors' parameters; ``loss_scale`` defaults to
        ``1/len(micro_batches)`` so that the accumulated gradient is that of the mean loss. At the end
        the copies of a tied parameter hold the sum of their gradients (:meth:`sum_tied`).
        """
        scale = 1.0 / len(micro_batches) if loss_scale is None else loss_scale
        inboxes = [Inbox(p) for p in self.programs]
        queue: list[_Msg] = []
        for mu, batch in enumerate(micro_batches):
            for p in self.programs:
                queue.extend(_Msg(False, p.stage, mu, r.name, DATA, batch[r.name]) for r in p.recv if r.src == DATA)
        losses: dict[int, float] = {}
        while queue:
            msg = queue.pop(rng.randrange(len(queue)) if rng is not None else 0)
            ex, box, prog = self.executors[msg.dst], inboxes[msg.dst], self.programs[msg.dst]
            if msg.src != DATA:
                self.bytes_moved += msg.tensor.numel() * msg.tensor.element_size()
            if not msg.grad:
                ready = box.put_activation(msg.micro, msg.name, msg.tensor)
                if ready is None:
                    continue
                outs = ex.forward(msg.micro, ready)
                if prog.loss is not None:
                    losses[msg.micro] = float(outs[prog.loss])
                for o in prog.send:
                    queue.extend(_Msg(False, d, msg.micro, o.name, prog.stage, outs[o.name]) for d in o.dsts)
                if box.grads_needed():
                    continue
                grads_in: Mapping[str, torch.Tensor] = {}
            else:
                got = box.put_grad(msg.micro, msg.name, msg.src, msg.tensor)
                if got is None:
                    continue
                grads_in = got
            back = ex.backward(msg.micro, grads_in, loss_scale=scale)
            src_of = {r.name: r.src for r in prog.recv}
            queue.extend(_Msg(True, src_of[n], msg.micro, n, prog.stage, g) for n, g in back.items())
        self.sum_tied()
        return [losses[m] for m in sorted(losses)]
