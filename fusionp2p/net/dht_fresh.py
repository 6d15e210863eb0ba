"""A DHT read of a ranked record that a stale local copy cannot hide (``Libp2pTransport.dht_get``).

py-libp2p's ``KadDHT.get_value`` answers from the local store without asking anyone, and keeps the best
answer it got from the network in that store. A record with several versions over time (a job's status,
its latest plan: ``Transport.rank_records``) then reads stale for ever on a node that no newer put reaches:
in issue 43 a NAT'd leader could not dial its publisher back, its DONE status reached every other peer,
and the publisher polled its own cached RUNNING copy until its idle deadline. For a ranked key with a
local copy we ask the closest peers too, keep the best of every answer (the key's ranker decides; the
local copy wins ties) and store it locally, as a get from the network would have.
"""

from __future__ import annotations

from collections.abc import Callable

import trio
from libp2p.kad_dht.common import ALPHA, QUERY_TIMEOUT
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.peer.id import ID

Select = Callable[[str, list[bytes]], int]   # the DHT validator's ``select``: index of the best value


async def freshest(dht: KadDHT, key: str, local: Record, select: Select, *, timeout: float) -> bytes:
    """The best of *local* and the copies held by the peers closest to *key*, asked within *timeout*
    (whatever answered by then counts; with no answer, the local copy)."""
    kb = key.encode()
    found: list[Record] = [local]
    me = dht.host.get_id()

    async def ask(peer: ID, limit: trio.CapacityLimiter) -> None:
        async with limit:
            with trio.move_on_after(QUERY_TIMEOUT):
                rec = await dht.value_store._get_from_peer(peer, kb, return_record=True)
                if isinstance(rec, Record) and rec.value:
                    found.append(rec)

    with trio.move_on_after(timeout):
        peers = [p for p in await dht.peer_routing.find_closest_peers_network(kb) if p != me]
        limit = trio.CapacityLimiter(ALPHA)
        async with trio.open_nursery() as nursery:
            for p in peers:
                nursery.start_soon(ask, p, limit)
    best = found[select(key, [bytes(r.value) for r in found])]
    if best is not local:
        dht.value_store.put_record(kb, best)
    return bytes(best.value)


__all__ = ["freshest"]
