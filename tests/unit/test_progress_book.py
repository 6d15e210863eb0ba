"""The publisher's per-step aggregation of the loss replicas' reports (jobs/progress.py)."""

from fusionp2p.jobs.events import StepProgress
from fusionp2p.jobs.progress import ProgressBook


def _rep(peer: str, step: int, epoch: int, loss: float) -> StepProgress:
    return StepProgress(job="j", step=step, epoch=epoch, stage=0, peer=peer, loss=loss)


def test_a_step_is_emitted_once_every_replica_reported_with_their_mean() -> None:
    book = ProgressBook(job="j", steps=10)
    book.set_plan(0, 0, ["a", "b"])
    assert book.add("a", _rep("a", 0, 0, 1.0), now=0.0) == []
    (ev,) = book.add("b", _rep("b", 0, 0, 3.0), now=0.0)
    assert (ev.step, ev.loss) == (0, 2.0)


def test_a_step_of_the_old_plan_heard_after_the_replan_is_kept() -> None:
    # CI, 2026-11-27: the survivor of a killed replica trained steps 64-73 alone; their reports arrived after the
    # new plan (resumed from its live state at 74) and were dropped, so the job's curve lost ten steps
    book = ProgressBook(job="j", steps=10)
    book.set_plan(0, 0, ["a", "b"])
    book.add("a", _rep("a", 0, 0, 1.0), now=0.0)
    book.add("b", _rep("b", 0, 0, 1.0), now=0.0)
    book.set_plan(1, 0, ["a", "c"])
    assert book.add("a", _rep("a", 1, 0, 2.0), now=0.0) == []
    book.add("a", _rep("a", 2, 1, 3.0), now=0.0)
    out = book.add("c", _rep("c", 2, 1, 5.0), now=0.0)
    assert [(e.step, e.epoch, e.loss) for e in out] == [(1, 0, 2.0), (2, 1, 4.0)]
    assert book.add("b", _rep("b", 1, 0, 9.0), now=0.0) == []      # emitted already: the curve does not move


def test_a_step_trained_again_by_the_new_plan_replaces_the_old_reports() -> None:
    book = ProgressBook(job="j", steps=10)
    book.set_plan(1, 0, ["a", "c"])
    book.add("a", _rep("a", 3, 0, 7.0), now=0.0)          # late, from epoch 0
    book.add("a", _rep("a", 3, 1, 1.0), now=0.0)
    (ev,) = book.add("c", _rep("c", 3, 1, 3.0), now=0.0)
    assert (ev.epoch, ev.loss) == (1, 2.0)
    assert book.add("b", _rep("b", 3, 0, 9.0), now=0.0) == []


def test_old_reports_still_pending_are_emitted_at_the_end() -> None:
    book = ProgressBook(job="j", steps=10)
    book.set_plan(1, 0, ["a", "c"])
    book.add("a", _rep("a", 9, 0, 2.0), now=0.0)
    assert [(e.step, e.loss) for e in book.flush(now=0.0)] == [(9, 2.0)]


def test_a_step_only_the_final_report_carries_keeps_the_epoch_that_trained_it() -> None:
    # full suite, 2026-11-27: step 2's gossip was lost, the final report filled it in labelled with the
    # new plan's epoch, and the re-plan looked as if it had resumed at step 2, before its checkpoint at 4
    book = ProgressBook(job="j", steps=8)
    book.set_plan(0, 0, ["a"])
    for step in (0, 1, 3, 4, 5):
        book.add("a", _rep("a", step, 0, 1.0), now=0.0)
    book.set_plan(1, 0, ["b"])
    book.add("b", _rep("b", 4, 1, 2.0), now=0.0)
    book.add("b", _rep("b", 5, 1, 2.0), now=0.0)
    out = book.fill({s: [3.0] for s in range(8)}, now=0.0)
    assert [(e.step, e.epoch) for e in out] == [(2, 0), (6, 1), (7, 1)]


def test_a_report_carrying_earlier_steps_counts_as_one_report_per_step() -> None:
    """A replica gossips several fast steps in one message (StepProgress.earlier): each step is aggregated
    with the other replica's report of it, oldest first."""
    book = ProgressBook(job="j", steps=10)
    book.set_plan(0, 0, ["a", "b"])
    assert book.add("a", StepProgress(job="j", step=3, epoch=0, stage=0, peer="a", loss=4.0,
                                      earlier=(1.0, 2.0, 3.0)), now=0.0) == []
    out = book.add("b", StepProgress(job="j", step=2, epoch=0, stage=0, peer="b", loss=5.0, earlier=(3.0, 4.0)),
                   now=0.0)
    assert [(e.step, e.loss, e.earlier) for e in out] == [(0, 2.0, ()), (1, 3.0, ()), (2, 4.0, ())]
    (ev,) = book.add("b", _rep("b", 3, 0, 6.0), now=0.0)
    assert (ev.step, ev.loss) == (3, 5.0)
