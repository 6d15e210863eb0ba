"""LossCurves: loss curves from gossip, bounded in jobs and points, refusing what does not verify."""

from __future__ import annotations

import itertools

from fusionp2p.jobs.events import CheckpointSaved, StepProgress, encode_event
from fusionp2p.net.refusals import Refusals
from fusionp2p.net.transport import GossipMessage
from fusionp2p.ops.curves import LossCurves
from fusionp2p.wire.protocols import TOPIC_JOBS


def msg(ev: StepProgress | CheckpointSaved, sender: str = "p") -> GossipMessage:
    return GossipMessage(TOPIC_JOBS, sender, encode_event(ev))


def step(job: str, i: int, loss: float | None = 1.0, peer: str = "p", epoch: int = 0) -> StepProgress:
    return StepProgress(job=job, step=i, epoch=epoch, peer=peer, loss=loss, tokens_per_s=100.0 + i, compute_util=0.5)


def test_curve_follows_the_steps_and_keeps_the_latest() -> None:
    book = LossCurves()
    for i in range(5):
        book.on_gossip(msg(step("j", i, loss=5.0 - i)), now=float(i))
    book.on_gossip(msg(step("j", 3, loss=9.0)), now=6.0)       # a late duplicate (gossip reorders): ignored
    book.on_gossip(msg(CheckpointSaved(job="j", step=4, stage=0, peer="p")), now=7.0)
    c = book.jobs["j"]
    assert c.points == [(0, 5.0), (1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)]
    assert (c.step, c.loss, c.tokens_per_s, c.checkpoint_step) == (4, 1.0, 104.0, 4)
    out = c.to_json(now=10.0)
    assert out["curve"][-1] == [4, 1.0] and out["age_s"] == 3.0


def test_a_replan_that_goes_back_cuts_the_curve() -> None:
    book = LossCurves()
    for i in range(6):
        book.on_gossip(msg(step("j", i, loss=10.0 - i)), now=0.0)
    book.on_gossip(msg(step("j", 3, loss=7.5, epoch=1)), now=1.0)      # resumed from the step-3 checkpoint
    book.on_gossip(msg(step("j", 5, loss=99.0, epoch=0)), now=1.0)     # a late report of the old epoch
    c = book.jobs["j"]
    assert c.points == [(0, 10.0), (1, 9.0), (2, 8.0), (3, 7.5)]
    assert (c.step, c.loss, c.epoch) == (3, 7.5, 1)


def test_a_long_curve_stays_bounded_and_evenly_sampled() -> None:
    book = LossCurves(max_points=64)
    for i in range(10_000):
        book.on_gossip(msg(step("j", i, loss=float(i))), now=0.0)
    pts = book.jobs["j"].points
    assert len(pts) <= 64
    steps = [s for s, _ in pts]
    gaps = {b - a for a, b in itertools.pairwise(steps)}
    assert len(gaps) == 1 and steps[0] == 0 and steps[-1] > 9_000   # one stride over the whole run


def test_jobs_are_bounded_the_stalest_forgotten() -> None:
    book = LossCurves(max_jobs=3)
    for k in range(5):
        book.on_gossip(msg(step(f"j{k}", 0)), now=float(k))
    assert sorted(book.jobs) == ["j2", "j3", "j4"]


def test_bad_and_spoofed_messages_are_refused_not_raised() -> None:
    refusals = Refusals()
    book = LossCurves(refusals=refusals)
    book.on_gossip(GossipMessage(TOPIC_JOBS, "mallory", b"\xc1not msgpack"), now=0.0)
    book.on_gossip(msg(step("j", 0, peer="alice"), sender="mallory"), now=0.0)   # claims to be alice
    assert book.jobs == {}
    assert refusals.by_reason == {"jobs/progress-decode": 1, "jobs/progress-sender": 1}
    assert refusals.by_peer[("mallory", "jobs/progress-sender")] == 1


def test_plan_votes_on_the_jobs_topic_are_not_refused_as_bad_progress() -> None:
    """A normal job's plan votes share the jobs topic; they once counted as jobs/progress-decode refusals."""
    from fusionp2p.jobs.election import Vote

    refusals = Refusals()
    book = LossCurves(refusals=refusals)
    vote = Vote.make(job="j", epoch=0, plan_hash="ab" * 32, snapshot_hash="cd" * 32, peer="alice",
                     sign=lambda b: b"sig")
    book.on_gossip(GossipMessage(TOPIC_JOBS, "alice", vote.encode()), now=0.0)
    assert refusals.by_reason == {} and book.jobs == {}


def test_nan_loss_is_shown_as_missing() -> None:
    book = LossCurves()
    book.on_gossip(msg(step("j", 0, loss=float("nan"))), now=0.0)
    out = book.jobs["j"].to_json(now=0.0)
    assert out["loss"] is None and out["curve"] == [[0, None]]


def test_held_out_loss_rides_along() -> None:
    from fusionp2p.jobs.events import EvalProgress

    book = LossCurves()
    book.on_gossip(msg(step("j", 0)), now=0.0)
    book.on_gossip(GossipMessage(TOPIC_JOBS, "p", encode_event(EvalProgress(job="j", step=2, peer="p", loss=3.5))), now=1.0)
    book.on_gossip(GossipMessage(TOPIC_JOBS, "q", encode_event(EvalProgress(job="j", step=2, peer="q", loss=3.6))), now=1.0)
    book.on_gossip(GossipMessage(TOPIC_JOBS, "q", encode_event(EvalProgress(job="j", step=4, peer="p", loss=1.0))), now=1.0)
    out = book.jobs["j"].to_json(now=2.0)
    assert (out["eval_step"], out["eval_loss"]) == (2, 3.5)   # first report of a step; a spoofed one refused
