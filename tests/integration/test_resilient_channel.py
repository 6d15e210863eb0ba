"""Reconnecting channels over the real encrypted data plane (fusionp2p.net.resilient): a peer whose data
plane dies mid-stream and returns, a peer that never returns, a forged record on the wire, protocol
violations, and restarts on either side. Many nodes in one trio.run; every test has a deadline."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import suppress
from functools import partial
from typing import Any

import pytest
import torch
import trio

from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.net.bulk import DataPlane, open_data_plane
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.memory import MemoryNetwork, MemoryTransport, memory_network
from fusionp2p.net.resilient import (
    RESERVED,
    Hello,
    ResilientAcceptor,
    ResilientConfig,
    hello_message,
    open_resilient_acceptor,
    open_resilient_channel,
    parse_welcome,
)
from fusionp2p.net.transport import Stream
from fusionp2p.wire import tensor_frame as tf
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.protocols import BULK_TICKET

CHUNK = 64 * 1024


def run(body: Callable[[MemoryNetwork], Awaitable[None]], timeout: float = 30.0) -> None:
    async def main() -> None:
        with trio.fail_after(timeout):
            async with memory_network() as net:
                await body(net)

    trio.run(main)


def _msg(i: int, n: int = 50_000) -> TensorMessage:
    g = torch.Generator().manual_seed(i)
    return TensorMessage(job="j", kind="act", step=i, name=f"e{i}", meta={"i": i},
                         tensors=(torch.randn(n, generator=g),))


def _check(m: TensorMessage, i: int, n: int = 50_000) -> None:
    ref = _msg(i, n)
    assert (m.key, m.meta) == (ref.key, ref.meta)
    assert torch.equal(m.tensors[0], ref.tensors[0])


async def _plane(host: MemoryTransport, acc: ResilientAcceptor, scope: trio.CancelScope,
                 task_status: Any = trio.TASK_STATUS_IGNORED, **kw: Any) -> None:
    """A data plane for *host* whose incoming links go to *acc*, until *scope* is cancelled (the plane dies)."""
    with scope:
        async with open_data_plane(host, chunk_size=CHUNK, **kw) as dp:
            await acc.serve(dp.incoming, task_status=task_status)


def test_peer_data_plane_dies_mid_stream_and_returns() -> None:
    """B's data plane dies twice while messages flow both ways and comes back with the same identity
    (a new port): every message arrives exactly once, in order, on the same two channel objects."""
    n_ab, n_ba, kills = 40, 20, (10, 25)
    cfg = ResilientConfig(window=4, reconnect_timeout=10.0)

    async def body(net: MemoryNetwork) -> None:
        ta, tb = net.add_host(), net.add_host()
        async with open_resilient_acceptor(config=cfg) as acc, open_data_plane(ta, chunk_size=CHUNK) as da, \
                trio.open_nursery() as n:
            scopes = [trio.CancelScope()]
            await n.start(_plane, tb, acc, scopes[-1])
            async with open_resilient_channel(da, tb.peer_id, name="x", config=cfg) as a:
                b = await acc.incoming.receive()
                got_a: list[TensorMessage] = []

                async def a_sends() -> None:
                    for i in range(n_ab):
                        await a.send(_msg(i))

                async def b_sends() -> None:
                    for i in range(n_ba):
                        await b.send(_msg(1000 + i))

                async def a_receives() -> None:
                    got_a.extend([await a.receive() for _ in range(n_ba)])

                async with trio.open_nursery() as m:
                    m.start_soon(a_sends)
                    m.start_soon(b_sends)
                    m.start_soon(a_receives)
                    for i in range(n_ab):
                        _check(await b.receive(), i)
                        if i == kills[0]:
                            # first let b hold a full window it has received but not delivered (white box:
                            # woken by each arrival), so that the resume must not resend those
                            while b._book.received - b._book.delivered < cfg.window:
                                await b._changed.wait()
                        if i in kills:
                            scopes[-1].cancel()  # B's data plane dies (its links break mid-stream)
                            scopes.append(trio.CancelScope())
                            await n.start(_plane, tb, acc, scopes[-1])  # and comes back
                            while i == kills[0] and a.links < 2:  # b takes nothing until a has resumed
                                await a._changed.wait()
                for i, got in enumerate(got_a):
                    _check(got, 1000 + i)
                assert len(got_a) == n_ba
                assert a.links == b.links == 1 + len(kills)
                with pytest.raises(trio.WouldBlock):
                    acc.incoming.receive_nowait()  # the session resumed: no new channel appeared
                await a.send(_msg(99))
                _check(await b.receive(), 99)
            with pytest.raises(trio.EndOfChannel):
                await b.receive()  # a's clean close reaches b
            n.cancel_scope.cancel()

    run(body)


def test_peer_that_never_returns_is_reported_within_the_deadline() -> None:
    cfg = ResilientConfig(window=4, reconnect_timeout=0.5)

    async def body(net: MemoryNetwork) -> None:
        ta, tb = net.add_host(), net.add_host()
        async with open_resilient_acceptor(config=cfg) as acc, open_data_plane(ta, chunk_size=CHUNK) as da, \
                trio.open_nursery() as n:
            scope = trio.CancelScope()
            await n.start(_plane, tb, acc, scope)
            async with open_resilient_channel(da, tb.peer_id, name="x", config=cfg) as a:
                b = await acc.incoming.receive()
                await a.send(_msg(0))
                _check(await b.receive(), 0)
                t0 = trio.current_time()
                scope.cancel()  # B's data plane dies for good
                with pytest.raises(PeerUnavailable, match=r"within 0\.5 s"):
                    await a.receive()
                assert 0.4 < trio.current_time() - t0 < 2.0

                async def send_past_the_window() -> None:
                    for i in range(10):
                        await a.send(_msg(i))

                with pytest.raises(PeerUnavailable):
                    await send_past_the_window()  # never hangs
                with pytest.raises(PeerUnavailable, match="did not come back"):
                    await b.receive()  # the accepting side gives up as well
            n.cancel_scope.cancel()

    run(body)


def test_a_peer_the_swarm_declared_dead_is_not_waited_for() -> None:
    """With a long reconnect_timeout, both ends give up as soon as peer_gone says so."""
    cfg = ResilientConfig(window=4, reconnect_timeout=60.0)
    dead: set[str] = set()

    async def body(net: MemoryNetwork) -> None:
        ta, tb = net.add_host(), net.add_host()
        async with open_resilient_acceptor(config=cfg, peer_gone=dead.__contains__) as acc, \
                open_data_plane(ta, chunk_size=CHUNK) as da, trio.open_nursery() as n:
            scope = trio.CancelScope()
            await n.start(_plane, tb, acc, scope)
            async with open_resilient_channel(da, tb.peer_id, name="x", config=cfg,
                                              peer_gone=dead.__contains__) as a:
                b = await acc.incoming.receive()
                await a.send(_msg(0))
                _check(await b.receive(), 0)
                scope.cancel()  # B's data plane dies; the membership view then marks both sides dead
                dead.update({ta.peer_id, tb.peer_id})
                t0 = trio.current_time()
                with pytest.raises(PeerUnavailable, match="declared the peer dead"):
                    await a.receive()
                with pytest.raises(PeerUnavailable, match="declared the peer dead"):
                    await b.receive()
                assert trio.current_time() - t0 < 5.0  # not the 60 s reconnect_timeout
            n.cancel_scope.cancel()

    run(body)


class _PointAt:
    """A BULK_TICKET stream whose reply sends the dialer to another TCP port (our proxy)."""

    def __init__(self, inner: Stream, port: int) -> None:
        self._inner = inner
        self._port = port

    @property
    def remote_peer(self) -> str:
        return self._inner.remote_peer

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self._inner.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        reply = tf.decode_ticket_reply(FrameDecoder(max_frame=1 << 20).feed(data)[0])
        await self._inner.send_all(encode_frame(tf.encode_ticket_reply(
            ticket=reply["ticket"], cipher=reply["cipher"], k_dial=reply["k_dial"], k_listen=reply["k_listen"],
            host=reply["host"], port=self._port, lanes=reply["lanes"]), max_frame=1 << 20))

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Proxy:
    """TCP proxy to 127.0.0.1:*target* between a dialer and a data plane's bulk port (records:
    u32 length | u8 kind | sealed body). ``flip`` set: one tag bit of the next listener→dialer record
    is flipped. ``freeze()``: the connections open now go silent (nothing forwarded, nothing closed,
    like a cut cable); later connections work."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.flip = trio.Event()
        self._flipped = False
        self._frozen = trio.Event()
        self.connections = 0

    def freeze(self) -> None:
        self._frozen.set()
        self._frozen = trio.Event()

    async def _forward(self, src: trio.SocketStream, dst: trio.SocketStream, tamper: bool,
                       frozen: trio.Event, done: trio.CancelScope) -> None:
        buf = bytearray()
        with suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):  # a side went away
            async for data in src:
                if frozen.is_set():
                    await trio.sleep_forever()
                if not tamper:  # dialer→listener: a ticket, then records; forwarded as they come
                    await dst.send_all(data)
                    continue
                buf += data
                while len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "big"):
                    rec_end = 4 + int.from_bytes(buf[:4], "big")
                    rec = buf[:rec_end]
                    del buf[:rec_end]
                    if self.flip.is_set() and not self._flipped:
                        rec[-1] ^= 1
                        self._flipped = True
                    await dst.send_all(bytes(rec))
        if not frozen.is_set():
            done.cancel()

    async def _handle(self, client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", self.target)
        self.connections += 1
        frozen = self._frozen
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._forward, client, upstream, False, frozen, nursery.cancel_scope)
            nursery.start_soon(self._forward, upstream, client, True, frozen, nursery.cancel_scope)
        for s in (client, upstream):
            await trio.aclose_forcefully(s)

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)


async def _behind_proxy(n: trio.Nursery, tb: MemoryTransport, db: DataPlane) -> tuple[_Proxy, list[str]]:
    """Send every dialer of *db* through a new proxy; returns it and the list of ticket requests."""
    proxy = _Proxy(db.port)
    port = await n.start(proxy.serve)
    tickets: list[str] = []

    async def via_proxy(stream: Stream) -> None:
        tickets.append(stream.remote_peer)
        await db.handle_ticket(_PointAt(stream, port))  # type: ignore[arg-type]

    tb.set_stream_handler(BULK_TICKET, via_proxy)
    return proxy, tickets


def test_forged_record_is_a_protocol_error_and_is_not_retried() -> None:
    cfg = ResilientConfig(window=4, reconnect_timeout=0.5)

    async def body(net: MemoryNetwork) -> None:
        ta, tb = net.add_host(), net.add_host()
        async with open_resilient_acceptor(config=cfg) as acc, open_data_plane(ta) as da, \
                open_data_plane(tb) as db, trio.open_nursery() as n:
            n.start_soon(acc.serve, db.incoming)
            proxy, tickets = await _behind_proxy(n, tb, db)
            async with open_resilient_channel(da, tb.peer_id, name="x", config=cfg) as a:
                b = await acc.incoming.receive()
                await b.send(_msg(0))
                _check(await a.receive(), 0)  # the proxy is faithful until armed
                proxy.flip.set()
                await b.send(_msg(1))
                with pytest.raises(RemoteProtocolError):
                    await a.receive()
                with pytest.raises(RemoteProtocolError):
                    await a.send(_msg(2))
                # a hung up and never dials again, so b gives up after its reconnect timeout
                with pytest.raises(PeerUnavailable):
                    await b.receive()
                assert tickets == [ta.peer_id]
                assert a.links == 1
            n.cancel_scope.cancel()

    run(body)


async def _raw_session(da: DataPlane, peer: str, name: str) -> Any:
    """A hand-driven dialer: a plain BulkChannel that has said hello and read the welcome."""
    link = await da.connect(peer)
    await link.send(hello_message(Hello(name=name, session="ab" * 16, fresh=True, received=0, delivered=0,
                                        window=4)))
    assert not isinstance(parse_welcome(await link.receive()), str)
    return link


def test_link_cut_silently_is_replaced_before_the_acceptor_notices() -> None:
    """The cable is cut (no reset, no EOF): the dialer, quick to declare silence, reconnects; the
    acceptor, slow to, still holds the old link and must swap it for the new one. Nothing is lost or
    doubled, and nothing waits for the acceptor's 20 s silence deadline."""
    cfg = ResilientConfig(window=4, reconnect_timeout=5.0)

    async def body(net: MemoryNetwork) -> None:
        ta, tb = net.add_host(), net.add_host()
        async with open_resilient_acceptor(config=cfg) as acc, \
                open_data_plane(ta, chunk_size=CHUNK, keepalive=0.1, dead_after=0.4) as da, \
                open_data_plane(tb, chunk_size=CHUNK, keepalive=0.1, dead_after=20.0) as db, \
                trio.open_nursery() as n:
            n.start_soon(acc.serve, db.incoming)
            proxy, tickets = await _behind_proxy(n, tb, db)
            async with open_resilient_channel(da, tb.peer_id, name="x", config=cfg) as a:
                b = await acc.incoming.receive()
                t0 = trio.current_time()
                async with trio.open_nursery() as m:

                    async def a_sends() -> None:
                        for i in range(20):
                            await a.send(_msg(i))
                            if i == 5:
                                proxy.freeze()

                    m.start_soon(a_sends)
                    for i in range(20):
                        _check(await b.receive(), i)
                await b.send(_msg(100))
                _check(await a.receive(), 100)
                assert a.links == b.links == 2
                assert len(tickets) == 2 and proxy.connections == 2 * da.config.lanes
                assert trio.current_time() - t0 < 5.0
            n.cancel_scope.cancel()

    run(body)


async def _drain(link: Any) -> None:
    while True:
        await link.receive()


def test_gap_in_sequence_numbers_fails_the_channel() -> None:
    async def body(net: MemoryNetwork) -> None:
        ta, tb = net.add_host(), net.add_host()
        async with open_resilient_acceptor() as acc, open_data_plane(ta) as da, open_data_plane(tb) as db, \
                trio.open_nursery() as n:

            async def route() -> None:  # by hand, as a node mixing plain and resilient links would
                async for link in db.incoming:
                    first = await link.receive()
                    assert first.kind == RESERVED
                    n.start_soon(acc.attach, link, first)

            n.start_soon(route)
            link = await _raw_session(da, tb.peer_id, "x")
            b = await acc.incoming.receive()
            for seq in (1, 1, 3):  # a duplicate is dropped; a gap is a violation
                await link.send(TensorMessage(job="j", kind="act", step=seq, meta={RESERVED: {"s": seq, "d": 0}}))
            assert (await b.receive()).step == 1
            with pytest.raises(RemoteProtocolError, match="gap"):
                await b.receive()
            with pytest.raises(RemoteProtocolError):
                await b.send(_msg(0))
            with pytest.raises((trio.EndOfChannel, PeerUnavailable)):
                await _drain(link)  # b's ack of message 1, then the end: b closed the link
            n.cancel_scope.cancel()

    run(body)


def test_acceptor_that_lost_the_session_rejects_the_resume() -> None:
    """B restarts (its acceptor state is gone): A's resume is refused at once, not after reconnect_timeout."""
    cfg = ResilientConfig(window=4, reconnect_timeout=10.0)
    cfg_b = ResilientConfig(window=4, reconnect_timeout=10.0, close_timeout=0.2)

    async def body(net: MemoryNetwork) -> None:
        ta, tb = net.add_host(), net.add_host()
        async with open_data_plane(ta, keepalive=0.2, dead_after=0.5) as da, trio.open_nursery() as n:
            first_life = trio.CancelScope()
            gone = trio.Event()

            async def life(scope: trio.CancelScope, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                try:
                    with scope:
                        async with open_resilient_acceptor(config=cfg_b) as acc, trio.open_nursery() as inner:
                            # a short dead_after: closing a link that has just died can wait that long
                            await inner.start(partial(_plane, keepalive=0.2, dead_after=0.5), tb, acc,
                                              trio.CancelScope())
                            task_status.started(acc)
                            await trio.sleep_forever()
                finally:
                    gone.set()

            acc1 = await n.start(life, first_life)
            async with open_resilient_channel(da, tb.peer_id, name="x", config=cfg) as a:
                await acc1.incoming.receive()
                await a.send(_msg(0))
                first_life.cancel()  # B's process dies: data plane and sessions
                await gone.wait()
                t0 = trio.current_time()
                acc2 = await n.start(life, trio.CancelScope())
                with pytest.raises(PeerUnavailable, match="no longer knows"):
                    await a.receive()
                assert trio.current_time() - t0 < 5.0
                with pytest.raises(trio.WouldBlock):
                    acc2.incoming.receive_nowait()
            n.cancel_scope.cancel()

    run(body)


def test_new_session_under_the_same_name_replaces_the_old_one() -> None:
    """A restarted dialer opens a new session under the same name: the acceptor ends the old channel
    (PeerUnavailable) and offers the new one; two names between the same peers stay apart."""

    async def body(net: MemoryNetwork) -> None:
        ta, tb = net.add_host(), net.add_host()
        async with open_resilient_acceptor() as acc, open_data_plane(ta) as da, open_data_plane(tb) as db, \
                trio.open_nursery() as n:
            n.start_soon(acc.serve, db.incoming)
            async with open_resilient_channel(da, tb.peer_id, name="x") as a1, \
                    open_resilient_channel(da, tb.peer_id, name="y") as y:
                b1 = await acc.incoming.receive()
                by = await acc.incoming.receive()
                assert {b1.name, by.name} == {"x", "y"}
                if b1.name == "y":
                    b1, by = by, b1
                await a1.send(_msg(1))
                await y.send(_msg(2))
                _check(await b1.receive(), 1)
                _check(await by.receive(), 2)
                async with open_resilient_channel(da, tb.peer_id, name="x") as a2:
                    b2 = await acc.incoming.receive()
                    with pytest.raises(PeerUnavailable, match="new session"):
                        await b1.receive()
                    with pytest.raises(PeerUnavailable):
                        await a1.receive()  # its session is gone at the acceptor
                    await a2.send(_msg(3))
                    _check(await b2.receive(), 3)
                    await y.send(_msg(4))
                    _check(await by.receive(), 4)
            n.cancel_scope.cancel()

    run(body)


def test_goodbye_behind_a_clean_link_close_ends_the_session() -> None:
    """B sends a last message and closes. A's acker acks it after B's link CLOSE arrived but before A's
    pump has read B's goodbye (forced here by holding the pump): the failed ack must not give the link
    up (which would drop the unread goodbye and wait reconnect_timeout for a peer that said goodbye);
    A's receive ends with EndOfChannel once the pump reads on."""
    cfg = ResilientConfig(window=4, reconnect_timeout=20.0)

    async def body(net: MemoryNetwork) -> None:
        ta, tb = net.add_host(), net.add_host()
        async with open_resilient_acceptor(config=cfg) as acc, open_data_plane(ta, chunk_size=CHUNK) as da, \
                trio.open_nursery() as n:
            await n.start(_plane, tb, acc, trio.CancelScope())
            async with open_resilient_channel(da, tb.peer_id, name="x", config=cfg) as a:
                b = await acc.incoming.receive()
                link = a._link
                assert link is not None
                gate, closed, ack_failed = trio.Event(), trio.Event(), trio.Event()
                receive, on_event, send = link.receive, link._on_event, link.send

                async def held_receive() -> TensorMessage:
                    msg = await receive()
                    if msg.kind != "act":  # the message after B's last one (its goodbye) waits for the gate
                        await gate.wait()
                    return msg

                def watching_on_event(kind: int, message: Any, count: int) -> None:
                    on_event(kind, message, count)
                    if kind == tf.CLOSE:
                        closed.set()

                async def watching_send(msg: TensorMessage) -> None:
                    try:
                        await send(msg)
                    except PeerUnavailable:
                        ack_failed.set()
                        raise

                link.receive, link._on_event, link.send = held_receive, watching_on_event, watching_send  # type: ignore[method-assign]
                await b.send(_msg(1))
                await b.aclose()
                await closed.wait()  # B's link CLOSE has reached A; its goodbye sits unread in the link
                _check(await a.receive(), 1)  # taking it makes A's acker ack on the closed link
                await ack_failed.wait()
                gate.set()
                with trio.fail_after(5):  # without the fix: PeerUnavailable after reconnect_timeout
                    with pytest.raises(trio.EndOfChannel):
                        await a.receive()
            n.cancel_scope.cancel()

    run(body)
