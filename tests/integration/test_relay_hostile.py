"""The relay against hostile peers, on real libp2p hosts on loopback (issue 43, net/relay.py).

Each test pushes past one limit of :class:`RelayLimits`, or plays the attack the review found: requests
sent at once (every limit is counted before the first await), one circuit's end cutting another's,
circuits the destination refuses, the per-circuit deadline. Every host here shares 127.0.0.1, so the
per-IP limits apply to all of them together."""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, Libp2pTransport, open_libp2p_transport
from fusionp2p.net.relay import HOP, RelayLimits
from fusionp2p.net.transport import Stream
from fusionp2p.testing.wait import poll_until

ECHO = "/fusionp2p-test/echo/1.0.0"


async def _echo(s: Stream) -> None:
    while data := await s.receive_some():
        await s.send_all(data)


async def _hosts(st: AsyncExitStack, limits: RelayLimits, n: int, *, relay_timeout: float = 10.0
                 ) -> tuple[Libp2pTransport, list[Libp2pTransport]]:
    relay = await st.enter_async_context(open_libp2p_transport(
        Identity.generate(), Libp2pConfig(relay=limits, stream_timeout=relay_timeout)))
    peers = [await st.enter_async_context(open_libp2p_transport(Identity.generate())) for _ in range(n)]
    for t in peers:
        t.set_stream_handler(ECHO, _echo)
        await t.connect(relay.listen_addrs()[0])
    return relay, peers


async def _hop(t: Libp2pTransport, relay: Libp2pTransport, msg: HopMessage) -> int:
    """One raw HOP request; the status code of the relay's answer."""
    s = await t.host.new_stream(ID.from_base58(relay.peer_id), [HOP])
    await write_delimited_msg(s, msg)
    with trio.fail_after(15):
        resp = await read_delimited_msg(s, HopMessage)
    return int(resp.status)


def _connect_msg(dest: Libp2pTransport) -> HopMessage:
    return HopMessage(type=HopMessage.CONNECT, peer=CircuitPeerId(id=ID.from_base58(dest.peer_id).to_bytes()))




async def _at_once(n: int, fn: object, *args: object) -> list[int]:
    codes: list[int] = []

    async def one() -> None:
        codes.append(await fn(*args))  # type: ignore[operator]

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return codes


def test_concurrent_reserves_from_one_ip_get_per_ip_slots() -> None:
    """Before: the IP was recorded after an await, so 40 RESERVEs at once took all 32 slots."""
    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                relay, peers = await _hosts(st, RelayLimits(reservations=32, per_ip=2), 5)
                codes: list[int] = []

                async def reserve(t: Libp2pTransport) -> None:
                    codes.append(await _hop(t, relay, HopMessage(type=HopMessage.RESERVE)))

                async with trio.open_nursery() as nursery:
                    for t in peers:
                        nursery.start_soon(reserve, t)
                assert sorted(codes).count(StatusCode.OK) == 2, codes
                assert codes.count(StatusCode.RESERVATION_REFUSED) == 3
                svc = relay.relay_service
                assert svc is not None and len(svc.reservations()) == 2

    trio.run(main)


def test_concurrent_connects_keep_the_per_node_and_per_ip_circuit_limits() -> None:
    """Before: the per-node check ran before py-libp2p counted the circuit (20 CONNECTs at once to one node
    were all accepted, limit 8), and no per-source-IP limit existed at all."""
    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                limits = RelayLimits(circuits=64, circuits_per_peer=2, circuits_per_ip=3)
                relay, (a, b, c) = await _hosts(st, limits, 3)
                await b.reserve(relay.peer_id)
                await c.reserve(relay.peer_id)
                svc = relay.relay_service
                assert svc is not None
                codes = await _at_once(6, _hop, a, relay, _connect_msg(b))
                assert codes.count(StatusCode.OK) == 2, codes          # circuits_per_peer
                assert svc.open_circuits == 2
                # one more source IP's worth: c is another node, but the same IP (127.0.0.1) asks
                codes = await _at_once(4, _hop, a, relay, _connect_msg(c))
                assert codes.count(StatusCode.OK) == 1, codes          # circuits_per_ip: 3 from 127.0.0.1
                assert codes.count(StatusCode.RESOURCE_LIMIT_EXCEEDED) == 3
                assert svc.open_circuits == 3

    trio.run(main)


def test_one_ip_takes_few_of_a_nodes_circuits() -> None:
    """Before: one host's identities took all of a node's circuits_per_peer (the live hostile test saw an
    honest NAT'd peer wait two minutes for a circuit to its victim)."""
    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                limits = RelayLimits(circuits=64, circuits_per_peer=8, circuits_per_ip=8, circuits_per_ip_peer=2)
                relay, (a, b, c) = await _hosts(st, limits, 3)
                await b.reserve(relay.peer_id)
                await c.reserve(relay.peer_id)
                codes = await _at_once(5, _hop, a, relay, _connect_msg(b))
                assert codes.count(StatusCode.OK) == 2, codes
                assert codes.count(StatusCode.RESOURCE_LIMIT_EXCEEDED) == 3
                codes = await _at_once(3, _hop, a, relay, _connect_msg(c))   # another node: its own two
                assert codes.count(StatusCode.OK) == 2, codes

    trio.run(main)


def test_the_global_circuit_limit() -> None:
    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                limits = RelayLimits(circuits=2, circuits_per_peer=8, circuits_per_ip=8)
                relay, (a, b) = await _hosts(st, limits, 2)
                await b.reserve(relay.peer_id)
                codes = await _at_once(5, _hop, a, relay, _connect_msg(b))
                assert codes.count(StatusCode.OK) == 2, codes

    trio.run(main)


def test_one_circuits_end_does_not_cut_another() -> None:
    """Before: py-libp2p keyed circuits by peer id, and a stranger dropping its own circuit to V closed the
    honest circuit to V stored under the same key."""
    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                relay, (honest, stranger, v) = await _hosts(st, RelayLimits(), 3)
                await v.reserve(relay.peer_id)
                [circuit] = [c for c in v.circuit_addrs() if "/ip4/127.0.0.1/" in c]
                await stranger.connect(circuit)
                await honest.connect(circuit)
                svc = relay.relay_service
                assert svc is not None and svc.open_circuits == 2
                await stranger.hang_up(v.peer_id)
                await poll_until(lambda: svc.open_circuits == 1)
                s = await honest.open_stream(v.peer_id, ECHO)
                await s.send_all(b"still here")
                assert await s.receive_some() == b"still here"
                await s.aclose()
                assert honest.is_relayed(v.peer_id) and svc.open_circuits == 1

    trio.run(main)


def test_refused_circuits_leave_nothing_and_the_deadline_closes_both_halves() -> None:
    """Before: each circuit the destination refused left an ``_active_relays`` entry forever, and at the
    deadline only the source half was closed (the destination kept a dead connection)."""
    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                relay, (a, v) = await _hosts(st, RelayLimits(duration=1), 2, relay_timeout=2.0)
                await v.reserve(relay.peer_id)
                svc = relay.relay_service
                assert svc is not None
                v.forget_relay(relay.peer_id)            # v now refuses circuits from this relay
                for _ in range(5):
                    assert await _hop(a, relay, _connect_msg(v)) == StatusCode.CONNECTION_FAILED
                await poll_until(lambda: svc.open_circuits == 0)
                assert not svc._active_relays
                await v.reserve(relay.peer_id)
                [circuit] = [c for c in v.circuit_addrs() if "/ip4/127.0.0.1/" in c]
                await a.connect(circuit)
                assert a.peer_id in v.connected_peers()
                # duration 1 s + the relay's 2 s timeout: both ends lose the circuit
                await poll_until(lambda: a.peer_id not in v.connected_peers() and v.peer_id not in a.connected_peers(), 15)
                assert svc.open_circuits == 0 and not svc._active_relays

    trio.run(main)


def test_a_reservation_lapses_after_its_ttl() -> None:
    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                relay, (a, b) = await _hosts(st, RelayLimits(reservation_ttl=1), 2)
                svc = relay.relay_service
                assert svc is not None
                assert await b.reserve(relay.peer_id) <= 1.0
                assert svc.reservations() == [b.peer_id]
                await poll_until(lambda: svc.reservations() == [], 10)      # not refreshed: gone after 1 s
                assert await _hop(a, relay, _connect_msg(b)) == StatusCode.NO_RESERVATION

    trio.run(main)


def test_all_circuits_together_keep_to_the_rate() -> None:
    """768 KiB each way through a relay limited to 512 KiB/s (one second of burst): at least two seconds,
    where loopback without the limit takes a fraction of one."""
    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                relay, (a, b) = await _hosts(st, RelayLimits(rate=float(512 << 10)), 2)
                await b.reserve(relay.peer_id)
                [circuit] = [c for c in b.circuit_addrs() if "/ip4/127.0.0.1/" in c]
                await a.connect(circuit)
                svc = relay.relay_service
                assert svc is not None
                payload = bytes(768 << 10)
                s = await a.open_stream(b.peer_id, ECHO)
                t0 = trio.current_time()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(s.send_all, payload)
                    got = 0
                    while got < len(payload):
                        chunk = await s.receive_some()
                        assert chunk
                        got += len(chunk)
                elapsed = trio.current_time() - t0
                await s.aclose()
                assert svc.stats["relayed_bytes"] >= 2 * len(payload)
                assert elapsed >= 1.9, elapsed          # (1.5 MiB - 0.5 MiB of burst) / 0.5 MiB/s

    trio.run(main)
