"""NodeJobService's routing of incoming data-plane channels to the jobs that claim them (no network)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.jobs.node import NodeJobConfig, NodeJobService


class _Chan:
    def __init__(self, name: str, peer: str) -> None:
        self.name, self.remote_peer, self.closed = name, peer, False

    async def aclose(self) -> None:
        self.closed = True


def _service(tmp_path: Path, **cfg: Any) -> tuple[NodeJobService, Any]:
    svc = NodeJobService(SimpleNamespace(transport=None), tmp_path, NodeJobConfig(**cfg))  # type: ignore[arg-type]
    run = SimpleNamespace(job_id="j1", members=frozenset({"alice", "mallory", "bob"}), epoch=1)
    svc.jobs["j1"] = run  # type: ignore[assignment]
    return svc, run


def test_channels_are_claimed_by_job_name_and_authenticated_peer(tmp_path: Path) -> None:
    svc, _ = _service(tmp_path)
    impostor, right = _Chan("j1/e1/p0:0-1", "mallory"), _Chan("j1/e1/p0:0-1", "alice")

    async def main() -> None:
        got: list[Any] = []
        with trio.fail_after(5):
            async with trio.open_nursery() as n:
                async def claim() -> None:
                    got.append(await svc.claim("j1", "e1/p0:0-1", "alice", alive=lambda p: True))

                n.start_soon(claim)
                await trio.testing.wait_all_tasks_blocked()
                svc._route_one(impostor)  # type: ignore[arg-type]   # same name, another peer: never alice's
                await trio.testing.wait_all_tasks_blocked()
                assert got == []
                svc._route_one(right)  # type: ignore[arg-type]
        assert got == [right]
        assert list(svc._arrived) == [("j1", "e1/p0:0-1", "mallory")]

    trio.run(main)


def test_a_claim_gives_up_when_the_peer_dies(tmp_path: Path) -> None:
    svc, _ = _service(tmp_path)
    alive = {"alice": True}

    async def main() -> None:
        with trio.fail_after(5):
            async with trio.open_nursery() as n:
                async def kill() -> None:
                    await trio.testing.wait_all_tasks_blocked()
                    alive["alice"] = False

                n.start_soon(kill)
                with pytest.raises(PeerUnavailable):
                    await svc.claim("j1", "e1/p0:0-1", "alice", alive=lambda p: alive[p])

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("name", ["nojob/e1/p0:0-1", "j1/", "p0:0-1", "j1"])
def test_a_channel_for_no_job_of_this_node_is_refused(tmp_path: Path, name: str) -> None:
    svc, _ = _service(tmp_path)
    with pytest.raises(RemoteProtocolError, match="no job"):
        svc._route_one(_Chan(name, "alice"))  # type: ignore[arg-type]
    assert svc._arrived == {}


def test_duplicates_non_members_past_epochs_and_too_many_pending_are_refused(tmp_path: Path) -> None:
    svc, run = _service(tmp_path, max_pending_links=2)
    svc._route_one(_Chan("j1/e1/a", "alice"))  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError, match="duplicate"):
        svc._route_one(_Chan("j1/e1/a", "alice"))  # type: ignore[arg-type]
    svc._route_one(_Chan("j1/e1/b", "alice"))  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError, match="too many"):
        svc._route_one(_Chan("j1/e1/c", "alice"))  # type: ignore[arg-type]
    svc._arrived.clear()
    with pytest.raises(RemoteProtocolError, match="non-member"):
        svc._route_one(_Chan("j1/e1/d", "eve"))  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError, match="past epoch"):
        svc._route_one(_Chan("j1/e0/d", "bob"))  # type: ignore[arg-type]
    svc._route_one(_Chan("j1/e1/d", "bob"))  # type: ignore[arg-type]
    run.members = None                        # an accepted job that has not started: nobody may link yet
    with pytest.raises(RemoteProtocolError, match="non-member"):
        svc._route_one(_Chan("j1/e1/e", "bob"))  # type: ignore[arg-type]


@pytest.mark.parametrize("epoch", ["\u00b2", "1\u00b9", "9" * 5000])
def test_an_epoch_that_is_not_ascii_digits_is_a_protocol_error(tmp_path: Path, epoch: str) -> None:
    """Regression (issue 15): a member's link named ``j1/e²/a`` (``"²".isdigit()`` is true, ``int()``
    raises ValueError) or ``j1/e999...`` (over int()'s 4300 digits) raised ValueError out of _route_one,
    which ended the channel router; it is refused like any link without an epoch."""
    svc, _ = _service(tmp_path)
    with pytest.raises(RemoteProtocolError, match="past epoch"):
        svc._route_one(_Chan(f"j1/e{epoch}/a", "alice"))  # type: ignore[arg-type]
    assert svc._arrived == {}


def test_reconnect_timeout_is_validated_and_reaches_the_channels() -> None:
    with pytest.raises(ValueError, match="reconnect_timeout"):
        NodeJobConfig(reconnect_timeout=0)
    ch = NodeJobConfig(reconnect_timeout=7.0).channels()
    assert ch.reconnect_timeout == 7.0
    assert ch.copy_on_send is False
