"""Datasets larger than any node (issue 38), in process: only the reading stages fetch the data.

In-process nodes train a GPT-2 tiny cut into three stages on a token file streamed as small shards: the
first stage (it reads the tokens) and the last (the targets) fetch the shards their replica reads; the
middle stage fetches none. With one replica a stage (three nodes, the default suite) a reader fetches
the whole epoch once, little more; with two (six nodes, slow: twice the cost) each replica about half.
Every shard received was checked against the manifest, and a reader holds no more than its window.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fusionp2p.data import ShardManifest, TokenFile
from fusionp2p.jobs.build import build_job
from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.sdk import Swarm
from fusionp2p.train.config import TrainConfig

SEQ = 16
PER_SHARD = 5               # windows a shard
SHARDS = 16
TIMEOUT = 240


@pytest.mark.parametrize("replicas", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_only_the_reading_stages_fetch_the_data_in_proportion_to_their_share(tmp_path: Path, replicas: int) -> None:
    torch.set_num_threads(1)
    shard_tokens = PER_SHARD * SEQ + 1
    text = tmp_path / "tokens.txt"
    text.write_bytes(random.Random(3).randbytes(SHARDS * shard_tokens))
    # one epoch: 16 shards x 5 windows = 80 samples, 8 a step (2 replicas x 2 micro-batches x 2, or 1 x 2 x 4)
    cfg = TrainConfig(steps=10, micro_batch=4 // replicas, micro_batches=2, lr=1e-3, replicas=replicas, averaging="none",
                      compression="none", planner="even_layers", seed=1)
    with Swarm.local(n_nodes=3 * replicas, home=tmp_path) as sw:
        torch.manual_seed(0)
        built = build_job(GPT2(GPT2Config.tiny(block_size=SEQ, n_layer=3)), None, TokenFile(str(text), seq_len=SEQ),
                          cfg, publisher=sw.publisher_id, sign=sw.sign, now=1.0, nonce=b"d" * 16,
                          shard_tokens=shard_tokens)
        job = sw.publish_built(built)
        job.wait(timeout=TIMEOUT)
        assert job.state is JobState.DONE
        assert sw.embedded is not None
        runs = {n.peer_id: n.jobs.jobs[built.spec.job_id] for n in sw.embedded.nodes}
        stores = {n.peer_id: n.jobs.content.store for n in sw.embedded.nodes}
        plan = next(r.plan for r in runs.values() if r.plan is not None)
        assert plan is not None and [len(st.replicas) for st in plan.stages] == [replicas] * 3
        man = ShardManifest.decode(bytes(built.blobs[built.spec.dataset.content_hash]))
        shards = set(man.shards)
        total = SHARDS * shard_tokens
        first, middle, last = ([runs[p].data for p in st.replicas] for st in plan.stages)
        for st in middle:     # never reads a token: fetched none, holds none
            assert st.received_bytes == st.consumed_bytes == st.disk_bytes == 0
        for p in plan.stages[1].replicas:
            assert not shards & set(stores[p]._held)
        for stats in (first, last):
            got = [s.received_bytes for s in stats]
            assert all(s.consumed_bytes > 0 for s in stats)
            # each replica its share of the dataset (its own run of shards, a shard or two at the edges twice)
            assert all(0.6 * total / replicas < g < 1.5 * total / replicas for g in got), (got, total)
            # fetched over read: the edges, and the next epoch's first shards fetched for the final evaluation
            assert all(s.received_bytes <= 1.5 * s.consumed_bytes for s in stats), stats
            assert sum(got) <= 1.35 * total
