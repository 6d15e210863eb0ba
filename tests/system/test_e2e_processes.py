"""End to end with real processes: a bootstrap + 4 ``fusionp2p node`` processes on loopback (CLI),
jobs published with ``Swarm.connect`` and ``fusionp2p job submit`` over libp2p and the encrypted data plane.
The training checks shared with the embedded swarm are in test_job_conformance.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fusionp2p.cli.cluster import LocalCluster
from fusionp2p.data import BuiltinCorpus
from fusionp2p.errors import JobError
from fusionp2p.jobs.events import StepProgress
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.sdk import Swarm
from fusionp2p.testing.wait import wait_until
from fusionp2p.train.config import TrainConfig

pytestmark = pytest.mark.system

SEQ = 32
TIMEOUT = 180


def _model(seed: int = 0) -> GPT2:
    torch.manual_seed(seed)
    return GPT2(GPT2Config.tiny(block_size=SEQ))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(4, tmp_path_factory.mktemp("cluster"), dead_timeout=15.0)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def swarm(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    torch.set_num_threads(1)
    sw = Swarm.connect([cluster.bootstrap], home=tmp_path_factory.mktemp("client"), listen="/ip4/127.0.0.1/tcp/0")
    try:
        wait_until(lambda: len(sw.members()) >= 4, timeout=90, interval=0.5, what="4 nodes in the bootstrap's view")
        yield sw
    finally:
        sw.close()


def test_cancel_reaches_every_node(swarm: Swarm) -> None:
    cfg = TrainConfig(steps=100_000, micro_batch=2, micro_batches=2, replicas=2, averaging="co2", seed=2)
    job = swarm.publish(model=_model(), dataset=BuiltinCorpus(seq_len=SEQ), config=cfg)
    for ev in job.events(timeout=TIMEOUT):
        if isinstance(ev, StepProgress) and ev.step >= 2:
            job.cancel()
            break
    with pytest.raises(JobError, match="cancelled"):
        job.wait(timeout=60)


def test_cli_job_submit_builtin(cluster: LocalCluster, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "fusionp2p.cli", "job", "--log-level", "warning", "submit", "--builtin",
                        "gpt2-tiny", "--bootstrap", cluster.bootstrap, "--steps", "4", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (out / "model.safetensors").is_file()
    assert "final eval loss" in p.stdout


def test_every_node_exits_cleanly(cluster: LocalCluster, swarm: Swarm) -> None:
    swarm.close()
    codes = cluster.stop()
    assert codes == {"node0": 0, "node1": 0, "node2": 0, "node3": 0, "bootstrap": 0}, codes
