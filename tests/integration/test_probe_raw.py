"""Probes on raw sockets to the data plane's port: both directions timed, the slower one is the link's
figure, a port that cannot be reached falls back to the stream, and a peer's grant cannot aim our
bytes at a third party (real TCP on loopback, the in-memory transport for PROBE)."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
import trio
import trio.testing

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net import bulk
from fusionp2p.net.bulk import RAW_LANE, DataPlane, open_data_plane
from fusionp2p.net.memory import MemoryNetwork, MemoryTransport
from fusionp2p.net.transport import Stream
from fusionp2p.swarm import probe as probe_mod
from fusionp2p.swarm.membership import prober_of
from fusionp2p.swarm.node import SwarmConfig
from fusionp2p.swarm.probe import (
    MEASURE_BYTES,
    ProbeBusy,
    ProbeConfig,
    ProbeServer,
    open_probe,
    probe,
    tcp_min_rtt,
)
from fusionp2p.testing.swarm import converge, local_swarm
from fusionp2p.wire import tensor_frame as tf
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.msg import packb, unpackb
from fusionp2p.wire.protocols import PROBE
from tests.integration.test_bulk_dataplane import run


def _serve_probes(host: MemoryTransport, dp: DataPlane | None) -> ProbeServer:
    server = ProbeServer()
    server.raw = dp
    host.set_stream_handler(PROBE, server)
    return server


def test_a_probe_times_both_directions_on_a_raw_socket_to_the_data_plane_port() -> None:
    async def body(net: MemoryNetwork) -> None:
        a, b = net.add_host(), net.add_host()
        async with open_data_plane(a) as da, open_data_plane(b) as db:
            server = _serve_probes(b, db)
            res = await probe(a, b.peer_id, nbytes=MEASURE_BYTES, raw=da)
            assert res.path == "direct" and res.measured and not res.raw_failed
            assert res.forward is not None and res.reverse is not None
            assert res.bandwidth == min(res.forward, res.reverse) > 0
            assert res.transfers == 2 and res.sent == 2 * MEASURE_BYTES
            assert server.inbound[a.peer_id] > 0            # the server timed our direction: its downlink
            await trio.testing.wait_all_tasks_blocked()     # the server's handler saw our stream end
            assert not db._raw and not server.busy(trio.current_time())   # the ticket is used up, the server free

    run(body)


def test_the_rtt_is_the_kernels_smallest_when_the_pings_queued() -> None:
    """Pings on the stream wait behind whatever the uplinks queue (benchmarks.wan's 8 Mbit/s links read
    50-110 ms with no delay added); with a raw socket the RTT is also the kernel's smallest of it."""
    async def body(net: MemoryNetwork) -> None:
        a, b = net.add_host(), net.add_host()
        async with open_data_plane(a) as da, open_data_plane(b) as db:
            _serve_probes(b, db)
            session = await open_probe(a, b.peer_id)
            try:
                session.rtt = 0.5                               # as if each ping waited behind a full queue
                res = await session.measure(MEASURE_BYTES, raw=da)
            finally:
                await session.aclose()
            assert res.path == "direct" and 0 < res.rtt < 0.05 and session.rtt == res.rtt
            res = await probe(a, b.peer_id, nbytes=MEASURE_BYTES)   # no raw socket: the pings' figure
            assert res.path == "libp2p"

    run(body)


def test_the_kernels_smallest_rtt_of_a_socket() -> None:
    lst = socket.create_server(("127.0.0.1", 0))
    with lst, socket.create_connection(lst.getsockname()) as c:
        s, _ = lst.accept()
        with s:
            c.sendall(b"x" * 4096)
            s.recv(4096)
            rtt = tcp_min_rtt(c)
            assert rtt is not None and 0 < rtt < 0.05
        assert tcp_min_rtt(lst) is None                         # a listener has no round trips


def test_the_link_figure_is_the_slower_direction(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's sends are held to about 4 MB/s (a DSL uplink beside a fast downlink): the probe's
    figure is that direction, not the prober's fast one."""
    served: set[int] = set()
    send = probe_mod._raw_send

    def slow_send(sock: socket.socket, n: int, timeout: float) -> None:
        if sock.fileno() not in served:
            send(sock, n, timeout)
            return
        for i in range(0, n, 64 * 1024):
            send(sock, min(64 * 1024, n - i), timeout)
            time.sleep(64 * 1024 / 4e6)

    async def body(net: MemoryNetwork) -> None:
        a, b = net.add_host(), net.add_host()
        async with open_data_plane(a) as da, open_data_plane(b) as db:
            take = db.take_raw

            async def take_and_mark(ticket: bytes) -> socket.socket | None:
                sock = await take(ticket)
                if sock is not None:
                    served.add(sock.fileno())
                return sock

            monkeypatch.setattr(db, "take_raw", take_and_mark)
            _serve_probes(b, db)
            res = await probe(a, b.peer_id, nbytes=MEASURE_BYTES, raw=da)
            assert res.reverse is not None and res.forward is not None
            assert res.reverse < 4.5e6 < res.forward
            assert res.bandwidth == res.reverse

    monkeypatch.setattr(probe_mod, "_raw_send", slow_send)
    run(body)


def test_without_a_raw_path_the_probe_times_its_own_direction_on_the_stream() -> None:
    async def body(net: MemoryNetwork) -> None:
        a, b = net.add_host(), net.add_host()
        async with open_data_plane(a) as da:
            _serve_probes(b, None)                           # a node without a data plane (yet)
            res = await probe(a, b.peer_id, nbytes=MEASURE_BYTES, raw=da)
            assert res.path == "libp2p" and res.reverse is None and res.measured and not res.raw_failed

    run(body)


def test_a_raw_port_that_cannot_be_reached_falls_back_to_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulk, "RAW_WAIT", 0.5)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]   # bound, never listening: connections are refused

    async def body(net: MemoryNetwork) -> None:
        a, b = net.add_host(), net.add_host()
        async with open_data_plane(a) as da, open_data_plane(b, advertise_port=port) as db:
            server = _serve_probes(b, db)
            res = await probe(a, b.peer_id, nbytes=MEASURE_BYTES, raw=da)
            assert res.path == "libp2p" and res.raw_failed and res.measured and res.reverse is None
            await trio.testing.wait_all_tasks_blocked()
            assert not db._raw and not server.busy(trio.current_time())

    try:
        run(body)
    finally:
        closed.close()


def test_a_raw_ticket_works_once_and_only_with_its_lane_byte() -> None:
    async def body(net: MemoryNetwork) -> None:
        a, b = net.add_host(), net.add_host()
        async with open_data_plane(b) as db:
            grant = db.grant_raw(a.peer_id)
            assert grant is not None and db.grant_raw(a.peer_id) is None   # one outstanding per peer
            ticket, _, port = grant
            wrong = await trio.open_tcp_stream("127.0.0.1", port)
            await wrong.send_all(ticket + bytes([0]))        # a tensor lane's byte: not a raw socket
            assert await wrong.receive_some(16) == b""       # closed
            sock = await db.dial_raw(a.peer_id, "127.0.0.1", port, ticket)
            second = await trio.open_tcp_stream("127.0.0.1", port)
            await second.send_all(ticket + bytes([RAW_LANE]))
            got = await db.take_raw(ticket)
            assert got is not None
            assert await second.receive_some(16) == b""      # the ticket was used
            got.sendall(b"x")
            assert sock.recv(1) == b"x"                      # the two ends of one socket
            sock.close()
            got.close()
            await second.aclose()
            await wrong.aclose()

    run(body)


def _a_lying_grant(host: str, after: str) -> bytes:
    """A peer that answers our raw probe with a grant naming a third party's listener at *host*, then
    *after* ("raw": go on; "noraw": refuse the raw path): what that listener received."""
    received = bytearray()

    async def third_party(stream: trio.SocketStream) -> None:
        while data := await stream.receive_some(65536):
            received.extend(data)

    async def body(net: MemoryNetwork) -> None:
        a, b = net.add_host(), net.add_host()
        async with trio.open_nursery() as n, open_data_plane(a) as da:
            listeners = await trio.open_tcp_listeners(0, host=host)
            port = listeners[0].socket.getsockname()[1]
            await n.start(trio.serve_listeners, third_party, listeners)

            async def liar(stream: Stream) -> None:
                dec = FrameDecoder(max_frame=1 << 20)
                while data := await stream.receive_some():
                    for fr in dec.feed(data):
                        m = unpackb(fr)
                        if m["op"] == "ping":
                            answer = [{"op": "pong", "i": m["i"]}]
                        elif m["op"] == "raw":
                            answer = [{"op": "dial", "t": b"\x01" * tf.TICKET_SIZE, "h": host, "p": port}, {"op": after}]
                        else:
                            answer = [{"op": "go"}]
                        for msg in answer:
                            await stream.send_all(encode_frame(packb(msg), max_frame=4096))

            b.set_stream_handler(PROBE, liar)
            if after == "raw":
                with pytest.raises(PeerUnavailable):
                    await probe(a, b.peer_id, nbytes=MEASURE_BYTES, raw=da, timeout=5.0)
            else:
                with contextlib.suppress(PeerUnavailable):
                    await probe(a, b.peer_id, nbytes=MEASURE_BYTES, raw=da, timeout=5.0)
                await trio.testing.wait_all_tasks_blocked()
            n.cancel_scope.cancel()

    run(body)
    return bytes(received)


def test_a_grant_cannot_aim_our_probe_at_a_third_party() -> None:
    """A lying peer names someone else's port in its grant: we dial it, send the ticket, and send
    nothing more, because that listener cannot echo a ticket it never saw."""
    assert len(_a_lying_grant("127.0.0.1", "raw")) <= tf.TICKET_SIZE + 1


def test_a_grant_naming_another_host_is_not_dialled() -> None:
    """Issue 43: a grant may name only the IP the peer is seen at (or none): before, the prober connected
    to whatever host and port it named (here 127.0.0.2, another loopback address) and sent its ticket."""
    assert not _a_lying_grant("127.0.0.2", "noraw")


def test_nodes_with_a_data_plane_measure_their_links_both_ways() -> None:
    """Two swarm nodes given their data planes (as the job service does) re-measure their link on raw
    sockets, and the swarm's table holds the slower direction's figure."""
    async def main() -> None:
        cfg = SwarmConfig(probe=ProbeConfig(bytes=64 * 1024, interval=0.2, duty=1.0))
        with trio.fail_after(30):
            async with local_swarm(2, libp2p=False, config=cfg) as (_boot, nodes):
                a, b = nodes
                async with open_data_plane(a.transport) as da, open_data_plane(b.transport) as db:
                    a.set_raw_path(da)
                    b.set_raw_path(db)
                    prober = a if prober_of(a.peer_id, b.peer_id) == a.peer_id else b
                    await prober.wait_until(lambda: prober.counters.probes_direct > 0, timeout=20)
                    link = prober.prober.links[(b if prober is a else a).peer_id]
                    assert link.samples >= 1 and link.bandwidth is not None and link.bandwidth > 0

    trio.run(main)


def test_a_client_cannot_skip_the_raw_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rbulk``/``rback`` without a raw socket, or a second ``raw``: a protocol error that closes the stream."""
    async def body(net: MemoryNetwork) -> None:
        a, b = net.add_host(), net.add_host()
        async with open_data_plane(b) as db:
            server = _serve_probes(b, db)
            for ops in (["rback"], ["rbulk"], ["raw", "raw"]):
                stream = await a.open_stream(b.peer_id, PROBE)
                dec = FrameDecoder(max_frame=1 << 20)
                for op in ops:
                    await stream.send_all(encode_frame(packb({"op": op, "n": 1024}), max_frame=4096))
                answers = []
                while data := await stream.receive_some():
                    answers += [unpackb(fr)["op"] for fr in dec.feed(data)]
                assert "go" not in answers                  # nothing was sent or received in the clear
                await stream.aclose()
            assert server.refusals.by_reason["probe/protocol"] == 3

    monkeypatch.setattr(bulk, "RAW_WAIT", 0.2)
    run(body)


def test_a_training_node_neither_refreshes_its_links_nor_lets_them_be_remeasured() -> None:
    """While a node trains, a refresh would time what its job leaves of the link: its own refresh
    rounds stop, and its probe server refuses peers that measured it before (first probes still run)."""
    async def main() -> None:
        cfg = SwarmConfig(heartbeat=1.0, dead_timeout=5.0, probe=ProbeConfig(bytes=64 * 1024, interval=1.0, refresh_max=1.0, duty=1.0))
        training = [False]
        async with local_swarm(2, libp2p=False, config=cfg) as (_boot, nodes):
            for n in nodes:
                n.set_training(lambda: training[0])
            await converge(nodes, bandwidth=True, timeout=30)
            a, b = nodes
            await trio.sleep(5)
            assert a.counters.probes_ok + b.counters.probes_ok >= 3     # refreshes run while idle
            training[0] = True
            await trio.sleep(2)                                           # a round under way ends
            before = a.counters.probes_ok + b.counters.probes_ok
            await trio.sleep(30)
            assert a.counters.probes_ok + b.counters.probes_ok == before
            # the server side: a peer that measured us before is answered busy, a new one is measured
            prober, served = (a, b) if prober_of(a.peer_id, b.peer_id) == a.peer_id else (b, a)
            with pytest.raises(ProbeBusy):
                await probe(prober.transport, served.peer_id, nbytes=64 * 1024, timeout=5.0)
            training[0] = False
            await trio.sleep(5)
            assert a.counters.probes_ok + b.counters.probes_ok > before

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
