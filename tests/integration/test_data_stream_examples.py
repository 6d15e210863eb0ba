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


def test_only_the_reading_stages_fetch_examples_and_each_is_trained_once(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    data = _examples()
    assert data.num_examples == TRAIN + HELD
    # one epoch: 80 examples, 8 a step
    cfg = TrainConfig(steps=10, micro_batch=4, micro_batches=2, lr=1e-3, replicas=1, averaging="none",
                      compression="none", planner="even_layers", seed=1)
    reads: dict[int, dict[int, list[np.ndarray]]] = {}    # feed -> micro-batch -> what it read
    call = ExampleFeed.__call__

    def record(self: ExampleFeed, sstep: int, micro: int) -> Any:
        step, _ = self._split(sstep, micro)
        if step < cfg.steps:       # not the final evaluation's (it reads the held-out examples)
            mine = reads.setdefault(id(self), {})
            mine.setdefault(sstep * cfg.micro_batches + micro, []).append(self._windows(sstep, micro))
        return call(self, sstep, micro)

    monkeypatch.setattr(ExampleFeed, "__call__", record)
    with Swarm.local(n_nodes=3, home=tmp_path) as sw:
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
        assert plan is not None and [len(st.replicas) for st in plan.stages] == [1, 1, 1]
        man = ExampleManifest.decode(bytes(built.blobs[built.spec.dataset.content_hash]))
        assert (man.num_train, man.shard_examples, len(man.shards)) == (TRAIN, PER_SHARD, 18)
        first, middle, last = (runs[st.replicas[0]].data for st in plan.stages)
        assert middle.received_bytes == middle.consumed_bytes == middle.disk_bytes == 0
        assert not set(man.shards) & set(stores[plan.stages[1].replicas[0]]._held)
        total = man.total_bytes
        for stats in (first, last):
            # every training shard once, and the held-out shard of the evaluation (8 examples: the first 2 shards)
            assert stats.received_bytes == total, (stats.received_bytes, total)
            assert stats.consumed_bytes == (TRAIN + cfg.micro_batch * cfg.micro_batches) * ROW
    assert len(reads) == 2     # the first and the last stage
    n = cfg.steps * cfg.micro_batches
    for mine in reads.values():
        assert sorted(mine) == list(range(n)) and all(len(v) == 1 for v in mine.values())
        got = np.concatenate([mine[k][0] for k in range(n)])
        assert np.array_equal(np.sort(got), np.arange(TRAIN))        # each once; never a held-out example
    a, b = reads.values()
    assert all(np.array_equal(a[k][0], b[k][0]) for k in range(n))   # both stages read the same examples
