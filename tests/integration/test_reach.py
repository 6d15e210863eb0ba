"""Nodes whose data-plane port cannot be reached still train (issue 21): their links fall back to a
stream on the libp2p connection, the job says so, and their records announce their data addresses.

In one trio.run: real ``NodeJobService`` s on the in-memory transport, the data plane on loopback; one
node announces a data-plane port that refuses connections (what a NAT or an unpublished container port
looks like to its peers). Real processes behind a real NAT: tests/system/test_nat.py.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
import trio

from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.build import build_job
from fusionp2p.jobs.content import ContentService, ContentStore
from fusionp2p.jobs.events import JobStateChanged, LinksUp, PlanChanged, ProgressEvent, StepProgress
from fusionp2p.jobs.node import NodeJobConfig, NodeJobService
from fusionp2p.jobs.publisher import DriverConfig, Publisher
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.net.memory import MemoryTransport, memory_network
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.train.config import CO2, TrainConfig

SEQ = 32
CFG = SwarmConfig(heartbeat=0.2, dead_timeout=5.0, probing=False)
# progress_interval 0: the tests act at a step (cut a link, kill a member) as soon as it ends
NODE_CFG = NodeJobConfig(election_timeout=20, link_timeout=20, recv_timeout=20, progress_interval=0.0)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def _cluster(configs: list[NodeJobConfig], home: Path) -> AsyncIterator[tuple[SwarmNode, list[NodeJobService], Publisher, MemoryTransport]]:
    async with memory_network() as net, trio.open_nursery() as nursery:
        boot = SwarmNode(net.add_host(), SwarmConfig(role="bootstrap", heartbeat=0.2, dead_timeout=5.0), None)
        await nursery.start(boot.run, [])
        addr = boot.transport.listen_addrs()[0]
        services: list[NodeJobService] = []

        async def node_main(i: int, cfg: NodeJobConfig, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            node = SwarmNode(net.add_host(), CFG, TEST_PROFILE)
            async with trio.open_nursery() as inner:
                await inner.start(node.run, [addr])
                services.append(NodeJobService(node, home / f"node{i}", cfg))
                await inner.start(services[-1].run)
                task_status.started()

        for i, cfg in enumerate(configs):
            await nursery.start(node_main, i, cfg)
        client = net.add_host()
        await client.connect(addr)
        pub = Publisher(client, ContentService(client, ContentStore()), [boot.peer_id],
                        DriverConfig(idle_timeout=30, offer_timeout=30))
        await nursery.start(pub.run)
        await boot.wait_until(lambda: len(boot.members()) >= len(configs), 20)
        try:
            yield boot, services, pub, client
        finally:
            nursery.cancel_scope.cancel()


def _acceptor(plan: PlanChanged, a: str, b: str) -> str:
    """Which of two linked peers accepts their channel (jobs/run.py ``_open_links``): the next stage's
    replica on a pipeline link, the higher replica index between replicas of one stage."""
    role, at = {}, 0
    for s, n in enumerate(plan.stage_sizes):
        for r in range(n):
            role[plan.members[at]] = (s, r)
            at += 1
    (sa, ra), (sb, rb) = role[a], role[b]
    if sa != sb:
        return a if sa > sb else b
    return a if ra > rb else b


def test_nodes_whose_data_port_is_unreachable_still_train(tmp_path: Path) -> None:
    """2 stages x 2 replicas; three of the four nodes announce a data port that refuses connections. A
    link runs on the libp2p fallback exactly when its accepting end is one of them (the dialer cannot
    reach its port), directly otherwise; the job ends DONE, and the publisher's LinksUp events say which
    path each link took, the same from both ends."""
    torch.set_num_threads(1)
    configs = [dataclasses.replace(NODE_CFG, data_announce=f"/ip4/127.0.0.1/tcp/{_closed_port()}") for _ in range(3)]
    configs.append(NODE_CFG)
    cfg = TrainConfig(steps=8, micro_batch=2, micro_batches=2, lr=3e-3, replicas=2, averaging=CO2(tau=2),
                      compression="adatopk", seed=1)

    async def main() -> tuple[list[ProgressEvent], list[str], dict[str, Any]]:
        with trio.fail_after(150):
            async with _cluster(configs, tmp_path) as (boot, services, pub, client):
                torch.manual_seed(0)
                model = GPT2(GPT2Config.tiny(block_size=SEQ))
                built = await trio.to_thread.run_sync(lambda: build_job(
                    model, None, BuiltinCorpus(seq_len=SEQ), cfg, publisher=client.peer_id, sign=client.sign,
                    now=1.0, nonce=b"r" * 16))
                events: list[ProgressEvent] = []
                await pub.run_job(built, events.append, tmp_path / "pub")
                # the bootstrap's view carries each node's announced data-plane address
                await boot.wait_until(lambda: all(boot.view.records[s.swarm.peer_id].data for s in services), 10)
                return events, [s.swarm.peer_id for s in services], boot.snapshot()

    events, peers, snap = trio.run(main)
    assert [e.state for e in events if isinstance(e, JobStateChanged)] == ["planned", "running", "done"], events[-1]
    losses = [e.loss for e in events if isinstance(e, StepProgress) and e.loss is not None and e.step < cfg.steps]
    assert len(losses) == cfg.steps
    plan = next(e for e in events if isinstance(e, PlanChanged))
    assert sorted(plan.members) == sorted(peers)          # every node is used, the unreachable ones included
    nat = set(peers[:3])
    links = [e for e in events if isinstance(e, LinksUp)]
    assert {e.peer for e in links} == set(peers), links   # every member reported its links
    seen: dict[frozenset[str], str] = {}
    for e in links:
        for peer, path in e.paths().items():
            want = "libp2p" if _acceptor(plan, e.peer, peer) in nat else "direct"
            assert path == want, (e.peer[-6:], peer[-6:], path)
            assert seen.setdefault(frozenset((e.peer, peer)), path) == path   # both ends agree
    assert "libp2p" in seen.values() and len(seen) == 4
    members = {m["peer"]: m for m in snap["members"]}
    for i, p in enumerate(peers):
        want = configs[i].data_announce
        assert members[p]["data"] == ([want] if want else members[p]["data"]) and members[p]["data"]
