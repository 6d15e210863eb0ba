"""A private swarm's allow-list (``TrainConfig.allow_members``, issue 46): a job of a swarm of three nodes that
lists two of them runs on those two only, and a node off the list refuses to start an epoch that names a
node off the list (the check every member makes: ``JobRun.offer_start``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.events import PlanChanged
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.sdk import Swarm
from fusionp2p.train.config import TrainConfig


@pytest.mark.slow
def test_a_job_runs_on_its_allowed_members_only(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2(GPT2Config.tiny(block_size=32, n_layer=2, n_head=2, n_embd=32))
    with Swarm.local(n_nodes=3, home=tmp_path) as sw:
        nodes = sw.members()
        assert len(nodes) == 3
        allow = tuple(sorted(nodes)[:2])
        cfg = TrainConfig(steps=4, micro_batch=4, micro_batches=2, lr=2e-3, averaging="co2", allow_members=allow)
        job = sw.publish(model=model, dataset=BuiltinCorpus(seq_len=32), config=cfg)
        plans = [ev for ev in job.events(timeout=240) if isinstance(ev, PlanChanged)]
        job.wait(timeout=240)
    assert plans and all(set(p.members) <= set(allow) for p in plans), [p.members for p in plans]
