"""What py-libp2p dials for a peer is cut to a few of its addresses (issue 43 finding 7, net/libp2p_host.py).

Before, a stranger's addresses as identify or the DHT put them in the peerstore (its own claim: 16 and
more) were all dialled whenever a node opened a stream to it without a connection: the swarm's own
filter (net/addrs.peer_dial_addrs) applied to the addresses of its records only."""

from __future__ import annotations

import functools

import multiaddr
import pytest
import trio
from libp2p.peer.id import ID

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.addrs import DIAL_LIMIT
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import open_libp2p_transport


def test_a_stream_to_a_peer_dials_a_few_of_its_claimed_addresses() -> None:
    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery, open_libp2p_transport(Identity.generate()) as t:
                hits: list[int] = []

                async def count(port: int, stream: trio.SocketStream) -> None:
                    hits.append(port)
                    await trio.aclose_forcefully(stream)

                ports = []
                for _ in range(16):
                    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
                    ports.append(listeners[0].socket.getsockname()[1])
                    await nursery.start(trio.serve_listeners, functools.partial(count, ports[-1]), listeners)
                stranger = Identity.generate().peer_id
                t.host.get_peerstore().add_addrs(
                    ID.from_base58(stranger), [multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{p}") for p in ports], 0)
                with pytest.raises(PeerUnavailable):
                    await t.open_stream(stranger, "/fusionp2p-test/x/1.0.0")
                assert 1 <= len(set(hits)) <= DIAL_LIMIT, hits
                # the same few whatever order they were reported in (one canonical order)
                kept = sorted(f"/ip4/127.0.0.1/tcp/{p}" for p in ports)[:DIAL_LIMIT]
                assert {f"/ip4/127.0.0.1/tcp/{p}" for p in hits} <= set(kept)
                assert len(t.peer_addrs(stranger)) <= DIAL_LIMIT
                nursery.cancel_scope.cancel()

    trio.run(main)
