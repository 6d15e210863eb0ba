"""Replicas of one stage in one process, for integration tests and benchmarks of the stage worker.

The pieces every such harness builds: the whole model as one stage's program (:func:`one_stage`),
seeded classification micro-batches (:func:`seeded_batches`), ``R`` :class:`StageWorker` s over all-pairs
memory channels (:func:`replica_workers`, channels from :func:`~fusionp2p.testing.channels.memory_mesh`),
a run of them all within a deadline (:func:`run_replicas`), and a replica's own averager class, for
attacks (:func:`replica_averagers`: a liar among honest replicas).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import torch
import trio
from torch import nn

from fusionp2p.graph import StageExecutor, StageProgram, coarsen, partition, stages_from_fences, trace
from fusionp2p.net.channel import TensorChannel
from fusionp2p.testing.channels import memory_mesh
from fusionp2p.train import worker as worker_mod
from fusionp2p.train.averager import ReplicaAverager, open_replica_averager
from fusionp2p.train.config import TrainConfig
from fusionp2p.train.worker import DataFn, StageContext, StageReport, StageWorker


def one_stage(model: nn.Module, example: tuple[torch.Tensor, ...]) -> StageProgram:
    """*model* traced on *example* and coarsened, as the program of a single stage (no fences)."""
    c = coarsen(trace(model, example))
    (prog,) = partition(c, stages_from_fences(len(c.units), []))
    return prog


def seeded_batches(prog: StageProgram, *, batch: int, features: int, classes: int) -> DataFn:
    """Micro-batch ``(step, mu)`` of a classifier *prog* (inputs ``x``, then labels): ``batch`` rows of
    ``features`` normal values and ``batch`` labels below ``classes``, drawn from the seed ``10 step + mu``."""
    names = [r.name for r in prog.recv]

    def data(step: int, mu: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 10 + mu)
        return {names[0]: torch.randn(batch, features, generator=g),
                names[1]: torch.randint(0, classes, (batch,), generator=g)}

    return data


def replica_workers(prog: StageProgram, config: TrainConfig, *, data: DataFn | Sequence[DataFn],
                    report: Callable[[StageReport], Awaitable[None]], tokens_per_micro: int, recv_timeout: float,
                    peers: Sequence[Sequence[TensorChannel]] | None = None, micro: Sequence[int] = (),
                    micro_period: int = 1, slowdown: Sequence[float] | None = None, job: str = "j",
                    ) -> list[StageWorker]:
    """``config.replicas`` workers of *prog*, each on its own executor. *peers*: each replica's channels to
    the others (default ``memory_mesh(config.replicas)``); *data* and *slowdown* (``compute_slowdown``):
    one for all or one a replica."""
    n = config.replicas
    if n is None:
        raise ValueError("set config.replicas: the number of workers to build")
    mesh: Sequence[Sequence[TensorChannel]] = memory_mesh(n) if peers is None else peers
    datas = [data] * n if callable(data) else list(data)
    slow = [1.0] * n if slowdown is None else list(slowdown)
    if not len(mesh) == len(datas) == len(slow) == n:
        raise ValueError(f"peers, data and slowdown must have one entry a replica ({n})")
    return [StageWorker(StageContext(job=job, executor=StageExecutor(prog), config=config, replica=r, replicas=n,
                                     links={}, peers=mesh[r], data=datas[r], tokens_per_micro=tokens_per_micro,
                                     report=report, recv_timeout=recv_timeout, micro=micro, micro_period=micro_period,
                                     compute_slowdown=slow[r]))
            for r in range(n)]


def run_replicas(workers: Sequence[StageWorker], *, timeout: float = 60.0) -> None:
    """Run *workers* to their end in one ``trio.run``; ``trio.TooSlowError`` after *timeout* seconds."""
    async def main() -> None:
        with trio.fail_after(timeout):
            async with trio.open_nursery() as n:
                for w in workers:
                    n.start_soon(w.run)

    trio.run(main)


def final_params(workers: Sequence[StageWorker]) -> list[dict[str, torch.Tensor]]:
    """Each worker's parameters, copied."""
    return [{k: v.detach().clone() for k, v in w.ex.parameters().items()} for w in workers]


@contextmanager
def replica_averagers(cls_of: Callable[[str], type[ReplicaAverager] | None],
                      setup: Callable[[str, ReplicaAverager], None] | None = None) -> Iterator[None]:
    """Within the block, the stage workers' averager of replica ``me`` (``"r0"``, ...) is ``cls_of(me)``
    (None: the shipped :class:`ReplicaAverager`), then ``setup(me, averager)`` once it is open."""
    real = open_replica_averager

    @asynccontextmanager
    async def opened(config: Any, *, me: str, **kw: Any) -> AsyncIterator[ReplicaAverager]:
        async with real(config, me=me, cls=cls_of(me), **kw) as avg:
            if setup is not None:
                setup(me, avg)
            yield avg

    saved = vars(worker_mod)["open_replica_averager"]
    setattr(worker_mod, "open_replica_averager", opened)  # noqa: B010 (mypy: a module attribute, patched)
    try:
        yield
    finally:
        setattr(worker_mod, "open_replica_averager", saved)  # noqa: B010


__all__ = ["final_params", "one_stage", "replica_averagers", "replica_workers", "run_replicas", "seeded_batches"]
