"""Many swarm nodes in one process: convergence on real libp2p, failure detection on the memory transport."""

from dataclasses import replace

import pytest
import trio
import trio.testing

from fusionp2p.net.identity import Identity, verify
from fusionp2p.net.memory import memory_network
from fusionp2p.net.transport import GossipMessage
from fusionp2p.swarm import node as swarm_mod
from fusionp2p.swarm.membership import Change, prober_of
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.probe import ProbeConfig
from fusionp2p.testing.swarm import TEST_PROFILE, converge, local_swarm, start_swarm
from fusionp2p.wire.protocols import TOPIC_MEMBERS
from fusionp2p.wire.records import BandwidthReport, encode_bundle


def test_eight_libp2p_nodes_converge_on_members_and_bandwidth() -> None:
    # One process carries the whole swarm: at the default gossip_rate (5 heartbeat messages/s, each verified by all 9
    # nodes, several times over gossipsub) it idled at 0.16-0.2 CPU-s/s, and short of CPU its probes timed out and
    # its members were declared dead: converging took 139 s and 30.8 CPU-s on a 0.25-core cgroup (131 failed probes)
    # and 192 s and 35 CPU-s (124 failed, 93 deaths; 10 s control deadline) at load 9-27, against 8 s and 2.6 CPU-s when it got its CPU.
    # At 1 message/s (the 9 nodes together verify about what one node of a real swarm verifies at the default
    # rate; a 9 s period, so a late heartbeat is no death: 5 periods) it idles at 0.05-0.08 CPU-s/s and converges
    # in 14-17 s with 2.2-2.3 CPU-s on 0.15-0.25 core; the probes' control deadline of 10 s (3 s: a stream opened
    # on a starved loop in more, and each failed open was paid again) took a 0.1-core run from 40-66 failed probes
    # and 35-51 s to 2 and 28 s. (At 2 messages/s: 9 s when it got its CPU, not within 4 minutes on 0.1 core.)
    cfg = SwarmConfig(probe=ProbeConfig(bytes=128 * 1024, takeover=1e6, ctrl_timeout=10.0), gossip_rate=1.0)

    async def main() -> None:
        with trio.fail_after(90):
            async with local_swarm(8, config=cfg) as (boot, nodes):
                await converge(nodes, bandwidth=True, timeout=80)
                ids = sorted(n.peer_id for n in nodes)
                # every node holds the same member set and a complete, directly measured matrix
                mats = [n.bandwidth.matrix(ids) for n in nodes]
                for m in mats:
                    assert len(m) == len(ids) * (len(ids) - 1)
                    assert all(e.measured and e.bandwidth > 0 for e in m.values())
                assert boot.view.alive(role="node") == ids
                assert all(n.counters.bad_records == 0 for n in nodes)
                # each pair was probed from one side only, the one prober_of names
                for n in nodes:
                    mine = {p for p in ids if p != n.peer_id and prober_of(n.peer_id, p) == n.peer_id}
                    assert {p for p, ln in n.prober.links.items() if ln.samples} == mine

    trio.run(main)


def test_dead_and_departing_peers_are_detected_with_fake_clock() -> None:
    async def main() -> None:
        cfg = SwarmConfig(heartbeat=1.0, dead_timeout=4.0, probing=False)
        async with memory_network() as net:
            hosts = [net.add_host() for _ in range(5)]
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=4.0), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:]]
            async with trio.open_nursery() as nursery:
                await start_swarm(nursery, boot, nodes, hosts[0].listen_addrs()[0])
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


def test_a_held_up_event_loop_declares_nobody_dead() -> None:
    """The process does not run for longer than dead_timeout (a long synchronous step: the first DAG
    validation in a node imported 800 modules on the event loop, 3 s and more under load). The peers'
    heartbeats sent meanwhile wait unread; before, the reaper woke first and declared every peer dead
    (and revived them a moment later: a spurious re-plan of a running job). A killed peer still dies."""
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def main() -> None:
        cfg = SwarmConfig(heartbeat=1.0, dead_timeout=4.0, probing=False)
        async with memory_network() as net:
            hosts = [net.add_host() for _ in range(4)]
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=4.0), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:]]
            async with trio.open_nursery() as nursery:
                await start_swarm(nursery, boot, nodes, hosts[0].listen_addrs()[0])
                await converge(nodes, bandwidth=False, timeout=10)
                clock.jump(3 * cfg.dead_timeout)       # the loop held up: no task ran meanwhile
                await trio.sleep(3 * cfg.heartbeat)    # the reapers and the queued heartbeats run
                assert not [e for n in [boot, *nodes] for e in n.counters.events if e.change is Change.DEAD]
                net.kill(nodes[2].peer_id)
                await nodes[0].wait_until(lambda: nodes[2].peer_id in nodes[0].view.dead, timeout=10)
                nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)


def test_forged_gossip_is_counted_not_fatal() -> None:
    async def main() -> None:
        with trio.fail_after(10):
            async with local_swarm(2, libp2p=False, config=SwarmConfig(probing=False)) as (_boot, nodes):
                await converge(nodes, bandwidth=False, timeout=5)
                for junk in (b"", b"\x00", b"\x81\xa1v\x01", b"\xff" * 100):
                    nodes[0].handle_gossip(GossipMessage("fusionp2p/members/1", nodes[1].peer_id, junk))
                assert nodes[0].counters.bad_records == 4
                assert nodes[0].members() == sorted(n.peer_id for n in nodes)

    trio.run(main)


def test_heartbeat_period_stretches_with_the_swarm_without_false_deaths() -> None:
    """With gossip_rate 1 msg/s, 7 members beat every 7 s: the swarm sends ~1 heartbeat/s, nobody is
    declared dead although dead_timeout (3 s) is far below the period, and a killed node still is."""

    async def main() -> None:
        cfg = SwarmConfig(heartbeat=1.0, dead_timeout=3.0, gossip_rate=1.0, probing=False)
        async with memory_network() as net:
            hosts = [net.add_host() for _ in range(7)]
            published = [0]
            for h in hosts:
                orig = h.publish

                async def counting(topic: str, data: bytes, orig=orig) -> None:  # type: ignore[no-untyped-def]
                    published[0] += 1
                    await orig(topic, data)

                h.publish = counting  # type: ignore[method-assign]
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=3.0, gossip_rate=1.0), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:]]
            async with trio.open_nursery() as nursery:
                await start_swarm(nursery, boot, nodes, hosts[0].listen_addrs()[0])
                await converge(nodes, bandwidth=False, timeout=30)
                everyone = [boot, *nodes]
                for n in everyone:     # every node has stretched its period and heard everyone announce it
                    await n.wait_until(lambda n=n: n.period() == 7.0 and all(
                        n.view.records[m.peer_id].period == 7.0 for m in everyone if m is not n), timeout=10)
                published[0] = 0
                await trio.sleep(70)
                assert 7 * 70 / 7.0 <= published[0] <= 7 * 70 / (0.8 * 7.0) + 7   # ~gossip_rate per second, swarm-wide
                assert not any(e.change is Change.DEAD for n in nodes for e in n.counters.events)
                victim = nodes[-1]
                t0 = trio.current_time()
                net.kill(victim.peer_id)
                await nodes[0].wait_until(lambda: victim.peer_id in nodes[0].view.dead, timeout=60)
                assert trio.current_time() - t0 <= cfg.dead_beats * 7.0 + 7.0   # dead_beats periods, plus one
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_large_swarm_probes_a_bounded_sample_and_publishes_its_first_figure_at_once() -> None:
    """A round probes at most probe_first never-measured peers (then probe_sample in refresh rounds), every pair
    still gets measured over the rounds, and a node's first figures go out before its next regular heartbeat."""

    async def main() -> None:
        cfg = SwarmConfig(heartbeat=5.0, dead_timeout=30.0, probe=ProbeConfig(first=2, sample=2, bytes=64 * 1024))
        async with memory_network() as net:
            hosts = [net.add_host() for _ in range(7)]
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=5.0, dead_timeout=30.0), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:]]
            rounds: list[int] = []
            first_probe: dict[str, float] = {}
            for n in nodes:
                targets, one = n.prober._probe_targets, n.prober._probe_one

                def recording(targets=targets) -> list[str]:  # type: ignore[no-untyped-def]
                    out = targets()
                    rounds.append(len(out))
                    return out

                async def timed(peer: str, *args, n=n, one=one) -> None:  # type: ignore[no-untyped-def]
                    await one(peer, *args)
                    if n.counters.probes_ok and n.peer_id not in first_probe:
                        first_probe[n.peer_id] = trio.current_time()

                n.prober._probe_targets = recording  # type: ignore[method-assign]
                n.prober._probe_one = timed  # type: ignore[method-assign]
            report_at: dict[str, float] = {}
            apply = boot._apply_record

            def stamping(rec, raw, apply=apply):  # type: ignore[no-untyped-def]
                if isinstance(rec, BandwidthReport):
                    report_at.setdefault(rec.peer, trio.current_time())
                apply(rec, raw)

            boot._apply_record = stamping  # type: ignore[method-assign]
            async with trio.open_nursery() as nursery:
                await start_swarm(nursery, boot, nodes, hosts[0].listen_addrs()[0])
                for n in nodes:
                    await boot.wait_until(lambda n=n: n.peer_id in boot.bandwidth.reports, timeout=60)
                assert first_probe   # a node none of whose pairs is its own reports only its downlink figure
                for p, t in first_probe.items():
                    # the bootstrap holds the node's report less than one heartbeat after its first measurement
                    assert report_at[p] - t < cfg.heartbeat
                await converge(nodes, bandwidth=True, timeout=300)
                assert rounds and max(rounds) <= max(cfg.probe.first, cfg.probe.sample)
                ids = sorted(n.peer_id for n in nodes)
                assert len(boot.bandwidth.matrix(ids)) == len(ids) * (len(ids) - 1)
                up = [boot.bandwidth.reports[p] for p in ids]
                assert all(r.uplink > 0 and r.downlink > 0 for r in up)   # capacity estimates for unmeasured pairs
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_repeated_report_is_not_verified_again(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with local_swarm(2, libp2p=False, config=SwarmConfig(probe=ProbeConfig(bytes=64 * 1024))) as (_boot, nodes):
                await converge(nodes, bandwidth=True, timeout=20)
                a, b = nodes
                await a.wait_until(lambda: b.peer_id in a._raw_bw, timeout=20)
                calls: list[bytes] = []

                def counting(peer: str, data: bytes, sig: bytes) -> bool:
                    calls.append(data.split(b"\x00", 1)[0])
                    return verify(peer, data, sig)

                monkeypatch.setattr(swarm_mod, "verify", counting)
                raw_bw = a._raw_bw[b.peer_id]
                bundle = encode_bundle([a._raw[b.peer_id], raw_bw])
                b_seen = a.counters.bad_records
                a.handle_gossip(GossipMessage(TOPIC_MEMBERS, b.peer_id, bundle))
                assert calls == [b"node"]     # the node record (stale seq, dropped by the view), not the report
                assert a.counters.bad_records == b_seen

    trio.run(main)


def test_a_pair_whose_prober_does_not_probe_is_taken_over_by_the_other_side() -> None:
    """Each pair is probed from one side (prober_of); a node with probes off leaves its pairs to the other
    side, which measures them once probe_takeover has passed, so the matrix still completes."""

    async def main() -> None:
        cfg = SwarmConfig(heartbeat=1.0, dead_timeout=5.0, probe=ProbeConfig(bytes=64 * 1024, takeover=20.0))
        async with memory_network() as net:
            hosts = [net.add_host(Identity(bytes([i + 1]) * 32)) for i in range(5)]   # fixed ids: a fixed split
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=5.0), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:4]]
            lazy = SwarmNode(hosts[4], replace(cfg, probing=False), TEST_PROFILE)
            ids = sorted(n.peer_id for n in [*nodes, lazy])
            assert sum(prober_of(n.peer_id, lazy.peer_id) == lazy.peer_id for n in nodes) == 2   # left to take over
            async with trio.open_nursery() as nursery:
                await nursery.start(boot.run, [])
                t0 = trio.current_time()
                for n in [*nodes, lazy]:
                    await nursery.start(n.run, [hosts[0].listen_addrs()[0]])
                await converge([*nodes, lazy], bandwidth=True, timeout=120)
                assert trio.current_time() - t0 >= cfg.probe.takeover       # not before the takeover
                assert lazy.counters.probes_ok == 0
                assert len(boot.bandwidth.matrix(ids)) == len(ids) * (len(ids) - 1)
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_refresh_probes_keep_to_the_duty_cycle() -> None:
    """On a shaped 20 Mbit/s link (mock clock) a probe lasts ~0.25 s; with refreshes due every second,
    the bulk transfer time over 300 s stays within probe_duty of it plus the bucket's burst."""

    async def main() -> None:
        cfg = SwarmConfig(heartbeat=1.0, dead_timeout=5.0, probe=ProbeConfig(interval=1.0, refresh_max=1.0, duty=0.02, burst=1.0))
        async with memory_network() as net:
            hosts = [net.add_host() for _ in range(3)]
            for h in hosts[1:]:
                orig = h.open_stream

                async def shaped(peer: str, protocol: str, orig=orig) -> object:  # type: ignore[no-untyped-def]
                    return _Paced(await orig(peer, protocol), 20e6 / 8)

                h.open_stream = shaped  # type: ignore[method-assign]
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=5.0), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:]]
            spent: list[float] = []
            for n in nodes:
                apply = n.prober._apply_probe

                def counting(peer, res, apply=apply):  # type: ignore[no-untyped-def]
                    spent.append(res.elapsed)
                    apply(peer, res)

                n.prober._apply_probe = counting  # type: ignore[method-assign]
            async with trio.open_nursery() as nursery:
                await start_swarm(nursery, boot, nodes, hosts[0].listen_addrs()[0])
                await converge(nodes, bandwidth=True, timeout=30)
                t0, first = trio.current_time(), sum(spent)
                await trio.sleep(300)
                refresh = sum(spent) - first
                assert len(spent) >= 4                                   # refreshes did run
                assert refresh <= cfg.probe.duty * (trio.current_time() - t0) + cfg.probe.burst + 0.5
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


class _Paced:
    """A stream whose sends take len/rate seconds (a shaped link on the mock clock)."""

    def __init__(self, s: object, rate: float) -> None:
        self.s, self.rate = s, rate
        self.remote_peer = s.remote_peer  # type: ignore[attr-defined]

    async def send_all(self, data: bytes) -> None:
        await trio.sleep(len(data) / self.rate)
        await self.s.send_all(data)  # type: ignore[attr-defined]

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.s.receive_some(max_bytes)  # type: ignore[attr-defined,no-any-return]

    async def send_eof(self) -> None:
        await self.s.send_eof()  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        await self.s.aclose()  # type: ignore[attr-defined]
