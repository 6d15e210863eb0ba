"""The job lifecycle table: every legal path works, every other transition raises and changes nothing."""

from __future__ import annotations

import itertools

import pytest

from fusionp2p.errors import LocalProtocolError
from fusionp2p.jobs.lifecycle import TRANSITIONS, IllegalTransition, JobLifecycle, JobState

S = JobState
LEGAL = {
    (S.PENDING, S.PLANNED), (S.PENDING, S.FAILED), (S.PENDING, S.CANCELLED),
    (S.PLANNED, S.RUNNING), (S.PLANNED, S.PLANNED), (S.PLANNED, S.FAILED), (S.PLANNED, S.CANCELLED),
    (S.RUNNING, S.DONE), (S.RUNNING, S.PLANNED), (S.RUNNING, S.FAILED), (S.RUNNING, S.CANCELLED),
}


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(JobState, JobState)))
def test_table_matches_the_design(src: JobState, dst: JobState) -> None:
    lc = JobLifecycle("j", now=0.0, state=src)
    if (src, dst) in LEGAL:
        t = lc.to(dst, now=1.0, reason="x")
        assert (t.src, t.dst, lc.state) == (src, dst, dst)
    else:
        with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
            lc.to(dst, now=1.0)
        assert lc.state is src
        assert len(lc.history) == 1


def test_terminal_states_and_error_class() -> None:
    assert {s for s in JobState if s.terminal} == {S.DONE, S.FAILED, S.CANCELLED}
    assert set(TRANSITIONS) == set(JobState)
    assert issubclass(IllegalTransition, LocalProtocolError)


def test_happy_path_with_replan_counts_epochs_and_keeps_history() -> None:
    lc = JobLifecycle("job1", now=10.0)
    for i, (dst, why) in enumerate([(S.PLANNED, "plan"), (S.RUNNING, ""), (S.PLANNED, "node left"), (S.RUNNING, ""), (S.DONE, "")]):
        lc.to(dst, now=11.0 + i, reason=why)
    assert lc.epoch == 2
    assert lc.terminal
    assert [t.dst for t in lc.history] == [S.PENDING, S.PLANNED, S.RUNNING, S.PLANNED, S.RUNNING, S.DONE]
    assert [t.at for t in lc.history] == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    assert lc.history[3].reason == "node left"
    assert not lc.can(S.RUNNING)
