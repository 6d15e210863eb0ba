"""Which plans the publisher's driver believes (jobs/publisher.py, issue 41): a plan event only from a member
it knows; a stranger's makes it read the plan record instead; a known member vouches for the joiners it took
in (``MembersChanged``), a stranger for no one; steps of an epoch it has no plan for make it read the record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from fusionp2p.jobs.events import MembersChanged, PlanChanged, ProgressEvent, StepProgress
from fusionp2p.jobs.publisher import JobDriver


def _driver(events: list[ProgressEvent], home: Path) -> JobDriver:
    none: Any = None   # _on_progress touches neither the transport nor the content service
    d = JobDriver(none, none, [], None, events.append, home, job="j", steps=10)
    d.members, d.epoch = {"a", "b"}, 0
    return d


def test_a_member_vouches_for_its_joiners_and_a_strangers_plan_is_read_from_the_record(tmp_path: Path) -> None:
    async def main() -> None:
        events: list[ProgressEvent] = []
        d = _driver(events, tmp_path)
        plan = PlanChanged(job="j", epoch=1, plan_hash="h", stage_sizes=(1,), members=("j1",), idle=("a",))
        d._on_progress("j1", plan)                     # a stranger's plan: not believed
        assert d.epoch == 0 and plan not in events and d._behind == 1
        d._on_progress("x", MembersChanged(job="j", epoch=0, joined=("x2",)))
        assert "x2" not in d.members                   # a stranger vouches for no one
        d._on_progress("a", MembersChanged(job="j", epoch=0, joined=("j1",)))
        d._on_progress("j1", plan)
        assert d.epoch == 1 and plan in events and {"j1", "a"} <= d.members

    trio.run(main)


def test_steps_of_an_epoch_without_its_plan_make_the_driver_read_the_record(tmp_path: Path) -> None:
    async def main() -> None:
        d = _driver([], tmp_path)
        d._on_progress("b", StepProgress(job="j", step=3, epoch=0, stage=0, peer="b", loss=1.0))
        assert d._behind == -1                         # the plan it knows
        t0 = trio.current_time()
        d._on_progress("b", StepProgress(job="j", step=4, epoch=2, stage=0, peer="b", loss=1.0))
        assert d._behind == 2 and d._next_pull >= t0 + 1.0   # a second for the plan event to come first

    trio.run(main)
