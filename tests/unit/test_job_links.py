"""NodeJobService's routing of incoming data-plane channels to the jobs that claim them (no network)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs.node import NodeJobConfig, NodeJobService, _Job


class _Chan:
    def __init__(self, name: str, peer: str) -> None:
        self.name, self.remote_peer, self.closed = name, peer, False

    async def aclose(self) -> None:
        self.closed = True


def _service(tmp_path: Path, **cfg: Any) -> tuple[NodeJobService, _Job]:
    svc = NodeJobService(SimpleNamespace(transport=None), tmp_path, NodeJobConfig(**cfg))  # type: ignore[arg-type]
    nj = _Job(accepted=SimpleNamespace(spec=SimpleNamespace(job_id="j1")), publisher="pub")  # type: ignore[arg-type]
    svc.jobs["j1"] = nj
    return svc, nj


def test_channels_are_claimed_by_job_name_and_authenticated_peer(tmp_path: Path) -> None:
    svc, nj = _service(tmp_path)
    impostor, right = _Chan("j1/p0:0-1", "mallory"), _Chan("j1/p0:0-1", "alice")

    async def main() -> None:
        got: dict[str, Any] = {}
        with trio.fail_after(5):
            async with trio.open_nursery() as n:
                n.start_soon(svc._claim_link, nj, "p0:0-1", "alice", got)
                await trio.testing.wait_all_tasks_blocked()
                svc._route_one(impostor)            # same name, another peer: never taken for alice's link
                await trio.testing.wait_all_tasks_blocked()
                assert got == {}
                svc._route_one(right)
        assert got == {"p0:0-1": right}
        assert nj.channels == [right]
        assert list(svc._arrived) == [("j1", "p0:0-1", "mallory")]   # dropped when the job ends

    trio.run(main)


@pytest.mark.parametrize("name", ["nojob/p0:0-1", "j1/", "p0:0-1", "j1"])
def test_a_channel_for_no_job_of_this_node_is_refused(tmp_path: Path, name: str) -> None:
    svc, _ = _service(tmp_path)
    with pytest.raises(RemoteProtocolError, match="no job"):
        svc._route_one(_Chan(name, "alice"))  # type: ignore[arg-type]
    assert svc._arrived == {}


def test_duplicates_non_members_and_too_many_pending_are_refused(tmp_path: Path) -> None:
    svc, nj = _service(tmp_path, max_pending_links=2)
    svc._route_one(_Chan("j1/a", "alice"))  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError, match="duplicate"):
        svc._route_one(_Chan("j1/a", "alice"))  # type: ignore[arg-type]
    svc._route_one(_Chan("j1/b", "alice"))  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError, match="too many"):
        svc._route_one(_Chan("j1/c", "alice"))  # type: ignore[arg-type]
    nj.members = frozenset({"alice", "bob"})  # once the job started, only its members may link
    svc._arrived.clear()
    with pytest.raises(RemoteProtocolError, match="non-member"):
        svc._route_one(_Chan("j1/d", "mallory"))  # type: ignore[arg-type]
    svc._route_one(_Chan("j1/d", "bob"))  # type: ignore[arg-type]


def test_reconnect_timeout_is_validated_and_reaches_the_channels() -> None:
    with pytest.raises(ValueError, match="reconnect_timeout"):
        NodeJobConfig(reconnect_timeout=0)
    ch = NodeJobConfig(reconnect_timeout=7.0).channels()
    assert ch.reconnect_timeout == 7.0
    assert ch.copy_on_send is False
