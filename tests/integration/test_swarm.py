"""Many swarm nodes in one process: convergence on real libp2p, failure detection on the memory transport."""

import trio
import trio.testing

from fusionp2p.runtime.membership import Change
from fusionp2p.runtime.swarm import SwarmConfig, SwarmNode
from fusionp2p.testing.memory import memory_network
from fusionp2p.testing.swarm import TEST_PROFILE, converge, local_swarm


def test_eight_libp2p_nodes_converge_on_members_and_bandwidth() -> None:
    async def main() -> None:
        with trio.fail_after(90):
            async with local_swarm(8, config=SwarmConfig(probe_bytes=128 * 1024)) as (boot, nodes):
                await converge(nodes, bandwidth=True, timeout=80)
                ids = sorted(n.peer_id for n in nodes)
                # every node holds the same member set and a complete, directly measured matrix
                mats = [n.bandwidth.matrix(ids) for n in nodes]
                for m in mats:
                    assert len(m) == len(ids) * (len(ids) - 1)
                    assert all(e.measured and e.bandwidth > 0 for e in m.values())
                assert boot.view.alive(role="node") == ids
                assert all(n.counters.bad_records == 0 for n in nodes)

    trio.run(main)


def test_dead_and_departing_peers_are_detected_with_fake_clock() -> None:
    async def main() -> None:
        cfg = SwarmConfig(heartbeat=1.0, dead_timeout=4.0, probe=False)
        async with memory_network() as net:
            hosts = [net.add_host() for _ in range(5)]
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=4.0), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:]]
            async with trio.open_nursery() as nursery:
                await nursery.start(boot.run, [])
                for n in nodes:
                    await nursery.start(n.run, [hosts[0].listen_addrs()[0]])
                await converge(nodes, bandwidth=False, timeout=10)
                # SIGKILL-like death: no goodbye
                victim = nodes[3]
                t0 = trio.current_time()
                net.kill(victim.peer_id)
                for n in nodes[:3]:
                    await n.wait_until(lambda n=n: victim.peer_id in n.view.dead, timeout=10)
                assert trio.current_time() - t0 <= cfg.dead_timeout + 2 * cfg.heartbeat
                # clean departure: removed at once, not after the timeout
                leaver = nodes[2]
                t1 = trio.current_time()
                await leaver.leave()
                for n in nodes[:2]:
                    await n.wait_until(lambda n=n: leaver.peer_id not in n.members(), timeout=10)
                assert trio.current_time() - t1 < cfg.heartbeat
                assert any(e.change is Change.LEFT and e.peer == leaver.peer_id for e in nodes[0].counters.events)
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_forged_gossip_is_counted_not_fatal() -> None:
    async def main() -> None:
        with trio.fail_after(10):
            async with local_swarm(2, libp2p=False, config=SwarmConfig(probe=False)) as (_boot, nodes):
                await converge(nodes, bandwidth=False, timeout=5)
                from fusionp2p.net.transport import GossipMessage

                for junk in (b"", b"\x00", b"\x81\xa1v\x01", b"\xff" * 100):
                    nodes[0].handle_gossip(GossipMessage("fusionp2p/members/1", nodes[1].peer_id, junk))
                assert nodes[0].counters.bad_records == 4
                assert nodes[0].members() == sorted(n.peer_id for n in nodes)

    trio.run(main)
