"""The narrow transport interface that everything above ``net/`` talks to.

Two implementations pass one conformance suite (tests/unit/test_transport_conformance.py):
:class:`fusionp2p.net.libp2p_host.Libp2pTransport` (real libp2p: Noise, yamux, Kademlia, gossipsub)
and :class:`fusionp2p.net.memory.MemoryTransport` (in one process, for fast deterministic tests).

Streams mirror ``trio.abc.Stream`` (``send_all`` / ``receive_some`` / ``aclose``) so that trio's own
stream helpers apply. ``receive_some`` returns ``b""`` at end of stream; a reset or a dead peer
raises :class:`~fusionp2p.errors.PeerUnavailable`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import trio

from fusionp2p.net.traffic import Traffic


@runtime_checkable
class Stream(Protocol):
    """A reliable, ordered, authenticated byte stream to one peer."""

    @property
    def remote_peer(self) -> str:
        """The authenticated peer id of the other end."""
        ...

    async def send_all(self, data: bytes | bytearray | memoryview) -> None: ...

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Up to *max_bytes* bytes (short reads are normal); ``b""`` at a clean end of stream."""
        ...

    async def send_eof(self) -> None:
        """Half-close: the peer reads ``b""``; we can still receive."""
        ...

    async def aclose(self) -> None: ...


StreamHandler = Callable[[Stream], Awaitable[None]]
RecordRank = Callable[[bytes], "tuple[int | float, ...] | None"]


@dataclass(frozen=True, slots=True)
class GossipMessage:
    topic: str
    sender: str  # authenticated peer id of the original publisher
    data: bytes


@runtime_checkable
class Relaying(Protocol):
    """What a transport that speaks circuit relay v2 adds (``net/relay.py``); the in-memory one does not."""

    def circuit_addrs(self) -> list[str]:
        """Our full circuit addresses (``/…/p2p/RELAY/p2p-circuit/p2p/<us>``) through the relays holding a slot."""
        ...

    def relays(self) -> list[str]:
        """The relays that hold a valid reservation for us."""
        ...

    async def reserve(self, relay: str) -> float:
        """Reserve or refresh a slot on *relay*; the seconds it is valid. PeerUnavailable if refused."""
        ...

    def forget_relay(self, relay: str) -> None: ...

    def is_relayed(self, peer: str) -> bool:
        """Our connection to *peer* goes through a circuit relay."""
        ...


class Transport(Protocol):
    """What a node needs from the network: identity, streams, gossip and a DHT."""

    @property
    def peer_id(self) -> str: ...

    @property
    def traffic(self) -> Traffic:
        """Bytes sent and received per peer and plane (``net/traffic.py``)."""
        ...

    def listen_addrs(self) -> list[str]:
        """Full multiaddrs, each ending in ``/p2p/<peer id>``."""
        ...

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature by this node's identity key."""
        ...

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None: ...

    async def connect(self, addr: str) -> str:
        """Dial a full multiaddr; return the peer id. Raises PeerUnavailable on failure."""
        ...

    async def open_stream(self, peer: str, protocol: str) -> Stream:
        """Open a new stream; raises PeerUnavailable when the peer cannot be reached."""
        ...

    def connected_peers(self) -> list[str]: ...

    def peer_addrs(self, peer: str) -> list[str]:
        """Known multiaddrs of *peer* (without the /p2p part); may be empty."""
        ...

    async def publish(self, topic: str, data: bytes) -> None: ...

    async def subscribe(self, topic: str) -> trio.MemoryReceiveChannel[GossipMessage]:
        """A bounded channel of messages on *topic* (our own included); overflow is dropped and counted."""
        ...

    async def dht_put(self, key: str, value: bytes) -> None: ...

    def rank_records(self, prefix: str, rank: RecordRank) -> None:
        """Values of keys starting with *prefix* are ranked by *rank* (larger wins; None: invalid, never
        kept over a valid one): a put never replaces a better value, and a get returns the best one found.
        Without it the DHT keeps the last write and a get returns the first answer, so a stale copy on
        one peer can hide a newer record."""
        ...

    async def dht_get(self, key: str) -> bytes | None: ...

    async def provide(self, key: str) -> None: ...

    async def find_providers(self, key: str, *, fresh: bool = False) -> list[str]:
        """Peer ids announcing *key*, deduplicated. *fresh*: ask the network even when this node holds records
        of the key already (a re-lookup: the records it holds may name only providers that died since)."""
        ...

    async def hang_up(self, peer: str) -> None:
        """Close every connection to *peer*."""
        ...
