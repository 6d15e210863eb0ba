"""A job's failure or cancellation ends the job, never the node: ``JobRun.run`` with a stand-in for the
epochs (no swarm, no plan)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from fusionp2p.errors import PeerUnavailable
from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.jobs.node import NodeJobConfig
from fusionp2p.jobs.run import JobRun
from fusionp2p.net.memory import memory_network
from fusionp2p.types import DeviceProfile


def _run(transport: object, tmp_path: Path) -> JobRun:
    svc = SimpleNamespace(transport=transport, config=NodeJobConfig(report_timeout=1.0),
                          drop_arrived=lambda *a, **k: None, planning=trio.CapacityLimiter(1))
    spec = SimpleNamespace(job_id="j1", publisher="pub", config=SimpleNamespace(steps=10, allow_members=(), min_work=0,
                                                                             trust_issuers=()))
    return JobRun(svc, SimpleNamespace(spec=spec), "pub")  # type: ignore[arg-type]


def test_a_cancel_racing_a_failing_send_ends_the_job_not_the_node(tmp_path: Path) -> None:
    """The publisher cancels while one of the job's tasks fails (a send to a peer that has already
    stopped): the job's nursery raises Cancelled and PeerUnavailable together; the job ends cancelled
    and ``run`` returns (it used to re-raise the PeerUnavailable and take the node process down)."""

    async def main() -> JobRun:
        with trio.fail_after(10):
            async with memory_network() as net:
                run = _run(net.add_host(), tmp_path)
                training = trio.Event()

                async def epochs() -> None:
                    async def send_to_a_stopped_peer() -> None:
                        try:
                            await trio.sleep_forever()
                        finally:
                            raise PeerUnavailable("peer-b", "channel closed by peer")

                    async with trio.open_nursery() as n:
                        n.start_soon(send_to_a_stopped_peer)
                        n.start_soon(trio.sleep_forever)
                        training.set()

                run._epochs = epochs  # type: ignore[method-assign]
                run._watch = trio.sleep_forever  # type: ignore[method-assign]
                run._listen = trio.sleep_forever  # type: ignore[method-assign]
                async with trio.open_nursery() as n:
                    n.start_soon(run.run)
                    await training.wait()
                    assert run.scope is not None
                    run.scope.cancel()  # the publisher's cancel
                return run

    run = trio.run(main)
    assert run.state is JobState.CANCELLED
    assert run.reason == "cancelled by the publisher"
    assert [t.dst for t in run.life.history][-1] is JobState.CANCELLED


def test_a_failing_epoch_fails_the_job_with_the_real_reason(tmp_path: Path) -> None:
    async def main() -> JobRun:
        with trio.fail_after(10):
            async with memory_network() as net:
                run = _run(net.add_host(), tmp_path)

                async def epochs() -> None:
                    async with trio.open_nursery() as n:
                        n.start_soon(trio.sleep_forever)
                        raise ValueError("loss is NaN at step 3 of stage 1")

                run._epochs = epochs  # type: ignore[method-assign]
                run._watch = trio.sleep_forever  # type: ignore[method-assign]
                run._listen = trio.sleep_forever  # type: ignore[method-assign]
                await run.run()
                return run

    run = trio.run(main)
    assert run.state is JobState.FAILED
    assert run.reason == "ValueError: loss is NaN at step 3 of stage 1"


def test_a_replan_request_for_an_earlier_epoch_is_stale(tmp_path: Path) -> None:
    """A member's "my pipeline broke" for epoch 5 that reaches the leader after epoch 6 began must not break
    epoch 6 (it cancelled the new epoch before it trained, and the next, one re-plan every replan_retry)."""
    async def main() -> None:
        run = _run(SimpleNamespace(peer_id="b"), tmp_path)
        run.plan = SimpleNamespace(peers=("a", "b"))  # type: ignore[assignment]
        # a view where "a" lives and leads; the leader that is told but does not lead asks the one it sees
        suspected: list[str] = []
        run.svc.swarm = SimpleNamespace(view=SimpleNamespace(is_alive=lambda p: True, left=set()))  # type: ignore[assignment]
        run.svc.confirmed_dead = lambda p: False  # type: ignore[method-assign, assignment]
        run.svc.suspect = suspected.append  # type: ignore[method-assign, assignment]
        run.epoch = 6
        run.on_replan("a", 5)
        assert not run._broken
        run.on_replan("zz", 6)     # not a member of the plan
        assert not run._broken
        run.on_replan("a", 6)
        assert run._broken and run._cur.reported and suspected == ["a"]

    trio.run(main)


def test_a_member_dead_only_to_the_membership_view_is_asked_before_a_replan(tmp_path: Path) -> None:
    """A starved member's heartbeats ran late (benchmarks.wan's 0.165-core hosts): the leader asks the
    members the view calls dead; one that answers is not re-planned around (for confirm_ttl), one that
    does not answer, or announced it is leaving, is gone."""
    asked: list[list[str]] = []

    async def main() -> None:
        run = _run(SimpleNamespace(peer_id="a"), tmp_path)
        run.svc.config = NodeJobConfig(confirm_timeout=1.0, confirm_ttl=10.0)  # type: ignore[misc]
        run.svc.swarm = SimpleNamespace(view=SimpleNamespace(left={"d"}))  # type: ignore[attr-defined]

        async def ask_all(peers: list[str], msg: dict[str, object], *, timeout: float | None = None) -> dict[str, dict[str, object]]:
            asked.append(list(peers))
            assert msg["op"] == "status" and timeout == 1.0
            return {p: {"ok": True} for p in peers if p == "b"}     # b answers, c is really gone

        run._ask_all = ask_all  # type: ignore[method-assign]
        assert await run._confirm_gone(["b", "c", "d"]) == ["c", "d"]
        assert asked == [["b", "c"]]                 # d announced leaving: not asked
        assert await run._confirm_gone(["b", "c"]) == ["c"]
        assert asked[-1] == ["c"]                    # b's answer still counts
        await trio.sleep(11)                         # (autojump clock) b's answer has expired: asked again
        await run._confirm_gone(["b"])
        assert asked[-1] == ["b"]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_leader_judges_the_same_joiners_only_every_join_check_interval(tmp_path: Path) -> None:
    """Each look at joiners plans twice (with and without them); at the 1 s watch interval that took 40% of
    a 0.33-core leader in benchmarks.wan. The same joiners are judged again only after the interval; a new
    joiner is judged at once."""
    from fusionp2p.errors import PlanError

    looks: list[list[str]] = []

    async def main() -> None:
        run = _run(SimpleNamespace(peer_id="a"), tmp_path)
        run.svc.config = NodeJobConfig(join_check_interval=5.0)  # type: ignore[misc]
        run.plan = SimpleNamespace(peers=("a", "b"), epoch=0)  # type: ignore[assignment]
        run.epoch = 0
        run.joiners = {"c"}
        run._alive = lambda p: True  # type: ignore[method-assign]
        run._offer_joiners = lambda plan: None  # type: ignore[method-assign]

        def snapshot(members: list[str], epoch: int) -> object:
            looks.append(members)
            raise PlanError("stop here")

        run._snapshot = snapshot  # type: ignore[method-assign,assignment]
        plan = run.plan
        await run._take_in_joiners(plan)  # type: ignore[arg-type]
        await run._take_in_joiners(plan)  # type: ignore[arg-type]
        assert looks == [["a", "b", "c"]]
        run.joiners = {"c", "d"}
        await run._take_in_joiners(plan)  # type: ignore[arg-type]
        assert looks[-1] == ["a", "b", "c", "d"] and len(looks) == 2
        await trio.sleep(5.5)
        await run._take_in_joiners(plan)  # type: ignore[arg-type]
        assert len(looks) == 3

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_job_nearer_its_end_than_replan_min_saving_weighs_no_planned_replan(tmp_path: Path) -> None:
    """A planned re-plan saves at most the time left: with less than ``replan_min_saving`` left at the rate
    the epoch trains (or before it has measured one), the leader neither offers the job to standbys nor
    weighs plans (in benchmarks.wan's 12 s jobs that work slowed the leader's replica 20-45%)."""

    async def main() -> None:
        run = _run(SimpleNamespace(peer_id="a"), tmp_path)
        run.svc.config = NodeJobConfig(replan_min_saving=30.0)  # type: ignore[misc]
        assert not run._replan_may_pay()                       # no worker (not a member)
        left: list[float | None] = [None]
        run._worker = SimpleNamespace(seconds_left=lambda: left[0])  # type: ignore[assignment]
        assert not run._replan_may_pay()                       # no rate measured yet
        left[0] = 29.0
        assert not run._replan_may_pay()
        left[0] = 31.0
        assert run._replan_may_pay()

    trio.run(main)


def test_the_halt_skips_a_member_whose_death_a_direct_question_confirmed(tmp_path: Path) -> None:
    """The view calls a killed member alive until dead_timeout; the halt round waits for every answer, and a
    dial to the dead node took 1.5 s under load (benchmarks.churn): a member that refused a direct question is
    not asked."""
    halted_to: list[list[str]] = []

    async def main() -> None:
        run = _run(SimpleNamespace(peer_id="a"), tmp_path)
        run.plan = SimpleNamespace(peers=("a", "b", "c"))  # type: ignore[assignment]
        run.members = frozenset({"a", "b", "c", "d"})
        run.svc.swarm = SimpleNamespace(view=SimpleNamespace(is_alive=lambda p: True, left=set()))  # type: ignore[assignment]
        run.svc.confirmed_dead = lambda p: p == "c"  # type: ignore[method-assign, assignment]

        async def ask_all(peers: list[str], msg: dict[str, object], *, timeout: float | None = None) -> dict[str, dict[str, object]]:
            halted_to.append(list(peers))
            return {}   # nobody answers: the leader retries later

        run._ask_all = ask_all  # type: ignore[method-assign]
        await run._lead(run.plan, at=None, why="test")  # type: ignore[arg-type]

    trio.run(main)
    assert halted_to == [["a", "b", "d"]]


def test_the_leader_offers_the_job_to_no_node_a_direct_question_found_dead(tmp_path: Path) -> None:
    """Issue 41: after each re-plan in benchmarks.churn its leader dialled the killed member, which the view calls
    alive for dead_timeout, every OFFER_AGAIN seconds. A node a direct question found dead is not offered the job;
    a standby of an earlier epoch and a fresh node are (a standby may have restarted: it answers at once)."""
    offered: list[str] = []

    async def main() -> None:
        run = _run(SimpleNamespace(peer_id="a"), tmp_path)
        rec = SimpleNamespace(profile=object(), leaving=False)
        alive = ["b", "c", "d", "e"]
        run.svc.swarm = SimpleNamespace(view=SimpleNamespace(  # type: ignore[attr-defined]
            alive=lambda role: alive, records=dict.fromkeys(alive, rec), is_alive=lambda p: p in alive, left=set()))
        run.svc.confirmed_dead = lambda p: p == "d"  # type: ignore[method-assign, assignment]
        run.svc.nursery = SimpleNamespace(start_soon=lambda fn, peer: offered.append(peer))  # type: ignore[attr-defined]
        run.members = frozenset({"a", "b", "c", "d"})       # c: a standby of the started epoch; d: just killed
        run._offer_joiners(SimpleNamespace(peers=("a", "b")))  # type: ignore[arg-type]
        assert offered == ["c", "e"]

    trio.run(main)


def test_the_leader_offers_the_job_to_a_node_without_a_profile_and_plans_it_with_the_one_it_accepted_with(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40: a node measures its device profile only when its deferred start-up runs (swarm/startup.py); a
    re-plan's leader passed over a live node whose record had none (up to ``defer`` after it joined) while the
    publisher's first offer went to it. It is offered the job, and planned with the profile its accept carries."""
    from fusionp2p.jobs import lead

    measured = DeviceProfile(device="cpu", kind="cpu", name="joiner", flops_fp32=3e10, flops_bf16=0.0,
                             memory_bytes=2 << 30)
    offered: list[str] = []

    async def request(t: object, peer: str, msg: dict[str, object], **kw: object) -> dict[str, object]:
        assert msg["op"] == "offer"
        return {"ok": True, "job": "j1", "profile": measured.to_wire()}

    async def admitted(*a: object, **kw: object) -> str:
        return ""

    monkeypatch.setattr(lead.job_proto, "request", request)
    monkeypatch.setattr(lead.reputation, "admitted", admitted)

    async def main() -> None:
        run = _run(SimpleNamespace(peer_id="a"), tmp_path)
        run.spec = SimpleNamespace(job_id="j1", model_hash="m", config=run.spec.config)  # type: ignore[assignment]
        run.accepted = SimpleNamespace(envelope=b"env")  # type: ignore[assignment]
        mine = SimpleNamespace(profile=measured, leaving=False, speed_on=lambda h: 0.0)
        records = {"b": mine, "e": SimpleNamespace(profile=None, leaving=False, speed_on=lambda h: 0.0)}
        alive = ["b", "e"]
        run.svc.swarm = SimpleNamespace(  # type: ignore[attr-defined]
            view=SimpleNamespace(alive=lambda role: alive, records=records, is_alive=lambda p: p in alive, left=set()),
            profile=measured, speed_on=lambda h: 0.0,
            bandwidth=SimpleNamespace(direct=lambda a, b: None, estimate=lambda a, b: None))
        run.svc.confirmed_dead = lambda p: False  # type: ignore[method-assign, assignment]
        run.svc.nursery = SimpleNamespace(start_soon=lambda fn, peer: offered.append(peer))  # type: ignore[attr-defined]
        run._offer_joiners(SimpleNamespace(peers=("a", "b")))  # type: ignore[arg-type]
        assert offered == ["e"]            # was []: no profile in its record
        await run._offer_to("e")
        assert run.joiners == {"e"}
        snap = run._snapshot(["a", "e"], 1)
        assert snap.members["e"] == measured   # from its accept: its record has none

    trio.run(main)
