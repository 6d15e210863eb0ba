"""Elastic jobs on the embedded swarm (the node job service and the publisher, as in ``fusionp2p node``):
members die, leave and join mid-training, the publisher goes away; the job re-plans and ends DONE.

Real processes: tests/system/test_elastic_processes.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio

from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs import build
from fusionp2p.jobs.build import BuiltJob, build_job, module_state
from fusionp2p.jobs.checkpoint import assemble
from fusionp2p.jobs.content import ContentService, ContentStore
from fusionp2p.jobs.embedded import EmbeddedConfig, EmbeddedNode, EmbeddedSwarm, open_embedded_swarm
from fusionp2p.jobs.events import EvalProgress, JobStateChanged, PlanChanged, ProgressEvent, StepProgress
from fusionp2p.jobs.node import NodeJobConfig
from fusionp2p.jobs.publisher import DriverConfig, Publisher
from fusionp2p.jobs.run import JobRun
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.net.identity import Identity
from fusionp2p.net.memory import MemoryTransport
from fusionp2p.testing.evaluation import final_eval_loss
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.worker import StageWorker
from fusionp2p.types import DeviceProfile

SEQ = 32
# replan_min_saving: these tiny jobs train for seconds, so a planned re-plan (a joiner taken in, a re-balance)
# never saves the default 30 s; let any saving count (test_no_rebalance_... restores the default).
# progress_interval 0: the tests act at a step (a kill, a join) as soon as it ends
JOBS = NodeJobConfig(election_timeout=20, link_timeout=20, recv_timeout=30, halt_timeout=10, start_timeout=40,
                     replan_retry=10, watch_interval=0.5, replan_min_saving=1e-6, progress_interval=0.0)
DRIVER = DriverConfig(idle_timeout=60, offer_timeout=30, status_poll=1.0)


def _model(seed: int = 0) -> GPT2:
    torch.manual_seed(seed)
    return GPT2(GPT2Config.tiny(block_size=SEQ))


@asynccontextmanager
async def _swarm(n: int, home: Path, identity: Identity | None = None, profile: DeviceProfile = TEST_PROFILE,
                 jobs: NodeJobConfig = JOBS) -> AsyncIterator[tuple[EmbeddedSwarm, Publisher, MemoryTransport]]:
    async with open_embedded_swarm([profile] * n, home, config=EmbeddedConfig(jobs=jobs)) as emb, \
            trio.open_nursery() as nursery:
        client = emb.add_host(identity)
        boot = await client.connect(emb.bootstrap_addr)
        pub = Publisher(client, ContentService(client, ContentStore()), [boot], DRIVER)
        await nursery.start(pub.run)
        try:
            yield emb, pub, client
        finally:
            nursery.cancel_scope.cancel()


async def _built(client: MemoryTransport, cfg: TrainConfig, nonce: bytes) -> BuiltJob:
    """Trace and sign in a worker thread, as the SDK does in the caller's thread: tracing takes seconds,
    and a blocked event loop would miss the nodes' heartbeats (the bootstrap would declare them dead)."""
    return await trio.to_thread.run_sync(lambda: build_job(
        _model(), None, BuiltinCorpus(seq_len=SEQ), cfg, publisher=client.peer_id, sign=client.sign, now=1.0,
        nonce=nonce * 16))


def _node(emb: EmbeddedSwarm, peer: str) -> EmbeddedNode:
    return next(n for n in emb.nodes if n.peer_id == peer)


def _plan_highest_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node and the publisher plan the same: the highest live id alone, in every epoch (so the standbys,
    offered the job as joiners, get no role in a planned re-plan: the leader weighs them and keeps them
    standbys, and the only member is still the only one at the kill)."""
    choose = build.choose_plan

    def highest_alone(spec: Any, dag: Any, members: Any, *, links: Any = None, epoch: int = 0) -> Any:
        return choose(spec, dag, {max(members): members[max(members)]}, links=links, epoch=epoch)

    monkeypatch.setattr(build, "choose_plan", highest_alone)


async def _attach_elsewhere(emb: EmbeddedSwarm, key: Identity, built: BuiltJob, root: Path) -> list[ProgressEvent]:
    """The same key on another machine: attach to *built*'s job, follow it to its end (and its download)."""
    other = emb.add_host(key)
    boot = await other.connect(emb.bootstrap_addr)
    pub2 = Publisher(other, ContentService(other, ContentStore()), [boot], DRIVER)
    later: list[ProgressEvent] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pub2.run)
        await pub2.attach_job(built.spec.job_id, later.append, root, steps=built.spec.config.steps)
        nursery.cancel_scope.cancel()
    return later


def _stage_peers(plan: PlanChanged, stage: int) -> tuple[str, ...]:
    off = sum(plan.stage_sizes[:stage])
    return plan.members[off:off + plan.stage_sizes[stage]]


def _plans(events: list[ProgressEvent]) -> list[PlanChanged]:
    return [e for e in events if isinstance(e, PlanChanged)]


def _losses(events: list[ProgressEvent]) -> dict[int, StepProgress | EvalProgress]:
    """Per step its event with a loss; at ``steps``, the final evaluation (the publisher's, peer "")."""
    out: dict[int, StepProgress | EvalProgress] = {}
    for e in events:
        if (isinstance(e, StepProgress) and e.loss is not None) or (isinstance(e, EvalProgress) and not e.peer):
            out[e.step] = e
    return out


def _check_done(events: list[ProgressEvent], cfg: TrainConfig) -> tuple[list[PlanChanged],
                                                                          dict[int, StepProgress | EvalProgress]]:
    states = [e.state for e in events if isinstance(e, JobStateChanged)]
    assert states[-1] == "done", [e for e in events if isinstance(e, JobStateChanged)]
    plans = [e for e in events if isinstance(e, PlanChanged)]
    steps = _losses(events)
    assert set(range(cfg.steps + 1)) <= set(steps)      # every step and the final evaluation
    return plans, steps


def _check_download(tmp: Path, built: BuiltJob, cfg: TrainConfig, events: list[ProgressEvent], replicas: int) -> None:
    """The stage files fetched by hash assemble into the user's module, load strictly, reproduce the loss."""
    state = module_state(built.dag, assemble(tmp / "checkpoints", built.spec.job_id))
    model = _model(seed=99)
    model.load_state_dict(state)
    final = _losses(events)[cfg.steps].loss
    ref = final_eval_loss(model, cfg, seq_len=SEQ, replicas=replicas)
    assert final is not None and abs(ref - final) < 1e-4, (ref, final)


async def _publish(pub: Publisher, built: BuiltJob, home: Path, on_event: Callable[[ProgressEvent], None]) -> list[ProgressEvent]:
    events: list[ProgressEvent] = []

    def emit(ev: ProgressEvent) -> None:
        events.append(ev)
        on_event(ev)

    await pub.run_job(built, emit, home / "checkpoints")
    return events


def test_a_killed_replica_hands_over_live_and_nothing_is_lost(tmp_path: Path) -> None:
    """2 stages x 2 replicas, CO2; a stage-1 replica dies without a goodbye (no checkpoints taken): the
    survivors re-plan and the new holders take the live replicas' state. No step is lost, the loss goes
    on from where it was, the job ends DONE and its download reproduces the reported loss."""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=30, micro_batch=4, micro_batches=2, lr=3e-3, replicas=2, averaging=CO2(tau=2),
                      compression="adatopk", checkpoint_every=0, seed=1)
    killed: list[str] = []

    async def main() -> tuple[list[ProgressEvent], BuiltJob]:
        with trio.fail_after(150):
            async with _swarm(4, tmp_path) as (emb, pub, client):
                built = await _built(client, cfg, b"k")
                plan0: list[PlanChanged] = []

                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, PlanChanged) and not plan0:
                        plan0.append(ev)
                    if isinstance(ev, StepProgress) and ev.step == 12 and not killed:
                        victim = _stage_peers(plan0[0], 1)[1]
                        killed.append(victim)
                        emb.kill(_node(emb, victim))

                return await _publish(pub, built, tmp_path, on_event), built

    events, built = trio.run(main)
    plans, steps = _check_done(events, cfg)
    assert plans[0].stage_sizes == (2, 2) and plans[-1].epoch >= 1
    assert killed[0] not in plans[-1].members   # replicas=2 on 3 survivors: one stage of 2, a standby
    resumed = min(s for s, e in steps.items() if e.epoch >= 1)
    assert resumed >= 12                                  # live hand-off: nothing trained is thrown away
    before = np.mean([steps[s].loss for s in range(resumed - 3, resumed)])   # type: ignore[misc]
    assert steps[resumed].loss < before + 0.3, (steps[resumed].loss, before)   # no jump back to an untrained model
    assert steps[cfg.steps - 1].loss < steps[0].loss - 1.0   # type: ignore[operator]
    _check_download(tmp_path, built, cfg, events, len(_plans(events)[-1].stage_sizes and _stage_peers(_plans(events)[-1], len(_plans(events)[-1].stage_sizes) - 1)))


def test_the_leader_dies_and_the_next_lowest_id_carries_the_job_on(tmp_path: Path) -> None:
    """Issue 43: the other kill tests kill the highest peer id, never the leader (the lowest live id of the
    plan, ``replan.leader_of``). Here the leader dies without a goodbye mid-training: the next lowest id
    leads the re-plan, the survivors take the live replicas' state, and the job ends DONE."""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=24, micro_batch=4, micro_batches=2, lr=3e-3, replicas=2, averaging=CO2(tau=2),
                      compression="adatopk", checkpoint_every=0, seed=3)
    killed: list[str] = []

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(150):
            async with _swarm(4, tmp_path) as (emb, pub, client):
                built = await _built(client, cfg, b"L")
                plan0: list[PlanChanged] = []

                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, PlanChanged) and not plan0:
                        plan0.append(ev)
                    if isinstance(ev, StepProgress) and ev.step == 8 and not killed:
                        killed.append(min(plan0[0].members))        # the leader
                        emb.kill(_node(emb, killed[0]))

                return await _publish(pub, built, tmp_path, on_event)

    events = trio.run(main)
    plans, steps = _check_done(events, cfg)
    assert killed and killed[0] not in plans[-1].members and plans[-1].epoch >= 1
    assert min(s for s, e in steps.items() if e.epoch >= 1) >= 8     # live hand-off: nothing trained is lost
    # the median of the last steps: one batch of this corpus reads ~5.4 at any point of training (step 20 when
    # the new epoch resumes at 9), and where it lands depends on the resume step, so on how fast the re-plan was
    assert np.median([steps[s].loss for s in range(cfg.steps - 5, cfg.steps)]) < steps[0].loss - 1.0   # type: ignore[arg-type, operator]


def test_a_member_that_leaves_is_replanned_around(tmp_path: Path) -> None:
    """A stage-0 node announces its departure (SIGTERM): the others re-plan at once and finish."""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=24, micro_batch=2, micro_batches=2, lr=3e-3, replicas=2, averaging="co2",
                      compression="none", checkpoint_every=0, seed=2)

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(150):
            async with _swarm(4, tmp_path) as (emb, pub, client), trio.open_nursery() as nursery:
                plan0: list[PlanChanged] = []

                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, PlanChanged) and not plan0:
                        plan0.append(ev)
                    if isinstance(ev, StepProgress) and ev.step == 8 and ev.epoch == 0 and not left:
                        left.append(_stage_peers(plan0[0], 0)[0])
                        nursery.start_soon(emb.leave, _node(emb, left[0]))

                return await _publish(pub, await _built(client, cfg, b"l"), tmp_path, on_event)

    left: list[str] = []
    events = trio.run(main)
    plans, steps = _check_done(events, cfg)
    assert left[0] not in plans[-1].members and plans[-1].epoch >= 1
    assert min(s for s, e in steps.items() if e.epoch >= 1) >= 8


def test_a_joiner_is_taken_in_at_a_step_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One stage on one node; a second node joins the swarm mid-job. The leader offers it the job; with it
    the plan has two stages (predicted 23% faster, over the 10% a re-plan must gain: JOIN_GAIN), so the
    member halts at an agreed step boundary, hands its state over, and continues with the joiner; no
    step is lost."""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=60, micro_batch=2, micro_batches=2, lr=3e-3, replicas=1, averaging="none",
                      compression="none", checkpoint_every=0, seed=3)
    joined: list[str] = []
    # This tiny job trains faster than a node starts and joins: the first epoch waits at step 10 until
    # the joiner has accepted the job (the re-plan itself is not helped along).
    accepted = trio.Event()
    offer_to, train_step = JobRun._offer_to, StageWorker._train_step

    async def offer_and_note(self: JobRun, peer: str) -> None:
        await offer_to(self, peer)
        if peer in self.joiners:
            accepted.set()

    async def step_or_wait(self: StageWorker, step: int) -> tuple[float, float]:
        if step == 10:
            with trio.fail_after(60):
                await accepted.wait()
        return await train_step(self, step)

    monkeypatch.setattr(JobRun, "_offer_to", offer_and_note)
    monkeypatch.setattr(StageWorker, "_train_step", step_or_wait)

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(150):
            async with _swarm(1, tmp_path) as (emb, pub, client), trio.open_nursery() as nursery:
                async def join() -> None:
                    joined.append((await emb.add_node(TEST_PROFILE)).peer_id)

                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, StepProgress) and ev.step == 3 and not joined:
                        joined.append("")
                        nursery.start_soon(join)

                return await _publish(pub, await _built(client, cfg, b"j"), tmp_path, on_event)

    events = trio.run(main)
    plans, steps = _check_done(events, cfg)
    assert plans[0].stage_sizes == (1,)
    assert joined[-1] in plans[-1].members and plans[-1].stage_sizes == (1, 1)
    first_new = min(s for s, e in steps.items() if e.epoch >= 1)
    last_old = max(s for s, e in steps.items() if e.epoch == 0 and s < cfg.steps)
    assert first_new == last_old + 1                       # a planned halt: no step trained twice or lost


def test_a_joiner_that_would_gain_too_little_stays_a_standby(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stages on 2 nodes; a third joins and accepts the job, but three stages are predicted only 6%
    faster (under JOIN_GAIN): the leader does not halt the job for it, and the job ends in epoch 0.
    (Before, any plan that gave a joiner a role re-planned: under load, a standby whose probed figures had
    moved a little swapped places with a member, an extra planned/running pair for nothing.)"""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=40, micro_batch=2, micro_batches=2, lr=3e-3, replicas=1, averaging="none",
                      compression="none", checkpoint_every=0, seed=3)
    joined: list[str] = []
    judged = trio.Event()          # the leader has weighed the plan with the joiner at least once
    take_in, train_step = JobRun._take_in_joiners, StageWorker._train_step
    led: list[str] = []
    lead = JobRun._lead

    async def take_in_and_note(self: JobRun, plan: Any) -> None:
        had = bool(self.joiners)
        await take_in(self, plan)
        if had:
            judged.set()

    async def lead_and_note(self: JobRun, plan: Any, *, at: int | None, why: str) -> None:
        led.append(why)
        await lead(self, plan, at=at, why=why)

    async def step_or_wait(self: StageWorker, step: int) -> tuple[float, float]:
        if step == 10:
            with trio.fail_after(60):
                await judged.wait()
        return await train_step(self, step)

    monkeypatch.setattr(JobRun, "_take_in_joiners", take_in_and_note)
    monkeypatch.setattr(JobRun, "_lead", lead_and_note)
    monkeypatch.setattr(StageWorker, "_train_step", step_or_wait)

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(150):
            async with _swarm(2, tmp_path) as (emb, pub, client), trio.open_nursery() as nursery:
                async def join() -> None:
                    joined.append((await emb.add_node(TEST_PROFILE)).peer_id)

                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, StepProgress) and ev.step == 3 and not joined:
                        joined.append("")
                        nursery.start_soon(join)

                return await _publish(pub, await _built(client, cfg, b"k"), tmp_path, on_event)

    events = trio.run(main)
    plans, _ = _check_done(events, cfg)
    assert judged.is_set() and not led, led
    assert [p.epoch for p in plans] == [0] and plans[0].stage_sizes == (1, 1)
    assert joined[-1] not in plans[-1].members


def test_a_job_left_with_too_few_members_takes_in_a_newcomer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes whose memory holds half the model each (2 stages); one dies. The survivor finds no plan
    on its own, so it waits, offering the job to every live node outside it; a fresh node that joins later
    is taken in and the job ends DONE on the two. (Before, the lone leader re-planned alone every
    replan_retry, never offering the job to anyone, until the job timed out.)"""
    torch.set_num_threads(1)
    small = dataclasses.replace(TEST_PROFILE, memory_bytes=3 << 20)   # 1 node: no plan; 2 nodes: 2 stages
    # (without recomputation, which would let one node hold the whole model: the case here is no plan)
    cfg = TrainConfig(steps=30, micro_batch=2, micro_batches=2, lr=3e-3, replicas=1, averaging="none",
                      compression="none", checkpoint_every=4, seed=5, recompute="never")
    killed: list[str] = []
    joined: list[str] = []
    alone = trio.Event()
    run_epoch = JobRun._epoch

    async def epoch_and_note(self: JobRun, req: Any) -> bool:
        done = await run_epoch(self, req)
        if self._cur.outcome == "no plan":
            alone.set()   # the survivor found no plan on its own
        return done

    monkeypatch.setattr(JobRun, "_epoch", epoch_and_note)

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(150):
            async with _swarm(2, tmp_path, profile=small) as (emb, pub, client), trio.open_nursery() as nursery:
                async def join_when_alone() -> None:
                    await alone.wait()
                    joined.append((await emb.add_node(small)).peer_id)

                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, PlanChanged) and ev.epoch == 0 and not killed:
                        killed.append(ev.members[-1])
                    if isinstance(ev, StepProgress) and ev.step == 6 and len(killed) == 1:
                        killed.append("")
                        emb.kill(_node(emb, killed[0]))
                        nursery.start_soon(join_when_alone)

                return await _publish(pub, await _built(client, cfg, b"n"), tmp_path, on_event)

    events = trio.run(main)
    plans, _ = _check_done(events, cfg)
    assert plans[0].stage_sizes == (1, 1)
    assert joined and joined[0] in plans[-1].members and killed[0] not in plans[-1].members


def test_a_joiner_arriving_while_a_member_dies_is_taken_in(tmp_path: Path) -> None:
    """Issue 43: a member dies and, at the same step, a fresh node joins the swarm (the joiner's offer and
    the re-plan around the dead member race). Two nodes hold half the model each, so the job can go on
    only with the joiner: it is taken in, and the job ends DONE without the dead member."""
    torch.set_num_threads(1)
    small = dataclasses.replace(TEST_PROFILE, memory_bytes=3 << 20)   # 1 node: no plan; 2 nodes: 2 stages
    # (without recomputation, which would let one node hold the whole model: the case here is no plan)
    cfg = TrainConfig(steps=24, micro_batch=2, micro_batches=2, lr=3e-3, replicas=1, averaging="none",
                      compression="none", checkpoint_every=4, seed=7, recompute="never")
    killed: list[str] = []
    joined: list[str] = []

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(150):
            async with _swarm(2, tmp_path, profile=small) as (emb, pub, client), trio.open_nursery() as nursery:
                async def join() -> None:
                    joined.append((await emb.add_node(small)).peer_id)

                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, PlanChanged) and ev.epoch == 0 and not killed:
                        killed.append(min(ev.members))           # the leader, for good measure
                    if isinstance(ev, StepProgress) and ev.step == 6 and len(killed) == 1:
                        killed.append("")
                        nursery.start_soon(join)
                        emb.kill(_node(emb, killed[0]))

                return await _publish(pub, await _built(client, cfg, b"r"), tmp_path, on_event)

    events = trio.run(main)
    plans, _ = _check_done(events, cfg)
    assert plans[0].stage_sizes == (1, 1)
    assert joined and joined[0] in plans[-1].members and killed[0] not in plans[-1].members


def test_two_failures_in_a_row_and_one_during_the_replan(tmp_path: Path) -> None:
    """Five nodes, one replica per stage (every loss breaks the pipeline). One dies; while the leader
    halts the others for the re-plan a second one dies; later a third. Each lost stage comes back from
    its replicated checkpoint (every 4 steps) and the job ends DONE on the two survivors."""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=40, micro_batch=2, micro_batches=2, lr=3e-3, replicas=1, averaging="none",
                      compression="none", checkpoint_every=4, seed=4)
    dead: list[str] = []
    lead = JobRun._lead

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(200):
            async with _swarm(5, tmp_path) as (emb, pub, client):
                plans: list[PlanChanged] = []

                async def lead_and_lose_one(self: JobRun, plan: Any, **kw: Any) -> None:
                    if len(dead) == 1:   # a failure during the re-plan: another member dies now
                        victim = next(p for p in plan.peers if p != self.me and p not in dead)
                        dead.append(victim)
                        emb.kill(_node(emb, victim))
                    await lead(self, plan, **kw)

                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, PlanChanged):
                        plans.append(ev)
                    if isinstance(ev, StepProgress) and ev.step == 6 and not dead:
                        victim = plans[-1].members[-1]
                        dead.append(victim)
                        emb.kill(_node(emb, victim))
                    if isinstance(ev, StepProgress) and ev.step == 22 and len(dead) == 2 and ev.epoch >= 1:
                        victim = max(p for p in plans[-1].members if p not in dead)
                        dead.append(victim)
                        emb.kill(_node(emb, victim))

                JobRun._lead = lead_and_lose_one  # type: ignore[method-assign]
                try:
                    return await _publish(pub, await _built(client, cfg, b"t"), tmp_path, on_event)
                finally:
                    JobRun._lead = lead  # type: ignore[method-assign]

    events = trio.run(main)
    plans, _ = _check_done(events, cfg)
    assert len(dead) == 3
    assert plans[-1].epoch >= 2 and not set(dead) & set(plans[-1].members)


def test_the_plans_only_member_dies_and_a_standby_carries_the_job_on(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Epoch 0's plan has one member and the other nodes are standbys (the planner chooses so when one
    node holds the model and the links look too slow to split it: real processes on a loaded machine
    did). That member dies without a goodbye. The lowest live standby leads the re-plan (before, no node
    did: each waited for a live member of the plan to lead, and the job stalled until the publisher gave
    up after 300 s), the stage comes back from the checkpoint a standby kept, and the job ends DONE."""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=24, micro_batch=2, micro_batches=2, lr=3e-3, replicas=1, averaging="none",
                      compression="none", checkpoint_every=4, seed=6)
    _plan_highest_alone(monkeypatch)
    killed: list[str] = []

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(150):
            async with _swarm(3, tmp_path) as (emb, pub, client):
                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, PlanChanged) and ev.epoch == 0:
                        assert len(ev.members) == 1
                    if isinstance(ev, StepProgress) and ev.step == 6 and not killed:
                        killed.append(max(n.peer_id for n in emb.nodes))
                        emb.kill(_node(emb, killed[0]))

                return await _publish(pub, await _built(client, cfg, b"o"), tmp_path, on_event)

    events = trio.run(main)
    plans, steps = _check_done(events, cfg)
    assert plans[0].members == (killed[0],) and plans[-1].epoch >= 1 and killed[0] not in plans[-1].members
    assert min(s for s, e in steps.items() if e.epoch >= 1) >= 4, (   # from the kept checkpoint, not step 0
        [(s, e.epoch) for s, e in sorted(steps.items())], [(p.epoch, p.members) for p in plans])


def test_the_job_outlives_its_publisher_and_is_attached_from_elsewhere(tmp_path: Path) -> None:
    """The publisher's process vanishes mid-job; the job runs to its end; a second client with the same
    key attaches from another machine, sees it DONE and downloads the trained model."""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=20, micro_batch=2, micro_batches=2, lr=3e-3, replicas=1, averaging="none",
                      compression="none", checkpoint_every=5, seed=5)
    key = Identity.generate()

    async def main() -> tuple[list[ProgressEvent], list[ProgressEvent], BuiltJob]:
        with trio.fail_after(150):
            async with _swarm(2, tmp_path, identity=key) as (emb, pub, client):
                built = await _built(client, cfg, b"p")
                first: list[ProgressEvent] = []
                with trio.CancelScope() as gone:
                    def emit(ev: ProgressEvent) -> None:
                        first.append(ev)
                        if isinstance(ev, StepProgress) and ev.step == 4:
                            emb.net.kill(client.peer_id)      # the publisher's process dies
                            gone.cancel()

                    await pub.run_job(built, emit, tmp_path / "first")
                # the same key, another machine: follow the job to its end and download it
                later = await _attach_elsewhere(emb, key, built, tmp_path / "checkpoints")
                return first, later, built

    first, later, built = trio.run(main)
    assert not any(isinstance(e, JobStateChanged) and e.state in ("failed", "cancelled") for e in first)
    assert [e.state for e in later if isinstance(e, JobStateChanged)][-1] == "done"
    _check_download(tmp_path, built, cfg, later, 1)


def test_a_node_restarted_with_its_identity_rejoins_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One replica per stage on 2 nodes: one dies (the survivor goes on alone from the replicated
    checkpoint), then comes back with the same identity; it is taken in again and the job ends DONE on both."""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=60, micro_batch=2, micro_batches=2, lr=3e-3, replicas=1, averaging="none",
                      compression="none", checkpoint_every=4, seed=6)
    back = trio.Event()
    offer_to, train_step = JobRun._offer_to, StageWorker._train_step

    async def offer_and_note(self: JobRun, peer: str) -> None:
        await offer_to(self, peer)
        if peer in self.joiners:
            back.set()

    async def step_or_wait(self: StageWorker, step: int) -> tuple[float, float]:
        if step == 30:   # this tiny job trains faster than a node restarts: wait until it accepted again
            with trio.fail_after(60):
                await back.wait()
        return await train_step(self, step)

    monkeypatch.setattr(JobRun, "_offer_to", offer_and_note)
    monkeypatch.setattr(StageWorker, "_train_step", step_or_wait)
    victim: list[EmbeddedNode] = []

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(150):
            async with _swarm(2, tmp_path) as (emb, pub, client), trio.open_nursery() as nursery:
                async def restart() -> None:
                    await emb.wait_members(1)                  # the bootstrap saw it die
                    await emb.add_node(TEST_PROFILE, identity=victim[0].identity)

                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, StepProgress) and ev.step == 9 and not victim:
                        victim.append(max(emb.nodes, key=lambda n: n.peer_id))
                        emb.kill(victim[0])
                        nursery.start_soon(restart)

                return await _publish(pub, await _built(client, cfg, b"r"), tmp_path, on_event)

    events = trio.run(main)
    plans, _ = _check_done(events, cfg)
    assert victim[0].peer_id not in plans[1].members     # the first re-plan went on without it
    assert victim[0].peer_id in plans[-1].members        # and it is back in the last plan


REBALANCE_JOBS = dataclasses.replace(JOBS, rebalance_after=6)    # judged within the 30-step job
REBALANCE_CFG = TrainConfig(steps=30, micro_batch=2, micro_batches=4, lr=3e-3, replicas=2, averaging=CO2(tau=2),
                            compression="none", checkpoint_every=0, seed=8)


def _replica_1_measures_3x_slower(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica 1's worker counts 3x the forward and backward seconds it spent (as benchmarks.wan's
    small-quota hosts train slower than their start-up benchmark says)."""
    train_step = StageWorker._train_step

    async def slower_replica_1(self: StageWorker, step: int) -> tuple[float, float]:
        before = self.busy_s
        out = await train_step(self, step)
        if self.ctx.replica == 1:
            self.busy_s += 2.0 * (self.busy_s - before)
        return out

    monkeypatch.setattr(StageWorker, "_train_step", slower_replica_1)


def test_the_leader_rebalances_the_micro_batches_by_the_speeds_measured_in_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two equal profiles, so epoch 0 deals the micro-batches evenly; but replica 1 computes 3x slower per
    micro-batch (as benchmarks.wan's small-quota hosts do against their start-up benchmark). After
    ``rebalance_after`` steps the leader asks both for their measured speed, re-plans at a step boundary
    with fewer micro-batches for replica 1, and the job ends DONE in epoch 1, whose speeds match its plan
    (no second re-plan)."""
    torch.set_num_threads(1)
    cfg = REBALANCE_CFG
    _replica_1_measures_3x_slower(monkeypatch)
    led: list[str] = []
    lead = JobRun._lead

    async def lead_and_note(self: JobRun, plan: Any, *, at: int | None, why: str) -> None:
        led.append(why)
        await lead(self, plan, at=at, why=why)

    monkeypatch.setattr(JobRun, "_lead", lead_and_note)

    async def main() -> tuple[list[ProgressEvent], BuiltJob]:
        with trio.fail_after(150):
            async with _swarm(2, tmp_path, jobs=REBALANCE_JOBS) as (_emb, pub, client):
                built = await _built(client, cfg, b"r")
                return await _publish(pub, built, tmp_path, lambda ev: None), built

    events, built = trio.run(main)
    plans, _ = _check_done(events, cfg)
    assert [p.epoch for p in plans] == [0, 1], led
    assert plans[0].stage_sizes == plans[1].stage_sizes == (2,) and plans[0].micro == ()
    assert len(led) == 1 and led[0].startswith("measured per micro-batch")
    assert len(plans[1].micro) == 2 and plans[1].micro[1] < plans[1].micro[0] and sum(plans[1].micro) == 8
    _check_download(tmp_path, built, cfg, events, 2)


def test_no_rebalance_when_the_steps_left_would_not_pay_for_the_halt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same job with the default ``replan_min_saving`` (30 s), its time left reported as an hour so that
    the leader weighs the re-balance: the better split would save well under a second over the steps
    left, so the leader keeps the plan and the job ends in epoch 0."""
    torch.set_num_threads(1)
    cfg = REBALANCE_CFG
    _replica_1_measures_3x_slower(monkeypatch)
    monkeypatch.setattr(StageWorker, "seconds_left", lambda self: 3600.0)
    judged: list[int] = []
    rebalance = JobRun._rebalance

    async def rebalance_and_note(self: JobRun, plan: Any) -> None:
        before = self._rebalance_judged
        await rebalance(self, plan)
        if self._rebalance_judged != before:
            judged.append(self._rebalance_judged)

    monkeypatch.setattr(JobRun, "_rebalance", rebalance_and_note)

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(150):
            async with _swarm(2, tmp_path, jobs=dataclasses.replace(REBALANCE_JOBS, replan_min_saving=30.0)) as (
                    _emb, pub, client):
                return await _publish(pub, await _built(client, cfg, b"s"), tmp_path, lambda ev: None)

    plans, _ = _check_done(trio.run(main), cfg)
    assert judged == [0] and [p.epoch for p in plans] == [0]


def test_the_next_job_is_planned_by_the_speeds_its_nodes_trained_at_in_the_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first job on two equal profiles deals its micro-batches evenly; its replica 1 measures 3x slower
    (re-balancing is off). When the job ends, each node announces the speed it trained at against its
    benchmark in its record, and the next job's first plan gives the slow node fewer micro-batches."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(REBALANCE_CFG, steps=6)
    _replica_1_measures_3x_slower(monkeypatch)

    async def main() -> tuple[list[ProgressEvent], list[ProgressEvent], dict[str, float]]:
        with trio.fail_after(200):
            async with _swarm(2, tmp_path, jobs=dataclasses.replace(REBALANCE_JOBS, rebalance_max=0)) as (
                    emb, pub, client):
                first = await _publish(pub, await _built(client, cfg, b"a"), tmp_path / "a", lambda ev: None)
                peers = [n.peer_id for n in emb.nodes]
                recs = emb.bootstrap.view.records
                await emb.bootstrap.wait_until(lambda: all(recs[p].speed > 0 for p in peers), timeout=30)
                speeds = {p: recs[p].speed for p in peers}
                second = await _publish(pub, await _built(client, cfg, b"b"), tmp_path / "b", lambda ev: None)
                return first, second, speeds

    first, second, speeds = trio.run(main)
    (plan1,), _ = _check_done(first, cfg)
    plans2, _ = _check_done(second, cfg)
    assert plan1.micro == ()
    fast, slow = plan1.members                       # stage 0's replicas 0 and 1
    assert speeds[slow] < 0.6 * speeds[fast], speeds
    plan2 = plans2[0]
    micro = dict(zip(plan2.members, plan2.micro, strict=True))
    assert micro[slow] < micro[fast] and sum(micro.values()) == 8, (plan2.members, plan2.micro)
