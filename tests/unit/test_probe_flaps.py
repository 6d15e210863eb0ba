"""A node's probes on a busy machine (issue 40): a member that flaps (declared dead, then revived) keeps its
link's figure, and a peer whose probe stream does not open in time is tried again after a growing backoff
with a longer deadline, not every heartbeat."""

from __future__ import annotations

import trio
import trio.testing

from fusionp2p.swarm.membership import Change, MemberEvent
from fusionp2p.swarm.prober import BACKOFF_MAX, KEEP_DEAD, _Link
from fusionp2p.testing.swarm import run_hand_driven


def _run(body):  # type: ignore[no-untyped-def]
    """*body(net, nodes)* on 3 nodes and a bootstrap, probing off (driven by hand): ``testing.swarm.run_hand_driven``."""
    run_hand_driven(body, dead_timeout=4.0)


def test_a_flapping_member_keeps_its_measured_link() -> None:
    async def body(net, nodes):  # type: ignore[no-untyped-def]
        a, b, c = nodes
        link = a.prober.links[b.peer_id] = _Link(bandwidth=5e6, rtt=0.002, samples=2)
        a.prober.dirty = True
        a._apply_events(a.view.declare_dead(b.peer_id))
        assert not a.view.is_alive(b.peer_id)
        assert a.prober.links[b.peer_id] is link   # kept through the death
        rep = a._report()
        assert rep is not None and any(m.dst == b.peer_id for m in rep.measurements)
        a._apply_events([MemberEvent(Change.REVIVED, b.peer_id)])
        assert b.peer_id not in a.prober.dead_since
        assert b.peer_id not in a.prober._probe_targets()   # measured: not probed again as a newcomer
        # one that stays dead is forgotten after KEEP_DEAD; one that leaves, at once
        a.prober.links[c.peer_id] = _Link(bandwidth=5e6, rtt=0.002, samples=1)
        await a.wait_until(lambda: a.view.is_alive(b.peer_id), 10)   # its next record revives it here too
        net.kill(b.peer_id)
        await a.wait_until(lambda: not a.view.is_alive(b.peer_id), 10)   # by its silence this time
        assert a.prober.links[b.peer_id] is link
        await trio.sleep(KEEP_DEAD + 1)
        a.prober.on_gone(c.peer_id, left=False)
        assert b.peer_id not in a.prober.links and c.peer_id in a.prober.links
        a.prober.on_gone(c.peer_id, left=True)
        assert c.peer_id not in a.prober.links and not a.prober.dead_since

    _run(body)


def test_a_peer_whose_probe_does_not_open_is_backed_off() -> None:
    async def body(net, nodes):  # type: ignore[no-untyped-def]
        a, b, _ = nodes
        net.kill(b.peer_id)   # still alive in a's view for a while: its probes fail
        pr = a.prober
        hb = a.config.heartbeat
        waits = []
        for _ in range(7):
            t = trio.current_time()
            await pr._probe_one(b.peer_id, trio.Lock(), trio.CapacityLimiter(1), [0.0])
            waits.append(round((pr.links[b.peer_id].retry_at - t) / hb))
            assert b.peer_id not in pr._probe_targets()   # waits out its backoff
        assert waits == [1, 2, 4, 4, 4, 4, 4] and BACKOFF_MAX == 4
        assert a.counters.probes_failed == 7

    _run(body)
