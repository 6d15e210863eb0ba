"""Circuit relay v2 over the real libp2p adapter on loopback (issue 21, net/relay.py).

A node that peers cannot dial reserves a slot on a relay and is reached at its circuit address; the
relayed connection carries ordinary streams (Noise + yamux end to end) and the data plane's libp2p
fallback; the relay keeps to its limits whatever a peer asks."""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack

import pytest
import torch
import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.bulk import open_data_plane
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, Libp2pTransport, open_libp2p_transport
from fusionp2p.net.relay import HOP, RelayLimits
from fusionp2p.net.transport import Stream
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.testing.wait import poll_until

ECHO = "/fusionp2p-test/echo/1.0.0"


async def _echo(s: Stream) -> None:
    while data := await s.receive_some():
        await s.send_all(data)


def _relayed(t: Libp2pTransport, peer: str) -> bool:
    conns = t.host.get_network().connections.get(ID.from_base58(peer)) or []
    return any("/p2p-circuit" in str(a) for c in conns for a in c.muxed_conn.get_transport_addresses())


async def _round_trip(t: Libp2pTransport, peer: str, payload: bytes) -> bytes:
    s = await t.open_stream(peer, ECHO)
    try:
        await s.send_all(payload)
        got = b""
        while len(got) < len(payload):
            chunk = await s.receive_some()
            assert chunk, "echo stream ended early"
            got += chunk
        return got
    finally:
        await s.aclose()


def test_a_node_reached_through_a_relay() -> None:
    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                relay = await st.enter_async_context(open_libp2p_transport(
                    Identity.generate(), Libp2pConfig(relay=RelayLimits())))
                a, b = [await st.enter_async_context(open_libp2p_transport(Identity.generate())) for _ in range(2)]
                a.set_stream_handler(ECHO, _echo)
                b.set_stream_handler(ECHO, _echo)
                await b.connect(relay.listen_addrs()[0])
                ttl = await b.reserve(relay.peer_id)
                assert ttl > 60 and b.relays() == [relay.peer_id]
                [circuit] = [c for c in b.circuit_addrs() if "/ip4/127.0.0.1/" in c]
                assert circuit.endswith(f"/p2p/{relay.peer_id}/p2p-circuit/p2p/{b.peer_id}")
                # a reaches b only through the relay (it dials the circuit address; it learns no other)
                assert await a.connect(circuit) == b.peer_id
                assert _relayed(a, b.peer_id) and _relayed(b, a.peer_id)
                assert a.is_relayed(b.peer_id) and not a.is_relayed(relay.peer_id)
                payload = bytes(range(256)) * 4096      # 1 MiB, many yamux frames through the relay
                assert await _round_trip(a, b.peer_id, payload) == payload
                assert await _round_trip(b, a.peer_id, b"back") == b"back"    # streams open from either side
                svc = relay.relay_service
                assert svc is not None and svc.stats["circuits"] == 1 and svc.stats["relayed_bytes"] > 2 * len(payload)
                # the connection drops: a later stream is opened through the relay again (py-libp2p's own
                # dial skips circuit addresses)
                await a.hang_up(b.peer_id)
                # py-libp2p tears the connection down in its own tasks: no event to wait on
                await poll_until(lambda: b.peer_id not in a.connected_peers(), timeout=10, interval=0.05)
                a.host.get_peerstore().clear_addrs(ID.from_base58(b.peer_id))   # (identify told it b's loopback address)
                assert await _round_trip(a, b.peer_id, b"again") == b"again"
                assert svc.stats["circuits"] == 2

    trio.run(main)


def test_the_dialled_side_reaches_its_dialer_again_at_the_circuit_its_record_announces() -> None:
    """Two nodes behind NATs: a dialled b through the relay, then the connection dropped. b never dialled a
    circuit, so before issue 43 it knew none to reach a by (the swarm's dialer of the pair was a, with its
    back-off): the live hostile test's home-office link did not come up in 60 s. b dials the circuit that
    a's record announces (``set_circuit_source``, the swarm's ``circuits_of``)."""
    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                relay = await st.enter_async_context(open_libp2p_transport(Identity.generate(), Libp2pConfig(relay=RelayLimits())))
                a, b = [await st.enter_async_context(open_libp2p_transport(Identity.generate())) for _ in range(2)]
                a.set_stream_handler(ECHO, _echo)
                for t in (a, b):
                    await t.connect(relay.listen_addrs()[0])
                    await t.reserve(relay.peer_id)
                [a_circuit] = [c for c in a.circuit_addrs() if "/ip4/127.0.0.1/" in c]
                await a.connect(next(c for c in b.circuit_addrs() if "/ip4/127.0.0.1/" in c))
                assert _relayed(b, a.peer_id)
                await b.hang_up(a.peer_id)
                await poll_until(lambda: a.peer_id not in b.connected_peers(), timeout=10, interval=0.05)   # (as above)
                b.host.get_peerstore().clear_addrs(ID.from_base58(a.peer_id))   # a's direct addresses lead nowhere
                with pytest.raises(PeerUnavailable):
                    await b.open_stream(a.peer_id, ECHO)      # no circuit known for a
                asked: list[str] = []

                def a_record_circuits(peer: str) -> list[str]:     # as the swarm's circuits_of: without /p2p/<peer>
                    asked.append(peer)
                    return [a_circuit.rsplit("/p2p/", 1)[0]] if peer == a.peer_id else []

                b.set_circuit_source(a_record_circuits)
                assert await _round_trip(b, a.peer_id, b"back") == b"back"
                assert asked == [a.peer_id] and _relayed(b, a.peer_id)

    trio.run(main)


def test_a_stream_to_a_peer_whose_closed_connection_is_still_listed_dials_again() -> None:
    """py-libp2p lists a closed connection until its own tasks remove it, and meanwhile fails every stream
    to the peer at once ("No valid connections available") without dialling: a job's leader asked a live
    member whose relayed connection had just dropped, and took it for dead (issue 43's live test)."""
    async def main() -> None:
        with trio.fail_after(30):
            async with AsyncExitStack() as st:
                a, b = [await st.enter_async_context(open_libp2p_transport(Identity.generate())) for _ in range(2)]
                b.set_stream_handler(ECHO, _echo)
                await a.connect(b.listen_addrs()[0])
                net = a.host.get_network()
                pid = ID.from_base58(b.peer_id)
                stale = list(net.connections[pid])
                await a.hang_up(b.peer_id)
                assert all(c.is_closed for c in stale)
                net.connections[pid] = stale            # as between the close and py-libp2p's clean-up
                assert await _round_trip(a, b.peer_id, b"again") == b"again"
                assert not any(c.is_closed for c in net.connections[pid])

    trio.run(main)


def test_relay_limits_bound_what_strangers_get() -> None:
    limits = RelayLimits(reservations=2, per_ip=8, circuits=1, circuit_bytes=256 * 1024, rate=50e6)

    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                relay = await st.enter_async_context(open_libp2p_transport(Identity.generate(), Libp2pConfig(relay=limits)))
                a, b, c, d = [await st.enter_async_context(open_libp2p_transport(Identity.generate())) for _ in range(4)]
                for t in (a, b, c, d):
                    t.set_stream_handler(ECHO, _echo)
                    await t.connect(relay.listen_addrs()[0])
                svc = relay.relay_service
                assert svc is not None
                # garbage, an oversized length prefix and a half message end only their own streams
                for junk in (b"\xff" * 64, b"\xff\xff\xff\xff\x0f", b"\x05ab"):
                    s = await a.host.new_stream(ID.from_base58(relay.peer_id), [HOP])
                    await s.write(junk)
                    with trio.fail_after(15):
                        if junk != b"\x05ab":
                            await read_delimited_msg(s, HopMessage)     # answered with a status
                        else:
                            await s.close()
                # a stranger's RESERVE naming another peer reserves for the stranger, never for the one named
                s = await c.host.new_stream(ID.from_base58(relay.peer_id), [HOP])
                await write_delimited_msg(s, HopMessage(type=HopMessage.RESERVE, peer=CircuitPeerId(id=ID.from_base58(d.peer_id).to_bytes())))
                await read_delimited_msg(s, HopMessage)
                assert svc.reservations() == [c.peer_id]
                await b.reserve(relay.peer_id)
                # two slots: a third peer is refused
                with pytest.raises(PeerUnavailable, match="RESERVATION_REFUSED"):
                    await d.reserve(relay.peer_id)
                # a slot of a peer that disconnected is freed
                await c.hang_up(relay.peer_id)
                await poll_until(lambda: c.peer_id not in relay.connected_peers(), timeout=10, interval=0.05)   # (as above)
                await d.reserve(relay.peer_id)
                assert sorted(svc.reservations()) == sorted([b.peer_id, d.peer_id])
                # no circuit to a peer without a slot
                with pytest.raises(PeerUnavailable, match="NO_RESERVATION"):
                    await a.connect(f"{relay.listen_addrs()[0]}/p2p-circuit/p2p/{c.peer_id}")
                # one circuit at a time
                b_circuit = f"{relay.listen_addrs()[0]}/p2p-circuit/p2p/{b.peer_id}"
                await a.connect(b_circuit)
                with pytest.raises(PeerUnavailable, match="RESOURCE_LIMIT_EXCEEDED"):
                    await d.connect(b_circuit)
                # a circuit is cut after circuit_bytes (both directions together)
                with pytest.raises(PeerUnavailable):
                    await _round_trip(a, b.peer_id, b"x" * (512 * 1024))
                assert svc.stats["refused"] >= 2
                # a node accepts circuits only from relays it reserved on
                assert d.relays() == [relay.peer_id] and a.relays() == []

    trio.run(main)


def test_data_plane_fallback_over_a_relayed_connection() -> None:
    """The receiver's data port cannot be dialled and its libp2p connection is relayed: tensors go on
    a libp2p stream through the relay (the slow path, but the job does not fail)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = int(sock.getsockname()[1])

    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                relay = await st.enter_async_context(open_libp2p_transport(Identity.generate(), Libp2pConfig(relay=RelayLimits())))
                a, b = [await st.enter_async_context(open_libp2p_transport(Identity.generate())) for _ in range(2)]
                await b.connect(relay.listen_addrs()[0])
                await b.reserve(relay.peer_id)
                await a.connect(b.circuit_addrs()[0])
                da = await st.enter_async_context(open_data_plane(a, listen_host="127.0.0.1"))
                db = await st.enter_async_context(open_data_plane(b, listen_host="127.0.0.1", advertise_port=closed))
                ch = await da.connect(b.peer_id)
                peer_ch = await db.incoming.receive()
                assert peer_ch.remote_peer == a.peer_id
                assert ch.path == peer_ch.path == "libp2p"
                x = torch.randn(256, 256)
                await ch.send(TensorMessage(job="j", kind="act", stage=1, step=0, micro=0, name="h", tensors=(x,)))
                got = await peer_ch.receive()
                assert torch.equal(got.tensors[0], x)
                assert _relayed(a, b.peer_id)
                await ch.aclose()
                await peer_ch.aclose()

    trio.run(main)


def test_swarm_nodes_behind_nats_reserve_and_connect_through_the_bootstrap() -> None:
    """Two nodes that the bootstrap found undialable (reach set as its check would) reserve a slot on
    it, announce their circuit addresses, and connect to each other only through it."""
    cfg = SwarmConfig(heartbeat=0.3, dead_timeout=5.0, probing=False)

    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                tb = await st.enter_async_context(open_libp2p_transport(Identity.generate(), Libp2pConfig(relay=RelayLimits())))
                t1, t2 = [await st.enter_async_context(open_libp2p_transport(Identity.generate())) for _ in range(2)]
                # as if behind two NATs: their own listen addresses lead nowhere for the other
                for t in (t1, t2):
                    t.listen_addrs = lambda: []  # type: ignore[method-assign]
                nursery = await st.enter_async_context(trio.open_nursery())
                boot = SwarmNode(tb, SwarmConfig(role="bootstrap", heartbeat=0.3, dead_timeout=5.0), None)
                await nursery.start(boot.run, [])
                nodes = []
                for t in (t1, t2):
                    n = SwarmNode(t, cfg, TEST_PROFILE)
                    n.reach = "private"
                    await nursery.start(n.run, [tb.listen_addrs()[0]])
                    n.own_reach.relay_now.set()
                    nodes.append(n)
                n1, n2 = nodes
                await n1.wait_until(lambda: t2.peer_id in t1.connected_peers(), 30)
                assert _relayed(t1, t2.peer_id)
                # each announces its circuit address (the dialer found the other's there)
                for n, other in ((n1, t2), (n2, t1)):
                    await n.wait_until(lambda n=n, other=other: other.peer_id in n.view.records and any(
                        "/p2p-circuit" in a for a in n.view.records[other.peer_id].addrs), 10)
                # each finds the other's circuit in its record (for the transport to dial it back through) and
                # asks no reversal of it: both sides behind NATs, the peer could not dial us
                for n, other in ((n1, t2), (n2, t1)):
                    assert n.circuits_of(other.peer_id) == [a for a in n.view.records[other.peer_id].addrs
                                                            if "/p2p-circuit" in a][:2] != []
                    assert n.circuits_of(tb.peer_id) == [] and n.circuits_of(Identity.generate().peer_id) == []
                nursery.cancel_scope.cancel()

    trio.run(main)
