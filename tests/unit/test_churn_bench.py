"""benchmarks.churn's bookkeeping: samples per plan (the equal-samples check) and a quiet run's ticks."""

from __future__ import annotations

from collections.abc import Iterator

from benchmarks.churn import _events, samples
from fusionp2p.jobs.events import JobStateChanged


def test_samples_add_up_each_plans_steps_times_its_replicas() -> None:
    per = 4 * 8   # micro-batches x micro-batch
    assert samples([(0, [2, 2], 0)], 300, per) == 300 * 2 * per
    # a plan of one stage x 2 replicas from step 40, then 2 x 2 again from step 85: still 2 replicas a step
    assert samples([(0, [2, 2], 0), (1, [2], 40), (2, [2, 2], 85)], 100, per) == 100 * 2 * per
    # a plan of 1 replica per stage for 20 steps trains fewer samples: the held-out losses are not comparable
    assert samples([(0, [2, 2], 0), (1, [1, 1], 40), (2, [2, 2], 60)], 100, per) == (80 * 2 + 20) * per


class _Job:
    """Job.events' contract: events in order, TimeoutError when none comes within the timeout."""

    def __init__(self, evs: list[object]) -> None:
        self.feed = iter(evs)

    def events(self, timeout: float) -> Iterator[object]:
        while True:
            nxt = next(self.feed)
            if nxt is None:
                raise TimeoutError
            yield nxt
            if isinstance(nxt, JobStateChanged):
                return


def test_a_quiet_job_yields_ticks_and_the_events_go_on_after_them() -> None:
    done = JobStateChanged(job="j", state="done", reason="", at=0.0)
    assert list(_events(_Job(["a", None, None, "b", done]), 0.01)) == ["a", None, None, "b", done]
