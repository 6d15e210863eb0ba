"""A node that runs for weeks holds no more after a job than before it (issue 42), in one trio.run.

The short version of ``benchmarks/soak.py``: real node job services on the in-memory transport run a
few consecutive jobs; after each, nothing of the finished job is left in memory (no stage worker, no
model, weights or data, no pins, no memory copies of its blobs, no tasks, channels or subscriptions)
and the store holds no more than ``--disk``. Before issue 42 the store kept every blob in a dict and
every finished job its worker, model and data. Then a hostile publisher offering many valid jobs.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path

import torch
import trio
import trio.testing

from fusionp2p.data import BuiltinCorpus, TokenFile
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.build import BuiltJob, build_job
from fusionp2p.jobs.content import ContentService, ContentStore
from fusionp2p.jobs.events import JobStateChanged
from fusionp2p.jobs.node import NodeJobConfig, NodeJobService
from fusionp2p.jobs.store import StoreConfig
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.net.memory import memory_network
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.train.config import TrainConfig
from fusionp2p.train.worker import StageWorker
from tests.integration.test_e2e_service import NODE_CFG, SEQ, _cluster, _model, _run

DISK = 8_000_000   # a few jobs' stage files, DAG and weights (about 3.3 MB a job on each node): evicts by job 3


def _tasks() -> int:
    n, todo = 0, [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        n += 1
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return n


def test_a_finished_job_leaves_nothing_behind_but_its_record_and_cached_files(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=3, micro_batch=2, micro_batches=1, lr=3e-3, replicas=1, checkpoint_every=2, seed=1)
    node_cfg = NodeJobConfig(**{**{f: getattr(NODE_CFG, f) for f in ("election_timeout", "link_timeout",
                                                                         "recv_timeout", "progress_interval")}},
                             store=StoreConfig(disk_bytes=DISK))

    async def main() -> None:
        with trio.fail_after(180):
            async with _cluster(2, tmp_path, node_cfg) as cl:
                tasks: list[int] = []
                for j in range(3):
                    built = await trio.to_thread.run_sync(lambda j=j: build_job(
                        _model(seed=j), None, BuiltinCorpus(seq_len=SEQ), cfg, publisher=cl.client.peer_id,
                        sign=cl.client.sign, now=1.0 + j, nonce=bytes([j]) * 16))
                    events = await _run(cl, built, tmp_path / f"pub{j}")
                    assert [e.state for e in events if isinstance(e, JobStateChanged)][-1] == "done"
                    await trio.testing.wait_all_tasks_blocked()
                    gc.collect()
                    assert not [o for o in gc.get_objects() if isinstance(o, StageWorker)]
                    for svc in cl.services:
                        st = svc.content.store.stats()
                        assert st["memory_bytes"] == st["pinned_bytes"] == st["owners"] == 0, st
                        assert st["held_bytes"] <= DISK
                        assert svc.content.store.has(built.spec.weights_hash)   # cached on disk, not in memory
                        assert not svc._subs and not svc._offers and not svc._arrived and not svc._intakes
                        for run in svc.jobs.values():
                            assert run.state.terminal and not run.channels
                            assert not run.accepted.dag.tensors and run.accepted.tokens is None
                            assert run.progress()["step"] == cfg.steps   # the record still answers
                    tasks.append(_tasks())
                assert tasks[2] == tasks[1], tasks   # no task outlives its job
                assert max(s.content.store.evicted for s in cl.services) > 0   # the cap was reached, and held

    trio.run(main)


def _hostile_job(pub: ContentService, seed: int, tmp: Path) -> BuiltJob:
    torch.manual_seed(seed)
    # its own 600 kB of data in 9,375 shards: a data manifest of about 630 kB, what a node fetches when it takes
    # the offer (the shards themselves are streamed by the reading stages once the job runs, issue 38)
    text = tmp / f"corpus{seed}.txt"
    text.write_bytes(random.Random(seed).randbytes(600_000))
    built = build_job(GPT2(GPT2Config.tiny(block_size=16)), None, TokenFile(str(text), seq_len=16),
                      TrainConfig(steps=2, micro_batch=2, micro_batches=1), publisher=pub.transport.peer_id,
                      sign=pub.transport.sign, now=1.0, nonce=bytes([seed]) * 16, shard_tokens=64)
    for blob in built.blobs.values():
        pub.store.put(blob)
    return built


def test_a_publisher_offering_many_valid_jobs_cannot_pass_the_nodes_caps(tmp_path: Path) -> None:
    """Each job is valid (its own 0.6 MB data manifest and weight manifest, a DAG without weights shared by all;
    the weights are fetched per stage only once planned) and never started. The node takes offers while
    their content fits under ``--disk`` beside what earlier offers pin, refuses the rest (store full, or
    two offers pending from one peer), and after ``offer_ttl`` lets go of them all."""
    cap, mem = 1_500_000, 600_000   # two offers fit, not three
    cfg = NodeJobConfig(offer_ttl=5.0, store=StoreConfig(disk_bytes=cap, memory_bytes=mem))

    async def main() -> None:
        with trio.fail_after(90):
            async with memory_network() as net, trio.open_nursery() as nursery:
                boot = SwarmNode(net.add_host(), SwarmConfig(role="bootstrap", heartbeat=0.2, dead_timeout=5.0), None)
                await nursery.start(boot.run, [])
                node = SwarmNode(net.add_host(), SwarmConfig(heartbeat=0.2, dead_timeout=5.0, probing=False),
                                 TEST_PROFILE)
                await nursery.start(node.run, [boot.transport.listen_addrs()[0]])
                svc = NodeJobService(node, tmp_path / "node", cfg)
                await nursery.start(svc.run)
                store = svc.content.store
                pubs = [ContentService(net.add_host(), ContentStore()) for _ in range(3)]
                for p in pubs:
                    p.install()

                # built before the first offer: the offers follow each other well within offer_ttl
                jobs = {seed: await trio.to_thread.run_sync(_hostile_job, pubs[seed % 3], seed, tmp_path)
                        for seed in (1, 2, 3)}

                async def offer(p: ContentService, seed: int) -> dict[str, object]:
                    built = jobs[seed]
                    reply = await job_proto.request(p.transport, node.peer_id, {"op": "offer", "envelope": built.envelope},
                                                    timeout=30)
                    st = store.stats()
                    assert st["held_bytes"] <= cap and st["memory_bytes"] <= mem, st
                    return reply

                assert (await offer(pubs[1], 1))["ok"]
                assert (await offer(pubs[2], 2))["ok"]
                full = await offer(pubs[0], 3)                   # a third job's content does not fit beside the pins
                assert not full["ok"] and "StoreFull" in str(full["error"]), full
                assert store.stats()["owners"] == 2               # the two accepted offers, nothing of the refused
                # offer_ttl: never started, forgotten (checked on the node's changes: heartbeats, every 0.2 s)
                await node.wait_until(lambda: not store.stats()["pinned_bytes"], 30)
                assert not svc.jobs
                assert (await offer(pubs[0], 3))["ok"]            # room again: the expired offers' blobs went
                assert store.stats()["held_bytes"] <= cap and store.evicted > 0
                nursery.cancel_scope.cancel()

    trio.run(main)
