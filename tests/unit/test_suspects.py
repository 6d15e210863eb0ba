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


def test_the_allow_list_admits_listed_nodes_only() -> None:
    s = Suspects(("a", "b"))
    assert s.admits("a") and not s.admits("z")
    assert s.unlisted(["a", "z", "b", "y"]) == ["y", "z"]
    open_ = Suspects()
    assert open_.admits("z") and open_.unlisted(["z"]) == []
    open_.excluded.add("z")
    assert not open_.admits("z")


def test_train_config_allow_members_validated_and_off_the_wire_by_default() -> None:
    import pytest

    from fusionp2p.errors import ConfigError
    from fusionp2p.train.config import TrainConfig

    assert "allow_members" not in TrainConfig(steps=2).to_wire()   # older specs keep their bytes
    cfg = TrainConfig(steps=2, allow_members=["12D3KooWa", "12D3KooWb"])   # type: ignore[arg-type]
    assert cfg.allow_members == ("12D3KooWa", "12D3KooWb")
    assert TrainConfig.from_wire(cfg.to_wire()) == cfg
    for bad in ("12D3KooWa", ("a", "a"), ("",), (3,)):
        with pytest.raises(ConfigError, match="allow_members"):
            TrainConfig(steps=2, allow_members=bad)   # type: ignore[arg-type]
