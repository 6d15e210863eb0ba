"""A followed job whose members all died ends FAILED within ``gone_after``, not after ``idle_timeout``'s silence
(``JobDriver._gone``): a `job attach` after the SIGKILL of a job's only member waited 10 minutes on nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from fusionp2p.errors import JobError, PeerUnavailable
from fusionp2p.jobs import publisher
from fusionp2p.jobs.publisher import DriverConfig, JobDriver, SwarmView
from fusionp2p.types import DeviceProfile

PROFILE = DeviceProfile(device="cpu", kind="cpu", name="cpu", flops_fp32=1e10, flops_bf16=0.0, memory_bytes=1 << 30)
CFG = DriverConfig(gone_after=30.0, view_poll=10.0)


def swarm_of(monkeypatch: pytest.MonkeyPatch, alive: list[set[str] | None]) -> None:
    """Each view read returns the next set of live members (None: no bootstrap answered)."""
    async def discover(t: object, bootstraps: list[str], *, timeout: float) -> SwarmView:
        members = alive.pop(0)
        if members is None:
            raise PeerUnavailable("boot", "no view")
        return SwarmView(members=dict.fromkeys(members, PROFILE), addrs={}, links=[])

    monkeypatch.setattr(publisher, "discover", discover)


def driver(tmp_path: Path) -> JobDriver:
    d = JobDriver(None, None, ["boot"], None, lambda ev: None, tmp_path, CFG, job="j", steps=60)  # type: ignore[arg-type]
    d.members = {"A", "B"}
    return d


def run(body: object) -> None:
    trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0))  # type: ignore[arg-type]


def test_every_member_dead_for_gone_after_fails_the_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    swarm_of(monkeypatch, [{"A", "C"}, {"C"}, {"C"}, {"C"}])

    async def main() -> None:
        d = driver(tmp_path)
        await d._gone(0.0, last_news=0.0)      # A lives
        assert d._gone_since is None
        await d._gone(10.0, last_news=0.0)     # neither A nor B: from now
        await d._gone(20.0, last_news=0.0)
        with pytest.raises(JobError, match=r"none of its 2 members .* alive in the swarm for 30 s"):
            await d._gone(40.0, last_news=0.0)

    run(main)


def test_news_or_a_live_member_or_no_view_concludes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    swarm_of(monkeypatch, [set(), set(), None, {"B"}, set(), set()])

    async def main() -> None:
        d = driver(tmp_path)
        await d._gone(0.0, last_news=0.0)
        assert d._gone_since == 0.0
        await d._gone(35.0, last_news=20.0)    # a member reported meanwhile: not gone after all
        assert d._gone_since is None
        await d._gone(100.0, last_news=20.0)   # no bootstrap answered: nothing known
        await d._gone(110.0, last_news=20.0)   # B is back in the view
        assert d._gone_since is None
        await d._gone(120.0, last_news=20.0)
        await d._gone(149.0, last_news=20.0)   # 29 s < gone_after
        assert d._gone_since == 120.0

    run(main)
