"""AdaTopK's backward over the network: the gradient a stage sends back over a compressed fence is the
exact gradient of the forward's masking (zero wherever the forward dropped the entry).

The product used to top-k the raw gradient at the fence's ratio (straight-through), which sends other
entries than the forward kept; a 2 x 2 GPT-2 with its fence at 0.23 then stopped learning at a loss
of 3.2 over 2,000 steps (benchmarks.convergence), where the dense runs reached 0.7-0.8.
"""

from __future__ import annotations

import torch
import trio

from fusionp2p.compress.adatopk import TopKLink
from fusionp2p.compress.codec import decode, kept_mask
from fusionp2p.graph import StageExecutor
from fusionp2p.graph.program import DATA
from fusionp2p.net.channel import TensorMessage
from fusionp2p.testing.channels import memory_channel_pair
from fusionp2p.train.config import AdaTopK, TrainConfig
from fusionp2p.train.worker import StageContext, StageReport, StageWorker
from tests.integration.test_hostile_training import _programs

RHO = 0.25


def _run(config: TrainConfig) -> list[tuple[int, torch.Tensor, TensorMessage]]:
    """Stage 1 (a StageWorker) behind a hand-written stage 0 that sends compressed activations at ``RHO``;
    the (step, forward keep-mask, gradient message) of every gradient stage 1 sends back."""
    p0, p1 = _programs()
    a, b = memory_channel_pair("s1", "s0", window=8)
    labels = [r.name for r in p1.recv if r.src == DATA]
    got: list[tuple[int, torch.Tensor, TensorMessage]] = []

    async def stage0(ch: object) -> None:
        """A hand-written stage 0: compressed activations forward, records the gradients it gets back."""
        link = TopKLink(ratio=RHO)
        sent: dict[tuple[int, int], torch.Tensor] = {}
        steps = config.steps
        for step in range(steps + 1):                 # the last one is the evaluation pass (forward only)
            for mu in range(2):
                g = torch.Generator().manual_seed(step * 10 + mu)
                for r in p0.send:
                    x = torch.randn(2, 8, generator=g)
                    if step == steps:
                        await ch.send(TensorMessage(job="j", kind="eval", stage=1, step=step, micro=mu,  # type: ignore[attr-defined]
                                                    name=r.name, tensors=(x,)))
                        continue
                    payload, meta = link.encode_act(x)
                    sent[(step, mu)] = kept_mask(payload, meta)
                    await ch.send(TensorMessage(job="j", kind="act", stage=1, step=step, micro=mu,  # type: ignore[attr-defined]
                                                name=r.name, meta=dict(meta), tensors=tuple(payload)))
            if step == steps:
                break
            for _ in range(2):
                msg: TensorMessage = await ch.receive()  # type: ignore[attr-defined]
                assert msg.kind == "grad"
                got.append((msg.step, sent[(msg.step, msg.micro)], msg))

    def data(step: int, micro: int) -> dict[str, torch.Tensor]:
        return {n: torch.tensor([0, 1]) for n in labels}

    async def report(rep: StageReport) -> None:
        pass

    ctx = StageContext(job="j", executor=StageExecutor(p1), config=config,
                       replica=0, replicas=1, links={0: a}, data=data, tokens_per_micro=2, report=report,
                       recv_timeout=10.0, rho_out={-1: RHO})

    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(stage0, b)
                await StageWorker(ctx).run()

    trio.run(main)
    return got


def test_the_gradient_over_a_compressed_fence_is_masked_like_the_forward() -> None:
    got = _run(TrainConfig(steps=2, micro_batch=2, micro_batches=2, lr=0.1))
    pairs = [(mask, decode(msg.tensors, msg.meta) if msg.meta else msg.tensors[0]) for _, mask, msg in got]
    assert len(pairs) == 4
    for mask, grad in pairs:
        assert grad.shape == mask.shape
        assert torch.all(grad[~mask] == 0), "a gradient entry the forward dropped went back"
        assert torch.count_nonzero(grad[mask]) > 0


def test_the_dense_finish_ramps_the_fence_up_to_dense_by_the_last_step() -> None:
    """AdaTopK(dense_finish=0.5) of 4 steps: steps 0-1 at the plan's ratio, step 2 at RHO ** 0.5, step 3 dense."""
    got = _run(TrainConfig(steps=4, micro_batch=2, micro_batches=2, lr=0.1, compression=AdaTopK(dense_finish=0.5)))
    kept = {step: int(msg.meta["k"]) if msg.meta else None for step, _, msg in got}
    n = got[0][1].numel()
    assert kept[0] == kept[1] and kept[0] is not None and kept[0] <= round(RHO * n) + 1
    assert kept[2] is not None and kept[2] > kept[1]
    assert kept[3] is None                    # dense: the codec's identity, no meta
    for _step, mask, msg in got:              # still the exact gradient of the forward's masking
        g = decode(msg.tensors, msg.meta) if msg.meta else msg.tensors[0]
        assert torch.all(g[~mask] == 0)
