"""A node's work does not grow with the swarm (issue 40): its probe set stays at ``probe.peers``, and a
killed node is noticed by every other within the same bound at 200 members as at 30, while the
heartbeat records' period stretches with the swarm (members / gossip_rate). Real SwarmNodes on the
in-memory transport, trio's autojump clock."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing

from fusionp2p.net.identity import verify
from fusionp2p.net.memory import memory_network
from fusionp2p.swarm import node as swarm_mod
from fusionp2p.swarm.membership import prober_of
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.probe import ProbeConfig
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.testing.wait import poll_until
from fusionp2p.wire.records import Record, decode_signed

K = 12   # probe.peers: smaller than the default (24), so that 30 members already exceed it


def _swarm(n: int) -> tuple[float, float, list[int], list[float]]:
    """(seconds until every live node saw a killed one dead, the bound, probe set sizes, periods) of a
    swarm of *n* nodes. Probing itself is off (its transfers are not what is measured here); the probe
    sets are the prober's own choice over the same view."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    cfg = SwarmConfig(heartbeat=1.0, dead_timeout=4.0, watch_timeout=4.0, gossip_rate=5.0, probing=False,
                      probe=ProbeConfig(peers=K))
    out: list[tuple[float, float, list[int], list[float]]] = []

    async def main() -> None:
        async with memory_network(gossip_buffer=4 * n) as net:
            hosts = [net.add_host() for _ in range(n + 1)]
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=4.0), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:]]
            async with trio.open_nursery() as nursery:
                await nursery.start(boot.run, [])
                for node in nodes:
                    await nursery.start(node.run, [hosts[0].listen_addrs()[0]])
                ids = sorted(x.peer_id for x in nodes)
                with trio.fail_after(120):   # virtual seconds
                    for node in nodes:
                        await node.wait_until(lambda node=node: node.members() == ids, 120)
                    # every node watches its chosen members (a task each) before the kill is timed
                    def watching() -> bool:
                        return all(set(x.watcher.scopes) == set(x.watcher.chosen()) for x in nodes)
                    await poll_until(watching, 120, interval=cfg.heartbeat / 4)
                sizes = [len(x.prober.chosen()[1]) for x in nodes]
                periods = [x.period() for x in nodes]
                victim = nodes[n // 2]
                t0 = trio.current_time()
                net.kill(victim.peer_id)
                with trio.fail_after(60):
                    for node in nodes:
                        if node is not victim:
                            await node.wait_until(lambda node=node: victim.peer_id in node.view.dead, 60)
                out.append((trio.current_time() - t0, cfg.watch_timeout + 2 * cfg.heartbeat, sizes, periods))
                nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    return out[0]


def test_probe_set_and_death_notice_do_not_grow_with_the_swarm(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every node of a real swarm verifies each record on its own CPU; here the 200 share one, so each
    # distinct record is decoded and verified once for all of them (records are immutable).
    @functools.cache
    def decode(raw: bytes) -> Record:
        return decode_signed(raw, verify)

    monkeypatch.setattr(swarm_mod, "decode_signed", lambda raw, _verify: decode(raw))
    small = _swarm(30)
    big = _swarm(200)
    for took, bound, sizes, _ in (small, big):
        assert took <= bound, (took, bound)
        assert max(sizes) <= K
    # the heartbeat records stretch (200 / 5 = 40 s; their own timeout would be 200 s), the notice does not
    assert min(big[3]) >= 30.0
    assert big[0] <= small[0] + 2.0
    # every node measures some links of its own, and together they cover each node's chosen peers once
    assert min(big[2]) >= 1 and sum(big[2]) >= 200 * K // 2


def test_probes_of_measures_every_pair_once_while_the_swarm_is_small() -> None:
    from fusionp2p.net.identity import Identity
    from fusionp2p.swarm.membership import probes_of

    ids = sorted(Identity(bytes([i + 1]) * 32).peer_id for i in range(K + 1))
    pairs = [(a, b) for a in ids for b in probes_of(a, ids, K)]
    assert len(pairs) == len(ids) * (len(ids) - 1) // 2
    assert all(prober_of(a, b) == a for a, b in pairs)
