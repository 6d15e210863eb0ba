"""An in-memory implementation of :class:`fusionp2p.net.transport.Transport`.

Many nodes in one ``trio.run``: streams are pairs of bounded memory channels (so backpressure is
real), gossip is delivered to every live subscriber, and the DHT is one shared dict. A host can be
killed (``MemoryNetwork.kill``): its streams break with PeerUnavailable and it stops hearing gossip.
Identities and signatures are the real Ed25519 ones, so signed records verify exactly as over libp2p.
With ``MemoryNetwork.emulator`` set, streams between shaped pairs move at the emulated rates, and
chunks arrive the emulated latency after they left (each carries its arrival time).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.net.identity import Identity
from fusionp2p.net.shaping import LinkEmulator
from fusionp2p.net.traffic import Traffic
from fusionp2p.net.transport import GossipMessage, RecordRank, StreamHandler
from fusionp2p.types import short_peer

log = logging.getLogger(__name__)

_CHUNK = 64 * 1024


class MemoryStream:
    """One end of an in-memory stream pair."""

    def __init__(self, local: str, remote: str, send: trio.MemorySendChannel[tuple[float, bytes]],
                 recv: trio.MemoryReceiveChannel[tuple[float, bytes]], net: MemoryNetwork) -> None:
        self._local = local
        self._remote = remote
        self._send = send
        self._recv = recv
        self._net = net
        self._pending = b""
        self._ready_at = 0.0   # when the pending chunk arrives (an emulated latency: the module docstring)
        self._eof = False

    @property
    def remote_peer(self) -> str:
        return self._remote

    @property
    def remote_ip(self) -> str | None:
        """Every in-memory peer lives in this process: it is seen at the loopback address."""
        return "127.0.0.1"

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._net.is_dead(self._remote) or self._net.is_dead(self._local):
            raise PeerUnavailable(self._remote, "peer is dead")
        mv = memoryview(bytes(data))
        emu = self._net.emulator
        latency = emu.latency(self._local, self._remote) if emu is not None else 0.0
        try:
            for i in range(0, len(mv), _CHUNK):
                chunk = bytes(mv[i : i + _CHUNK])
                if emu is not None:   # an emulated link: the chunk leaves at its rate, arrives its latency later
                    wait = emu.delay(self._local, self._remote, len(chunk), trio.current_time())
                    if wait > 0:
                        await trio.sleep(wait)
                await self._send.send((trio.current_time() + latency if latency else 0.0, chunk))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise PeerUnavailable(self._remote, "stream closed by peer") from None
        self._net.traffic_of(self._local).add("control", self._remote, sent=len(mv))

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._pending:
            if self._eof:
                return b""
            try:
                self._ready_at, chunk = await self._recv.receive()
            except trio.EndOfChannel:
                self._eof = True
                if self._net.is_dead(self._remote):
                    raise PeerUnavailable(self._remote, "peer died") from None
                return b""
            except trio.ClosedResourceError:
                return b""
            self._pending = chunk
        if self._ready_at:   # kept pending while it travels: a cancelled wait loses nothing
            await trio.sleep_until(self._ready_at)
            self._ready_at = 0.0
        n = len(self._pending) if max_bytes is None else max_bytes
        out, self._pending = self._pending[:n], self._pending[n:]
        self._net.traffic_of(self._local).add("control", self._remote, received=len(out))
        return out

    async def send_eof(self) -> None:
        await self._send.aclose()

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._recv.aclose()


class MemoryTransport:
    """A node's view of a :class:`MemoryNetwork`."""

    def __init__(self, net: MemoryNetwork, identity: Identity) -> None:
        self._net = net
        self._identity = identity
        self._handlers: dict[str, StreamHandler] = {}
        self._subs: dict[str, list[trio.MemorySendChannel[GossipMessage]]] = defaultdict(list)
        self._connected: set[str] = set()
        self.dropped_gossip = 0
        self.traffic = Traffic()   # stream bytes only (gossip and the DHT are not counted here)

    @property
    def peer_id(self) -> str:
        return self._identity.peer_id

    def listen_addrs(self) -> list[str]:
        return [f"/memory/{self.peer_id}/p2p/{self.peer_id}"]

    def sign(self, data: bytes) -> bytes:
        return self._identity.sign(data)

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        self._handlers[protocol] = handler

    async def connect(self, addr: str) -> str:
        peer = addr.rsplit("/p2p/", 1)[-1]
        await trio.lowlevel.checkpoint()
        if peer not in self._net.hosts or self._net.is_dead(peer):
            raise PeerUnavailable(peer, "no such host")
        self._connected.add(peer)
        self._net.hosts[peer]._connected.add(self.peer_id)
        return peer

    async def open_stream(self, peer: str, protocol: str) -> MemoryStream:
        await trio.lowlevel.checkpoint()
        if self._net.is_dead(self.peer_id):
            raise PeerUnavailable(peer, "local host is dead")
        remote = self._net.hosts.get(peer)
        if remote is None or self._net.is_dead(peer):
            raise PeerUnavailable(peer, "unreachable")
        handler = remote._handlers.get(protocol)
        if handler is None:
            raise PeerUnavailable(peer, f"protocol {protocol} not supported")
        a_send, b_recv = trio.open_memory_channel[tuple[float, bytes]](self._net.window)
        b_send, a_recv = trio.open_memory_channel[tuple[float, bytes]](self._net.window)
        mine = MemoryStream(self.peer_id, peer, a_send, a_recv, self._net)
        theirs = MemoryStream(peer, self.peer_id, b_send, b_recv, self._net)
        self._connected.add(peer)
        remote._connected.add(self.peer_id)
        self._net.spawn(peer, handler, theirs)
        return mine

    def connected_peers(self) -> list[str]:
        return sorted(p for p in self._connected if not self._net.is_dead(p))

    def peer_addrs(self, peer: str) -> list[str]:
        return [f"/memory/{peer}"] if peer in self._net.hosts else []

    async def publish(self, topic: str, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if self._net.is_dead(self.peer_id):
            return
        msg = GossipMessage(topic, self.peer_id, bytes(data))
        for host in list(self._net.hosts.values()):
            if self._net.is_dead(host.peer_id):
                continue
            for ch in host._subs.get(topic, []):
                try:
                    ch.send_nowait(msg)
                except trio.WouldBlock:
                    host.dropped_gossip += 1
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    async def subscribe(self, topic: str) -> trio.MemoryReceiveChannel[GossipMessage]:
        await trio.lowlevel.checkpoint()
        send, recv = trio.open_memory_channel[GossipMessage](self._net.gossip_buffer)
        self._subs[topic].append(send)
        return recv

    async def dht_put(self, key: str, value: bytes) -> None:
        await trio.lowlevel.checkpoint()
        old = self._net.dht.get(key)
        if old is not None and not _better(self._net.rankers, key, bytes(value), old):
            return
        self._net.dht[key] = bytes(value)

    def rank_records(self, prefix: str, rank: RecordRank) -> None:
        self._net.rankers[prefix] = rank

    async def dht_get(self, key: str) -> bytes | None:
        await trio.lowlevel.checkpoint()
        return self._net.dht.get(key)

    async def provide(self, key: str) -> None:
        await trio.lowlevel.checkpoint()
        self._net.providers[key].add(self.peer_id)

    async def find_providers(self, key: str, *, fresh: bool = False) -> list[str]:
        await trio.lowlevel.checkpoint()   # always the network's whole view: *fresh* changes nothing here
        return sorted(p for p in self._net.providers.get(key, ()) if not self._net.is_dead(p))

    async def hang_up(self, peer: str) -> None:
        await trio.lowlevel.checkpoint()
        self._connected.discard(peer)


class MemoryNetwork:
    """A set of in-memory hosts sharing one nursery (create with :func:`memory_network`)."""

    def __init__(self, nursery: trio.Nursery, *, window: int = 64, gossip_buffer: int = 1024) -> None:
        self._nursery = nursery
        self.window = window
        self.gossip_buffer = gossip_buffer
        self.hosts: dict[str, MemoryTransport] = {}
        self.dead: set[str] = set()
        self.dht: dict[str, bytes] = {}
        self.rankers: dict[str, RecordRank] = {}
        self.providers: dict[str, set[str]] = defaultdict(set)
        self._scopes: dict[str, list[trio.CancelScope]] = defaultdict(list)
        self.emulator: LinkEmulator | None = None   # emulated link rates between hosts (net/shaping.py)

    def add_host(self, identity: Identity | None = None) -> MemoryTransport:
        ident = identity or Identity.generate()
        t = MemoryTransport(self, ident)
        self.hosts[t.peer_id] = t
        self.dead.discard(t.peer_id)
        return t

    def is_dead(self, peer: str) -> bool:
        return peer in self.dead

    def traffic_of(self, peer: str) -> Traffic:
        host = self.hosts.get(peer)
        return host.traffic if host is not None else Traffic()

    def kill(self, peer: str) -> None:
        """Make *peer* vanish: its handlers are cancelled and its streams break."""
        self.dead.add(peer)
        for scope in self._scopes.pop(peer, []):
            scope.cancel()
        host = self.hosts.get(peer)
        if host is not None:
            for chans in host._subs.values():
                for ch in chans:
                    ch.close()
            host._subs.clear()

    def spawn(self, peer: str, handler: StreamHandler, stream: MemoryStream) -> None:
        scope = trio.CancelScope()
        self._scopes[peer].append(scope)

        async def run() -> None:
            with scope:
                try:
                    await handler(stream)
                except (PeerUnavailable, RemoteProtocolError) as exc:
                    # as the libp2p adapter does: a peer that went away or broke the protocol ends its own
                    # stream, never the network (any other exception is a bug of ours and propagates)
                    log.debug("stream handler (from %s): %s", short_peer(stream.remote_peer), exc)
                finally:
                    with trio.CancelScope(shield=True):
                        await stream.aclose()
            if scope in self._scopes.get(peer, []):
                self._scopes[peer].remove(scope)

        self._nursery.start_soon(run)


def _better(rankers: dict[str, RecordRank], key: str, new: bytes, old: bytes) -> bool:
    """Whether *new* may replace *old* under the ranker of *key*'s prefix (no ranker: the last write wins)."""
    rank = next((r for p, r in rankers.items() if key.startswith(p)), None)
    if rank is None:
        return True
    a, b = rank(new), rank(old)
    return a is not None and (b is None or a >= b)


@asynccontextmanager
async def memory_network(*, window: int = 64, gossip_buffer: int = 1024) -> AsyncIterator[MemoryNetwork]:
    """``async with memory_network() as net: a = net.add_host(); ...``"""
    async with trio.open_nursery() as nursery:
        net = MemoryNetwork(nursery, window=window, gossip_buffer=gossip_buffer)
        try:
            yield net
        finally:
            nursery.cancel_scope.cancel()


__all__ = ["MemoryNetwork", "MemoryStream", "MemoryTransport", "memory_network"]
