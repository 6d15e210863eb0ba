"""The libp2p adapter of :class:`fusionp2p.net.transport.Transport` (py-libp2p 0.8.1).

Configured as LIBP2P_NOTES.md measured it must be:

* Noise is the only security transport (the default also accepts plaintext dialers), yamux the only
  muxer, ``max_connections_per_peer=1`` (otherwise every connect waits the 250 ms happy-eyeballs delay).
* Kademlia in SERVER mode, used for discovery and provider records only; provider lists are deduplicated.
* GossipSub with a 1 s heartbeat (the default is 120 s), the per-peer rate limit set to our real rate,
  eclipse protection off (every test host shares one IP), payloads bounded well under 1 MiB.
* py-libp2p's auto-connector is switched off (membership decides whom to dial).
* ``unblock_peer`` before every dial (the swarm keeps a 60 s negative dial cache), and every call is
  wrapped in a deadline.
* Per-RPC costs of py-libp2p cut (:func:`_install_fast_paths`): yamux window updates are batched to half
  a window (go-yamux) instead of one per read, a peer's signed peer record is verified once rather than
  on every pubsub RPC it rides on, and our own is not re-serialised for every RPC we send.
* Bytes are counted per peer at each connection's secure channel (:class:`_CountingNotifee`), into
  ``transport.traffic`` under the plane ``"control"``.
* libp2p's logger is left alone here; the CLI routes it (STYLE.md 17).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import libp2p.pubsub.gossipsub as _gossipsub_mod
import libp2p.pubsub.pubsub as _pubsub_mod
import libp2p.stream_muxer.yamux.yamux as _yamux_mod
import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.network.config import ConnectionConfig
from libp2p.network.stream.exceptions import StreamClosed, StreamEOF, StreamError, StreamReset
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11
from libp2p.records.validator import Validator
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from fusionp2p.errors import ConfigError, PeerUnavailable
from fusionp2p.net.addrs import GLOBAL, LOOPBACK, PRIVATE, peer_dial_addrs
from fusionp2p.net.advertised import WildcardExpander
from fusionp2p.net.dht_fresh import freshest
from fusionp2p.net.dht_providers import network_providers
from fusionp2p.net.dial_errors import dial_cause
from fusionp2p.net.gossip_router import GossipPubsub, GossipRouter
from fusionp2p.net.holepunch import GuardedDCUtR, HolePunchLimits, HolePunchPolicy
from fusionp2p.net.identity import Identity
from fusionp2p.net.listening import not_listening
from fusionp2p.net.pubsub_retry import install as install_pubsub_retry
from fusionp2p.net.relay import RelayClient, RelayLimits, RelayService, is_circuit
from fusionp2p.net.traffic import Traffic
from fusionp2p.net.transport import GossipMessage, RecordRank, StreamHandler
from fusionp2p.wire.protocols import TOPIC_MEMBERS

log = logging.getLogger(__name__)

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

_READ_MAX = 65_536


@dataclass(frozen=True, kw_only=True, slots=True)
class Libp2pConfig:
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce: tuple[str, ...] = ()
    dial_timeout: float = 10.0
    stream_timeout: float = 10.0
    dht_timeout: float = 15.0
    gossip_heartbeat: int = 1
    gossip_degree: tuple[int, int, int] = (6, 4, 12)  # mesh degree D, D_low, D_high
    gossip_max_rate: float = 50.0       # messages / s / peer / topic we really send is far below this
    gossip_buffer: int = 1024
    max_gossip_bytes: int = 64 * 1024
    # topics whose messages are periodic state (the next heartbeat supersedes the last): not replayed to new peers
    state_topics: tuple[str, ...] = (TOPIC_MEMBERS,)
    # offer circuit relay v2 to peers that cannot be dialled, within these limits (None: do not relay)
    relay: RelayLimits | None = None
    # try DCUtR hole punching on relayed connections (net/holepunch.py, around py-libp2p's; experimental)
    hole_punch: bool = False
    hole_punch_limits: HolePunchLimits = field(default_factory=HolePunchLimits)

    def __post_init__(self) -> None:
        for a in (*self.listen, *self.announce):
            parse_multiaddr(a)
        if self.dial_timeout <= 0 or self.stream_timeout <= 0:
            raise ConfigError("timeouts must be positive")
        d, lo, hi = self.gossip_degree
        if not 0 < lo <= d <= hi:
            raise ConfigError("gossip_degree must be (D, D_low, D_high) with 0 < D_low <= D <= D_high")


def parse_multiaddr(addr: str) -> multiaddr.Multiaddr:
    """Parse or raise a one-line ConfigError."""
    try:
        return multiaddr.Multiaddr(addr)
    except Exception:
        raise ConfigError(f"malformed multiaddr {addr!r}; expected e.g. /ip4/127.0.0.1/tcp/4001") from None


def parse_peer_addr(addr: str) -> tuple[str, multiaddr.Multiaddr]:
    """Split a full ``.../p2p/<id>`` address; ConfigError if it is not one."""
    try:
        ma = multiaddr.Multiaddr(addr)
    except Exception:
        raise ConfigError(f"malformed multiaddr {addr!r}; expected the full address a bootstrap prints, "
                          "e.g. /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...") from None
    try:
        info = info_from_p2p_addr(ma)
    except Exception:
        raise ConfigError(f"{addr!r} has no /p2p/<peer id> part; use the full address the bootstrap printed") from None
    return info.peer_id.to_base58(), ma


class Libp2pStream:
    """Adapts a libp2p net stream to our Stream protocol."""

    def __init__(self, stream: Any, remote: str, timeout: float) -> None:
        self._s = stream
        self._remote = remote
        self._timeout = timeout

    @property
    def remote_peer(self) -> str:
        return self._remote

    @property
    def remote_ip(self) -> str | None:
        """The IP address the connection under this stream comes from (as seen here: behind a NAT, the
        NAT's public address), or None if unknown; None over a relayed connection, where the address
        seen is the relay's, not the peer's."""
        try:
            if any("/p2p-circuit" in str(a) for a in self._s.muxed_conn.get_transport_addresses() or ()):
                return None
            addr = self._s.get_remote_address()
        except Exception:
            return None
        return str(addr[0]) if addr else None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self._s.write(bytes(data))
        except (StreamClosed, StreamReset, StreamError, OSError) as exc:
            raise PeerUnavailable(self._remote, f"write failed: {exc}") from None

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            data: bytes = await self._s.read(max_bytes or _READ_MAX)
        except StreamEOF:
            return b""
        except (StreamReset, StreamError, StreamClosed, OSError) as exc:
            raise PeerUnavailable(self._remote, f"read failed: {exc}") from None
        return data

    async def send_eof(self) -> None:
        try:
            await self._s.close_write()
        except Exception as exc:
            log.debug("close_write: %s", exc)

    async def aclose(self) -> None:
        try:
            await self._s.close()
        except Exception as exc:
            log.debug("close: %s", exc)


class _CountingNotifee(INotifee):
    """Counts the bytes of every new connection into a :class:`Traffic` meter (plane ``"control"``).

    The connection's secure channel gets counting ``read``/``write`` on the instance: yamux looks both
    up on every call, so every frame after the connection is announced is counted (a few bytes of the
    yamux start-up may precede it). One dict lookup and two additions per frame."""

    def __init__(self, traffic: Traffic) -> None:
        self._traffic = traffic

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        muxed: Any = conn.muxed_conn
        sc = getattr(muxed, "secured_conn", None)
        if sc is None or getattr(sc, "_fp2p_counted", False):
            return
        peer = muxed.peer_id.to_base58()
        read, write, add = sc.read, sc.write, self._traffic.add

        async def counted_read(n: int | None = None) -> bytes:
            data: bytes = await read(n)
            add("control", peer, received=len(data))
            return data

        async def counted_write(data: bytes) -> None:
            await write(data)
            add("control", peer, sent=len(data))

        sc.read, sc.write, sc._fp2p_counted = counted_read, counted_write, True

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        pass

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, maddr: multiaddr.Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, maddr: multiaddr.Multiaddr) -> None:
        pass


_SPR_SEND_TTL = 10.0     # seconds our serialised signed peer record is reused for outgoing RPCs
_SPR_RECHECK = 600.0     # seconds after which a peer's unchanged record is verified (and its TTL refreshed) again
_SPR_MAX_PEERS = 4096
_fast_paths_installed = False


def _install_fast_paths() -> None:
    """Cut three per-RPC costs of py-libp2p 0.8.1 (each 10-15% of a node's CPU at 20 processes, py-spy).

    * yamux: with ``PY_YAMUX_RELEASE_ON_READ`` at its default, every read sends a WINDOW_UPDATE frame (one
      more Noise-encrypted write and syscall); off, credit is returned in batches of half the window, as
      go-yamux does. A reader that consumes everything always returns credit before the sender can stall,
      so this cannot deadlock. An explicit ``PY_YAMUX_RELEASE_ON_READ`` in the environment is respected.
    * pubsub: every RPC carries the sender's signed peer record and the receiver verifies it (Ed25519) and
      rewrites the peer's addresses each time. Bytes identical to the record already accepted from that
      peer are skipped (re-checked after ``_SPR_RECHECK`` s, which also refreshes their 2 h TTL); any
      other record goes through py-libp2p's own check.
    * pubsub: the sender rebuilds its listen addresses and re-serialises its record for every RPC; the
      serialised record is reused for ``_SPR_SEND_TTL`` seconds.
    """
    global _fast_paths_installed
    if _fast_paths_installed:
        return
    _fast_paths_installed = True
    if "PY_YAMUX_RELEASE_ON_READ" not in os.environ:
        setattr(_yamux_mod, "_yamux_release_on_read", lambda: False)  # noqa: B010
    consume = getattr(_pubsub_mod, "maybe_consume_signed_record")  # noqa: B009 (not re-exported for mypy)
    seen: weakref.WeakKeyDictionary[Any, dict[Any, tuple[bytes, float]]] = weakref.WeakKeyDictionary()

    def consume_once(msg: Any, host: Any, peer_id: Any) -> bool:
        if not msg.HasField("senderRecord"):
            return True
        raw, now = msg.senderRecord, time.monotonic()
        known = seen.setdefault(host, {})
        hit = known.get(peer_id)
        if hit is not None and hit[0] == raw and now - hit[1] < _SPR_RECHECK:
            return True
        ok: bool = consume(msg, host, peer_id)
        if ok:
            if len(known) >= _SPR_MAX_PEERS:
                known.clear()
            known[peer_id] = (raw, now)
        return ok

    make_env = getattr(_pubsub_mod, "env_to_send_in_RPC")  # noqa: B009
    mine: weakref.WeakKeyDictionary[Any, tuple[float, bytes]] = weakref.WeakKeyDictionary()

    def cached_env(host: Any) -> tuple[bytes, bool]:
        now = time.monotonic()
        hit = mine.get(host)
        if hit is not None and now - hit[0] < _SPR_SEND_TTL:
            return hit[1], False
        env, fresh = make_env(host)
        mine[host] = (now, env)
        return env, fresh

    for mod in (_pubsub_mod, _gossipsub_mod):
        setattr(mod, "maybe_consume_signed_record", consume_once)  # noqa: B010 (names imported into each module)
        setattr(mod, "env_to_send_in_RPC", cached_env)  # noqa: B010


class Libp2pTransport:
    """A running libp2p host with DHT and gossip; create with :func:`open_libp2p_transport`."""

    def __init__(self, identity: Identity, config: Libp2pConfig) -> None:
        _install_fast_paths()
        install_pubsub_retry()
        self._identity = identity
        self._config = config
        self._reverse: Callable[[str], Awaitable[bool]] | None = None
        kp = identity.key_pair
        self.host = new_host(
            key_pair=kp,
            sec_opt={TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(kp, noise_privkey=create_new_x25519_key_pair().private_key)},
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
            connection_config=ConnectionConfig(max_connections_per_peer=1, min_connections=0, low_watermark=0),
            announce_addrs=[parse_multiaddr(a) for a in config.announce] or None,
            # a wildcard listen address advertised as the interfaces' (net/advertised.py: issue 43's publisher)
            addrs_factory=None if config.announce else WildcardExpander(),
        )
        # py-libp2p's AutoConnector dials every peer in the peerstore until the connection count reaches
        # the midpoint of its watermarks (150 by default): with our one-directional dialing that produced
        # simultaneous cross-dials and stuck streams. Membership decides whom we connect to.
        network: Any = self.host.get_network()  # the concrete Swarm (the interface type lacks these attributes)
        network.auto_connector.maybe_connect = _no_auto_connect
        # What py-libp2p dials for a peer is whatever its peerstore holds (identify, the DHT: the peer's own
        # claim, 16 addresses or more): every dial goes through _trim_addrs first (issue 43 finding 7: one
        # stranger's announced addresses made every node that opened a stream to it connect to all of them)
        self._dial_scopes: Callable[[], Collection[str]] = lambda: (GLOBAL, PRIVATE, LOOPBACK)
        self._prefer: dict[ID, multiaddr.Multiaddr] = {}   # peer -> the address connect() was given
        dial_peer = network.dial_peer

        async def trimmed_dial(peer_id: ID) -> Any:
            self._trim_addrs(peer_id)
            return await dial_peer(peer_id)

        network.dial_peer = trimmed_dial
        self.traffic = Traffic()
        network.register_notifee(_CountingNotifee(self.traffic))
        self.dht = KadDHT(self.host, DHTMode.SERVER)
        self._rankers = _RankingValidator()
        assert self.dht.validator is not None
        self.dht.validator.add_validator("fusionp2p", self._rankers)
        self.router = GossipRouter(
            config.state_topics,
            protocols=[PROTOCOL_ID_V11],
            degree=config.gossip_degree[0], degree_low=config.gossip_degree[1], degree_high=config.gossip_degree[2],
            heartbeat_interval=config.gossip_heartbeat,
            spam_protection_enabled=True, max_messages_per_topic_per_second=config.gossip_max_rate,
            eclipse_protection_enabled=False,
            # py-libp2p's "adaptive gossip" rewrites the router's heartbeat to 30-60 s whenever its health
            # score drops below 0.7 (measured: it does at 20 processes on 2 cores), which stalls mesh repair.
            adaptive_gossip_enabled=False,
        )
        # Peer scoring: all of its thresholds default to -inf, so it protects nothing here, but while a scorer
        # exists py-libp2p grafts "opportunistically" on every heartbeat (the spec says every 60), then prunes
        # the oversized mesh again: measured 5-11 GRAFT/s per node at 20 processes, with GRAFT-flood penalties.
        self.router.scorer = None
        self.pubsub = GossipPubsub(self.host, self.router, max_inbound_rpc_size=4 * config.max_gossip_bytes)
        push, stats, pubsub = self.pubsub.push_msg, self.router.stats, self.pubsub

        async def counting_push(msg_forwarder: ID, msg: Any) -> None:
            stats["dup" if pubsub._is_msg_seen(msg) else "msg"] += 1
            await push(msg_forwarder, msg)

        self.pubsub.push_msg = counting_push  # type: ignore[method-assign]
        self._nursery: trio.Nursery | None = None
        self._subs: dict[str, list[trio.MemorySendChannel[GossipMessage]]] = {}
        self.dropped_gossip = 0
        # circuit relay v2 (net/relay.py): every node accepts circuits from relays it reserved on and dials
        # circuits; only a node configured with limits relays for others
        self.relay_client = RelayClient(self.host, timeout=config.stream_timeout)
        self.relay_client.install()
        self.relay_service = RelayService(self.host, config.relay, timeout=config.stream_timeout) if config.relay else None
        if self.relay_service is not None:
            self.relay_service.install()
        self._circuits: dict[str, list[str]] = {}   # peer -> circuit addresses it was reached at (bounded)
        self._circuit_source: Callable[[str], list[str]] = lambda _peer: []
        # hole punching within our limits (net/holepunch.py): members only, once the swarm names them
        self.dcutr: GuardedDCUtR | None = None
        if config.hole_punch:
            self.dcutr = GuardedDCUtR(self.host, config.hole_punch_limits, read_timeout=max(1, int(config.stream_timeout)),
                                      write_timeout=max(1, int(config.stream_timeout)),
                                      dial_timeout=max(1, int(config.dial_timeout)))

    def _network(self) -> Any:
        return self.host.get_network()

    async def _log_stats(self, every: float = 5.0) -> None:
        """Debug log of gossip received and dropped (net/gossip_router.py), sent, and our longest outbound queue."""
        while True:
            await trio.sleep(every)
            if not log.isEnabledFor(logging.DEBUG):   # the arguments cost a pass over the router's tables
                continue
            log.debug("gossip received: %s; mesh %s; sent %s; outbound queues max %d", dict(self.router.stats),
                      {t[:20]: len(p) for t, p in self.router.mesh.items()}, dict(self.pubsub.send_stats),
                      max(map(len, self.pubsub.peer_queues.values()), default=0))

    # -- identity ---------------------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self._identity.peer_id

    def listen_addrs(self) -> list[str]:
        out = []
        for a in self.host.get_addrs():
            s = str(a)
            out.append(s if "/p2p/" in s else f"{s}/p2p/{self.peer_id}")
        return out

    def sign(self, data: bytes) -> bytes:
        return self._identity.sign(data)

    # -- what we dial ------------------------------------------------------------------------------
    def set_dial_scopes(self, scopes: Callable[[], Collection[str]]) -> None:
        """*scopes()*: the address scopes we dial peers in (``net/addrs.dial_scopes``; default all three)."""
        self._dial_scopes = scopes

    def _trim_addrs(self, pid: ID) -> None:
        """Cut *pid*'s peerstore addresses to those :func:`~fusionp2p.net.addrs.peer_dial_addrs` keeps (the
        one :meth:`connect` was given first), before py-libp2p dials them."""
        store: Any = self.host.get_peerstore()   # the concrete PeerStore (peer_data_map: the TTL)
        try:
            addrs = [str(a) for a in store.addrs(pid)]
        except Exception:   # PeerStoreError: none known
            return
        # the rest in one canonical order: py-libp2p's own dials (a stream, the DHT) keep to the same few
        # addresses whatever order identify or the DHT reported them in
        prefer = self._prefer.get(pid)
        first = [str(prefer)] if prefer is not None and str(prefer) in addrs else []
        keep = peer_dial_addrs([*first, *sorted(a for a in addrs if a not in first and "/p2p-circuit" not in a)],
                               self._dial_scopes())
        if keep == addrs:
            return
        ttl = store.peer_data_map[pid].get_ttl() if pid in store.peer_data_map else 0
        store.clear_addrs(pid)
        if keep:
            store.add_addrs(pid, [multiaddr.Multiaddr(a) for a in keep], ttl)
        log.debug("dial %s: %d of its %d known addresses left out", pid, len(addrs) - len(keep), len(addrs))

    # -- circuit relay (net/relay.py) ---------------------------------------------------------------
    def circuit_addrs(self) -> list[str]:
        """Our full ``.../p2p-circuit/p2p/<us>`` addresses through the relays holding a slot for us."""
        return [f"{a}/p2p/{self.peer_id}" for a in self.relay_client.circuit_addrs()]

    def relays(self) -> list[str]:
        """The relays that hold a valid reservation for us."""
        return self.relay_client.relays()

    async def reserve(self, relay: str) -> float:
        """Reserve (or refresh) a slot on *relay* (connected); seconds it is valid. PeerUnavailable if refused."""
        return await self.relay_client.reserve(relay)

    def forget_relay(self, relay: str) -> None:
        self.relay_client.forget(relay)

    def set_circuit_source(self, source: Callable[[str], list[str]]) -> None:
        """*source(peer)*: circuit addresses (``/…/p2p/RELAY/p2p-circuit``) *peer*'s signed record announces, a
        few, to dial it through when it cannot be dialled directly. Without it only circuits we dialled
        before are known: a NAT'd node that was dialled through a relay could not reach its dialer again
        once that connection dropped (the live hostile test's home-office link, issue 43)."""
        self._circuit_source = source

    def set_hole_punch_policy(self, policy: HolePunchPolicy) -> None:
        """*policy(peer)*: the IPs *peer* may be dialled at for hole punching, None if it is not a member
        (``net/holepunch.py``); without one, nobody is punched. A no-op without ``hole_punch``."""
        if self.dcutr is not None:
            self.dcutr.policy = policy

    def is_relayed(self, peer: str) -> bool:
        try:
            conns = self._network().connections.get(_peer(peer)) or []
            return bool(conns) and all(
                any("/p2p-circuit" in str(a) for a in c.muxed_conn.get_transport_addresses()) for c in conns)
        except Exception:
            return False

    # -- streams ----------------------------------------------------------------------------------
    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        timeout = self._config.stream_timeout

        async def wrapped(stream: Any) -> None:
            remote = stream.muxed_conn.peer_id.to_base58()
            s = Libp2pStream(stream, remote, timeout)
            try:
                await handler(s)
            except PeerUnavailable as exc:
                log.debug("handler %s: %s", protocol, exc)
            except Exception:
                log.exception("stream handler for %s failed", protocol)
            finally:
                await s.aclose()

        self.host.set_stream_handler(TProtocol(protocol), wrapped)

    async def connect(self, addr: str) -> str:
        if is_circuit(addr):
            peer = await self.relay_client.dial(addr)
            known = self._circuits.setdefault(peer, [])
            if addr not in known:
                known[:] = [addr, *known][:4]
            if len(self._circuits) > 4096:
                self._circuits.pop(next(iter(self._circuits)))
            return peer
        peer, ma = parse_peer_addr(addr)
        info = info_from_p2p_addr(ma)
        self._network().unblock_peer(info.peer_id)
        if info.addrs:   # the address we were asked to dial (ours: already cut by the swarm) is dialled first
            self._prefer[info.peer_id] = info.addrs[0]
            if len(self._prefer) > 4096:
                self._prefer.pop(next(iter(self._prefer)))
        try:
            with trio.fail_after(self._config.dial_timeout):
                await self.host.connect(info)
        except trio.TooSlowError:
            where = addr.split("/p2p/", 1)[0]
            raise PeerUnavailable(peer, f"no answer from {where} within {self._config.dial_timeout:g} s: "
                                        "wrong host, or a firewall in the way?") from None
        except Exception as exc:
            # py-libp2p's "no addresses established a successful connection" hides the cause a user acts on
            raise PeerUnavailable(peer, dial_cause(exc, addr)) from None
        try:
            with trio.move_on_after(self._config.dht_timeout):
                await self.dht.add_peer(info.peer_id)
        except Exception as exc:
            log.debug("dht.add_peer(%s): %s", peer, exc)
        return peer

    def set_reverse_dialer(self, fn: Callable[[str], Awaitable[bool]] | None) -> None:
        """*fn(peer)* asks a third party to have *peer* dial us (connection reversal, ``swarm/reach.py``);
        ``open_stream`` calls it when *peer* cannot be dialled (it sits behind a NAT), then tries again."""
        self._reverse = fn

    async def open_stream(self, peer: str, protocol: str) -> Libp2pStream:
        pid = _peer(peer)
        conns = self._network().connections.get(pid) or []
        if conns and all(getattr(c, "is_closed", False) for c in conns):
            # closed connections py-libp2p has not removed yet: its new_stream and dial_peer stop at them ("No
            # valid connections available"), and a stream to a peer whose relayed connection had just dropped
            # failed at once, without a redial (the live hostile test's leader took a live member for dead)
            await self.hang_up(peer)
            conns = []
        connected = bool(conns)
        if not connected:
            self._network().unblock_peer(pid)
        try:
            return await self._new_stream(peer, pid, protocol)
        except PeerUnavailable:
            if connected or self._network().connections.get(pid):
                raise
            if not (self._reverse is not None and await self._reverse(peer)) and not await self._via_relay(peer):
                raise
        return await self._new_stream(peer, pid, protocol)   # on the connection the peer opened to us, or the circuit

    async def _via_relay(self, peer: str) -> bool:
        """Dial *peer* at a circuit address it was reached at before, or one its record announces
        (py-libp2p's own dials skip them); a few, each within ``dial_timeout``."""
        announced = [f"{a}/p2p/{peer}" for a in self._circuit_source(peer)]
        for addr in list(dict.fromkeys([*self._circuits.get(peer, ()), *announced]))[:3]:
            try:
                await self.connect(addr)
                return True
            except PeerUnavailable as exc:
                log.debug("circuit %s: %s", addr, exc)
        return False

    async def _new_stream(self, peer: str, pid: ID, protocol: str) -> Libp2pStream:
        try:
            with trio.fail_after(self._config.stream_timeout):
                s = await self.host.new_stream(pid, [TProtocol(protocol)])
        except trio.TooSlowError:
            raise PeerUnavailable(peer, f"opening {protocol} timed out") from None
        except Exception as exc:
            raise PeerUnavailable(peer, f"cannot open {protocol}: {exc}") from None
        return Libp2pStream(s, peer, self._config.stream_timeout)

    def connected_peers(self) -> list[str]:
        return sorted(p.to_base58() for p in self.host.get_connected_peers())

    def peer_addrs(self, peer: str) -> list[str]:
        try:
            return [str(a) for a in self.host.get_peerstore().addrs(_peer(peer))]
        except Exception:
            return []

    async def hang_up(self, peer: str) -> None:
        try:
            with trio.move_on_after(self._config.stream_timeout):
                await self.host.disconnect(_peer(peer))
        except Exception as exc:
            log.debug("disconnect %s: %s", peer, exc)

    # -- gossip -----------------------------------------------------------------------------------
    async def publish(self, topic: str, data: bytes) -> None:
        if len(data) > self._config.max_gossip_bytes:
            raise ConfigError(f"gossip payload of {len(data)} bytes is over the {self._config.max_gossip_bytes} limit")
        # Deliver to our own subscribers first: gossipsub does not loop back reliably.
        self._deliver(GossipMessage(topic, self.peer_id, bytes(data)))
        with trio.move_on_after(self._config.stream_timeout):
            await self.pubsub.publish(topic, bytes(data))

    async def subscribe(self, topic: str) -> trio.MemoryReceiveChannel[GossipMessage]:
        send, recv = trio.open_memory_channel[GossipMessage](self._config.gossip_buffer)
        first = topic not in self._subs
        self._subs.setdefault(topic, []).append(send)
        if first:
            sub = await self.pubsub.subscribe(topic)
            assert self._nursery is not None, "transport not running"
            self._nursery.start_soon(self._pump, topic, sub)
        return recv

    def _deliver(self, msg: GossipMessage) -> None:
        for ch in self._subs.get(msg.topic, []):
            try:
                ch.send_nowait(msg)
            except trio.WouldBlock:
                self.dropped_gossip += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _pump(self, topic: str, sub: Any) -> None:
        while True:
            m = await sub.get()
            try:
                sender = ID(m.from_id).to_base58()
            except Exception:
                self.dropped_gossip += 1
                continue
            if sender == self.peer_id:
                continue  # already delivered locally in publish()
            if len(m.data) > self._config.max_gossip_bytes:
                self.dropped_gossip += 1
                continue
            self._deliver(GossipMessage(topic, sender, bytes(m.data)))

    # -- DHT --------------------------------------------------------------------------------------
    async def dht_put(self, key: str, value: bytes) -> None:
        with trio.move_on_after(self._config.dht_timeout):
            try:
                await self.dht.put_value(key, bytes(value))
            except ValueError as exc:   # py-libp2p: a better value (by the key's ranker) is stored already
                log.debug("dht put of %s not stored: %s", key[:80], exc)

    def rank_records(self, prefix: str, rank: RecordRank) -> None:
        self._rankers.rankers[prefix] = rank

    async def dht_get(self, key: str) -> bytes | None:
        local = self.dht.value_store.get(key.encode())
        if local is not None and self._rankers.ranks(key):   # a record with versions: ask the peers too
            return await freshest(self.dht, key, local, self._rankers.select, timeout=self._config.dht_timeout)
        with trio.move_on_after(self._config.dht_timeout):
            v = await self.dht.get_value(key)
            return bytes(v) if v is not None else None
        return None

    async def provide(self, key: str) -> None:
        with trio.move_on_after(self._config.dht_timeout):
            await self.dht.provide(key)

    async def find_providers(self, key: str, *, fresh: bool = False) -> list[str]:
        with trio.move_on_after(self._config.dht_timeout):
            if fresh:   # py-libp2p answers from its cache once it holds a record of the key (net/dht_providers.py)
                return await network_providers(self.dht, key)
            infos = await self.dht.find_providers(key)
            return sorted({i.peer_id.to_base58() for i in infos})
        return []

    async def refresh(self) -> None:
        """Refresh the DHT routing table (after joining)."""
        with trio.move_on_after(self._config.dht_timeout):
            await self.dht.refresh_routing_table()


class _RankingValidator(Validator):
    """py-libp2p's record validator for our ``/fusionp2p/...`` keys: accepts every value and picks the best of several by the ranker registered for the key's prefix
    (``Transport.rank_records``); py-libp2p uses ``select`` both when a put meets a stored value and
    when a get hears different values from different peers."""

    def __init__(self) -> None:
        self.rankers: dict[str, RecordRank] = {}

    def validate(self, key: str, value: bytes) -> None:
        """Every value is accepted here (its reader verifies it); ranking decides which one is kept."""

    def ranks(self, key: str) -> bool:
        return any(key.startswith(p) for p in self.rankers)

    def select(self, key: str, values: list[bytes]) -> int:
        rank = next((r for p, r in self.rankers.items() if key.startswith(p)), None)
        if rank is None:
            return 0
        ranks = [rank(bytes(v)) for v in values]
        best = max(range(len(values)), key=lambda i: (ranks[i] is not None, ranks[i] or ()))
        return best


def _is_teardown_race(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "closed to new arrivals" in str(exc)


async def _no_auto_connect() -> None:
    return None


def _peer(peer: str) -> ID:
    try:
        return ID.from_base58(peer)
    except Exception:
        raise ConfigError(f"{peer!r} is not a peer id") from None


@asynccontextmanager
async def open_libp2p_transport(identity: Identity, config: Libp2pConfig | None = None) -> AsyncIterator[Libp2pTransport]:
    """Start a libp2p host listening on ``config.listen``; stop it on exit."""
    config = config or Libp2pConfig()
    t = Libp2pTransport(identity, config)
    listen = [parse_multiaddr(a) for a in config.listen]
    body_error: BaseException | None = None
    refused: ConfigError | None = None
    try:
        async with t.host.run(listen_addrs=listen), trio.open_nursery() as nursery:
            t._nursery = nursery
            # py-libp2p logs a listener that failed (a port in use) and comes up without it
            if (refused := not_listening(t.host.get_network().listeners, listen)) is not None:
                raise refused
            async with background_trio_service(t.dht), background_trio_service(t.pubsub), background_trio_service(t.router), \
                    contextlib.AsyncExitStack() as extra:
                if t.dcutr is not None:
                    await extra.enter_async_context(background_trio_service(t.dcutr))
                with trio.fail_after(config.dial_timeout):
                    await t.pubsub.wait_until_ready()
                if log.isEnabledFor(logging.DEBUG):
                    nursery.start_soon(t._log_stats)
                try:
                    yield t
                except BaseException as exc:
                    body_error = exc
                    raise
                finally:
                    for chans in t._subs.values():
                        for ch in chans:
                            ch.close()
                    # Stop taking new pubsub streams before the pubsub service stops: otherwise a peer's
                    # stream arriving during teardown makes py-libp2p spawn into a closed nursery.
                    for proto in list(getattr(t.pubsub, "protocols", [])):
                        with contextlib.suppress(Exception):
                            t.host.remove_stream_handler(proto)
                    nursery.cancel_scope.cancel()
    except OSError as exc:   # nursery-ok: bare from host.run's start; a group goes to the handler below
        if body_error is not None:
            raise
        raise ConfigError(f"cannot listen on {', '.join(config.listen)}: {exc.strerror or exc}") from None
    except BaseExceptionGroup as group:
        if refused is not None:
            raise refused from None
        # The same race inside py-libp2p's own services (a stream handled while they stop) surfaces as
        # RuntimeError("Nursery is closed to new arrivals") after our body finished; nothing is lost then.
        rest = group.split(_is_teardown_race)[1]
        if body_error is not None or rest is not None:
            raise
        log.debug("ignored a py-libp2p teardown race: %s", group)
    # py-libp2p's service contexts can swallow an exception raised in our body; never let that happen
    if refused is not None:
        raise refused
    if body_error is not None and not isinstance(body_error, trio.Cancelled):
        raise body_error
