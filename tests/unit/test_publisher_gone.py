"""A followed job whose members all died ends FAILED within ``gone_after``, not after ``idle_timeout``'s silence
(``jobs/gone.py``): a `job attach` after the SIGKILL of a job's only member waited 10 minutes on nothing. But the
swarm's view is not believed alone: a member that answers directly is alive, and a job whose last step is done is
not failed for gone members (an attach under load ended FAILED "no member alive for 45 s (last step 24 of 24)").
The driver runs its real ``attach`` and ``_follow`` here on trio's mock clock; the swarm's view, the status record
and the members' answers are scripted."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from fusionp2p.errors import JobError, PeerUnavailable
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs import publisher
from fusionp2p.jobs.events import JobStateChanged, ProgressEvent
from fusionp2p.jobs.gone import ASK_AT_MOST
from fusionp2p.jobs.publisher import DriverConfig, JobDriver, SwarmView
from fusionp2p.types import DeviceProfile
from fusionp2p.wire.jobrecords import JobStatus, StageFile

PROFILE = DeviceProfile(device="cpu", kind="cpu", name="cpu", flops_fp32=1e10, flops_bf16=0.0, memory_bytes=1 << 30)
CFG = DriverConfig(gone_after=30.0, view_poll=10.0, final_wait=60.0)
STEPS = 24
FINAL = (StageFile(stage=0, hash="f" * 64, holders=("A",)),)


def swarm_of(monkeypatch: pytest.MonkeyPatch, alive: list[set[str] | None]) -> None:
    """Each view read returns the next set of live members (None: no bootstrap answered; the last repeats)."""
    async def discover(t: object, bootstraps: list[str], *, timeout: float) -> SwarmView:
        members = alive.pop(0) if len(alive) > 1 else alive[0]
        if members is None:
            raise PeerUnavailable("boot", "no view")
        return SwarmView(members=dict.fromkeys(members, PROFILE), addrs={}, links=[])

    monkeypatch.setattr(publisher, "discover", discover)


def members_answer(monkeypatch: pytest.MonkeyPatch, state: str | None) -> list[str]:
    """Every member answers ``status`` with *state* (None: nobody answers); the peers asked, in order."""
    asked: list[str] = []

    async def request(t: object, peer: str, msg: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        if msg["op"] == "status":
            asked.append(peer)
        if state is None or msg["op"] != "status":
            raise PeerUnavailable(peer, "connection refused")
        return {"ok": True, "state": state, "epoch": 0, "step": 10, "stage": 0}

    monkeypatch.setattr(job_proto, "request", request)
    return asked


def records(monkeypatch: pytest.MonkeyPatch, at: Callable[[float], JobStatus | None]) -> None:
    """The job's status record as the DHT holds it at each (mock) time."""
    async def read_status(self: JobDriver) -> JobStatus | None:
        return at(trio.current_time())

    async def plan_record(*args: object, **kw: object) -> tuple[int, None, tuple[str, ...]]:
        return 0, None, ("B",)   # epoch 0's plan record: its standby B

    monkeypatch.setattr(JobDriver, "read_status", read_status)
    monkeypatch.setattr(publisher, "fetch_latest_record", plan_record)


def status(step: int, *, state: str = "running", ckpt_step: int = -1, final: tuple[StageFile, ...] = ()) -> JobStatus:
    return JobStatus(job="j", peer="A", publisher="me", state=state, epoch=0, step=step, steps=STEPS, members=("A",),
                     checkpoint_step=ckpt_step, checkpoint=FINAL if ckpt_step >= 0 else (), final=final)


def attach(tmp_path: Path, heard: int) -> tuple[list[ProgressEvent], list[str], float]:
    """Run a real attach of job "j" (members A, its standby B) to its end, the first *heard* steps' losses heard
    on gossip already: (events, stage files fetched, when it ended)."""
    events: list[ProgressEvent] = []
    fetched: list[str] = []

    async def main() -> float:
        d = JobDriver(None, None, ["boot"], None, events.append, tmp_path, CFG, job="j", steps=STEPS)  # type: ignore[arg-type]
        d.book.fill({i: [1.0] for i in range(heard)}, now=0.0)

        async def fetch(holders: tuple[str, ...], h: str, stage: int, step: int) -> None:
            fetched.append(h)

        d._fetch_stage = fetch  # type: ignore[method-assign]
        await d.attach()
        return trio.current_time()

    end = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return events, fetched, end


def attached_members(tmp_path: Path, cfg: DriverConfig) -> set[str]:
    """Attach to job "j" (its stage files not fetched) and return the members the attach followed."""

    async def main() -> set[str]:
        d = JobDriver(None, None, ["boot"], None, lambda ev: None, tmp_path, cfg, job="j", steps=STEPS)  # type: ignore[arg-type]

        async def fetch(holders: tuple[str, ...], h: str, stage: int, step: int) -> None:
            pass

        d._fetch_stage = fetch  # type: ignore[method-assign]
        await d.attach()
        return d.members

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def states(events: list[ProgressEvent]) -> list[tuple[str, str]]:
    return [(e.state, e.reason) for e in events if isinstance(e, JobStateChanged)]


def test_every_member_dead_and_silent_fails_the_job_after_gone_after(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    swarm_of(monkeypatch, [{"A", "C"}, {"C"}])   # A lives at the first look, then neither A nor B
    asked = members_answer(monkeypatch, None)
    records(monkeypatch, lambda now: status(10))
    events, _, end = attach(tmp_path, 10)
    final = states(events)[-1]
    assert final[0] == "failed" and "none of its 2 members" in final[1] and "nor answers" in final[1], final
    assert "last step 10 of 24" in final[1]
    assert 30.0 + 10.0 <= end <= 30.0 + 3 * 10.0   # gone_after after the first view without them, a poll or two
    assert sorted(set(asked)) == ["A", "B"]        # asked directly before the view was believed


def test_the_last_step_done_is_not_failed_for_gone_members(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The view says every member is dead and none answers, but the status record says the last step is done:
    the attach waits for the final record (it comes at 100 s, well after gone_after) and ends DONE. The old code
    ended FAILED "none of its members ... alive for 30 s (last step 24 of 24)"."""
    swarm_of(monkeypatch, [set()])
    members_answer(monkeypatch, None)
    records(monkeypatch, lambda now: status(STEPS) if now < 100 else status(STEPS, state="done", final=FINAL))
    events, fetched, end = attach(tmp_path, STEPS)
    assert [s for s, _ in states(events)][-1] == "done", states(events)
    assert fetched == ["f" * 64] and 100 <= end < 110


def test_the_last_step_done_without_a_final_record_fails_after_final_wait_and_says_so(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    swarm_of(monkeypatch, [set()])
    members_answer(monkeypatch, None)
    records(monkeypatch, lambda now: status(STEPS, ckpt_step=20))   # a checkpoint, but not of the last step
    events, fetched, end = attach(tmp_path, STEPS)
    final = states(events)[-1]
    assert final[0] == "failed" and "last step 24 of 24 is done, but no final record came within 60 s" in final[1]
    assert not fetched and 30 + 60 <= end <= 30 + 60 + 3 * 10


def test_the_last_step_done_with_its_checkpoint_in_the_record_ends_done_from_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A member's final state is its checkpoint of the last step: the record names the model's stage files."""
    swarm_of(monkeypatch, [set()])
    members_answer(monkeypatch, None)
    records(monkeypatch, lambda now: status(STEPS, ckpt_step=STEPS))
    events, fetched, end = attach(tmp_path, STEPS)
    assert [s for s, _ in states(events)][-1] == "done", states(events)
    assert fetched == ["f" * 64] and end <= 30 + 3 * 10


def test_a_starved_view_with_a_member_that_answers_directly_is_followed_on(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The view never shows a member alive (its bootstrap's verdicts under load), but member A answers its
    status: the job is followed on to its final record at 200 s. The old code ended FAILED at ~40 s."""
    swarm_of(monkeypatch, [set()])
    asked = members_answer(monkeypatch, "running")
    records(monkeypatch, lambda now: status(10) if now < 200 else status(STEPS, state="done", final=FINAL))
    events, fetched, end = attach(tmp_path, 10)
    assert [s for s, _ in states(events)][-1] == "done", states(events)
    assert fetched == ["f" * 64] and 200 <= end < 210
    assert asked and set(asked) <= {"A", "B"}


def test_the_members_asked_directly_are_bounded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    swarm_of(monkeypatch, [set()])
    asked = members_answer(monkeypatch, None)
    many = tuple(f"M{i:03d}" for i in range(100))
    records(monkeypatch, lambda now: JobStatus(job="j", peer="M000", publisher="me", state="running", epoch=0, step=3,
                                               steps=STEPS, members=many))
    events, _, _ = attach(tmp_path, 3)
    assert states(events)[-1][0] == "failed"
    rounds = len(asked) // ASK_AT_MOST
    assert rounds >= 1 and len(asked) == rounds * ASK_AT_MOST and set(asked) <= set(many[:ASK_AT_MOST]), asked


def test_news_or_a_live_member_or_no_view_concludes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    swarm_of(monkeypatch, [set(), set(), None, {"B"}, set(), set()])
    members_answer(monkeypatch, None)
    records(monkeypatch, lambda now: status(10))

    async def main() -> None:
        d = JobDriver(None, None, ["boot"], None, lambda ev: None, tmp_path, CFG, job="j", steps=60)  # type: ignore[arg-type]
        g = d.gone

        async def check(now: float, last_news: float) -> None:
            assert await g.check(now, known={"A", "B"}, current=("A",), last_news=last_news, reached=10,
                                 steps=60) is None

        await check(0.0, last_news=0.0)
        assert g.since == 0.0
        await check(35.0, last_news=20.0)    # a member reported meanwhile: not gone after all
        assert g.since is None
        await check(100.0, last_news=20.0)   # no bootstrap answered: nothing known
        await check(110.0, last_news=20.0)   # B is back in the view
        assert g.since is None
        await check(120.0, last_news=20.0)
        await check(149.0, last_news=20.0)   # 29 s < gone_after
        assert g.since == 120.0
        with pytest.raises(JobError, match="none of its 2 members"):
            await check(150.0, last_news=20.0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_member_that_says_its_part_is_done_means_the_final_record_is_awaited(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The gossip of the last steps was lost (the follower saw step 10) and the view has no member alive, but a
    member answers that its part is done: the last step is done, and the final record (at 90 s: after gone_after, within final_wait) is awaited."""
    swarm_of(monkeypatch, [set()])
    members_answer(monkeypatch, "done")
    records(monkeypatch, lambda now: status(10) if now < 90 else status(STEPS, state="done", final=FINAL))
    events, fetched, end = attach(tmp_path, 10)
    assert [s for s, _ in states(events)][-1] == "done", states(events)
    assert fetched == ["f" * 64] and 90 <= end < 100


def test_an_attach_learns_the_standbys_from_a_slow_plan_record_read(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """The plan record's read (a DHT walk) took 3 s on a starved loop, longer than status_poll (1 s in the tests):
    the attach cut it off, never learned the standby, and ignored the standby's re-plan until idle_timeout."""
    records(monkeypatch, lambda now: status(STEPS, state="done", final=FINAL))

    async def slow_plan_record(*args: object, **kw: object) -> tuple[int, None, tuple[str, ...]]:
        await trio.sleep(3.0)
        return 0, None, ("B",)

    monkeypatch.setattr(publisher, "fetch_latest_record", slow_plan_record)

    assert attached_members(tmp_path, DriverConfig(status_poll=1.0)) == {"A", "B"}


def test_an_attach_learns_the_standbys_from_the_status_epochs_plan_record(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """By the time the attach reads it, the latest plan record is the standbys' re-plan (epoch 1), which no member
    it knows voted: it is not believed, and the standbys are learned from the status record's epoch's record (seen
    on 0.1 core: the attach then ignored the standbys' plans and final record until idle_timeout)."""
    records(monkeypatch, lambda now: status(STEPS, state="done", final=FINAL))

    async def plan_records(*args: object, epoch: int | None = None, **kw: object
                           ) -> tuple[int, None, tuple[str, ...]] | None:
        return None if epoch is None else (0, None, ("B",))   # the latest does not verify; epoch 0's does

    monkeypatch.setattr(publisher, "fetch_latest_record", plan_records)

    assert attached_members(tmp_path, CFG) == {"A", "B"}


def test_an_attach_learns_the_standbys_from_the_status_record(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """No plan record it can believe (its voters were the standbys alone, none of them a member the status names):
    the attach learns the standby from the status record, signed by the leader (before, it knew only the dead
    member A, ignored B's re-plan and records, and failed "no progress from the swarm")."""
    records(monkeypatch, lambda now: dataclasses.replace(status(STEPS, state="done", final=FINAL), standbys=("B",)))

    async def no_plan_record(*args: object, **kw: object) -> None:
        return None

    monkeypatch.setattr(publisher, "fetch_latest_record", no_plan_record)

    assert attached_members(tmp_path, CFG) == {"A", "B"}
