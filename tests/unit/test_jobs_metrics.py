"""Progress events: gossip encoding with bounds, JSON-lines log."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs.events import (
    CheckpointSaved,
    EvalProgress,
    JobStateChanged,
    MembersChanged,
    MetricsWriter,
    PlanChanged,
    StepProgress,
    decode_event,
    encode_event,
    event_to_dict,
    read_metrics,
)
from fusionp2p.wire.msg import packb

EVENTS = [
    StepProgress(job="j", step=3, epoch=1, stage=1, peer="p", loss=2.5, tokens_per_s=1234.0, compute_util=0.7, link_util=0.2, at=1.0),
    StepProgress(job="j", step=4),
    PlanChanged(job="j", epoch=2, plan_hash="h", stage_sizes=(2, 2), members=("a", "b", "c", "d"), at=2.0),
    PlanChanged(job="j", epoch=0, plan_hash="h", stage_sizes=(2, 2), members=("a", "b", "c", "d"), rho=(0.05,),
                link_bps=(2e6,), fence_s=(0.03,), dense_s=(0.5,), step_s=1.5, how="stage-major"),
    MembersChanged(job="j", epoch=2, joined=("e",), left=("a",)),
    JobStateChanged(job="j", state="running", reason="plan adopted"),
    CheckpointSaved(job="j", step=100, stage=0, peer="a"),
]


@pytest.mark.parametrize("ev", EVENTS, ids=lambda e: type(e).__name__)
def test_round_trip(ev: object) -> None:
    assert decode_event(encode_event(ev)) == ev  # type: ignore[arg-type]


def test_nan_loss_survives_but_other_nans_do_not() -> None:
    ev = decode_event(encode_event(StepProgress(job="j", step=1, loss=math.nan)))
    assert isinstance(ev, StepProgress)
    assert ev.loss is not None
    assert math.isnan(ev.loss)
    with pytest.raises(RemoteProtocolError):
        decode_event(packb({"type": "step", "job": "j", "step": 1, "tokens_per_s": math.nan}))


def test_earlier_steps_travel_only_when_there_are_some_and_are_bounded() -> None:
    """StepProgress.earlier (several steps in one gossip message): left out of the map when empty (the
    bytes of a one-step report, and its signature, are those of before), a NaN loss among them is news,
    and a peer may send at most MAX_EARLIER of them."""
    from fusionp2p.jobs.events import MAX_EARLIER, expand_steps

    assert "earlier" not in event_to_dict(StepProgress(job="j", step=3, loss=1.0))
    ev = StepProgress(job="j", step=3, peer="p", loss=4.0, earlier=(1.0, math.nan, 3.0))
    back = decode_event(encode_event(ev))
    assert isinstance(back, StepProgress) and back.earlier[0] == 1.0 and math.isnan(back.earlier[1])
    assert [(e.step, e.earlier) for e in expand_steps(back)] == [(0, ()), (1, ()), (2, ()), (3, ())]
    assert [e.step for e in expand_steps(StepProgress(job="j", step=1, loss=2.0, earlier=(0.5, 1.0)))] == [0, 1]
    with pytest.raises(RemoteProtocolError):
        decode_event(packb({"type": "step", "job": "j", "step": 999, "earlier": [1.0] * (MAX_EARLIER + 1)}))


def test_a_diverged_held_out_loss_is_news_not_an_attack() -> None:
    """Regression (issue 15, fuzzing the issue-18 events): EvalProgress's loss was a plain float, so the
    NaN or inf held-out loss of diverged weights, gossiped by jobs/run.py, was refused as a protocol
    error by every receiver (the publisher counted it against the sender and lost the news)."""
    for bad in (math.nan, math.inf):
        ev = decode_event(encode_event(EvalProgress(job="j", step=10, loss=bad)))
        assert isinstance(ev, EvalProgress)
        assert not math.isfinite(ev.loss)
    with pytest.raises(RemoteProtocolError):   # the other floats stay finite
        decode_event(packb({"type": "eval", "job": "j", "step": 1, "at": math.nan}))


@pytest.mark.parametrize(
    "msg",
    [
        {"type": "nope", "job": "j"},
        {"type": "step", "job": "j"},                            # missing step
        {"type": "step", "job": "j", "step": "1"},
        {"type": "step", "job": "j", "step": True},
        {"type": "step", "job": "j", "step": 1, "evil": 1},
        {"type": "plan", "job": "j", "epoch": 1, "plan_hash": "h", "members": [1]},
        {"type": "plan", "job": "j", "epoch": 1, "plan_hash": "h", "stage_sizes": ["x"]},
        {"type": "plan", "job": "j", "epoch": 1, "plan_hash": "h", "rho": [math.nan]},
        {"type": "plan", "job": "j", "epoch": 1, "plan_hash": "h", "link_bps": ["1"]},
        {"type": "plan", "job": "j", "epoch": 1, "plan_hash": "h", "fence_s": [True]},
        [1, 2],
    ],
)
def test_malformed_events(msg: object) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_event(packb(msg))


def test_plan_event_says_per_fence_what_was_chosen() -> None:
    from fusionp2p.plan import PlannerConfig, plan_joint
    from tests.unit.test_plan_helpers import chain, snapshot

    snap = snapshot(4, bw=lambda a, b: 1.25e9 if (a < 2) == (b < 2) else 2e6)
    plan = plan_joint(chain(8, act=4_000_000, params=20_000_000), snap, PlannerConfig(micro_batches=4, co2_tau=4),
                      replicas=2)
    ev = PlanChanged.of(plan, at=1.0)
    assert decode_event(encode_event(ev)) == ev
    assert ev.rho == tuple(f.rho for f in plan.fences) and min(ev.rho) < 1.0
    assert ev.stage_sizes == (2,) * len(plan.stages) and ev.how == plan.how
    text = ev.describe()
    assert "AdaTopK keeps" in text and "4.0 MB/s" in text


def test_oversized_event() -> None:
    with pytest.raises(RemoteProtocolError):
        decode_event(packb({"type": "members", "job": "j", "epoch": 1, "joined": ["x" * 200] * 400}))


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode_event(data)


def test_jsonl_writer(tmp_path: Path) -> None:
    path = tmp_path / "m" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        for ev in EVENTS:
            w.write(ev)
        w.write({"custom": 1})
    with path.open("a") as f:
        f.write('{"torn": ')  # a crash mid-line
    rows = read_metrics(path)
    assert rows == [event_to_dict(e) for e in EVENTS] + [{"custom": 1}]
    with MetricsWriter(path) as w:  # appends
        w.write(EVENTS[1])
    with pytest.raises(ValueError, match="closed"):
        w.write(EVENTS[1])
