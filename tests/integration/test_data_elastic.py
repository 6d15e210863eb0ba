"""Exact sampling of a streamed dataset across a kill and a joiner (issue 38), on the embedded swarm.

Two replicas train one stage on a streamed token file (or :class:`Examples` with a held-out split); one is killed (the job goes on with one replica),
then a node joins (two again). Every micro-batch each node read is recorded; the reads of the steps the
job kept (those consistent with its final data history) hold every window of each epoch once, none
twice, none skipped, and are exactly the final history's order (data/stream.py); never a held-out example.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio

from fusionp2p.data import ExampleManifest, Examples, ShardManifest, TokenFile
from fusionp2p.data.stream import ExampleOrder, OrderConfig, ShardOrder, StreamConfig, StreamOrder
from fusionp2p.jobs.build import build_job
from fusionp2p.jobs.data_shards import ExampleFeed, ShardFeed, StreamFeed
from fusionp2p.jobs.events import PlanChanged, ProgressEvent, StepProgress
from fusionp2p.jobs.run import JobRun
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.train.config import TrainConfig
from fusionp2p.train.worker import StageWorker
from tests.integration.test_elastic import _check_done, _node, _publish, _swarm

SEQ, PER, SHARDS = 16, 5, 8


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tokens", "examples"])
def test_a_kill_and_a_joiner_train_every_sample_of_each_epoch_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   kind: str) -> None:
    torch.set_num_threads(1)
    text = tmp_path / "tokens.txt"
    text.write_bytes(random.Random(4).randbytes(SHARDS * (PER * SEQ + 1)))
    data: TokenFile | Examples = TokenFile(str(text), seq_len=SEQ)
    if kind == "examples":   # the same windows as examples: 40 to train on, 4 held out, 5 a shard
        toks = np.random.default_rng(4).integers(0, 256, (SHARDS * PER + 4) * SEQ + 1)
        data = Examples.causal_lm(toks, SEQ, shift=1, names=("idx_BT", "targets_BT"), holdout=4, seed=1,
                                  shard_bytes=PER * 2 * SEQ * 8)
    feed_cls: type[StreamFeed] = ShardFeed if kind == "tokens" else ExampleFeed
    cfg = TrainConfig(steps=24, micro_batch=2, micro_batches=2, lr=1e-3, replicas=2, averaging="none",
                      compression="none", checkpoint_every=4, seed=5)
    reads: list[tuple[tuple[tuple[int, int], ...], int, np.ndarray, np.ndarray]] = []
    call = feed_cls.__call__

    def record(self: StreamFeed, sstep: int, micro: int) -> Any:
        step, k = self._split(sstep, micro)
        g = self.order.samples(step, k, 1)
        if step < cfg.steps:   # not the final evaluation's
            reads.append((self.order.history, step, g, self.order.windows(g)))
        return call(self, sstep, micro)

    monkeypatch.setattr(feed_cls, "__call__", record)
    accepted = trio.Event()
    offer_to, train_step = JobRun._offer_to, StageWorker._train_step

    async def offer_and_note(self: JobRun, peer: str) -> None:
        await offer_to(self, peer)
        if peer in self.joiners:
            accepted.set()

    async def step_or_wait(self: StageWorker, step: int) -> tuple[float, float]:
        if step == 14:   # these steps take less than a node's start: wait for the joiner to have accepted
            with trio.fail_after(60):
                await accepted.wait()
        return await train_step(self, step)

    monkeypatch.setattr(JobRun, "_offer_to", offer_and_note)
    monkeypatch.setattr(StageWorker, "_train_step", step_or_wait)
    killed: list[str] = []
    joined: list[str] = []

    async def main() -> tuple[list[ProgressEvent], Any]:
        with trio.fail_after(240):
            async with _swarm(2, tmp_path) as (emb, pub, client), trio.open_nursery() as nursery:
                built = await trio.to_thread.run_sync(lambda: build_job(
                    GPT2(GPT2Config.tiny(block_size=SEQ)), None, data, cfg,
                    publisher=client.peer_id, sign=client.sign, now=1.0, nonce=b"k" * 16, shard_tokens=PER * SEQ + 1))
                plans: list[PlanChanged] = []

                async def join() -> None:
                    joined.append((await emb.add_node(TEST_PROFILE)).peer_id)

                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, PlanChanged):
                        plans.append(ev)
                    if isinstance(ev, StepProgress) and ev.step == 5 and not killed:
                        killed.append(max(plans[-1].members))
                        emb.kill(_node(emb, killed[0]))
                    if isinstance(ev, StepProgress) and ev.step == 9 and ev.epoch >= 1 and not joined:
                        joined.append("")
                        nursery.start_soon(join)

                return await _publish(pub, built, tmp_path, on_event), built

    events, built = trio.run(main)
    plans, _ = _check_done(events, cfg)
    assert len(plans[0].members) == 2 and len(plans[-1].members) == 2 and len(plans) >= 3
    final = max((h for h, *_ in reads), key=len)
    # two replicas, one after the kill, two with the joiner: ((0, 4), (k, 2), (j, 4)) with k < j
    assert len(final) == 3 and [s for _, s in final] == [4, 2, 4], final
    blob = bytes(built.blobs[built.spec.dataset.content_hash])
    order: ShardOrder
    if kind == "tokens":
        order = StreamOrder(ShardManifest.decode(blob), StreamConfig(seq_len=SEQ, micro_batch=cfg.micro_batch,
                                                                     micro_batches=cfg.micro_batches, seed=cfg.seed), final)
    else:
        man = ExampleManifest.decode(blob)
        assert man.num_train == SHARDS * PER and man.num_holdout == 4
        order = ExampleOrder(man, OrderConfig(micro_batch=cfg.micro_batch, micro_batches=cfg.micro_batches, seed=cfg.seed),
                             final)

    def upto(h: tuple[tuple[int, int], ...], step: int) -> tuple[tuple[int, int], ...]:
        return tuple(seg for seg in h if seg[0] <= step)

    kept: dict[int, int] = {}
    for h, step, g, w in reads:
        if upto(h, step) != upto(final, step):
            continue                   # a step the re-plan threw away (trained again after it)
        for gi, wi in zip(g.tolist(), w.tolist(), strict=True):
            assert kept.setdefault(gi, wi) == wi
    total = order.base(cfg.steps)
    assert sorted(kept) == list(range(total))                     # every sample of the kept steps read
    got = np.array([kept[g] for g in range(total)])
    assert np.array_equal(got, order.windows(np.arange(total)))   # the final history's order
    n = order.num_windows
    assert n == SHARDS * PER and got.max() < n      # never a held-out example
    for e in range(total // n):
        assert np.array_equal(np.sort(got[e * n:(e + 1) * n]), np.arange(n))
    assert len(set(got[total // n * n:].tolist())) == total - total // n * n
