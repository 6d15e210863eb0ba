"""A fresh provider lookup asks the network (``find_providers(key, fresh=True)``, net/dht_providers.py): py-libp2p
answers from its local records once it holds any, so a provider that came later was never seen, and a job
attach asked a dead member three times and nobody else."""

import hashlib
from contextlib import AsyncExitStack

import trio
from libp2p.peer.peerinfo import PeerInfo

from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import open_libp2p_transport

KEY = hashlib.sha256(b"blob").hexdigest()


def test_libp2p_a_fresh_lookup_finds_a_provider_the_cached_one_does_not() -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with AsyncExitStack() as st:
                a, b, c = [await st.enter_async_context(open_libp2p_transport(Identity.generate())) for _ in range(3)]
                await a.connect(b.listen_addrs()[0])
                await b.provide(KEY)
                assert await a.find_providers(KEY) == [b.peer_id]        # a holds b's record now
                # a later holder whose announcement reached b, not a (c announces to the peers it knows)
                b.dht.provider_store.add_provider(bytes.fromhex(KEY), PeerInfo(c.host.get_id(), c.host.get_addrs()))
                assert await a.find_providers(KEY) == [b.peer_id]        # py-libp2p's answer: its cache
                assert set(await a.find_providers(KEY, fresh=True)) == {b.peer_id, c.peer_id}
                assert c.peer_id in await a.find_providers(KEY)          # and kept, as py-libp2p's lookup does

    trio.run(main)
