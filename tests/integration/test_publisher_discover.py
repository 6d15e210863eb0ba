"""The publisher's first step, reading the swarm's members from a bootstrap, survives a failed stream."""

import pytest
import trio
import trio.testing

from fusionp2p.errors import PeerUnavailable
from fusionp2p.jobs import publisher
from fusionp2p.swarm.node import SwarmConfig
from fusionp2p.testing.swarm import converge, local_swarm


def test_discover_asks_again_after_a_failed_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under load a VIEW stream to the bootstrap once failed to open (a multiselect handshake whose read
    failed), and the job failed with it; discover now asks again until its deadline."""
    calls: list[str] = []
    real = publisher.fetch_view

    async def once_broken(t: object, peer: str, *, timeout: float) -> dict[str, object]:
        calls.append(peer)
        if len(calls) == 1:
            raise PeerUnavailable(peer, "cannot open /fusionp2p/view/1.0.0: failed to open a stream")
        return await real(t, peer, timeout=timeout)  # type: ignore[arg-type]

    monkeypatch.setattr(publisher, "fetch_view", once_broken)

    async def main() -> None:
        with trio.fail_after(30):
            async with local_swarm(2, libp2p=False, config=SwarmConfig(probing=False)) as (boot, nodes):
                await converge(nodes, bandwidth=False, timeout=10)
                view = await publisher.discover(nodes[0].transport, [boot.peer_id], timeout=10)
                assert set(view.members) == {n.peer_id for n in nodes}

    trio.run(main)
    assert len(calls) == 2


def test_discover_gives_up_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(t: object, peer: str, *, timeout: float) -> dict[str, object]:
        raise PeerUnavailable(peer, "cannot open /fusionp2p/view/1.0.0")

    monkeypatch.setattr(publisher, "fetch_view", broken)

    async def main() -> None:
        t0 = trio.current_time()
        with pytest.raises(PeerUnavailable, match="no view"):
            await publisher.discover(None, ["boot"], timeout=5)  # type: ignore[arg-type]
        assert 4 <= trio.current_time() - t0 <= 5

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
