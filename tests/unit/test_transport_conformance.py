"""One conformance suite for both Transport implementations: in-memory and libp2p (loopback)."""

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import open_libp2p_transport
from fusionp2p.net.memory import memory_network
from fusionp2p.net.transport import Stream


@asynccontextmanager
async def memory_pair() -> AsyncIterator[tuple[Any, Any, Callable[[], None]]]:
    async with memory_network() as net:
        a, b = net.add_host(), net.add_host()
        yield a, b, lambda: net.kill(b.peer_id)


@asynccontextmanager
async def libp2p_pair() -> AsyncIterator[tuple[Any, Any, Callable[[], None]]]:
    async with AsyncExitStack() as st:
        a = await st.enter_async_context(open_libp2p_transport(Identity.generate()))
        b = await st.enter_async_context(open_libp2p_transport(Identity.generate()))
        yield a, b, None  # type: ignore[misc]


PAIRS = {"memory": memory_pair, "libp2p": libp2p_pair}


async def echo(s: Stream) -> None:
    while data := await s.receive_some():
        await s.send_all(data)
    await s.send_eof()


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_stream_echo_and_eof(kind: str) -> None:
    async def main() -> None:
        with trio.fail_after(20):
            async with PAIRS[kind]() as (a, b, _):
                b.set_stream_handler("/t/echo/1", echo)
                assert await a.connect(b.listen_addrs()[0]) == b.peer_id
                s = await a.open_stream(b.peer_id, "/t/echo/1")
                assert s.remote_peer == b.peer_id
                payload = bytes(range(256)) * 1024
                await s.send_all(payload)
                await s.send_eof()
                got = bytearray()
                while chunk := await s.receive_some():
                    got += chunk
                assert bytes(got) == payload
                await s.aclose()

    trio.run(main)


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_handler_sees_authenticated_peer(kind: str) -> None:
    async def main() -> None:
        seen: list[str] = []

        async def who(s: Stream) -> None:
            seen.append(s.remote_peer)
            await s.send_all(b"ok")

        with trio.fail_after(20):
            async with PAIRS[kind]() as (a, b, _):
                b.set_stream_handler("/t/who/1", who)
                await a.connect(b.listen_addrs()[0])
                s = await a.open_stream(b.peer_id, "/t/who/1")
                assert await s.receive_some() == b"ok"
                assert seen == [a.peer_id]

    trio.run(main)


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_unknown_protocol_is_peer_unavailable(kind: str) -> None:
    async def main() -> None:
        with trio.fail_after(20):
            async with PAIRS[kind]() as (a, b, _):
                await a.connect(b.listen_addrs()[0])
                with pytest.raises(PeerUnavailable):
                    await a.open_stream(b.peer_id, "/t/nothing/1")

    trio.run(main)


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_gossip_and_dht(kind: str) -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with PAIRS[kind]() as (a, b, _):
                await a.connect(b.listen_addrs()[0])
                sa, sb = await a.subscribe("t"), await b.subscribe("t")
                got = None
                while got is None:  # gossipsub needs a heartbeat to graft the mesh: republish until delivered
                    await a.publish("t", b"hello")
                    assert (await sa.receive()).data == b"hello"  # local delivery is immediate
                    with trio.move_on_after(0.5):
                        got = await sb.receive()
                assert got.sender == a.peer_id and got.data == b"hello"
                await a.dht_put("/fusionp2p/test", b"v")
                assert await b.dht_get("/fusionp2p/test") == b"v"

    trio.run(main)


def test_memory_dead_peer_breaks_stream() -> None:
    async def main() -> None:
        with trio.fail_after(10):
            async with memory_pair() as (a, b, kill):
                b.set_stream_handler("/t/echo/1", echo)
                s = await a.open_stream(b.peer_id, "/t/echo/1")
                kill()
                with pytest.raises(PeerUnavailable):
                    await s.send_all(b"x")
                with pytest.raises(PeerUnavailable):
                    await a.open_stream(b.peer_id, "/t/echo/1")

    trio.run(main)


def test_libp2p_refuses_plaintext_dialer() -> None:
    """Our host offers only Noise: a dialer that speaks only /plaintext/2.0.0 cannot connect."""
    import multiaddr
    from libp2p import new_host
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

    async def main() -> None:
        with trio.fail_after(20):
            async with open_libp2p_transport(Identity.generate()) as ours:
                kp = Identity.generate().key_pair
                evil = new_host(key_pair=kp, sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(kp)})
                async with evil.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                    info = info_from_p2p_addr(multiaddr.Multiaddr(ours.listen_addrs()[0]))
                    with pytest.raises(Exception):  # noqa: B017 - libp2p raises its own types
                        with trio.fail_after(8):
                            await evil.connect(info)
                    assert evil.get_id() not in list(ours.host.get_connected_peers())

    trio.run(main)


def test_libp2p_context_propagates_body_exceptions() -> None:
    """py-libp2p's service contexts swallowed exceptions raised inside our `async with`; ours must not."""

    async def main() -> None:
        with trio.fail_after(20):
            with pytest.raises(KeyError, match="boom"):
                async with open_libp2p_transport(Identity.generate()):
                    raise KeyError("boom")

    trio.run(main)


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_ranked_records_keep_the_best_copy(kind: str) -> None:
    """With a ranker, a stale write never replaces a newer record, and a reader gets the newest copy
    (without one, the DHT keeps the last write)."""
    def rank(v: bytes) -> tuple[int, ...] | None:
        return (int(v),) if v.isdigit() else None

    async def main() -> None:
        with trio.fail_after(30):
            async with PAIRS[kind]() as (a, b, _):
                for t in (a, b):
                    t.rank_records("/fusionp2p/ranked/", rank)
                await a.connect(b.listen_addrs()[0])
                await a.dht_put("/fusionp2p/ranked/x", b"7")
                await b.dht_put("/fusionp2p/ranked/x", b"3")        # an older writer comes late
                await b.dht_put("/fusionp2p/ranked/x", b"forged")   # does not even rank
                assert await a.dht_get("/fusionp2p/ranked/x") == b"7"
                assert await b.dht_get("/fusionp2p/ranked/x") == b"7"
                await b.dht_put("/fusionp2p/ranked/x", b"9")
                assert await a.dht_get("/fusionp2p/ranked/x") == b"9"

    trio.run(main)


def test_libp2p_a_stale_local_copy_does_not_hide_a_newer_record() -> None:
    """py-libp2p's get answers from the local store without asking anyone, and a get keeps the network's
    answer locally: a ranked record that changes (a job's status) read stale for ever on a node that no newer
    put reached. Issue 43: a NAT'd leader could not dial its publisher back, its DONE status reached every
    peer but that one, and the publisher polled its own cached RUNNING copy until the test's deadline."""
    def rank(v: bytes) -> tuple[int, ...] | None:
        return (int(v),) if v.isdigit() else None

    async def main() -> None:
        with trio.fail_after(30):
            async with AsyncExitStack() as st:
                a = await st.enter_async_context(open_libp2p_transport(Identity.generate()))
                b = await st.enter_async_context(open_libp2p_transport(Identity.generate()))
                for t in (a, b):
                    t.rank_records("/fusionp2p/ranked/", rank)
                assert await a.dht_get("/fusionp2p/ranked/x") is None     # no peer: nothing, at once
                await a.connect(b.listen_addrs()[0])
                await b.dht_put("/fusionp2p/ranked/x", b"3")
                assert await a.dht_get("/fusionp2p/ranked/x") == b"3"     # a holds a copy now
                b.dht.value_store.put(b"/fusionp2p/ranked/x", b"8")       # a newer write that reached b, not a
                assert await a.dht_get("/fusionp2p/ranked/x") == b"8"
                assert await a.dht_get("/fusionp2p/ranked/x") == b"8"     # and kept
                b.dht.value_store.put(b"/fusionp2p/ranked/x", b"forged")  # a worse copy elsewhere changes nothing
                assert await a.dht_get("/fusionp2p/ranked/x") == b"8"
                c = await st.enter_async_context(open_libp2p_transport(Identity.generate()))
                c.rank_records("/fusionp2p/ranked/", rank)
                c.dht.value_store.put(b"/fusionp2p/ranked/x", b"5")
                assert await c.dht_get("/fusionp2p/ranked/x") == b"5"     # nobody to ask: the local copy

    trio.run(main)
