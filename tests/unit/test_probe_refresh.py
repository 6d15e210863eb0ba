"""Refresh rounds of an idle node (issue 40): while its chosen peers and their figures stay the same, each
refresh round doubles the time to the next, up to probe.refresh_max; a figure that moves by more than
REFRESH_SHIFT, or a change of the chosen peers, sets it back to probe.interval."""

from __future__ import annotations

import itertools

import pytest
import trio
import trio.testing

from fusionp2p.errors import ConfigError
from fusionp2p.swarm.node import SwarmConfig
from fusionp2p.swarm.probe import ProbeConfig, ProbeResult
from fusionp2p.swarm.prober import REFRESH_SHIFT
from fusionp2p.testing.swarm import converge, local_swarm


def test_an_idle_nodes_refreshes_back_off_and_a_change_resets_them() -> None:
    async def main() -> None:
        cfg = SwarmConfig(heartbeat=1.0, dead_timeout=5.0, watch=0,
                          probe=ProbeConfig(bytes=64 * 1024, interval=1.0, refresh_max=8.0, duty=1.0))
        async with local_swarm(2, libp2p=False, config=cfg) as (_boot, nodes):
            await converge(nodes, bandwidth=True, timeout=30)
            a, b = nodes
            pr = a.prober if a.prober.links else b.prober     # the pair is measured from one side
            peer = next(iter(pr.links))
            # fixed figures: every refresh measures the same, as an idle link does
            real_apply = pr._apply_probe
            measured: list[float] = []

            def steady(p: str, res: ProbeResult) -> None:
                measured.append(trio.current_time())
                real_apply(p, ProbeResult(peer=p, bandwidth=50e6, rtt=0.001, elapsed=0.25, nbytes=1 << 20))

            pr._apply_probe = steady  # type: ignore[method-assign,assignment]
            pr.links[peer].bandwidth = 50e6
            t0 = trio.current_time()
            await trio.sleep(60)
            gaps = [round(y - x) for x, y in itertools.pairwise(measured)]
            # without the back-off: one refresh a second (about 60); with it, gaps 1, 2, 4, then 8
            assert 8 <= len(measured) <= 12, (len(measured), gaps)
            assert gaps[:4] == [1, 2, 4, 8] and gaps[-3:] == [8, 8, 8], gaps
            assert pr.refresh_every == 8.0 and measured[0] - t0 < 3
            # the link's figure moves by more than REFRESH_SHIFT: the next refresh is probe.interval after it
            pr._apply_probe = real_apply  # type: ignore[method-assign]
            moved = pr.links[peer].bandwidth * REFRESH_SHIFT * 2  # type: ignore[operator]
            pr._apply_probe(peer, ProbeResult(peer=peer, bandwidth=moved, rtt=0.001, elapsed=0.25, nbytes=1 << 20))
            assert pr.unsettled
            pr._apply_probe = steady  # type: ignore[method-assign,assignment]
            n = len(measured)
            await trio.sleep(10)
            later = measured[n:]
            assert len(later) >= 3 and round(later[1] - later[0]) == 1, later

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_refresh_max_is_validated() -> None:
    with pytest.raises(ConfigError):
        ProbeConfig(refresh_max=0)
    assert ProbeConfig(interval=300.0).refresh_max == 160.0   # a longer interval is kept (the top is the larger)


def test_refreshes_wait_while_peers_measure_us_for_the_first_time() -> None:
    """A forming swarm: while new peers keep measuring their links to us, our refresh rounds (which would
    hold our server and a peer's) wait; they resume probe.interval after the last one."""
    async def main() -> None:
        cfg = SwarmConfig(heartbeat=1.0, dead_timeout=5.0, watch=0,
                          probe=ProbeConfig(bytes=64 * 1024, interval=1.0, refresh_max=8.0, duty=1.0))
        async with local_swarm(2, libp2p=False, config=cfg) as (_boot, nodes):
            await converge(nodes, bandwidth=True, timeout=30)
            a, b = nodes
            pr = a.prober if a.prober.links else b.prober     # the pair is measured from one side
            real_apply = pr._apply_probe
            measured: list[float] = []

            def count(p: str, res: ProbeResult) -> None:
                measured.append(trio.current_time())
                real_apply(p, res)

            pr._apply_probe = count  # type: ignore[method-assign,assignment]
            for i in range(20):   # a new peer's first probe reaches our server every half second
                pr.server.record_inbound(f"new-{i}", 1e6)
                pr.unsettled = True   # the chosen peers change as they join: refreshes every probe.interval
                await trio.sleep(0.5)
            assert measured == []
            t_last = trio.current_time()
            await trio.sleep(5)
            assert measured and measured[0] - t_last >= 0.5, (measured, t_last)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
