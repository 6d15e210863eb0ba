"""`job attach` of a job carried on by a standby after the plan's only member and the publisher died (the heavy
real-process test's case when the planner puts the model on one node): the attaching publisher learns the
standbys from the status record (its leader names them; before, only from the epoch's plan record, whose voters
were often the standbys alone, so the attach knew only the dead member and failed "no progress from the swarm"
under load), believes the standby's re-plan and status, and follows the job to DONE."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from fusionp2p.jobs.build import BuiltJob
from fusionp2p.jobs.events import JobStateChanged, PlanChanged, ProgressEvent, StepProgress
from fusionp2p.net.identity import Identity
from fusionp2p.train.config import TrainConfig
from tests.integration.test_elastic import (
    _attach_elsewhere,
    _built,
    _check_download,
    _node,
    _plan_highest_alone,
    _swarm,
)


@pytest.mark.slow
def test_the_only_member_and_the_publisher_die_and_an_attach_follows_the_standby(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=24, micro_batch=2, micro_batches=2, lr=3e-3, replicas=1, averaging="none",
                      compression="none", checkpoint_every=4, seed=7)
    _plan_highest_alone(monkeypatch)   # the others are standbys
    key = Identity.generate()
    killed: list[str] = []

    async def main() -> tuple[list[ProgressEvent], BuiltJob]:
        with trio.fail_after(150):
            async with _swarm(3, tmp_path, identity=key) as (emb, pub, client):
                built = await _built(client, cfg, b"a")
                with trio.CancelScope() as gone:
                    def emit(ev: ProgressEvent) -> None:
                        if isinstance(ev, PlanChanged) and ev.epoch == 0:
                            assert len(ev.members) == 1
                        if isinstance(ev, StepProgress) and ev.step == 6 and not killed:
                            killed.append(max(n.peer_id for n in emb.nodes))
                            emb.kill(_node(emb, killed[0]))   # the plan's only member, without a goodbye
                            emb.net.kill(client.peer_id)      # and the publisher's process
                            gone.cancel()

                    await pub.run_job(built, emit, tmp_path / "first")
                # at once, before the standbys re-plan: the job's status still names only the dead member
                later = await _attach_elsewhere(emb, key, built, tmp_path / "checkpoints")
                return later, built

    later, built = trio.run(main)
    states = [e for e in later if isinstance(e, JobStateChanged)]
    assert states[-1].state == "done", states
    plans = [e for e in later if isinstance(e, PlanChanged)]
    assert plans and plans[-1].epoch >= 1 and killed[0] not in plans[-1].members, plans
    _check_download(tmp_path, built, cfg, later, 1)
