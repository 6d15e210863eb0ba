"""A dataset several times every node's memory trains through the CLI (issue 38), only its readers receiving it.

A token file of 2 GiB of random bytes (written by the test; ``FUSIONP2P_DATA_BYTES`` makes it smaller
for a smoke run) trains a GPT-2 tiny on six ``fusionp2p node --memory 1GiB`` processes, three stages of
two replicas. Before issue 38 every node refused the job at the offer (the dataset did not fit its
memory). Each node keeps the shards it received on disk (unpinned cache, far under ``--disk``): the
first and last stages' replicas hold shards, about as many each; the middle stage's none; together far
less than the dataset (each replica fetches what its steps read, a window ahead).

In process, with each node's bytes counted by its feed: tests/integration/test_data_stream.py.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fusionp2p.cli.cluster import LocalCluster
from fusionp2p.data import ShardManifest, TokenFile
from fusionp2p.jobs.build import build_job
from fusionp2p.jobs.events import PlanChanged
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.sdk import Swarm
from fusionp2p.testing.wait import wait_until
from fusionp2p.train.config import TrainConfig

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(1200)]   # 354 s at load 20 (2 cores)

SEQ = 64
TIMEOUT = 900
DATA_BYTES = int(os.environ.get("FUSIONP2P_DATA_BYTES", str(2 << 30)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(6, tmp_path_factory.mktemp("cluster"), dead_timeout=30.0)
    c.node_args += ["--memory", "1GiB"]
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _peak_rss(pid: int | str) -> int:
    """A process's peak resident set (VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def _held(home: Path, shards: set[str]) -> int:
    """Shards (by hash) a node's content store holds on disk."""
    return sum(1 for p in home.rglob("*") if p.name in shards and p.is_file())


def test_a_dataset_larger_than_every_node_streams_to_its_readers_only(cluster: LocalCluster, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    text = tmp_path / "tokens.txt"
    with text.open("wb") as f:      # random bytes, written in 64 MiB blocks (never the whole file in memory)
        rng = torch.Generator().manual_seed(0)
        left = DATA_BYTES
        while left:
            n = min(left, 64 << 20)
            f.write(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng).numpy().tobytes())
            left -= n
    cfg = TrainConfig(steps=20, micro_batch=2, micro_batches=2, lr=1e-3, replicas=2, averaging="none",
                      compression="none", planner="even_layers", seed=1)
    with Swarm.connect([cluster.bootstrap], home=tmp_path / "client", listen="/ip4/127.0.0.1/tcp/0") as sw:
        wait_until(lambda: len(sw.members()) >= 6, timeout=120, interval=0.5, what="6 nodes in the bootstrap's view")
        torch.manual_seed(0)
        t0, cpu0, rss0 = time.monotonic(), time.process_time(), _peak_rss("self")
        built = build_job(GPT2(GPT2Config.tiny(block_size=SEQ, n_layer=3)), None, TokenFile(str(text), seq_len=SEQ),
                          cfg, publisher=sw.publisher_id, sign=sw.sign, now=1.0, nonce=b"g" * 16)
        build_s, build_cpu = time.monotonic() - t0, time.process_time() - cpu0
        job = sw.publish_built(built)
        events = list(job.events(timeout=TIMEOUT))
        job.wait(timeout=30)
    wall = time.monotonic() - t0
    nodes = {name: _peak_rss(p.pid) for name, p in cluster.procs.items() if name.startswith("node")}
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"\ndata {DATA_BYTES} B: publish to end {wall:.0f} s (build {build_s:.1f} s, {build_cpu:.1f} CPU-s); "
          f"publisher (this process) peak RSS {_peak_rss('self') >> 20} MiB ({rss0 >> 20} before the build); "
          f"nodes' peak RSS MiB {sorted(v >> 20 for v in nodes.values())}; ended children CPU-s "
          f"{kids.ru_utime + kids.ru_stime:.0f}")
    assert len(nodes) == 6 and all(v < 1 << 30 for v in nodes.values()), nodes   # within --memory 1GiB
    if DATA_BYTES >= 2 << 30:      # the full run: the dataset is larger than every node's memory
        assert max(nodes.values()) < DATA_BYTES and DATA_BYTES > 1 << 30
    man = ShardManifest.decode(bytes(built.blobs[built.spec.dataset.content_hash]))
    shards = set(man.shards)
    plan = next(e for e in events if isinstance(e, PlanChanged))
    assert plan.stage_sizes == (2, 2, 2), plan
    by_peer = {cluster.peer_id(f"node{i}"): cluster.home / f"node{i}" for i in range(6)}
    stages, off = [], 0
    for n in plan.stage_sizes:
        stages.append([_held(by_peer[p], shards) for p in plan.members[off:off + n]])
        off += n
    print(f"shards held on disk by stage (of {len(shards)}): {stages}")
    first, middle, last = stages
    assert middle == [0, 0], stages                      # the middle stage read no token: received none
    for held in (first, last):
        assert all(h > 0 for h in held), stages
        assert max(held) <= 2 * min(held), stages        # in proportion to their (equal) share of samples
        assert sum(held) < len(shards), stages           # far from the whole dataset
