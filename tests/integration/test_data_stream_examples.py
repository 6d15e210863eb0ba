"""Examples larger than any node (issue 38), in process: only the reading stages fetch them, each its own.

In-process nodes train a GPT-2 tiny cut into three stages on an :class:`Examples` dataset (windows of
tokens as ``idx_BT``/``targets_BT``) sharded a few examples a shard, with a held-out split. The first
stage (it reads ``idx_BT``) and the last (``targets_BT``) fetch the shards their replica reads and the
held-out ones of the evaluation; the middle stage fetches none. Every micro-batch each reader read is
counted: one epoch holds every training example once, none twice, none skipped, never a held-out one,
and the first and the last stage read the very same examples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fusionp2p.data import ExampleManifest, Examples
from fusionp2p.jobs.build import build_job
from fusionp2p.jobs.data_shards import ExampleFeed
from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.sdk import Swarm
from fusionp2p.train.config import TrainConfig

SEQ = 16
PER_SHARD = 5                   # examples a shard
TRAIN, HELD = 80, 8             # 16 shards of training examples, 2 of held-out ones
ROW = 2 * SEQ * 8               # bytes of an example: two int64 fields of SEQ
TIMEOUT = 240


def _examples() -> Examples:
    toks = np.random.default_rng(6).integers(0, 256, (TRAIN + HELD) * SEQ + 1)
    return Examples.causal_lm(toks, SEQ, shift=1, names=("idx_BT", "targets_BT"), holdout=HELD, seed=2,
                              shard_bytes=PER_SHARD * ROW)


@pytest.mark.parametrize("replicas", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_only_the_reading_stages_fetch_examples_and_each_is_trained_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       replicas: int) -> None:
    torch.set_num_threads(1)
    data = _examples()
    assert data.num_examples == TRAIN + HELD
    # one epoch: 80 examples, 8 a step (1 replica x 2 micro-batches x 4, or 2 x 2 x 2)
    cfg = TrainConfig(steps=10, micro_batch=4 // replicas, micro_batches=2, lr=1e-3, replicas=replicas,
                      averaging="none", compression="none", planner="even_layers", seed=1)
    reads: dict[int, list[np.ndarray]] = {}    # micro-batch (sampler step x M + micro) -> what each reader read
    call = ExampleFeed.__call__

    def record(self: ExampleFeed, sstep: int, micro: int) -> Any:
        step, _ = self._split(sstep, micro)
        if step < cfg.steps:       # not the final evaluation's (it reads the held-out examples)
            reads.setdefault(sstep * cfg.micro_batches + micro, []).append(self._windows(sstep, micro))
        return call(self, sstep, micro)

    monkeypatch.setattr(ExampleFeed, "__call__", record)
    with Swarm.local(n_nodes=3 * replicas, home=tmp_path) as sw:
        torch.manual_seed(0)
        built = build_job(GPT2(GPT2Config.tiny(block_size=SEQ, n_layer=3)), None, data, cfg,
                          publisher=sw.publisher_id, sign=sw.sign, now=1.0, nonce=b"x" * 16)
        job = sw.publish_built(built)
        job.wait(timeout=TIMEOUT)
        assert job.state is JobState.DONE and job.final_loss is not None
        assert sw.embedded is not None
        runs = {n.peer_id: n.jobs.jobs[built.spec.job_id] for n in sw.embedded.nodes}
        stores = {n.peer_id: n.jobs.content.store for n in sw.embedded.nodes}
        plan = next(r.plan for r in runs.values() if r.plan is not None)
        assert plan is not None and [len(st.replicas) for st in plan.stages] == [replicas] * 3
        man = ExampleManifest.decode(bytes(built.blobs[built.spec.dataset.content_hash]))
        assert (man.num_train, man.shard_examples, len(man.shards)) == (TRAIN, PER_SHARD, 18)
        first, middle, last = ([runs[p].data for p in st.replicas] for st in plan.stages)
        for st in middle:     # never reads an example: fetched none, holds none
            assert st.received_bytes == st.consumed_bytes == st.disk_bytes == 0
        for p in plan.stages[1].replicas:
            assert not set(man.shards) & set(stores[p]._held)
        evals = TRAIN + np.arange(cfg.micro_batch * cfg.micro_batches)     # the evaluation's held-out examples
        held_out = sum(man.shard_bytes(i) for i in set((evals // PER_SHARD).tolist()))
        for stats in (first, last):
            # each replica its own half of the training shards, and the held-out shards of the evaluation
            assert sum(s.received_bytes - held_out for s in stats) == TRAIN * ROW, [s.received_bytes for s in stats]
            for s in stats:
                assert s.consumed_bytes == (TRAIN // replicas + cfg.micro_batch * cfg.micro_batches) * ROW
                assert s.received_bytes - held_out == TRAIN * ROW // replicas
    n = cfg.steps * replicas * cfg.micro_batches
    assert sorted(reads) == list(range(n))
    for k in range(n):   # read by the first and the last stage, the same examples
        assert len(reads[k]) == 2 and np.array_equal(reads[k][0], reads[k][1])
    got = np.concatenate([reads[k][0] for k in range(n)])
    assert np.array_equal(np.sort(got), np.arange(TRAIN))        # each once; never a held-out example
