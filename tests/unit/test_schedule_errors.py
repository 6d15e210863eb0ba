"""Rejections of the pipeline schedule: peer mistakes are RemoteProtocolError, shell misuse Local."""

from __future__ import annotations

import pytest

from fusionp2p.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from fusionp2p.train.schedule import (
    ActivationArrived,
    BackwardDone,
    ForwardDone,
    GradientArrived,
    OptimizerDone,
    RunBackward,
    RunForward,
    ScheduleConfig,
    SendActivation,
    StageSchedule,
)


def make(stage: int, kind: str = "1f1b", stages: int = 3, micro: int = 4) -> StageSchedule:
    s = StageSchedule(ScheduleConfig(kind=kind, stages=stages, micro_batches=micro, stage=stage))
    s.start()
    return s


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="schedule must be"):
        ScheduleConfig(kind="zb", stages=2, micro_batches=2, stage=0)
    with pytest.raises(ConfigError, match="outside"):
        ScheduleConfig(kind="gpipe", stages=2, micro_batches=2, stage=2)
    with pytest.raises(ConfigError):
        ScheduleConfig(kind="gpipe", stages=0, micro_batches=2, stage=0)
    assert ScheduleConfig(kind="1f1b", stages=4, micro_batches=2, stage=0).in_flight_limit == 2
    assert ScheduleConfig(kind="1f1b", stages=4, micro_batches=8, stage=1, max_in_flight=1).in_flight_limit == 1


@pytest.mark.parametrize("micro", [-1, 4, 99, True])
def test_out_of_range_micro_from_peer(micro: int) -> None:
    with pytest.raises(RemoteProtocolError):
        make(1).handle(ActivationArrived(micro))


def test_duplicate_activation_and_early_gradient() -> None:
    s = make(1)
    assert s.handle(ActivationArrived(0)) == [RunForward(0)]
    with pytest.raises(RemoteProtocolError, match="duplicate"):
        s.handle(ActivationArrived(0))
    with pytest.raises(RemoteProtocolError, match="unexpected gradient"):
        s.handle(GradientArrived(0))  # forward of 0 not finished yet
    assert s.handle(ForwardDone(0)) == [SendActivation(0)]
    assert s.handle(GradientArrived(0)) == [RunBackward(0)]


def test_wrong_direction_messages() -> None:
    with pytest.raises(RemoteProtocolError, match="stage 0"):
        make(0).handle(ActivationArrived(0))
    with pytest.raises(RemoteProtocolError, match="last stage"):
        make(2).handle(GradientArrived(0))


def test_shell_misuse_is_local() -> None:
    s = make(0)  # stage 0 started RunForward(0)
    with pytest.raises(LocalProtocolError):
        s.handle(ForwardDone(1))
    with pytest.raises(LocalProtocolError):
        s.handle(BackwardDone(0))
    with pytest.raises(LocalProtocolError):
        s.handle(OptimizerDone())
    with pytest.raises(LocalProtocolError):
        s.start()
    fresh = StageSchedule(ScheduleConfig(kind="gpipe", stages=1, micro_batches=1, stage=0))
    with pytest.raises(LocalProtocolError):
        fresh.handle(ForwardDone(0))


def test_single_stage_runs_forward_backward_then_optimizer() -> None:
    s = StageSchedule(ScheduleConfig(kind="gpipe", stages=1, micro_batches=2, stage=0))
    acts = s.start()
    trace = [acts]
    trace.extend(s.handle(ev) for ev in (ForwardDone(0), ForwardDone(1), BackwardDone(0), BackwardDone(1), OptimizerDone()))
    names = [type(a).__name__ + str(getattr(a, "micro", "")) for step in trace for a in step]
    assert names == ["RunForward0", "RunForward1", "RunBackward0", "RunBackward1", "OptimizerStep"]
    assert s.done
    with pytest.raises(RemoteProtocolError):
        s.handle(GradientArrived(0))
