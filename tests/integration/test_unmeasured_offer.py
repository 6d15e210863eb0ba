"""A job submitted before every node measured its device profile (issue 40: a node's start-up, with its device
benchmark, is deferred until a job request, its first probe round or ``--defer-startup`` after joining).

The publisher offers the job to the live members without a profile too; the offer starts their start-up, they
answer once measured, and their accepts carry the profiles the plan then uses (a fresh 5-node cluster had run
a job submitted at once on one node). A node whose start-up never serves is refused like any other. In-process
nodes on the in-memory transport (``jobs/embedded.py``, the same job service as ``fusionp2p node``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs import publisher, verify_links
from fusionp2p.jobs.build import build_job, plan_for_snapshot
from fusionp2p.jobs.content import ContentService, ContentStore
from fusionp2p.jobs.embedded import EmbeddedConfig, open_embedded_swarm
from fusionp2p.jobs.events import JobStateChanged, PlanChanged, ProgressEvent
from fusionp2p.jobs.node import NodeJobConfig
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.swarm.node import SwarmNode
from fusionp2p.swarm.startup import Startup, StartupConfig
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.testing.wait import poll_until
from fusionp2p.train.config import TrainConfig
from fusionp2p.wire.protocols import JOB

SEQ = 32
LATE = dataclasses.replace(TEST_PROFILE, name="measured-on-offer", flops_fp32=2e10)


async def _run_tiny_job(pub: publisher.Publisher, client: Any, cfg: TrainConfig, nonce: bytes,
                        root: Path) -> list[ProgressEvent]:
    """Build (traced in a thread, as the SDK does) and run a tiny GPT-2 job from *pub*; its events."""
    torch.manual_seed(0)
    built = await trio.to_thread.run_sync(lambda: build_job(
        GPT2(GPT2Config.tiny(block_size=SEQ)), None, BuiltinCorpus(seq_len=SEQ), cfg,
        publisher=client.peer_id, sign=client.sign, now=1.0, nonce=nonce * 16))
    events: list[ProgressEvent] = []
    await pub.run_job(built, events.append, root)
    return events


def _planned_snapshots(monkeypatch: pytest.MonkeyPatch) -> list[Snapshot]:
    """The snapshots the publisher plans from (its plan_for_snapshot, wrapped: jobs/verify_links.py; the first
    is the members' snapshot, any later one the link check's)."""
    snaps: list[Snapshot] = []

    def planned(spec: Any, dag: Any, snap: Snapshot, **kw: Any) -> Any:
        snaps.append(snap)
        return plan_for_snapshot(spec, dag, snap, **kw)

    monkeypatch.setattr(verify_links, "plan_for_snapshot", planned)
    return snaps


def test_members_without_a_profile_are_offered_the_job_and_planned_with_the_profile_they_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    snaps = _planned_snapshots(monkeypatch)
    reads: list[str] = []
    real_discover = publisher.discover

    async def discover(t: Any, bootstraps: list[str], *, timeout: float) -> publisher.SwarmView:
        reads.append(t.peer_id)
        return await real_discover(t, bootstraps, timeout=timeout)

    monkeypatch.setattr(publisher, "discover", discover)
    cfg = TrainConfig(steps=2, micro_batch=2, micro_batches=1, seed=1)
    jobs = NodeJobConfig(election_timeout=20, link_timeout=20, recv_timeout=20, progress_interval=0.0)

    async def main() -> tuple[list[ProgressEvent], dict[str, Any]]:
        with trio.fail_after(90):
            async with open_embedded_swarm([TEST_PROFILE], tmp_path, config=EmbeddedConfig(jobs=jobs)) as emb:
                late = [Startup(StartupConfig(defer=600)) for _ in range(2)]   # only a job request starts them
                nodes = [emb.nodes[0], *[await emb.add_node(LATE, startup=s) for s in late]]
                # a node whose start-up never serves: its early handler answers "still starting" after 1 s
                never = SwarmNode(emb.add_host(), emb.config.swarm(), None)
                stuck = Startup(StartupConfig(on_demand_timeout=1.0))
                never.transport.set_stream_handler(JOB, job_proto.serve(stuck.early_job, timeout=30))
                emb._nursery.start_soon(never.run, [emb.bootstrap_addr])
                await emb.wait_members(4)
                boot = emb.bootstrap
                assert sum(boot.view.records[p].profile is None for p in boot.members()) == 3
                client = emb.add_host()
                await client.connect(emb.bootstrap_addr)
                pub = publisher.Publisher(client, ContentService(client, ContentStore()), [boot.peer_id],
                                          publisher.DriverConfig(idle_timeout=30, offer_timeout=30))
                await emb._nursery.start(pub.run)
                view = await publisher.discover(client, [boot.peer_id], timeout=10)
                assert set(view.members) == {nodes[0].peer_id}
                assert set(view.unmeasured) == {nodes[1].peer_id, nodes[2].peer_id, never.peer_id} <= set(view.addrs)
                events = await _run_tiny_job(pub, client, cfg, b"u", tmp_path / "pub")
                return events, {"nodes": [n.peer_id for n in nodes], "never": never.peer_id, "late": late,
                                "stuck": stuck}

    events, got = trio.run(main)
    states = [e.state for e in events if isinstance(e, JobStateChanged)]
    assert states == ["planned", "running", "done"], events[-1]
    measured, *deferred = got["nodes"]
    # every node that measured when offered is in the publisher's snapshot with the profile it measured
    snap = snaps[0]
    assert dict(snap.members) == {measured: TEST_PROFILE, **dict.fromkeys(deferred, LATE)}
    plan = next(e for e in events if isinstance(e, PlanChanged))
    assert set(plan.members) | set(plan.idle) == {measured, *deferred}
    # their start-ups were started by the offer (at normal priority), the stuck one's too, which was left out
    assert all(s.on_demand and s.reason.startswith("a job request") for s in got["late"])
    assert got["stuck"].on_demand and got["never"] not in snap.members
    # the view read once by the test, then by the publisher before its offers and again before it planned
    # (the links the unmeasured members' probes measured meanwhile)
    assert len(reads) == 3


@pytest.mark.slow
def test_daemons_that_have_not_started_up_are_offered_the_job_over_libp2p(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through ``run_daemon`` as ``fusionp2p node`` runs it (its early JOB handler, the start-up that sets
    the profile, then the job service, as cli/daemon_cmd.py wires them), on real libp2p over loopback: two nodes
    joined without a profile (deferred 600 s, no probes), a job published at once runs on both."""
    from fusionp2p.jobs.node import NodeJobService
    from fusionp2p.net.identity import Identity
    from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport
    from fusionp2p.swarm import device
    from fusionp2p.swarm.daemon import DaemonConfig, run_daemon
    from fusionp2p.swarm.node import SwarmConfig

    torch.set_num_threads(1)
    monkeypatch.setattr(device, "measure_profile", lambda dev: LATE)   # the device benchmark, stubbed
    snaps = _planned_snapshots(monkeypatch)
    cfg = TrainConfig(steps=2, micro_batch=2, micro_batches=1, seed=1)
    jobs = NodeJobConfig(election_timeout=20, link_timeout=20, recv_timeout=20, progress_interval=0.0)
    swarm_cfg = SwarmConfig(heartbeat=0.3, dead_timeout=5.0, probing=False, watch=0)

    async def main() -> tuple[list[ProgressEvent], list[str], list[Startup]]:
        with trio.fail_after(120):
            async with (open_libp2p_transport(Identity.generate(), Libp2pConfig()) as bt,
                        open_libp2p_transport(Identity.generate(), Libp2pConfig()) as client):
                boot = SwarmNode(bt, SwarmConfig(role="bootstrap", heartbeat=0.3, dead_timeout=5.0), None)
                async with trio.open_nursery() as nursery:
                    await nursery.start(boot.run, [])
                    startups = [Startup(StartupConfig(defer=600)) for _ in range(2)]
                    for i, s in enumerate(startups):
                        def services(swarm: SwarmNode, inner: trio.Nursery, i: int = i, s: Startup = s) -> None:
                            svc = NodeJobService(swarm, tmp_path / f"n{i}", jobs)

                            async def serve() -> None:
                                await inner.start(svc.run)
                                s.serve(svc.handle)
                            inner.start_soon(serve)

                        dcfg = DaemonConfig(role="node", home=tmp_path / f"n{i}", listen=("/ip4/127.0.0.1/tcp/0",),
                                            bootstrap=(bt.listen_addrs()[0],), swarm=swarm_cfg)
                        early = [(JOB, job_proto.serve(s.early_job, timeout=60))]
                        nursery.start_soon(lambda d=dcfg, s=s, f=services, e=early: run_daemon(
                            d, on_ready=lambda a: None, extra_services=f, prepare=lambda: None, startup=s,
                            early_handlers=e))
                    await boot.wait_until(lambda: len(boot.members()) == 2, 30)
                    peers = boot.members()
                    assert all(boot.view.records[p].profile is None for p in peers)
                    await client.connect(bt.listen_addrs()[0])
                    pub = publisher.Publisher(client, ContentService(client, ContentStore()), [boot.peer_id],
                                              publisher.DriverConfig(idle_timeout=30, offer_timeout=60))
                    await nursery.start(pub.run)
                    events = await _run_tiny_job(pub, client, cfg, b"v", tmp_path / "pub")
                    nursery.cancel_scope.cancel()
                    return events, peers, startups
        raise AssertionError("unreachable")

    events, peers, startups = trio.run(main)
    assert [e.state for e in events if isinstance(e, JobStateChanged)] == ["planned", "running", "done"], events[-1]
    snap = snaps[0]
    assert dict(snap.members) == dict.fromkeys(peers, LATE)
    assert all(s.on_demand for s in startups)


def test_a_node_without_a_profile_that_joins_a_running_job_is_offered_it_by_the_leader(tmp_path: Path) -> None:
    """A re-plan's leader offers the job to a node that joined without a profile (its start-up deferred 600 s)
    as the publisher's first offer does: the offer starts its start-up and it is taken as a joiner with the
    profile its accept carried. The leader used to pass over a node whose record had no profile (up to
    ``defer`` after it joined)."""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=100_000, micro_batch=2, micro_batches=1, seed=1)   # runs until cancelled
    jobs = NodeJobConfig(election_timeout=20, link_timeout=20, recv_timeout=20, progress_interval=0.0)

    async def main() -> None:
        with trio.fail_after(90):
            async with open_embedded_swarm([TEST_PROFILE], tmp_path, config=EmbeddedConfig(jobs=jobs)) as emb:
                boot = emb.bootstrap
                client = emb.add_host()
                await client.connect(emb.bootstrap_addr)
                pub = publisher.Publisher(client, ContentService(client, ContentStore()), [boot.peer_id],
                                          publisher.DriverConfig(idle_timeout=60))
                await emb._nursery.start(pub.run)
                events: list[ProgressEvent] = []
                async with trio.open_nursery() as nursery:
                    async def job() -> None:
                        events.extend(await _run_tiny_job(pub, client, cfg, b"j", tmp_path / "pub"))
                    nursery.start_soon(job)
                    held = emb.nodes[0].jobs.jobs   # the job trains on its one node
                    await poll_until(lambda: any(r.state.value == "running" for r in held.values()), timeout=60)
                    (run,) = held.values()
                    late = Startup(StartupConfig(defer=600))
                    node = await emb.add_node(LATE, startup=late)
                    with trio.fail_after(30):   # old code: never (defer 600 s, no probing)
                        await late.wanted.wait()
                    assert late.on_demand and late.reason.startswith("a job request"), late.reason
                    await poll_until(lambda: node.peer_id in run.joiners, timeout=30)   # the leader took its accept
                    assert run._joiner_profiles[node.peer_id] == LATE
                    nursery.cancel_scope.cancel()

    trio.run(main)
