"""``TrainConfig.stages``: a job pins OP-Fence's stage count (issue 41: benchmarks.churn compared a calm run
planned 1 stage x 2 replicas with a churn run planned 2 x 2, then 1 x 2, so its goodput compared layouts).
The field's wire form (absent at its default: older signed specs keep their bytes), its validation, and
that the joint planner keeps to it, still choosing the best layout of that many stages."""

from __future__ import annotations

import pytest

from fusionp2p.errors import ConfigError
from fusionp2p.plan.config import PlannerConfig
from fusionp2p.plan.joint import plan_joint
from fusionp2p.plan.opfence import InfeasiblePlanError
from fusionp2p.train.config import TrainConfig
from fusionp2p.wire.msg import packb, unpackb
from tests.unit.test_plan_helpers import chain, snapshot


def test_stages_is_left_out_of_the_wire_at_its_default_and_round_trips() -> None:
    cfg = TrainConfig(steps=10)
    assert cfg.stages is None and "stages" not in cfg.to_wire()
    assert TrainConfig.from_wire(unpackb(packb(cfg.to_wire()))) == cfg
    pinned = TrainConfig(steps=10, replicas=2, stages=1)
    assert pinned.to_wire()["stages"] == 1
    assert TrainConfig.from_wire(unpackb(packb(pinned.to_wire()))) == pinned


def test_stages_user_errors() -> None:
    with pytest.raises(ConfigError, match="stages"):
        TrainConfig(steps=1, stages=0)
    with pytest.raises(ConfigError, match="leave stages=None"):
        TrainConfig(steps=1, stages=2, planner="even_layers", compression=None)


def test_the_planner_keeps_to_the_pinned_stage_count() -> None:
    wl, snap, pc = chain(8, act=40_000, params=200_000), snapshot(5), PlannerConfig(micro_batches=4)
    free = plan_joint(wl, snap, pc, replicas=2)
    for s in (1, 2):
        plan = plan_joint(wl, snap, pc, replicas=2, stages=s)
        assert len(plan.stages) == s
        assert plan.step_time_s >= free.step_time_s * (1 - 1e-9)   # the free choice is never worse
        assert all(c.stages == s for c in plan.considered)
    assert len(plan_joint(wl, snap, pc, replicas=2, stages=len(free.stages)).stages) == len(free.stages)


def test_a_stage_count_no_layout_fits_is_refused() -> None:
    with pytest.raises(InfeasiblePlanError, match="no layout of 9 stage"):
        plan_joint(chain(8, act=40_000, params=200_000), snapshot(3), PlannerConfig(micro_batches=4), stages=9)
