"""A provider lookup that asks the network, not py-libp2p's cache (a fetch's re-lookup, jobs/content.py).

py-libp2p 0.8.1's ``find_providers`` answers from the local provider store as soon as it holds any record of
the key, and every provider a lookup found is added to that store for 48 hours. So after one lookup a process
never asks the network again: a provider that died stays the only answer (the attach of a job whose member was
SIGKILLed asked that member three times and nobody else), and a holder that announced itself since is never
seen. :func:`network_providers` asks the peers closest to the key now and returns what they hold, together with
the local records; what it learns goes into the local store as py-libp2p's own lookup does (as
:mod:`fusionp2p.net.dht_fresh` does for ranked records).
"""

from __future__ import annotations

import trio
from libp2p.kad_dht.common import ALPHA, QUERY_TIMEOUT
from libp2p.kad_dht.kad_dht import KadDHT, _encode_key
from libp2p.peer.id import ID


async def network_providers(dht: KadDHT, key: str) -> list[str]:
    """Peer ids (base58) announcing *key*: the local records and those of the peers closest to the key, each
    asked once (at most ``ALPHA`` at a time, each within py-libp2p's ``QUERY_TIMEOUT``). The caller bounds the
    whole (the DHT walk to the closest peers included)."""
    store = dht.provider_store
    k = _encode_key(key)
    found = {i.peer_id.to_base58() for i in store.get_providers(k)}
    closest = list(await dht.peer_routing.find_closest_peers_network(k))
    me = dht.host.get_id()
    limit = trio.CapacityLimiter(ALPHA)

    async def ask(pid: ID) -> None:
        async with limit:
            with trio.move_on_after(QUERY_TIMEOUT):
                # py-libp2p's own step of its iterative lookup; it logs and returns ([], []) on any error
                providers, _ = await store._get_providers_from_peer_with_closers(pid, k)
                for info in providers:
                    store.add_provider(k, info)
                    found.add(info.peer_id.to_base58())

    async with trio.open_nursery() as nursery:
        for pid in closest:
            if pid != me:
                nursery.start_soon(ask, pid)
    return sorted(found)


__all__ = ["network_providers"]
