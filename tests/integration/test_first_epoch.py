"""Issue 40: a job's first epoch starts without a gossip election when the members agree with the publisher.

The publisher computes the plan from the snapshot it sends; its start request names the plan's hash, and
a member that computed the same hash adopts it at once (jobs/lead.py ``_fast_adopt``, the path re-plans
take with their leader's hash). Before, every member held a gossip election first: the demo's members
adopted 0.7-3.4 s after planning on an idle machine, 2-10 s apart under load, and the last one gated the
first step. Many nodes in one process (the embedded swarm, as in tests/integration/test_elastic.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import trio

from fusionp2p.jobs.events import PlanChanged, ProgressEvent
from fusionp2p.train.config import TrainConfig
from tests.integration.test_elastic import _built, _check_done, _publish, _swarm


def test_the_first_epoch_adopts_the_publishers_plan_without_an_election(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fusionp2p.jobs")
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=2, micro_batch=2, micro_batches=2, lr=3e-3, replicas=2)

    async def main() -> list[ProgressEvent]:
        with trio.fail_after(60):
            async with _swarm(2, tmp_path) as (_, pub, client):
                return await _publish(pub, await _built(client, cfg, b"f"), tmp_path, lambda ev: None)

    events = trio.run(main)
    plans, _ = _check_done(events, cfg)
    first = next(e for e in plans if isinstance(e, PlanChanged))
    members = set(first.members)
    assert len(members) == 2
    fast = [r.getMessage() for r in caplog.records if "adopted as its starter" in r.getMessage()]
    # every member, in epoch 0, the publisher's plan
    assert len(fast) == len(members) and all(f"epoch 0: plan {first.plan_hash[:12]}" in m for m in fast), fast
    assert not [r for r in caplog.records if "members disagree" in r.getMessage()]
