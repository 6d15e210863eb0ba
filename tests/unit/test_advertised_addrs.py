"""A host listening on a wildcard address advertises its interfaces' addresses (net/advertised.py)."""

from __future__ import annotations

from contextlib import AsyncExitStack

import multiaddr
import pytest
import trio

import fusionp2p.net.advertised as advertised
from fusionp2p.net.advertised import WildcardExpander
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport
from fusionp2p.net.transport import Stream
from fusionp2p.testing.wait import poll_until


def _loopback_interfaces(addr: multiaddr.Multiaddr) -> list[multiaddr.Multiaddr]:
    """The machine's interfaces, as loopback only (a dialable one, whatever this machine's IPs are)."""
    return [multiaddr.Multiaddr(str(addr).replace("/ip4/0.0.0.0/", "/ip4/127.0.0.1/"))]


def test_wildcards_become_interface_addresses_the_rest_stays() -> None:
    calls: list[str] = []

    def fake(addr: multiaddr.Multiaddr) -> list[multiaddr.Multiaddr]:
        calls.append(str(addr))
        return [multiaddr.Multiaddr(str(addr).replace("0.0.0.0", "10.1.2.3"))]

    ex = WildcardExpander(refresh_s=3600)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(advertised, "expand_wildcard_address", fake)
        given = [multiaddr.Multiaddr(a) for a in ("/ip4/0.0.0.0/tcp/4001", "/ip4/127.0.0.1/tcp/9",
                                                  "/ip4/10.1.2.3/tcp/4001")]
        assert [str(a) for a in ex(given)] == ["/ip4/10.1.2.3/tcp/4001", "/ip4/127.0.0.1/tcp/9"]
        ex(given)
    assert calls == ["/ip4/0.0.0.0/tcp/4001"]     # the interface list is read once per refresh_s


def test_a_peer_dials_a_wildcard_host_back_after_the_host_hung_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43: the publisher (the CLI listens on 0.0.0.0) advertised only 0.0.0.0, which nobody dials; a NAT'd
    member it had reached through the relay could not reach it again once that connection dropped."""
    monkeypatch.setattr(advertised, "expand_wildcard_address", _loopback_interfaces)

    async def echo(s: Stream) -> None:
        await s.send_all(await s.receive_some() or b"")
        await s.aclose()

    async def main() -> None:
        with trio.fail_after(30):
            async with AsyncExitStack() as st:
                pub = await st.enter_async_context(open_libp2p_transport(
                    Identity.generate(), Libp2pConfig(listen=("/ip4/0.0.0.0/tcp/0",))))
                member = await st.enter_async_context(open_libp2p_transport(Identity.generate()))
                assert not any("/0.0.0.0/" in a for a in pub.listen_addrs())
                pub.set_stream_handler("/t/echo/1", echo)
                await pub.connect(member.listen_addrs()[0])       # the host dials out; the peer learns it by identify
                await poll_until(lambda: member.peer_addrs(pub.peer_id))
                await pub.hang_up(member.peer_id)
                s = await member.open_stream(pub.peer_id, "/t/echo/1")   # before: "No known addresses"
                await s.send_all(b"back")
                assert await s.receive_some() == b"back"

    trio.run(main)
