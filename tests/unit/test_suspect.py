"""Suspicion before death (swarm/suspect.py): a member whose heartbeats stop is pinged, and declared dead
only if it does not answer; the bound on detection holds."""

import trio
import trio.testing

from fusionp2p.net.memory import MemoryTransport, memory_network
from fusionp2p.net.transport import Stream
from fusionp2p.swarm.membership import Change, MembershipView
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.testing.swarm import TEST_PROFILE, converge, start_swarm
from fusionp2p.wire.protocols import PROBE
from fusionp2p.wire.records import NodeRecord

IDS = [f"peer{i:02d}" for i in range(4)]


def _rec(peer: str, seq: int) -> NodeRecord:
    return NodeRecord(peer=peer, role="node", addrs=(), profile=None, started=0.0, seq=seq)


def test_a_silent_member_is_suspect_then_dead_unless_vouched_for() -> None:
    v = MembershipView(self_peer=IDS[0], timeout=5.0, confirm=3.0)
    for p in IDS[1:]:
        v.on_record(_rec(p, 1), 0.0)
    assert v.tick(5.5) == [] and set(v.suspects) == set(IDS[1:])   # silent past the timeout: suspect, alive
    assert all(v.is_alive(p) for p in IDS[1:])
    assert v.vouch(IDS[1], 6.0)                      # answered a ping: as good as a record
    assert [e.change for e in v.on_record(_rec(IDS[2], 2), 6.0)] == [Change.UPDATED]   # a record clears it too
    assert set(v.suspects) == {IDS[3]}
    assert v.tick(8.0) == []
    dead = v.tick(8.6)                                # 5 s + 3 s of suspicion, and no word
    assert [(e.change, e.peer) for e in dead] == [(Change.DEAD, IDS[3])] and not v.suspects
    assert not v.vouch(IDS[3], 9.0)                   # a dead member is revived by a record, not a ping
    assert v.tick(11.1) == [] and set(v.suspects) == set(IDS[1:3])   # 5 s after their word: suspect again
    v.excuse(2.0)                                     # our loop was held up: suspicion's end moves on too
    assert v.tick(13.5) == [] and set(v.suspects) == set(IDS[1:3])
    assert sorted(e.peer for e in v.tick(16.2)) == IDS[1:3] and v.alive() == []


def test_confirm_zero_is_dead_at_the_timeout() -> None:
    v = MembershipView(self_peer=IDS[0], timeout=5.0)
    v.on_record(_rec(IDS[1], 1), 0.0)
    assert [e.peer for e in v.tick(5.5)] == [IDS[1]] and not v.suspects


async def _hang(stream: Stream) -> None:
    await trio.sleep_forever()


def test_a_member_whose_heartbeats_stop_but_answers_pings_is_not_declared_dead() -> None:
    """Its heartbeats are lost (a starved process, gossip that does not reach us) but it answers a direct
    ping: alive, for as long as it answers. Once it stops answering (its loop hung), it is dead within the
    records' timeout plus the suspicion; a killed one (its stream refused) at once after the timeout."""

    async def main() -> None:
        cfg = SwarmConfig(heartbeat=1.0, dead_timeout=4.0, probing=False)
        async with memory_network() as net:
            hosts = [net.add_host() for _ in range(4)]
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=4.0), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:]]
            async with trio.open_nursery() as nursery:
                await start_swarm(nursery, boot, nodes, hosts[0].listen_addrs()[0])
                await converge(nodes, bandwidth=False, timeout=10)
                mute, watcher = nodes[0], nodes[1]

                async def dropped(topic: str, data: bytes) -> None:
                    return None

                mute.transport.publish = dropped  # type: ignore[method-assign]
                await trio.sleep(30)              # 6 of its records' timeouts of silence
                assert not any(e.change is Change.DEAD and e.peer == mute.peer_id
                               for n in [boot, *nodes[1:]] for e in n.counters.events)
                assert watcher.confirmer.answered > 0 and watcher.view.is_alive(mute.peer_id)
                assert isinstance(mute.transport, MemoryTransport)
                mute.transport.set_stream_handler(PROBE, _hang)   # now it hangs: pings go unanswered
                t0 = watcher.view.last_seen[mute.peer_id]   # its last answer
                bound = watcher.view.timeout_of(mute.peer_id) + cfg.confirm
                await watcher.wait_until(lambda: mute.peer_id in watcher.view.dead, timeout=30)
                assert trio.current_time() - t0 <= bound + cfg.heartbeat
                victim = nodes[2]
                t1, bound = trio.current_time(), watcher.view.timeout_of(victim.peer_id)
                net.kill(victim.peer_id)
                await watcher.wait_until(lambda: victim.peer_id in watcher.view.dead, timeout=30)
                assert trio.current_time() - t1 <= bound + cfg.heartbeat   # its stream refused: no suspicion's wait
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


class _HangingTransport:
    """open_stream never answers: counts the pings under way at once."""

    peer_id = IDS[0]

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.asked: list[str] = []

    def connected_peers(self) -> list[str]:
        return list(IDS[1:])

    async def open_stream(self, peer: str, protocol: str) -> Stream:
        self.asked.append(peer)
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await trio.sleep_forever()
        finally:
            self.now -= 1
        raise AssertionError("unreachable")


def test_suspects_are_pinged_a_few_at_a_time_and_die_at_their_deadline_regardless() -> None:
    """Many suspects at once (a lying swarm going silent, or our own loop starved): at most ``limit``
    pings run, earliest deadline first, and every suspect is dead by its deadline, pinged or not."""
    from fusionp2p.swarm.suspect import Confirmer

    ids = [f"peer{i:03d}" for i in range(1, 41)]

    async def main() -> None:
        v = MembershipView(self_peer=IDS[0], timeout=5.0, confirm=3.0)
        for i, p in enumerate(ids):
            v.on_record(_rec(p, 1), i * 0.01)
        t = _HangingTransport()
        dead: list[str] = []
        async def no_dial(peer: str) -> bool:
            return False

        c = Confirmer(t, v, limit=4, dead=dead.append, redial=no_dial)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(c.run)
            await trio.sleep(5.5)
            assert v.tick(trio.current_time()) == [] and len(v.suspects) == len(ids)
            c.kick()
            await trio.sleep(1.0)
            assert t.most == 4 and sorted(t.asked) == ids[:4]   # earliest deadlines (then ids) first, four at once
            await trio.sleep(2.1)                       # past every suspect's deadline (5.5 + 3 s)
            died = v.tick(trio.current_time())
            assert sorted(e.peer for e in died) == ids and dead == []   # silence, not refusals
            await trio.sleep(1.0)
            assert t.now == 0 and len(t.asked) <= 12 and not c.pinging   # pings ended with their suspects
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
