"""A model larger than any node through the CLI (issue 37): four ``fusionp2p node --memory`` processes, each
leaving its stage about a third of the model's training state; the job is cut into stages, ends DONE, its
sharded download reloads strictly, and no node's peak resident size passed its ``--memory`` (the whole
process: Python, torch, libp2p and the stage). The in-process version, which also counts each node's
fetched pieces, is tests/integration/test_stage_weights.py; benchmarks/model_scale.py the measured one."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fusionp2p.cli.cluster import LocalCluster
from fusionp2p.data import BuiltinCorpus, Examples
from fusionp2p.jobs.build import build_job, job_cost_model
from fusionp2p.jobs.download import INDEX, load_download
from fusionp2p.jobs.events import PlanChanged
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.sdk import LOCAL_PROFILE, Swarm
from fusionp2p.testing.wait import wait_until
from fusionp2p.train.config import TrainConfig

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = [pytest.mark.system, pytest.mark.slow]

SEQ = 32
TIMEOUT = 900
# each process in all: about 400 MiB of its own after start-up (330 when this was written, 2026-11-29: 399-400
# on 2026-11-30 with this session's venv, the same at the commit that added the test), 160 MiB reserve,
# ~215 MiB for a stage
MEMORY = 776 << 20
_ROOM = re.compile(r"--memory [\d.]+ MiB: ([\d.]+) MiB for a stage")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1365, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg)  # type: ignore[no-any-return]  # 29M parameters, ~560 MiB to train


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(4, tmp_path_factory.mktemp("cluster"), dead_timeout=15.0, probe_interval=60.0)
    c.node_args += ["--memory", str(MEMORY)]
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _peak(pid: int) -> int:
    m = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    assert m is not None
    return int(m.group(1)) * 1024


def test_a_model_larger_than_any_node_trains_through_the_cli(cluster: LocalCluster, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=2, micro_batch=2, micro_batches=4, lr=1e-4, replicas=1, averaging="none",
                      compression="none", schedule="1f1b", seed=1)
    data = Examples.causal_lm(BuiltinCorpus(seq_len=SEQ), SEQ)
    with Swarm.connect([cluster.bootstrap], home=tmp_path / "client", listen="/ip4/127.0.0.1/tcp/0") as sw:
        wait_until(lambda: len(sw.members()) >= 4, timeout=180, interval=0.5, what="4 nodes in the bootstrap's view")
        names = [f"node{i}" for i in range(4)]
        rooms = [float(m.group(1)) * 2**20 for n in names
                 if (m := _ROOM.search((cluster.home / f"{n}.log").read_text(errors="replace"))) is not None]
        assert len(rooms) == 4
        built = build_job(_llama(), None, data, cfg, publisher=sw.publisher_id, sign=sw.sign, now=1.0,
                          nonce=b"c" * 16, piece_bytes=1 << 20)
        snap = Snapshot(job=built.spec.job_id, epoch=0, members={"x": LOCAL_PROFILE}, links={})
        state = job_cost_model(built.spec, built.dag, snap)[0].mem[-1]
        assert state > 2.5 * max(rooms), (state, rooms)        # no node could hold its training state
        job = sw.publish_built(built)
        events = list(job.events(timeout=TIMEOUT))
        job.wait(timeout=30)
        peaks = {n: _peak(cluster.procs[n].pid) for n in names}
        path = job.download(tmp_path / "out", single_file_bytes=1)
    plan = next(e for e in events if isinstance(e, PlanChanged))
    assert len(plan.stage_sizes) >= 3, plan          # no node can hold the model: it is cut
    assert all(p <= MEMORY for p in peaks.values()), {n: p >> 20 for n, p in peaks.items()}
    assert path.name == INDEX
    _llama().load_state_dict(load_download(path), strict=True)
