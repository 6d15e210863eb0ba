"""Bounded work per node (issue 40): whom a node measures and watches, estimates of the other links, and
the watchers' death notices."""

from __future__ import annotations

import trio
import trio.testing

from fusionp2p.net.identity import Identity
from fusionp2p.net.memory import memory_network
from fusionp2p.swarm.membership import BandwidthTable, Change, MembershipView, chosen, probes_of
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.watch import Watch, watches
from fusionp2p.testing.swarm import TEST_PROFILE, converge, start_swarm
from fusionp2p.wire.records import BandwidthReport, Measurement, NodeRecord

IDS = [Identity(i.to_bytes(2, "big") * 16).peer_id for i in range(1, 301)]


def test_a_node_measures_at_most_k_links_whatever_the_swarm() -> None:
    k = 24
    for n in (30, 100, 300):
        ids = IDS[:n]
        probes = {a: probes_of(a, ids, k) for a in ids}
        assert max(len(p) for p in probes.values()) <= k
        pairs = {frozenset((a, b)) for a, bs in probes.items() for b in bs}
        assert sum(len(p) for p in probes.values()) == len(pairs)          # each pair from one side only
        # every pair a node chose is measured, by one side or the other
        assert all(frozenset((a, b)) in pairs for a in ids for b in chosen(a, ids, k))
        # and every node has measured links: it chose k peers
        assert min(sum(a in pair for pair in pairs) for a in ids) >= k
    # the choice is a hash of the pair: the same peer chooses the same among the same members
    assert chosen(IDS[0], IDS[:100], 8) == chosen(IDS[0], list(reversed(IDS[:100])), 8)


def test_each_pair_is_probed_from_one_side_from_views_that_leave_the_node_out() -> None:
    """A node's view of the members leaves itself out; the pairs it probes must still be the ones
    ``prober_of`` gives it in a small swarm, never both sides of one pair (found on the merge of #40)."""
    from fusionp2p.swarm.membership import prober_of

    ids = IDS[:8]
    for a in ids:
        view = [p for p in ids if p != a]
        assert set(probes_of(a, view, 24)) == {b for b in view if prober_of(a, b) == a}
    for n in (30, 100):
        views = {a: [p for p in IDS[:n] if p != a] for a in IDS[:n]}
        pairs = [frozenset((a, b)) for a in IDS[:n] for b in probes_of(a, views[a], 24)]
        assert len(pairs) == len(set(pairs))


def test_watchers_are_the_chosen_pairs() -> None:
    ids = IDS[:100]
    a = ids[0]
    for b in ids[1:]:
        assert watches(a, b, ids, 8) == (b in chosen(a, ids, 8) or a in chosen(b, ids, 8))
    # every node is watched by someone
    assert all(any(watches(w, p, ids, 8) for w in ids if w != p) for p in ids)


def _rep(peer: str, seq: int, up: float, down: float, *ms: tuple[str, float, float]) -> BandwidthReport:
    return BandwidthReport(peer=peer, seq=seq, uplink=up, downlink=down,
                           measurements=tuple(Measurement(src=peer, dst=d, bandwidth=bw, rtt=rtt, samples=1) for d, bw, rtt in ms))


def test_estimates_use_capacities_checked_against_measurements() -> None:
    a, b, c, liar = IDS[:4]
    t = BandwidthTable()
    t.on_report(_rep(a, 1, 10e6, 10e6, (b, 8e6, 0.020)))
    t.on_report(_rep(b, 1, 12e6, 12e6))
    t.on_report(_rep(c, 1, 5e6, 5e6, (a, 4e6, 0.030)))
    # measured pairs are never estimated
    assert t.estimate(a, b).measured and t.estimate(a, b).bandwidth == 8e6
    # unmeasured: min(uplink, downlink), latencies from the measured RTTs (half the smallest of each end)
    e = t.estimate(b, c)
    assert not e.measured and e.bandwidth == 5e6 and e.rtt == (0.020 + 0.030) / 2
    # a liar announcing absurd capacities: others measured 1 MB/s of it (more than CAPACITY_SLACK times less), it
    # is taken at the measured 1 MB/s and the announcement is counted against it
    t.on_report(_rep(liar, 1, 9e12, 9e12))
    t.on_report(_rep(a, 2, 10e6, 10e6, (b, 8e6, 0.020), (liar, 1e6, 0.040)))
    assert t.estimate(liar, b).bandwidth == 1e6
    assert t.estimate(b, liar).bandwidth == 1e6
    assert t.strikes == {liar: 1}
    # it spoils no other pair, and no measurement
    assert t.estimate(b, c).bandwidth == 5e6 and t.estimate(a, b).bandwidth == 8e6
    # a report replaced or forgotten leaves no figure behind
    t.on_report(_rep(a, 3, 10e6, 10e6))
    assert t.direct(a, b) is None and t.estimate(liar, b).bandwidth == 12e6   # unchecked again: b's downlink
    t.forget(c)
    assert t.direct(a, c) is None


def test_watch_needs_silence_and_two_failures() -> None:
    w = Watch(dead_after=4.0, last_ok=0.0)
    w.failed()
    assert not w.dead(10.0)                # one failure, however long: our own loop may have been held up
    w.failed()
    assert w.dead(10.0) and not w.dead(3.0)
    w.ok(11.0)
    assert not w.dead(20.0) and w.failures == 0


def test_declare_dead_and_revive() -> None:
    v = MembershipView(self_peer=IDS[0], timeout=5.0)
    v.on_record(NodeRecord(peer=IDS[1], role="node", addrs=(), profile=None, started=0.0, seq=1), 0.0)
    assert v.declare_dead(IDS[0]) == [] and v.declare_dead(IDS[2]) == []
    assert [e.change for e in v.declare_dead(IDS[1])] == [Change.DEAD]
    assert v.declare_dead(IDS[1]) == []
    rec = NodeRecord(peer=IDS[1], role="node", addrs=(), profile=None, started=0.0, seq=2)
    assert [e.change for e in v.on_record(rec, 1.0)] == [Change.REVIVED]


def test_a_false_death_notice_costs_its_victim_one_flap() -> None:
    """A watcher's notice about a live node: others take it (it comes from a watcher), the victim answers
    with a record at once, and everyone holds it alive again within a moment. A notice from a node that
    does not watch the peer is ignored."""
    async def main() -> None:
        cfg = SwarmConfig(heartbeat=1.0, dead_timeout=4.0, watch_timeout=4.0, gossip_rate=0.5, probing=False, watch=1)
        async with memory_network() as net:
            hosts = [net.add_host() for _ in range(7)]
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=4.0), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:]]
            async with trio.open_nursery() as nursery:
                await start_swarm(nursery, boot, nodes, hosts[0].listen_addrs()[0])
                await converge(nodes, bandwidth=False, timeout=30)
                ids = nodes[0].members()
                liar = nodes[0]
                victims = [n for n in nodes[1:] if watches(liar.peer_id, n.peer_id, ids, 1)]
                strangers = [n for n in nodes[1:] if not watches(liar.peer_id, n.peer_id, ids, 1)]
                assert victims and strangers
                others = [n for n in nodes[1:] if n is not victims[0]]
                t0 = trio.current_time()
                await liar._publish_record(gone=(victims[0].peer_id, strangers[0].peer_id))
                v, seen = victims[0].peer_id, others[0]
                await seen.wait_until(lambda: any(e.peer == v and e.change is Change.REVIVED for e in seen.counters.events), 5)
                for n in nodes:
                    await n.wait_until(lambda n=n: victims[0].peer_id in n.members() or n is victims[0], 5)
                assert trio.current_time() - t0 < cfg.heartbeat
                deaths = [(n, e.change) for n in others for e in n.counters.events if e.peer == victims[0].peer_id
                          and e.change in (Change.DEAD, Change.REVIVED)]
                assert {c for _, c in deaths} == {Change.DEAD, Change.REVIVED}
                assert not [e for n in others for e in n.counters.events if e.peer == strangers[0].peer_id
                            and e.change is Change.DEAD]
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_tick_looks_only_at_members_past_their_deadline() -> None:
    """The reaper's work per tick does not grow with the swarm: only members whose deadline passed are
    looked at (one heap entry each); a record, an excuse or a longer period moves a deadline on, and the
    live list is the same object until the member set changes."""
    def rec(peer: str, seq: int, period: float = 1.0) -> NodeRecord:
        return NodeRecord(peer=peer, role="node", addrs=(), profile=None, started=0.0, seq=seq, period=period)

    v = MembershipView(self_peer=IDS[0], timeout=5.0)
    for p in IDS[1:]:
        v.on_record(rec(p, 1), 0.0)
    alive = v.alive()
    assert v.tick(1.0) == [] and len(v._due) == len(IDS) - 1 and v.alive() is alive   # nothing due: nothing popped
    v.on_record(rec(IDS[1], 2), 4.0)
    v.on_record(rec(IDS[2], 2, period=2.0), 4.0)   # dead after 5 periods of 2 s now
    dead = v.tick(5.5)
    assert {e.peer for e in dead} == set(IDS[3:]) and all(e.change is Change.DEAD for e in dead)
    assert v.alive() == sorted(IDS[1:3]) and v.alive() is not alive and len(v._due) == 2
    v.excuse(10.0)   # we were held up: IDS[1] was last heard at 14 now
    assert v.tick(12.0) == [] and v.is_alive(IDS[1])
    assert [e.peer for e in v.tick(19.5)] == [IDS[1]]
    assert [e.peer for e in v.tick(24.5)] == [IDS[2]] and v.alive() == []


def test_members_that_went_silent_still_count_in_the_swarms_size() -> None:
    """A node that stops hearing its peers (starved, or its gossip lost) must not shorten its heartbeat
    period on that account: its peers time it out by the period it announces (the feedback measured at 20
    processes on a loaded machine: a member declared dead 5-10 s after it revived, over and over). The
    dead count for ``within`` seconds after their death, then no more; a revived or departed member once."""
    import dataclasses

    from fusionp2p.swarm.membership import RECENT_DEATHS

    v = MembershipView(self_peer=IDS[0], timeout=5.0)

    def rec(peer: str, seq: int) -> NodeRecord:
        return NodeRecord(peer=peer, role="node", addrs=(), profile=None, started=0.0, seq=seq, period=4.0)

    for p in IDS[:20]:
        v.on_record(rec(p, 1), 0.0)
    assert v.counted(0.0) == 20
    for p in IDS[:5]:                          # ourselves and 4 peers keep beating; 15 fall silent
        v.on_record(rec(p, 2), 30.0)
    assert len([e for e in v.tick(30.0) if e.change is Change.DEAD]) == 15
    assert len(v.last_seen) == 5 and v.counted(30.0) == 20          # the size held, not 5
    assert [e.change for e in v.declare_dead(IDS[4], 31.0)] == [Change.DEAD]
    assert v.counted(31.0) == 20
    v.on_record(rec(IDS[5], 2), 32.0)         # revived: counted once, as alive
    v.on_record(dataclasses.replace(rec(IDS[6], 3), leaving=True), 32.0)   # left: no longer counted
    assert v.counted(32.0) == 19
    assert v.counted(30.0 + RECENT_DEATHS) == 6    # 5 alive; the silent ones aged out, IDS[4] died later
    assert v.counted(31.0 + RECENT_DEATHS) == 5
    assert not v._died                        # and forgotten: bounded by the recent deaths
