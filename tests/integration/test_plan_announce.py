"""Every epoch's plan reaches the publisher (issue 41): the plan event comes from a member the publisher
knows, and when it does not come (its announcer died, the gossip dropped it) the publisher reads the
epoch's plan from the job's plan record as soon as that epoch's steps arrive.

The case the churn benchmark hit (three runs of three): a re-plan that gives every role to nodes that
joined since the last plan and leaves the old members standing by. The old rule had the lowest role
holder announce, a joiner the publisher had never heard of, whose event it then ignored: the publisher
went on believing the old plan for the rest of the epoch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import trio

from fusionp2p.jobs.events import PlanChanged, ProgressEvent, StepProgress
from fusionp2p.jobs.run import JobRun
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.train.config import TrainConfig
from fusionp2p.train.worker import StageWorker
from tests.integration.test_elastic import _built, _check_done, _node, _publish, _swarm

FAST = dataclasses.replace(TEST_PROFILE, flops_fp32=TEST_PROFILE.flops_fp32 * 50)   # the joiner: the plan is it alone


@pytest.mark.parametrize("announcement", ["sent", "lost"])
def test_a_plan_of_joiners_only_reaches_the_publisher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      announcement: str) -> None:
    """Two nodes train the job in two stages; a node 50x as fast joins and stands by (a plan with it alone
    would only swap it for the members). Then a member dies: the re-plan gives the joiner the only role
    and leaves the survivor standing by, so no role holder of epoch 1 is one the publisher knows. With the
    announcement *sent*, the standby (epoch 0's member) announces it; with it *lost* (every re-plan's plan
    event dropped on its way out), the publisher reads it from the plan record. Either way the publisher
    emits epoch 1's plan, naming the joiner."""
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=30, micro_batch=2, micro_batches=2, lr=3e-3, replicas=1, averaging="none",
                      compression="none", checkpoint_every=0, seed=3)
    joined: list[str] = []
    killed: list[str] = []
    accepted = trio.Event()
    offer_to, train_step, gossip = JobRun._offer_to, StageWorker._train_step, JobRun._gossip

    async def offer_and_note(self: JobRun, peer: str) -> None:
        await offer_to(self, peer)
        if peer in self.joiners:
            accepted.set()

    async def step_or_wait(self: StageWorker, step: int) -> tuple[float, float]:
        if step == 8:   # the job trains faster than a node joins: epoch 0 waits for the joiner here
            with trio.fail_after(60):
                await accepted.wait()
        return await train_step(self, step)

    async def gossip_or_drop(self: JobRun, ev: ProgressEvent) -> None:
        if not (isinstance(ev, PlanChanged) and ev.epoch > 0):
            await gossip(self, ev)

    monkeypatch.setattr(JobRun, "_offer_to", offer_and_note)
    monkeypatch.setattr(StageWorker, "_train_step", step_or_wait)
    if announcement == "lost":
        monkeypatch.setattr(JobRun, "_gossip", gossip_or_drop)

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(120):
            async with _swarm(2, tmp_path) as (emb, pub, client), trio.open_nursery() as nursery:
                async def join() -> None:
                    joined.append((await emb.add_node(FAST)).peer_id)

                def on_event(ev: ProgressEvent) -> None:
                    if isinstance(ev, PlanChanged) and ev.epoch == 0 and not killed:
                        killed.append(max(ev.members))   # not the leader, which took the joiner in
                    if isinstance(ev, StepProgress) and ev.step == 2 and not joined:
                        joined.append("")
                        nursery.start_soon(join)
                    if isinstance(ev, StepProgress) and ev.step == 10 and len(killed) == 1:
                        killed.append("")
                        emb.kill(_node(emb, killed[0]))

                return await _publish(pub, await _built(client, cfg, b"a"), tmp_path, on_event)

    events = trio.run(main)
    plans, _ = _check_done(events, cfg)
    assert [p.epoch for p in plans] == [0, 1], plans
    first = plans[0].members
    assert len(first) == 2 and plans[1].members == (joined[-1],)   # every role went to the joiner
    if announcement == "sent":
        survivor = tuple(p for p in first if p != killed[0])
        assert plans[1].idle == survivor               # announced by the standby, which it lists as idle
