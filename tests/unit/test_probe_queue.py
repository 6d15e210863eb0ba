"""A busy probe server queues rather than refuses (issue 40, swarm/probe_hold.py): a waiting prober is served
in turn without a busy answer, the queue and each wait are bounded, a refused prober keeps its session for
the next round, and a pair whose prober is alive and tries is not taken over."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from fusionp2p.net.memory import memory_network
from fusionp2p.swarm.membership import prober_of
from fusionp2p.swarm.probe import MEASURE_BYTES, ProbeBusy, ProbeResult, ProbeServer, open_probe
from fusionp2p.swarm.probe_hold import OWN, QUEUE, QUEUE_WAIT, Reservations, may_wait
from fusionp2p.testing.swarm import run_hand_driven
from fusionp2p.wire.framing import encode_frame
from fusionp2p.wire.msg import packb
from fusionp2p.wire.protocols import PROBE


def test_the_reservation_serves_waiters_in_turn_within_bounds() -> None:
    """The state machine alone: FIFO, one place per peer (none for the holder), QUEUE places, QUEUE_WAIT each,
    and no place for a peer whose share is used up."""
    async def main() -> None:
        r = Reservations(hold=10.0, share=0.1)
        assert r.reserve("a", 0.0)
        ws = [r.enqueue(p, 0.0) for p in "bcde"]
        assert all(ws) and len(ws) == QUEUE == 4
        assert r.enqueue("f", 0.0) is None                   # the queue is full
        assert r.enqueue("b", 0.0) is None and r.enqueue("a", 0.0) is None   # one place a peer, none for the holder
        assert not r.reserve("f", 0.5)                      # no one jumps the queue
        r.release("a", 1.0)
        assert r.holds("b", 1.0) and ws[0] is not None and ws[0].granted.is_set()
        r.release("b", QUEUE_WAIT + 0.5)                    # the others waited past their deadline: gone
        assert not r.busy(QUEUE_WAIT + 0.5) and not r.queue
        assert r.reserve("c", 4.0)
        # "a" held 1 s of its 10 s bucket: it waits again, and is not queued once its share is used up
        r2 = Reservations(hold=1.0, share=0.1)
        assert r2.reserve("a", 0.0)
        r2.release("a", 1.0)
        assert r2.reserve(OWN, 1.0) and r2.enqueue("a", 1.0) is None and r2.enqueue("b", 1.0) is not None

    trio.run(main)


def test_a_second_prober_waits_and_is_served_without_a_refusal() -> None:
    """While one client holds the server between its transfers, a second that may wait is answered when the
    first lets go (before: ``busy``, then retries and a new session a heartbeat later)."""
    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net:
                a, b, c = net.add_host(), net.add_host(), net.add_host()
                server = ProbeServer()
                b.set_stream_handler(PROBE, server)
                s = await a.open_stream(b.peer_id, PROBE)
                await s.send_all(encode_frame(packb({"op": "bulk", "n": 10, "mark": 2}), max_frame=4096))
                await s.receive_some()                        # "go"
                await s.send_all(encode_frame(b"x" * 10, max_frame=4096))
                await s.receive_some()                        # "ack" of a pilot: the server stays a's
                got: list[ProbeResult] = []

                async def second() -> None:
                    session = await open_probe(c, b.peer_id)
                    got.append(await session.measure(MEASURE_BYTES, wait=True))
                    await session.aclose()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(second)
                    await trio.sleep(1.0)
                    assert not got and [w.peer for w in server.queue] == [c.peer_id]   # c waits in the queue
                    t0 = trio.current_time()
                    await s.aclose()
                assert got and got[0].measured and trio.current_time() - t0 < 1.0
                assert not server.busy(trio.current_time()) and not server.queue

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_waiter_past_the_queue_bound_is_refused_and_a_wait_has_a_deadline() -> None:
    """QUEUE waiters wait (at most QUEUE_WAIT, then busy); the next one, or a second stream of a waiting
    peer, is refused at once: a peer cannot make us hold more than that, nor hold the server longer."""
    async def main() -> None:
        with trio.fail_after(60):
            async with memory_network() as net:
                b = net.add_host()
                clients = [net.add_host() for _ in range(QUEUE + 1)]
                server = ProbeServer()
                b.set_stream_handler(PROBE, server)
                assert server.reserve("holder", trio.current_time())   # held for SERVER_HOLD (10 s) > QUEUE_WAIT
                answered: dict[int, float] = {}
                t0 = trio.current_time()

                async def one(i: int) -> None:
                    session = await open_probe(clients[i], b.peer_id)
                    with pytest.raises(ProbeBusy):
                        await session.measure(1024, wait=True)
                    answered[i] = trio.current_time() - t0
                    await session.aclose()

                async with trio.open_nursery() as nursery:
                    for i in range(QUEUE):
                        nursery.start_soon(one, i)
                    await trio.testing.wait_all_tasks_blocked()
                    assert len(server.queue) == QUEUE
                    await one(QUEUE)                                  # past the bound: refused at once
                    # a waiting peer's second stream has no second place
                    session = await open_probe(clients[0], b.peer_id)
                    with pytest.raises(ProbeBusy):
                        await session.measure(1024, wait=True)
                    await session.aclose()
                    assert answered == {QUEUE: pytest.approx(0.0, abs=0.1)}
                assert sorted(answered) == list(range(QUEUE + 1))
                assert all(answered[i] == pytest.approx(QUEUE_WAIT, abs=0.1) for i in range(QUEUE))
                assert not server.queue and server.holds("holder", trio.current_time())

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _nodes(body):  # type: ignore[no-untyped-def]
    """*body(nodes)* on 3 nodes and a bootstrap, probing off (driven by hand): ``testing.swarm.run_hand_driven``."""
    async def with_nodes(net, nodes):  # type: ignore[no-untyped-def]
        await body(nodes)

    run_hand_driven(with_nodes, dead_timeout=60.0)


def test_a_busy_peers_session_is_kept_for_the_next_round() -> None:
    """A prober refused as busy (the peer's server stayed held past each wait) keeps its session: the next
    round measures on it, with no new stream (before: closed, and opened again one heartbeat later)."""
    async def body(nodes):  # type: ignore[no-untyped-def]
        a, b = next((x, y) for x in nodes for y in nodes if x is not y and not may_wait(x.peer_id, y.peer_id))
        opens = []
        orig = a.transport.open_stream

        async def counted(peer: str, protocol: str):  # type: ignore[no-untyped-def]
            opens.append(protocol)
            return await orig(peer, protocol)

        a.transport.open_stream = counted
        pr = a.prober
        assert b.prober.server.reserve("someone", trio.current_time())
        await pr._probe_one(b.peer_id, trio.Lock(), trio.CapacityLimiter(1), [0.0])
        assert b.peer_id in pr.kept and a.counters.probes_busy == pr.config.busy_retries + 1
        b.prober.server.release("someone", trio.current_time())
        await trio.sleep(a.config.heartbeat)
        await pr._probe_one(b.peer_id, trio.Lock(), trio.CapacityLimiter(1), [0.0])
        assert pr.links[b.peer_id].samples == 1 and opens == [PROBE]   # measured on the kept session
        assert not pr.kept

    _nodes(body)


def test_no_takeover_while_the_pairs_prober_tries() -> None:
    """A pair left unmeasured by its prober for probe.takeover is probed from our side only when its prober has
    not asked our server for a probe within that time (before: also while it was alive and queued)."""
    async def body(nodes):  # type: ignore[no-untyped-def]
        x, y = next((p, q) for p in nodes for q in nodes if p is not q and prober_of(p.peer_id, q.peer_id) == q.peer_id)
        takeover = x.config.probe.takeover
        await trio.sleep(takeover - 5)
        session = await open_probe(y.transport, x.peer_id)   # y's prober tries (it was queued, or refused)
        await session.aclose()
        await trio.sleep(6)
        assert trio.current_time() - x.prober.known_since[y.peer_id] > takeover
        assert y.peer_id not in x.prober._probe_targets()
        await trio.sleep(takeover)                            # y stopped trying: the pair is ours too now
        assert y.peer_id in x.prober._probe_targets()

    _nodes(body)


def test_a_prober_that_took_the_peers_server_first_lets_it_go_if_its_own_does_not_come() -> None:
    """At a peer whose id sorts below ours we take its server first, then wait for our own (the lower id
    first: no two nodes wait for each other); if ours stays held past QUEUE_WAIT, the session closes and the
    peer's server is free again at once, not after its hold."""
    async def body(nodes):  # type: ignore[no-untyped-def]
        a, b = next((x, y) for x in nodes for y in nodes if x is not y and not may_wait(x.peer_id, y.peer_id))
        pr = a.prober
        assert pr.server.reserve("someone", trio.current_time())   # a peer measures its link to us
        seen: list[bool] = []
        orig = pr._own_turn

        async def own_turn() -> bool:
            seen.append(b.prober.server.holds(a.peer_id, trio.current_time()))   # the peer's server is ours
            return await orig()

        pr._own_turn = own_turn  # type: ignore[method-assign]
        t0 = trio.current_time()
        await pr._probe_one(b.peer_id, trio.Lock(), trio.CapacityLimiter(1), [0.0])
        assert seen == [True] and trio.current_time() - t0 == pytest.approx(QUEUE_WAIT, abs=0.1)
        assert a.counters.probes_busy == 1 and not pr.kept and not pr.links[b.peer_id].samples
        await trio.testing.wait_all_tasks_blocked()
        assert not b.prober.server.busy(trio.current_time())
        pr.server.release("someone", trio.current_time())
        await pr._probe_one(b.peer_id, trio.Lock(), trio.CapacityLimiter(1), [0.0])
        assert pr.links[b.peer_id].samples == 1

    _nodes(body)
