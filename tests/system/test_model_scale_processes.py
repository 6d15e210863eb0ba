"""A model larger than any node through the CLI (issue 37): four ``fusionp2p node --memory`` processes each
offer about half the model's training state; the job is cut into stages, ends DONE, and its sharded
download reloads strictly. (The in-process version, which also counts each node's fetched pieces, is
tests/integration/test_stage_weights.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fusionp2p.cli.cluster import LocalCluster
from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.build import build_job
from fusionp2p.jobs.download import INDEX, load_download
from fusionp2p.jobs.events import PlanChanged
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.sdk import Swarm
from fusionp2p.testing.wait import wait_until
from fusionp2p.train.config import TrainConfig

pytestmark = [pytest.mark.system, pytest.mark.slow]

SEQ = 32
TIMEOUT = 300
MEMORY = "2400000"   # bytes each node offers; the model's training state is about 4.4 MB (the planner's count)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(4, tmp_path_factory.mktemp("cluster"), dead_timeout=15.0)
    c.node_args += ["--memory", MEMORY]
    c.start()
    try:
        yield c
    finally:
        c.stop()


def test_a_model_larger_than_any_node_trains_through_the_cli(cluster: LocalCluster, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=3, micro_batch=2, micro_batches=2, replicas=1, averaging="none", compression="none", seed=1)
    with Swarm.connect([cluster.bootstrap], home=tmp_path / "client", listen="/ip4/127.0.0.1/tcp/0") as sw:
        wait_until(lambda: len(sw.members()) >= 4, timeout=90, interval=0.5, what="4 nodes in the bootstrap's view")
        torch.manual_seed(0)
        built = build_job(GPT2(GPT2Config.tiny(block_size=SEQ)), None, BuiltinCorpus(seq_len=SEQ), cfg,
                          publisher=sw.publisher_id, sign=sw.sign, now=1.0, nonce=b"c" * 16, piece_bytes=4096)
        job = sw.publish_built(built)
        events = list(job.events(timeout=TIMEOUT))
        job.wait(timeout=10)
        path = job.download(tmp_path / "out", single_file_bytes=1)
    plan = next(e for e in events if isinstance(e, PlanChanged))
    assert len(plan.stage_sizes) >= 3, plan          # no node can hold the model: it is cut
    assert path.name == INDEX
    GPT2(GPT2Config.tiny(block_size=SEQ)).load_state_dict(load_download(path), strict=True)
