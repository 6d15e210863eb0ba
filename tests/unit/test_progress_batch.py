"""The loss stage's progress batching (jobs/status.py ProgressBatch): what is held, what goes out, and when."""

from fusionp2p.jobs.status import ProgressBatch


def test_consecutive_steps_are_held_and_go_out_with_the_next_sent_one() -> None:
    b = ProgressBatch(interval=1.0, limit=8)
    assert b.add(0, 3.0, 10.0, 100.0, now=0.0, last=False) == ((), (), ())      # nothing sent yet: at once
    assert b.add(1, 2.9, 11.0, 100.1, now=0.1, last=False) is None
    assert b.add(2, 2.8, 12.0, 100.2, now=0.2, last=False) is None
    assert b.add(3, 2.7, 13.0, 100.3, now=1.2, last=False) == ((2.9, 2.8), (11.0, 12.0), (100.1, 100.2))


def test_the_last_step_goes_out_at_once_and_a_gap_drops_what_was_held() -> None:
    b = ProgressBatch(interval=10.0, limit=8)
    b.add(0, 3.0, 1.0, 0.0, now=0.0, last=False)
    assert b.add(1, 2.0, 1.0, 0.0, now=0.1, last=False) is None
    assert b.add(5, 1.0, 1.0, 0.0, now=0.2, last=True) == ((), (), ())         # step 1 is not just before 5


def test_no_more_than_the_limit_is_held() -> None:
    b = ProgressBatch(interval=1e9, limit=2)
    b.add(0, 1.0, 1.0, 0.0, now=0.0, last=False)
    assert b.add(1, 1.0, 1.0, 0.0, now=0.0, last=False) is None
    assert b.add(2, 1.0, 1.0, 0.0, now=0.0, last=False) is None
    sent = b.add(3, 1.0, 1.0, 0.0, now=0.0, last=False)
    assert sent is not None and len(sent[0]) == 2
