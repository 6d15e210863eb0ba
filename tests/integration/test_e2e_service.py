"""The swarm job path (node job service + publisher driver) in one trio.run.

Nodes run the real ``NodeJobService`` (JOB protocol, content fetch, gossip election, encrypted TCP
data plane on loopback) on the in-memory transport; the publisher is the ``Publisher`` that
``Swarm.connect`` uses. Real processes over libp2p: tests/system/test_e2e_processes.py.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
import trio

from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.build import build_job, module_state
from fusionp2p.jobs.checkpoint import assemble
from fusionp2p.jobs.content import ContentService, ContentStore
from fusionp2p.jobs.events import EvalProgress, JobStateChanged, PlanChanged, ProgressEvent, StepProgress
from fusionp2p.jobs.node import NodeJobConfig, NodeJobService
from fusionp2p.jobs.publisher import DriverConfig, Publisher
from fusionp2p.jobs.spec import Resources
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.net.memory import MemoryTransport, memory_network
from fusionp2p.net.resilient import ResilientChannel
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.testing.evaluation import final_eval_loss
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.wire.framing import encode_frame
from fusionp2p.wire.protocols import JOB

SEQ = 32
CFG = SwarmConfig(heartbeat=0.2, dead_timeout=5.0, probing=False)
# progress_interval 0: the tests act at a step (cut a link, kill a member) as soon as it ends
NODE_CFG = NodeJobConfig(election_timeout=20, link_timeout=20, recv_timeout=20, progress_interval=0.0)


def _model(seed: int = 0) -> GPT2:
    torch.manual_seed(seed)
    return GPT2(GPT2Config.tiny(block_size=SEQ))


class _Cluster:
    def __init__(self, net: object, boot: SwarmNode, nodes: list[SwarmNode], scopes: list[trio.CancelScope],
                 pub: Publisher, client: MemoryTransport, services: list[NodeJobService]) -> None:
        self.net, self.boot, self.nodes, self.scopes, self.pub, self.client = net, boot, nodes, scopes, pub, client
        self.services = services


@asynccontextmanager
async def _cluster(n: int, home: Path, jobs: NodeJobConfig = NODE_CFG) -> AsyncIterator[_Cluster]:
    async with memory_network() as net, trio.open_nursery() as nursery:
        boot = SwarmNode(net.add_host(), SwarmConfig(role="bootstrap", heartbeat=0.2, dead_timeout=5.0), None)
        await nursery.start(boot.run, [])
        addr = boot.transport.listen_addrs()[0]
        nodes: list[SwarmNode] = []
        scopes: list[trio.CancelScope] = []
        services: list[NodeJobService] = []

        async def node_main(i: int, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:
                scopes.append(scope)
                node = SwarmNode(net.add_host(), CFG, TEST_PROFILE)
                nodes.append(node)
                async with trio.open_nursery() as inner:
                    await inner.start(node.run, [addr])
                    services.append(NodeJobService(node, home / f"node{i}", jobs))
                    await inner.start(services[-1].run)
                    task_status.started()

        for i in range(n):
            await nursery.start(node_main, i)
        client = net.add_host()
        await client.connect(addr)
        pub = Publisher(client, ContentService(client, ContentStore()), [boot.peer_id],
                        DriverConfig(idle_timeout=30, offer_timeout=30))
        await nursery.start(pub.run)
        await boot.wait_until(lambda: len(boot.members()) >= n, 20)
        try:
            yield _Cluster(net, boot, nodes, scopes, pub, client, services)
        finally:
            nursery.cancel_scope.cancel()


async def _run(cl: _Cluster, built: object, home: Path) -> list[ProgressEvent]:
    events: list[ProgressEvent] = []
    await cl.pub.run_job(built, events.append, home / "checkpoints")  # type: ignore[arg-type]
    return events


def test_two_by_two_over_the_data_plane(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    # tau=2: streaming CO2 averages each of 2 fragments six times in 12 steps (tau=8 would leave one each)
    cfg = TrainConfig(steps=12, micro_batch=4, micro_batches=2, lr=3e-3, replicas=2, averaging=CO2(tau=2),
                      compression="adatopk", checkpoint_every=6, seed=1)

    async def main() -> tuple[list[ProgressEvent], object]:
        with trio.fail_after(120):
            async with _cluster(4, tmp_path) as cl:
                built = await trio.to_thread.run_sync(lambda: build_job(_model(), None, BuiltinCorpus(seq_len=SEQ), cfg, publisher=cl.client.peer_id,
                                  sign=cl.client.sign, now=1.0, nonce=b"a" * 16))
                return await _run(cl, built, tmp_path / "pub"), built

    events, built = trio.run(main)
    states = [e.state for e in events if isinstance(e, JobStateChanged)]
    assert states == ["planned", "running", "done"], events[-1]
    assert next(e for e in events if isinstance(e, PlanChanged)).stage_sizes == (2, 2)
    steps = [e for e in events if isinstance(e, StepProgress) and e.step < cfg.steps]
    assert [e.step for e in steps] == list(range(cfg.steps))
    assert float(np.mean([e.loss for e in steps[-3:]])) < float(np.mean([e.loss for e in steps[:3]])) - 0.5
    assert not [e for e in events if isinstance(e, StepProgress) and e.step >= cfg.steps]   # no step past the last
    final = next(e for e in events if isinstance(e, EvalProgress) and e.step == cfg.steps and not e.peer)
    # the stage checkpoints fetched by hash assemble into the user's module and reproduce the final loss
    state = module_state(built.dag, assemble(tmp_path / "pub" / "checkpoints", built.spec.job_id))  # type: ignore[attr-defined]
    fresh = _model(seed=9)
    fresh.load_state_dict(state)
    ref = final_eval_loss(fresh, cfg, seq_len=SEQ)
    assert final.loss is not None
    assert abs(ref - final.loss) < 1e-4
    safetensors.torch.save_file(state, str(tmp_path / "m.safetensors"))   # the download format round-trips


def _cut(cl: _Cluster, job_id: str, *, stage: int) -> ResilientChannel:
    """Break the TCP connection under the job's data-plane channel on the node running *stage* (both
    directions at once, no CLOSE: both ends see a lost link). Returns that channel."""
    svc = next(x for x in cl.services if job_id in x.jobs and x.jobs[job_id].role == (stage, 0))
    (ch,) = svc.jobs[job_id].channels          # 2 stages x 1 replica: one link, p0:0-1
    link = ch._link
    assert link is not None, "the link is not up"
    link._sock.shutdown(socket.SHUT_RDWR)
    return ch


def test_fast_steps_are_gossiped_together_and_the_publisher_sees_every_step(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``progress_interval`` longer than the job, the loss replica gossips its first step and then one
    message at the last step that carries every step between (``StepProgress.earlier``); the publisher
    still yields one event per step, with the losses the node trained."""
    from fusionp2p.jobs.run import JobRun

    torch.set_num_threads(1)
    cfg = TrainConfig(steps=8, micro_batch=2, micro_batches=2, lr=3e-3, replicas=1, averaging="none",
                      compression="none", checkpoint_every=0, seed=4)
    sent: list[StepProgress] = []
    gossip = JobRun._gossip

    async def gossip_and_note(self: JobRun, ev: Any) -> None:
        if isinstance(ev, StepProgress):
            sent.append(ev)
        await gossip(self, ev)

    monkeypatch.setattr(JobRun, "_gossip", gossip_and_note)

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(120):
            async with _cluster(1, tmp_path, dataclasses.replace(NODE_CFG, progress_interval=3600.0)) as cl:
                built = await trio.to_thread.run_sync(lambda: build_job(
                    _model(), None, BuiltinCorpus(seq_len=SEQ), cfg, publisher=cl.client.peer_id, sign=cl.client.sign,
                    now=1.0, nonce=b"g" * 16))
                return await _run(cl, built, tmp_path / "pub")

    events = trio.run(main)
    assert [(e.step, len(e.earlier)) for e in sent] == [(0, 0), (7, 6)]
    trained = {0: sent[0].loss, **{1 + i: x for i, x in enumerate(sent[1].earlier)}, 7: sent[1].loss}
    steps = [e for e in events if isinstance(e, StepProgress) and e.step < cfg.steps]
    assert [(e.step, e.loss) for e in steps] == sorted(trained.items())
    assert all(e.earlier == () for e in steps)


def test_a_cut_data_plane_connection_does_not_change_the_training(tmp_path: Path) -> None:
    """A 2-stage job whose one data-plane connection is cut twice mid-job (once under the dialing
    stage, once under the accepting one) completes with exactly the losses of an uncut run."""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=16, micro_batch=2, micro_batches=2, replicas=1, averaging="none",
                      compression="adatopk", seed=4)

    async def run(cl: _Cluster, nonce: bytes, cut_at: dict[int, int]) -> tuple[list[ProgressEvent], list[ResilientChannel]]:
        built = await trio.to_thread.run_sync(lambda: build_job(_model(), None, BuiltinCorpus(seq_len=SEQ), cfg, publisher=cl.client.peer_id,
                          sign=cl.client.sign, now=1.0, nonce=nonce))
        events: list[ProgressEvent] = []
        cut: list[ResilientChannel] = []

        def emit(ev: ProgressEvent) -> None:
            events.append(ev)
            if isinstance(ev, StepProgress) and ev.step in cut_at:   # training is under way
                cut.append(_cut(cl, built.spec.job_id, stage=cut_at.pop(ev.step)))

        await cl.pub.run_job(built, emit, tmp_path / f"pub-{nonce[:1].decode()}")
        return events, cut

    async def main() -> tuple[list[ProgressEvent], list[ProgressEvent], list[ResilientChannel]]:
        with trio.fail_after(180):
            async with _cluster(2, tmp_path) as cl:
                plain, _ = await run(cl, b"e" * 16, {})
                events, cut = await run(cl, b"f" * 16, {1: 0, 5: 1})
                return plain, events, cut

    plain, events, cut = trio.run(main)
    for evs in (plain, events):
        assert [e.state for e in evs if isinstance(e, JobStateChanged)] == ["planned", "running", "done"], evs[-1]
    assert [ch.links for ch in cut] == [3, 3]      # the first link and two reconnections, on both ends
    assert cut[0].session == cut[1].session        # one session throughout: resumed, not reopened

    def losses(evs: list[ProgressEvent]) -> dict[int, float]:
        final = {e.step: e.loss for e in evs if isinstance(e, EvalProgress) and not e.peer}   # the final evaluation
        return {e.step: e.loss for e in evs if isinstance(e, StepProgress) and e.loss is not None} | final

    want, got = losses(plain), losses(events)
    assert sorted(want) == sorted(got) == list(range(cfg.steps + 1))   # every step and the final evaluation
    assert got == want      # bit for bit: nothing lost, repeated or reordered (the training is deterministic)


def test_unfittable_job_fails_with_the_nodes_reason(tmp_path: Path) -> None:
    cfg = TrainConfig(steps=2, micro_batch=2, micro_batches=1)

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(60):
            async with _cluster(2, tmp_path) as cl:
                built = await trio.to_thread.run_sync(lambda: build_job(_model(), None, BuiltinCorpus(seq_len=SEQ), cfg, publisher=cl.client.peer_id,
                                  sign=cl.client.sign, now=1.0, nonce=b"b" * 16,
                                  resources=Resources(min_memory_bytes=1 << 50)))
                return await _run(cl, built, tmp_path / "pub")

    events = trio.run(main)
    last = events[-1]
    assert isinstance(last, JobStateChanged)
    assert last.state == "failed"
    assert "no node accepted" in last.reason
    assert "needs" in last.reason


def test_a_dead_member_is_replanned_around_and_the_job_ends_done(tmp_path: Path) -> None:
    """Two nodes, one stage each; one dies mid-job. Its stage's newest shadow copy and its stage file of the last
    checkpoint were copied to the survivor (its keeper), so the survivor re-plans alone from the newer of the two
    and finishes the job."""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=24, micro_batch=2, micro_batches=2, replicas=1, averaging="none", compression="none",
                      checkpoint_every=4, seed=2)

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(120):
            async with _cluster(2, tmp_path) as cl:
                built = await trio.to_thread.run_sync(lambda: build_job(_model(), None, BuiltinCorpus(seq_len=SEQ), cfg, publisher=cl.client.peer_id,
                                  sign=cl.client.sign, now=1.0, nonce=b"c" * 16))
                events: list[ProgressEvent] = []

                def emit(ev: ProgressEvent) -> None:
                    events.append(ev)
                    if isinstance(ev, StepProgress) and ev.step == 10 and ev.epoch == 0:
                        cl.scopes[1].cancel()                 # the node dies mid-job
                        cl.net.kill(cl.nodes[1].peer_id)       # type: ignore[attr-defined]

                await cl.pub.run_job(built, emit, tmp_path / "pub")
                return events

    events = trio.run(main)
    states = [e.state for e in events if isinstance(e, JobStateChanged)]
    assert states[0] == "planned" and states[-1] == "done", events[-1]
    plans = [e for e in events if isinstance(e, PlanChanged)]
    assert [p.epoch for p in plans][:1] == [0] and plans[-1].epoch >= 1
    assert len(set(plans[-1].members)) == 1                  # the survivor holds both stages' parameters now
    steps = {e.step: e for e in events if isinstance(e, StepProgress) and e.loss is not None}
    assert set(range(cfg.steps)) <= set(steps) and any(isinstance(e, EvalProgress) and not e.peer for e in events)
    resumed = min(e.step for e in steps.values() if e.epoch >= 1)
    # the dead stage's newest shadow copy (jobs/shadow.py: at most a few steps old), never older than the newest
    # complete checkpoint before the death (every 4 steps: step 8)
    assert 8 <= resumed <= 11


@pytest.mark.parametrize("payload", [b"", b"\x00\x00\x00\x05hello", encode_frame(b"\x81\xa2op\xa4nope", max_frame=64),
                                     encode_frame(b"\x81\xa2op\xa5offer", max_frame=64)])
def test_garbage_on_the_job_protocol_is_answered_not_fatal(tmp_path: Path, payload: bytes) -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with _cluster(1, tmp_path) as cl:
                s = await cl.client.open_stream(cl.nodes[0].peer_id, JOB)
                await s.send_all(payload)
                await s.send_eof()
                while await s.receive_some():
                    pass
                # the node still answers a well-formed request
                from fusionp2p.jobs import proto as job_proto

                reply = await job_proto.request(cl.client, cl.nodes[0].peer_id, {"op": "status", "job": "x"}, timeout=5)
                assert reply["ok"] is False

    trio.run(main)
