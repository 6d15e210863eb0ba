"""A node's job slots against a publisher that offers and never starts (issue 15, item 8).

Offers still being fetched hold a slot (concurrent offers all passed the slot check before and fetched
at once), and one offering peer may have at most ``max_offers_per_publisher`` (2) offers pending, so a
hostile publisher cannot take all four slots of every node for ``offer_ttl``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import trio

from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.jobs.node import NodeJobConfig, NodeJobService


def _service(tmp_path: Path) -> NodeJobService:
    swarm = SimpleNamespace(transport=None, profile=None)   # no profile: an intake that gets a slot fails at once
    return NodeJobService(swarm, tmp_path, NodeJobConfig())  # type: ignore[arg-type]


def _job(state: JobState, publisher: str = "pub", offered_by: str = "") -> SimpleNamespace:
    return SimpleNamespace(state=state, publisher=publisher, offered_by=offered_by, epoch=-1)   # not started


def test_offers_being_fetched_hold_a_slot(tmp_path: Path) -> None:
    async def main() -> None:
        svc = _service(tmp_path)
        for p in ("a", "b", "c", "d"):
            svc._intakes[p] += 1   # four offers, from four publishers, still fetching their content
        assert (await svc._offer("pub", b"x", None))["error"] == "this node is busy"

    trio.run(main)


def test_one_publisher_cannot_take_every_slot(tmp_path: Path) -> None:
    async def main() -> None:
        svc = _service(tmp_path)
        svc.jobs["j0"] = _job(JobState.PENDING)  # type: ignore[assignment]
        svc.jobs["j1"] = _job(JobState.PENDING)  # type: ignore[assignment]
        assert (await svc._offer("pub", b"x", None))["error"] == "this publisher has 2 offers pending here"
        assert "pending" not in (await svc._offer("other", b"x", None))["error"]
        svc.jobs["j1"].state = JobState.RUNNING   # started: no longer an offer
        assert "pending" not in (await svc._offer("pub", b"x", None))["error"]
        # a member offering to joiners counts as the offering peer
        svc.jobs["j0"].state = JobState.DONE   # ended: holds no slot
        svc.jobs["j2"] = _job(JobState.PENDING, publisher="pub", offered_by="member")  # type: ignore[assignment]
        svc.jobs["j3"] = _job(JobState.PENDING, publisher="pub2", offered_by="member")  # type: ignore[assignment]
        assert (await svc._offer("member", b"x", None))["error"] == "this publisher has 2 offers pending here"

    trio.run(main)


def test_a_pending_joiner_takes_a_halt_from_any_member_that_offered_it(tmp_path: Path) -> None:
    """A joiner offered the job by one leader, then (that leader lost) by the next, answers the new
    leader's halt; it refused it before, so the leader left it out and re-planned for it again and again."""
    async def main() -> None:
        svc = _service(tmp_path)
        svc.transport = SimpleNamespace(peer_id="me")  # type: ignore[assignment]

        async def halt(at: int | None, *, timeout: float) -> SimpleNamespace:
            return SimpleNamespace(to_wire=lambda: {"peer": "me", "epoch": 0, "stage": -1})

        run = SimpleNamespace(state=JobState.PENDING, publisher="pub", offered_by="m1", offerers={"m1", "m2"},
                              members=None, epoch=-1, halt=halt)
        svc.jobs["j"] = run  # type: ignore[assignment]
        for peer in ("m1", "m2"):
            assert (await svc.handle(peer, {"op": "halt", "job": "j", "at": None}))["ok"]
        assert "no member" in (await svc.handle("m3", {"op": "halt", "job": "j", "at": None}))["error"]

    trio.run(main)
