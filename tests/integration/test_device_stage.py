"""A StageWorker whose executor is on another device than the host (issue 39), without a GPU: stage 0
of a two-stage model runs on the ``meta`` device (no data; like CUDA, it refuses host tensors in its
kernels) behind a compressed fence, against a hand-written stage 1 on the host. Received activations
and gradients, AdaTopK's selection and keep-masks, the optimizer step, the evaluation pass and the state
export all cross between host and device through ``fusionp2p.device``; a path that forgot to would
raise here as it would on a GPU.

Meta tensors hold no values, so the finiteness checks (which read a value) are told to trust them.
"""

from __future__ import annotations

import pytest
import torch
import trio

from fusionp2p.graph import StageExecutor, coarsen, partition, stages_from_fences, trace
from fusionp2p.graph.program import StageProgram
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.net.channel import TensorMessage
from fusionp2p.testing.channels import memory_channel_pair
from fusionp2p.train import guard, worker
from fusionp2p.train.config import TrainConfig
from fusionp2p.train.worker import StageContext, StageReport, StageWorker
from tests.integration.test_hostile_training import _programs

META = torch.device("meta")


def _finite_unless_known(tensors: object) -> bool:
    ts = [t for t in tensors if t is not None and t.is_floating_point()]  # type: ignore[attr-defined]
    return all(t.device.type == "meta" or bool(torch.isfinite(t).all()) for t in ts)


async def _stage1(ch: object, p1: StageProgram, seen: list[TensorMessage]) -> None:
    """Answers every activation with a host gradient of its full shape."""
    while True:
        msg: TensorMessage = await ch.receive()  # type: ignore[attr-defined]
        seen.append(msg)
        if msg.kind != "act":
            continue
        # the shape from the codec's header: a meta tensor's host copy is zeros, no valid top-k payload
        shape = msg.meta["shape"] if msg.meta else msg.tensors[0].shape
        await ch.send(TensorMessage(job="j", kind="grad", stage=0, step=msg.step, micro=msg.micro,  # type: ignore[attr-defined]
                                    name=msg.name, tensors=(torch.full(shape, 0.01),)))


async def _replica(ch: object, n: int, steps: int, seen: list[TensorMessage]) -> None:
    """The other replica of the stage in the per-step gradient all-reduce: sends a zero gradient (host)."""
    for step in range(steps):
        await ch.send(TensorMessage(job="j", kind="grad-avg", stage=0, step=step, name="g1",  # type: ignore[attr-defined]
                                    tensors=(torch.zeros(n),)))
        seen.append(await ch.receive())  # type: ignore[attr-defined]


@pytest.mark.parametrize("allreduce", [False, True])
def test_a_stage_on_a_device_trains_behind_a_compressed_fence(monkeypatch: pytest.MonkeyPatch, allreduce: bool) -> None:
    """Alone, or with a second replica that all-reduces gradients every step (averaged on the host, the
    result moved back to the device)."""
    monkeypatch.setattr(guard, "all_finite", _finite_unless_known)
    monkeypatch.setattr(worker, "all_finite", _finite_unless_known)
    p0, p1 = _programs()
    names = [r.name for r in p0.recv]
    reports: list[StageReport] = []
    seen: list[TensorMessage] = []
    averaged: list[TensorMessage] = []
    ex = StageExecutor(p0, device="meta")
    n = sum(p.numel() for p in ex.parameters().values())

    def data(step: int, micro: int) -> dict[str, torch.Tensor]:   # host tensors, as a data loader gives
        g = torch.Generator().manual_seed(step * 10 + micro)
        return {names[0]: torch.randn(2, 4, generator=g), **{n: torch.tensor([0, 1]) for n in names[1:]}}

    async def report(rep: StageReport) -> None:
        reports.append(rep)

    cfg = TrainConfig(steps=3, micro_batch=2, micro_batches=2, lr=0.1)
    a, b = memory_channel_pair("s0", "s1", window=8)
    r0, r1 = memory_channel_pair("r0", "r1", window=8)
    ctx = StageContext(job="j", executor=ex, config=cfg, replica=0, replicas=2 if allreduce else 1, links={1: a},
                       peers=[r0] if allreduce else [], data=data, tokens_per_micro=2, report=report,
                       recv_timeout=10.0, rho_out={1: 0.5})
    w = StageWorker(ctx)

    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_stage1, b, p1, seen)
                if allreduce:
                    nursery.start_soon(_replica, r1, n, cfg.steps, averaged)
                await w.run()
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert sorted(r.step for r in reports if not r.eval) == [0, 1, 2] and not any(r.skipped for r in reports)
    acts = [m for m in seen if m.kind == "act"]
    assert len(acts) == 6 and all(m.meta.get("codec") == "topk" for m in acts)   # selected on the device
    assert all(t.device.type == "cpu" for m in seen + averaged for t in m.tensors)   # sent from the host
    assert len(averaged) == (3 if allreduce else 0) and all(m.tensors[0].shape == (n,) for m in averaged)
    assert all(p.device == META for p in ex.parameters().values())
    assert all(v.device == META for st in w.opt.state.values() for k, v in st.items() if k != "step")
    st = w.export_state()                                                          # hand-offs, checkpoints
    assert st.step == 3 and all(t.device.type == "cpu" for t in [*st.tensors.values(), *st.optimizer.values()])


def test_a_tied_embedding_on_a_device_sums_with_its_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2 with tied embeddings: stage 0 (the input embedding) on meta, a hand-written stage 1 (the
    head, which holds the other copy) on the host. Every step the copies' gradients are exchanged: ours
    leaves as a host tensor, theirs is moved to the device before the sum."""
    monkeypatch.setattr(guard, "all_finite", _finite_unless_known)
    monkeypatch.setattr(worker, "all_finite", _finite_unless_known)
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, tie_weights=True))
    x = torch.randint(0, 64, (2, 8))
    dag = trace(model, example_inputs=(x, torch.randint(0, 64, (2, 8))))
    c = coarsen(dag)
    p0, _ = partition(c, stages_from_fences(len(c.units), [len(c.units) // 2]))
    (tied,) = p0.tied
    shape = tuple(p0.tensors[tied.name].shape)
    got: list[TensorMessage] = []

    async def stage1(ch: object) -> None:
        grads: dict[int, int] = {}
        while True:
            msg: TensorMessage = await ch.receive()  # type: ignore[attr-defined]
            got.append(msg)
            if msg.kind != "act":
                continue
            await ch.send(TensorMessage(job="j", kind="grad", stage=0, step=msg.step, micro=msg.micro,  # type: ignore[attr-defined]
                                        name=msg.name, tensors=(torch.full(msg.meta["shape"], 0.01),)))
            grads[msg.step] = grads.get(msg.step, 0) + 1
            if grads[msg.step] == 2:   # after this step's backward: our copy's gradient
                await ch.send(TensorMessage(job="j", kind="tied", stage=0, step=msg.step, name=tied.name,  # type: ignore[attr-defined]
                                            tensors=(torch.full(shape, 0.001), torch.ones(1))))

    async def report(rep: StageReport) -> None:
        pass

    ex = StageExecutor(p0, device="meta")
    cfg = TrainConfig(steps=2, micro_batch=2, micro_batches=2, lr=0.1)
    a, b = memory_channel_pair("s0", "s1", window=8)
    ctx = StageContext(job="j", executor=ex, config=cfg, replica=0, replicas=1, links={1: a},
                       data=lambda step, micro: {"idx_BT": x}, tokens_per_micro=16, report=report,
                       recv_timeout=10.0, rho_out={1: 0.5})
    w = StageWorker(ctx)

    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stage1, b)
                await w.run()
                nursery.cancel_scope.cancel()

    trio.run(main)
    sent_tied = [m for m in got if m.kind == "tied"]
    assert len(sent_tied) == 2 and all(m.tensors[0].device.type == "cpu" and tuple(m.tensors[0].shape) == shape
                                       for m in sent_tied)
    assert w.completed == 2 and ex.parameters()[tied.name].device == META
