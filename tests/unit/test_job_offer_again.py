"""A node offered a job it runs already answers at once (no fetch, no check of the content again)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.jobs.node import NodeJobConfig, NodeJobService
from fusionp2p.testing.swarm import TEST_PROFILE


def _service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, epoch: int, state: JobState
             ) -> tuple[NodeJobService, list[str]]:
    svc = NodeJobService(SimpleNamespace(transport=None, profile=TEST_PROFILE), tmp_path, NodeJobConfig())  # type: ignore[arg-type]
    svc.jobs["j1"] = SimpleNamespace(  # type: ignore[assignment]
        job_id="j1", epoch=epoch, state=state, accepted=SimpleNamespace(envelope=b"signed spec of j1"),
        offered_by=None, publisher="publisher")
    intakes: list[str] = []

    async def intake(peer: str, envelope: bytes, via: str | None, owner: str) -> dict[str, Any]:
        intakes.append(peer)     # the whole path: fetch the content, decode and check it
        return {"ok": True, "job": "j1"}

    monkeypatch.setattr(svc, "_intake", intake)
    monkeypatch.setattr(svc, "_slots_used", lambda: 0)
    return svc, intakes


def test_a_standby_offered_its_running_job_again_says_yes_without_an_intake(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41: after every re-plan its leader offered the job again to every standby (three a kill in
    benchmarks.churn), and each fetched, decoded and checked the job's content again (0.15 CPU-s)."""
    svc, intakes = _service(tmp_path, monkeypatch, epoch=2, state=JobState.RUNNING)
    # with its profile, as every accept (a publisher that found none in its record plans with it)
    assert trio.run(svc._offer, "leader", b"signed spec of j1", "j1") == {"ok": True, "job": "j1",
                                                                         "profile": TEST_PROFILE.to_wire()}
    assert intakes == []
    trio.run(svc._offer, "leader", b"signed spec of another job", None)   # another envelope: the whole path
    assert intakes == ["leader"]


@pytest.mark.parametrize(("epoch", "state"), [(-1, JobState.PENDING), (3, JobState.DONE)])
def test_a_job_not_started_or_ended_takes_the_whole_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         epoch: int, state: JobState) -> None:
    """Not started: the offerer must be checked (a member's offer names who may start it); ended: a new run."""
    svc, intakes = _service(tmp_path, monkeypatch, epoch=epoch, state=state)
    trio.run(svc._offer, "leader", b"signed spec of j1", "j1")
    assert intakes == ["leader"]
