"""The leader's exclusion of replicas that the other replicas of their stage call outliers (jobs/suspects.py)."""

from __future__ import annotations

from fusionp2p.jobs.events import AveragingOutlier, StepProgress
from fusionp2p.jobs.suspects import Suspects
from fusionp2p.plan.plan import Fence, Plan, Stage


def _plan(replicas: tuple[str, ...]) -> Plan:
    return Plan(job="j", epoch=0, snapshot_hash="s", algorithm="even-layers", seed=0, n_units=2, micro_batches=1,
                stages=(Stage(start=0, end=1, replicas=replicas), Stage(start=1, end=2, replicas=("x", "y", "z", "w"))),
                fences=(Fence(index=0, unit=1, dense_bytes=1.0, rho=1.0),))


def _ev(peer: str, suspect: str) -> AveragingOutlier:
    return AveragingOutlier(job="j", step=3, stage=0, peer=peer, suspect=suspect)


def test_a_majority_of_the_other_replicas_excludes() -> None:
    plan, s = _plan(("a", "b", "c", "d")), Suspects()
    assert not s.report("a", _ev("a", "d"), plan)      # 1 of 3 others
    assert not s.report("a", _ev("a", "d"), plan)      # the same reporter twice counts once
    assert s.report("b", _ev("b", "d"), plan)          # 2 of 3
    assert s.excluded == {"d"}
    assert not s.report("c", _ev("c", "d"), plan)      # excluded once


def test_reports_that_are_not_evidence_are_ignored() -> None:
    plan, s = _plan(("a", "b", "c")), Suspects()
    assert not s.report("a", _ev("b", "c"), plan)      # a sender speaking for another reporter
    assert not s.report("x", _ev("x", "c"), plan)      # a replica of another stage
    assert not s.report("c", _ev("c", "c"), plan)      # itself
    assert not s.report("a", _ev("a", "c"), None)      # no plan in force
    s.observe("a", StepProgress(job="j", step=1), plan)   # other events: nothing
    assert s.reports == {} and s.excluded == set()
    # with three replicas both others must say so: one liar cannot exclude an honest replica
    assert not s.report("a", _ev("a", "c"), plan)
    assert s.report("b", _ev("b", "c"), plan)


def test_two_replicas_cannot_exclude_each_other() -> None:
    plan, s = _plan(("a", "b")), Suspects()
    assert not s.report("a", _ev("a", "b"), plan)
    assert s.excluded == set()


def test_own_reports_count_and_come_back_as_events() -> None:
    plan, s = _plan(("a", "b", "c", "d")), Suspects()
    out = s.mine("j", 5, 0, "a", ("d",), plan)
    assert [(e.peer, e.suspect, e.step) for e in out] == [("a", "d", 5)]
    s.observe("b", _ev("b", "d"), plan)
    assert s.excluded == {"d"}
