"""Content fetch over the in-memory transport: discovery, verification, caps, hostile servers."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable

import pytest
import trio

from fusionp2p.errors import IntegrityError, PeerUnavailable, RemoteProtocolError
from fusionp2p.jobs.content import ContentConfig, ContentService, ContentStore
from fusionp2p.net.memory import MemoryNetwork, memory_network
from fusionp2p.net.transport import Stream
from fusionp2p.wire.framing import encode_frame
from fusionp2p.wire.msg import packb
from fusionp2p.wire.protocols import CONTENT

CFG = ContentConfig(chunk_bytes=4096, request_timeout=5.0, fetch_timeout=5.0)
BLOB = bytes(range(256)) * 100  # 25.6 KB: several chunks
H = hashlib.sha256(BLOB).hexdigest()


def run(test: Callable[[MemoryNetwork], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(20):
            async with memory_network() as net:
                await test(net)

    trio.run(main)


def node(net: MemoryNetwork) -> ContentService:
    svc = ContentService(net.add_host(), ContentStore(), CFG)
    svc.install()
    return svc


def test_fetch_via_providers_and_become_a_provider() -> None:
    async def t(net: MemoryNetwork) -> None:
        a, b, c = node(net), node(net), node(net)
        assert await a.publish(BLOB) == H
        assert await b.fetch(H, max_size=1 << 20) == BLOB
        assert b.store.has(H)
        assert set(await c.transport.find_providers(H)) == {a.transport.peer_id, b.transport.peer_id}
        net.kill(a.transport.peer_id)  # the publisher is gone; b still serves
        assert await c.fetch(H, max_size=1 << 20) == BLOB
        assert b.served == 1
        assert await c.fetch(H, max_size=10) == BLOB  # local hit, no network

    run(t)


def test_missing_content_and_cap() -> None:
    async def t(net: MemoryNetwork) -> None:
        a, b = node(net), node(net)
        await a.publish(BLOB)
        with pytest.raises(PeerUnavailable, match="not found"):
            await b.fetch_from(a.transport.peer_id, "1" * 64, max_size=1 << 20)
        with pytest.raises(PeerUnavailable, match="exceeds the cap"):
            await b.fetch_from(a.transport.peer_id, H, max_size=1000)
        with pytest.raises(PeerUnavailable, match="no provider"):
            await b.fetch("2" * 64, max_size=1 << 20)
        assert not b.store.has(H)

    run(t)


Responder = Callable[[Stream], Awaitable[None]]


def hostile(net: MemoryNetwork, respond: Responder) -> str:
    host = net.add_host()

    async def handler(stream: Stream) -> None:
        await stream.receive_some()
        await respond(stream)

    host.set_stream_handler(CONTENT, handler)
    return host.peer_id


def frame(obj: object) -> bytes:
    return encode_frame(packb(obj), max_frame=1 << 20)


async def wrong_bytes(s: Stream) -> None:
    await s.send_all(frame({"ok": True, "size": len(BLOB)}) + encode_frame(b"x" * len(BLOB), max_frame=1 << 20))


async def lies_about_size(s: Stream) -> None:
    await s.send_all(frame({"ok": True, "size": 10}) + encode_frame(BLOB, max_frame=1 << 20))


async def huge_size(s: Stream) -> None:
    await s.send_all(frame({"ok": True, "size": 1 << 40}))


async def truncated(s: Stream) -> None:
    await s.send_all(frame({"ok": True, "size": len(BLOB)}) + encode_frame(BLOB[:100], max_frame=1 << 20))


async def garbage(s: Stream) -> None:
    await s.send_all(b"\x00\x00\x00\x03\xc1\xc1\xc1")


async def trailing(s: Stream) -> None:
    await s.send_all(frame({"ok": True, "size": len(BLOB)}) + encode_frame(BLOB, max_frame=1 << 20) + frame({}))


async def giant_frame(s: Stream) -> None:
    await s.send_all(b"\xff\xff\xff\xff")


async def silent(s: Stream) -> None:
    return


@pytest.mark.parametrize(
    ("respond", "error"),
    [
        (wrong_bytes, IntegrityError),
        (lies_about_size, RemoteProtocolError),
        (huge_size, RemoteProtocolError),
        (truncated, PeerUnavailable),     # a cut stream: worth another round (test below)
        (garbage, RemoteProtocolError),
        (trailing, RemoteProtocolError),
        (giant_frame, RemoteProtocolError),
        (silent, RemoteProtocolError),
    ],
)
def test_hostile_server_is_detected_and_skipped(respond: Responder, error: type[Exception]) -> None:
    async def t(net: MemoryNetwork) -> None:
        good, client = node(net), node(net)
        bad = hostile(net, respond)
        await good.publish(BLOB)
        with pytest.raises(error):
            await client.fetch_from(bad, H, max_size=1 << 20)
        assert not client.store.has(H)
        # fetch() tries the hostile peer first, then the honest one.
        assert await client.fetch(H, max_size=1 << 20, peers=[bad, good.transport.peer_id]) == BLOB

    run(t)


def test_server_survives_malformed_requests() -> None:
    async def t(net: MemoryNetwork) -> None:
        server = node(net)
        await server.publish(BLOB)
        peer = net.add_host()
        for payload in (b"\x00\x00\x00\x02\xc1\xc1", frame({"op": "put", "hash": H, "max": 1}), frame({"op": "get", "hash": "zz", "max": 1}), frame([1]), b""):
            s = await peer.open_stream(server.transport.peer_id, CONTENT)
            await s.send_all(payload)
            await s.send_eof()
            assert await s.receive_some() == b""  # closed without an answer
            await s.aclose()
        assert server.rejected == 5
        assert await node(net).fetch_from(server.transport.peer_id, H, max_size=1 << 20) == BLOB

    run(t)


def test_unreachable_peer() -> None:
    async def t(net: MemoryNetwork) -> None:
        a, b = node(net), node(net)
        await a.publish(BLOB)
        net.kill(a.transport.peer_id)
        with pytest.raises(PeerUnavailable):
            await b.fetch_from(a.transport.peer_id, H, max_size=1 << 20)

    run(t)


def test_a_failed_stream_is_tried_again_and_a_refusal_is_not() -> None:
    """The only provider's first stream fails to open (as py-libp2p's multiselect handshake does now and then
    under load: benchmarks.wan lost a finished job's download to one): the next round fetches the blob. A
    provider that answers it cannot serve the blob is asked once."""
    async def t(net: MemoryNetwork) -> None:
        a, b = node(net), node(net)
        await a.publish(BLOB)
        opened: list[str] = []
        failed: list[str] = []
        open_stream = b.transport.open_stream

        async def flaky(peer: str, proto: str) -> Stream:
            opened.append(peer)
            if not failed:                 # the first stream ever fails
                failed.append(peer)
                raise PeerUnavailable(peer, "handshake read failed")
            return await open_stream(peer, proto)

        b.transport.open_stream = flaky  # type: ignore[method-assign]
        assert await b.fetch(H, max_size=1 << 20) == BLOB
        assert opened == [a.transport.peer_id] * 2

        refusing = hostile(net, lambda s: s.send_all(frame({"ok": False, "error": "busy"})))
        opened.clear()
        with pytest.raises(PeerUnavailable, match="providers of"):
            await b.fetch("3" * 64, max_size=1 << 20, peers=[refusing])
        assert opened == [refusing]

    run(t)


def test_a_stream_cut_inside_the_blob_is_tried_again() -> None:
    """The only holder's first stream ends inside a frame (a TCP connection reset under load did so in
    benchmarks.churn, and the re-plan whose state fetch it was failed): the next round fetches the blob."""
    async def t(net: MemoryNetwork) -> None:
        client = node(net)
        host = net.add_host()
        served: list[int] = []

        async def handler(s: Stream) -> None:
            await s.receive_some()
            served.append(1)
            head = frame({"ok": True, "size": len(BLOB)})
            body = encode_frame(BLOB, max_frame=1 << 20)
            await s.send_all(head + (body[:1000] if len(served) == 1 else body))
            await s.send_eof()

        host.set_stream_handler(CONTENT, handler)
        assert await client.fetch(H, max_size=1 << 20, peers=[host.peer_id]) == BLOB
        assert len(served) == 2

    run(t)
