"""Circuit relay v2 for the control plane of nodes that cannot be dialled (issue 21; docs/networking.md).

Theory of operation. Two nodes behind different NATs cannot open a TCP connection to each other, but
both can dial a public node. Circuit relay v2 (libp2p spec ``relay/circuit-v2.md``) lets the public
node carry one's libp2p connection to the other:

* a node that cannot be dialled **reserves** a slot on a relay (a ``RESERVE`` on
  ``/libp2p/circuit/relay/0.2.0/hop``) and announces ``/RELAY-ADDR/p2p/RELAY/p2p-circuit`` in its
  signed record;
* a peer that wants it dials that address: it asks the relay (``CONNECT`` naming the node), the relay
  opens ``/libp2p/circuit/relay/0.2.0/stop`` to the node and, both sides having said OK, copies bytes
  between the two streams; over those bytes the two peers run an ordinary Noise + yamux upgrade, so
  the relay sees only ciphertext and the connection is authenticated end to end.

py-libp2p 0.8.1 ships the protocol (``libp2p.relay.circuit_v2``); a loopback experiment (three hosts
configured as ours, 32 MiB echoed over a circuit) showed the relay side and the message formats work.
We use its protobufs, its length-delimited reads (64 KiB bound) and its reservations
(``CircuitV2Protocol._handle_reserve``, signed vouchers), and replace what is unsafe or unbounded there:

* its hop handler reads any number of messages per stream and logs every end of stream as an error:
  ours reads one message per stream, with a deadline;
* its ``RESERVE`` handler reserves for the peer id named *in the message* (any stranger can reserve on
  behalf of any id, for free): ours clears that field, so a slot is always for the authenticated
  remote peer;
* reservations of peers that disconnected keep their slot until the TTL; ours are pruned first;
* it has no limit on concurrent circuits across reservations, per source IP, or on the bytes per
  second relayed: ours has all three (:class:`RelayLimits`), each counted before the first await of
  a request (concurrent requests cannot all pass one check), and a hard deadline per circuit (its own
  duration check runs only when bytes arrive);
* its circuits are keyed by peer id (``_active_relays``): the end of one circuit closes whichever
  circuit to the same peer was stored last, a refused circuit leaves its entry behind, and at its
  deadline only the source half is closed. Ours (:meth:`RelayService._circuit`) owns its two streams
  and closes both, whatever ends it;
* its ``STOP`` handler accepts a circuit from any connected peer: ours only from relays we reserved on;
* its client (``CircuitV2Transport``) reserves a slot on the relay before every *dial*, and py-libp2p's
  swarm drops ``/p2p-circuit`` addresses from every dial: ours dials circuits itself (:meth:`dial`).
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, Limit, StopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
from libp2p.relay.circuit_v2.resources import RelayLimits as _Libp2pLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from fusionp2p.errors import ConfigError, PeerUnavailable
from fusionp2p.types import short_peer

log = logging.getLogger(__name__)

HOP = TProtocol("/libp2p/circuit/relay/0.2.0/hop")
STOP = TProtocol("/libp2p/circuit/relay/0.2.0/stop")
_READ = 65_535


@dataclass(frozen=True, kw_only=True, slots=True)
class RelayLimits:
    """What a relay carries for strangers at most (docs/security.md, "Relay").

    Whatever peers do, a relay holds at most ``reservations`` slots (``per_ip`` from one address) and
    ``circuits`` open circuits (``circuits_per_peer`` to one reserved node, ``circuits_per_ip`` from one
    source address, ``circuits_per_ip_peer`` from one source address to one node); a circuit lives at most
    ``duration`` seconds and carries at most ``circuit_bytes`` bytes (both directions together); all
    circuits together move at most ``rate`` bytes per second."""

    reservations: int = 32
    per_ip: int = 8
    reservation_ttl: int = 600            # seconds; clients refresh at half of it
    circuits: int = 64
    circuits_per_peer: int = 8
    circuits_per_ip: int = 8
    circuits_per_ip_peer: int = 2         # from one source IP to one reserved node (so one host cannot take a
                                          # node's circuits_per_peer: the live hostile test's did, and the node's
                                          # honest peers could not reach it through the relay)
    duration: int = 3600                  # seconds per circuit
    circuit_bytes: int = 1 << 30          # per circuit, both directions
    rate: float = 10e6                    # bytes/s over all circuits (token bucket, one second of burst)

    def __post_init__(self) -> None:
        if min(self.reservations, self.per_ip, self.circuits, self.circuits_per_peer, self.circuits_per_ip,
               self.circuits_per_ip_peer) < 1:
            raise ConfigError("relay limits on reservations and circuits must be >= 1")
        if min(self.reservation_ttl, self.duration, self.circuit_bytes) < 1 or not self.rate > 0:
            raise ConfigError("relay ttl, duration, bytes and rate must be positive")


class _Bucket:
    """Token bucket: ``take(n)`` waits until *n* bytes fit under *rate* bytes/s (one second of burst)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._tokens = rate
        self._t = trio.current_time()

    async def take(self, n: int) -> None:
        now = trio.current_time()
        self._tokens = min(self.rate, self._tokens + (now - self._t) * self.rate)
        self._t = now
        self._tokens -= n
        if self._tokens < 0:
            await trio.sleep(-self._tokens / self.rate)   # pacing, not a readiness wait


class RelayService(CircuitV2Protocol):
    """The hop side: serve reservations and circuits within :class:`RelayLimits`.

    Not run as a py-libp2p service: :meth:`install` registers the one stream handler it needs."""

    def __init__(self, host: Any, limits: RelayLimits, *, timeout: float = 10.0) -> None:
        super().__init__(host, limits=_Libp2pLimits(duration=limits.duration, data=limits.circuit_bytes,
                                                    max_circuit_conns=limits.circuits_per_peer,
                                                    max_reservations=limits.reservations,
                                                    reservation_ttl=limits.reservation_ttl),
                         allow_hop=True, read_timeout=int(timeout), write_timeout=int(timeout),
                         close_timeout=int(timeout))
        self.config = limits
        self.timeout = timeout
        self._ips: dict[ID, str] = {}           # reserved (or being reserved) peer -> the IP it reserved from
        self._circuits = 0
        self._to_peer: collections.Counter[ID] = collections.Counter()      # open circuits by destination
        self._from_ip: collections.Counter[str] = collections.Counter()     # open circuits by source IP
        self._pair: collections.Counter[tuple[str, ID]] = collections.Counter()   # ... by (source IP, destination)
        self._bucket: _Bucket | None = None
        self.stats: dict[str, int] = {"reserved": 0, "refused": 0, "circuits": 0, "relayed_bytes": 0}

    def install(self) -> None:
        self.host.set_stream_handler(HOP, self._handle_hop_stream)

    @property
    def open_circuits(self) -> int:
        return self._circuits

    def reservations(self) -> list[str]:
        self._prune()
        return sorted(p.to_base58() for p in self.resource_manager._reservations)

    def _prune(self) -> None:
        """Drop reservations that expired or whose peer disconnected (a slot is valid only while the
        reserving peer holds a connection to us, spec "Reservation")."""
        res = self.resource_manager._reservations
        net = self.host.get_network()
        for pid in [p for p, r in res.items() if r.is_expired() or not net.connections.get(p)]:
            del res[pid]
            self._ips.pop(pid, None)

    async def _deny(self, stream: Any, code: StatusCode) -> None:
        self.stats["refused"] += 1
        try:
            with trio.fail_after(self.timeout):
                await write_delimited_msg(stream, HopMessage(type=HopMessage.STATUS, status=to_proto_status(code)))
        except Exception as exc:
            log.debug("relay: status to a refused peer: %s", exc)
        await self._close_stream(stream)

    async def _handle_hop_stream(self, stream: Any) -> None:
        """One message per stream: RESERVE (answered, stream closed) or CONNECT (the stream becomes the
        circuit's source half, until it ends or a limit cuts it)."""
        peer: ID = stream.muxed_conn.peer_id
        if _relayed(stream):
            await self._deny(stream, StatusCode.PERMISSION_DENIED)   # no relaying over relayed connections
            return
        try:
            with trio.fail_after(self.timeout):
                msg = await read_delimited_msg(stream, HopMessage)
        except Exception as exc:
            log.debug("relay: hop request from %s: %s", peer, exc)
            await self._deny(stream, StatusCode.MALFORMED_MESSAGE)
            return
        if msg.type == HopMessage.RESERVE:
            await self._reserve(stream, peer, msg)
        elif msg.type == HopMessage.CONNECT:
            await self._connect(stream, msg)
        else:
            await self._deny(stream, StatusCode.UNEXPECTED_MESSAGE)

    async def _reserve(self, stream: Any, peer: ID, msg: Any) -> None:
        msg.ClearField("peer")          # a slot is for the authenticated remote peer, never for a named one
        self._prune()
        ip = _remote_ip(stream)
        known = peer in self.resource_manager._reservations
        pending = peer in self._ips and not known           # this peer's other RESERVE is under way
        if not known and (pending or len(self._ips) >= self.config.reservations
                          or sum(1 for v in self._ips.values() if v == ip) >= self.config.per_ip):
            await self._deny(stream, StatusCode.RESERVATION_REFUSED)
            return
        # counted before the first await: concurrent RESERVEs from one IP see each other's slots
        self._ips[peer] = ip
        try:
            await self._handle_reserve(stream, msg)
        finally:
            if peer not in self.resource_manager._reservations:
                self._ips.pop(peer, None)
        if not known and peer in self._ips:
            self.stats["reserved"] += 1
            log.info("relay: reserved a slot for %s (%d held)", peer, len(self._ips))
        await self._close_stream(stream)

    async def _connect(self, stream: Any, msg: Any) -> None:
        try:
            dest = ID(msg.peer.id)
        except Exception:
            await self._deny(stream, StatusCode.MALFORMED_MESSAGE)
            return
        source: ID = stream.muxed_conn.peer_id
        ip = _remote_ip(stream)
        # every limit checked and counted here, before any await: concurrent CONNECTs see each other
        self._prune()
        if self.resource_manager.get_reservation(dest) is None:
            await self._deny(stream, StatusCode.NO_RESERVATION)
            return
        cfg = self.config
        if (self._circuits >= cfg.circuits or self._to_peer[dest] >= cfg.circuits_per_peer
                or self._from_ip[ip] >= cfg.circuits_per_ip or self._pair[ip, dest] >= cfg.circuits_per_ip_peer):
            await self._deny(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED)
            return
        self._circuits += 1
        self._to_peer[dest] += 1
        self._from_ip[ip] += 1
        self._pair[ip, dest] += 1
        self.stats["circuits"] += 1
        try:
            await self._circuit(stream, source, dest)
        finally:
            self._circuits -= 1
            self._to_peer -= collections.Counter({dest: 1})    # (drops keys that reach zero)
            self._from_ip -= collections.Counter({ip: 1})
            self._pair -= collections.Counter({(ip, dest): 1})

    async def _circuit(self, src: Any, source: ID, dest: ID) -> None:
        """One circuit, which owns its two halves: STOP to *dest*, OK to the source, then bytes both ways
        until either side ends, a limit is passed or the deadline; both halves are closed whatever ends it
        (py-libp2p's ``_handle_connect`` keys circuits by peer, so one circuit's end closed another's)."""
        cfg = self.config
        dst: Any = None
        limit = Limit(duration=cfg.duration, data=cfg.circuit_bytes)
        try:
            with trio.move_on_after(cfg.duration + self.timeout):
                try:
                    with trio.fail_after(self.timeout):
                        dst = await self.host.new_stream(dest, [STOP])
                        await write_delimited_msg(dst, StopMessage(type=StopMessage.CONNECT,
                                                                   peer=CircuitPeerId(id=source.to_bytes()), limit=limit))
                        resp = await read_delimited_msg(dst, StopMessage)
                    code = resp.status if resp.HasField("status") else StatusCode.UNUSED
                except Exception as exc:
                    log.debug("relay: circuit to %s: %s", dest, exc)
                    code = StatusCode.CONNECTION_FAILED
                if code != StatusCode.OK:
                    await self._deny(src, StatusCode.CONNECTION_FAILED)
                    return
                with trio.fail_after(self.timeout):
                    await write_delimited_msg(src, HopMessage(type=HopMessage.STATUS,
                                                              status=to_proto_status(StatusCode.OK), limit=limit))
                budget = [cfg.circuit_bytes]          # both directions together
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pipe, src, dst, budget, nursery.cancel_scope)
                    nursery.start_soon(self._pipe, dst, src, budget, nursery.cancel_scope)
        except Exception as exc:
            log.debug("relay: circuit %s -> %s: %s", source, dest, exc)
        finally:
            with trio.CancelScope(shield=True):
                for half in (src, dst):
                    if half is not None:
                        await self._close_stream(half)

    async def _pipe(self, src: Any, dst: Any, budget: list[int], circuit: trio.CancelScope) -> None:
        """Copy *src* to *dst*; the circuit ends (both directions) when *src* ends or the budget is spent."""
        try:
            while data := await self._read_stream_with_retry(src):
                budget[0] -= len(data)
                if budget[0] < 0:
                    log.debug("relay: a circuit passed its %d bytes", self.config.circuit_bytes)
                    return
                with trio.fail_after(self.timeout):
                    await dst.write(data)
        except Exception as exc:
            log.debug("relay: circuit write: %s", exc)
        finally:
            circuit.cancel()

    async def _read_stream_with_retry(self, stream: Any, max_retries: int = 0) -> bytes | None:
        """One read of a circuit's half (py-libp2p's relay loop calls it per chunk), paced by the rate
        limit shared by all circuits."""
        try:
            data: bytes = await stream.read(_READ)
        except Exception:
            return None
        if not data:
            return None
        if self._bucket is None:
            self._bucket = _Bucket(self.config.rate)
        await self._bucket.take(len(data))
        self.stats["relayed_bytes"] += len(data)
        return data


@dataclass
class _Slot:
    relay: ID
    expires: float                 # wall clock (the relay's voucher expiry)
    addrs: tuple[str, ...]         # our circuit addresses through this relay


class RelayClient:
    """The node side: reserve slots, accept circuits from those relays, dial circuits to others."""

    def __init__(self, host: Any, *, timeout: float = 10.0) -> None:
        self.host = host
        self.timeout = timeout
        self._slots: dict[ID, _Slot] = {}
        # py-libp2p's STOP handling (accept, upgrade): used on streams from our relays only
        self._stop = CircuitV2Protocol(host, allow_hop=False)

    def install(self) -> None:
        self.host.set_stream_handler(STOP, self._handle_stop)

    def circuit_addrs(self) -> list[str]:
        now = time.time()
        return [a for s in self._slots.values() if s.expires > now for a in s.addrs]

    def relays(self) -> list[str]:
        now = time.time()
        return sorted(p.to_base58() for p, s in self._slots.items() if s.expires > now)

    def forget(self, relay: str) -> None:
        self._slots.pop(ID.from_base58(relay), None)

    async def reserve(self, relay: str) -> float:
        """Reserve (or refresh) a slot on *relay*, a peer we are connected to; the seconds it is valid.
        PeerUnavailable if the relay does not offer relaying or refuses."""
        rid = ID.from_base58(relay)
        try:
            with trio.fail_after(self.timeout):
                stream = await self.host.new_stream(rid, [HOP])
                try:
                    await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                    resp = await read_delimited_msg(stream, HopMessage)
                finally:
                    await _close(stream)
        except trio.TooSlowError:
            raise PeerUnavailable(relay, "relay reservation timed out") from None
        except Exception as exc:
            raise PeerUnavailable(relay, f"relay reservation failed: {exc}") from None
        code = resp.status if resp.HasField("status") else StatusCode.UNUSED
        if code != StatusCode.OK or not resp.HasField("reservation"):
            self._slots.pop(rid, None)
            raise PeerUnavailable(relay, f"relay refused the reservation: {_status_name(code)}")
        addrs: list[str] = []
        for raw in resp.reservation.addrs[:8]:
            try:
                ma = multiaddr.Multiaddr(bytes(raw))
            except Exception:
                continue
            s = str(ma)
            if f"/p2p/{relay}" not in s:
                s = f"{s}/p2p/{relay}"
            if s.startswith(("/ip4/", "/ip6/", "/dns")) and "/p2p-circuit" not in s and len(s) < 200:
                addrs.append(f"{s}/p2p-circuit")
        if not addrs:
            # a relay that listens on a wildcard address sends none: use the addresses we know it at
            try:
                known = [str(a) for a in self.host.get_peerstore().addrs(rid)]
            except Exception:
                known = []
            addrs = [f"{a}/p2p/{relay}/p2p-circuit" for a in known
                     if a.startswith(("/ip4/", "/ip6/", "/dns")) and "/p2p" not in a and "/0.0.0.0/" not in a
                     and not a.startswith("/ip6/::/")][:4]
        expires = float(resp.reservation.expire)
        self._slots[rid] = _Slot(rid, expires, tuple(addrs))
        return max(0.0, expires - time.time())

    async def _handle_stop(self, stream: Any) -> None:
        relay: ID = stream.muxed_conn.peer_id
        slot = self._slots.get(relay)
        if slot is None or slot.expires < time.time():
            log.debug("relay: refused a circuit from %s (no reservation there)", relay)
            try:
                with trio.fail_after(self.timeout):
                    await write_delimited_msg(stream, StopMessage(type=StopMessage.STATUS,
                                                                  status=to_proto_status(StatusCode.PERMISSION_DENIED)))
            except Exception:
                pass
            await _close(stream)
            return
        with trio.move_on_after(2 * self.timeout):   # the STOP exchange and the Noise/yamux upgrade
            await self._stop._handle_stop_stream(stream)

    async def dial(self, addr: str) -> str:
        """Open a libp2p connection to the peer of ``.../p2p/RELAY/p2p-circuit/p2p/PEER`` through the relay;
        the peer id. PeerUnavailable on any failure (the relay refuses, the peer does not answer)."""
        relay_part, _, dest_part = addr.partition("/p2p-circuit")
        try:
            dest = ID.from_base58(dest_part.removeprefix("/p2p/").split("/")[0])
            rid = ID.from_base58(relay_part.rsplit("/p2p/", 1)[1])
            relay_ma = multiaddr.Multiaddr(relay_part.rsplit("/p2p/", 1)[0]) if relay_part.startswith("/ip") or \
                relay_part.startswith("/dns") else None
        except Exception:
            raise ConfigError(f"{addr!r} is not a circuit address: expected /ip4/ADDR/tcp/PORT/p2p/RELAY/p2p-circuit/p2p/PEER") from None
        peer = dest.to_base58()
        try:
            with trio.fail_after(2 * self.timeout):
                net = self.host.get_network()
                if not net.connections.get(rid):
                    if relay_ma is None:
                        raise PeerUnavailable(peer, "relay not connected and its address unknown")
                    net.unblock_peer(rid)
                    await self.host.connect(PeerInfo(rid, [relay_ma]))
                stream = await self.host.new_stream(rid, [HOP])
                await write_delimited_msg(stream, HopMessage(type=HopMessage.CONNECT, peer=CircuitPeerId(id=dest.to_bytes())))
                resp = await read_delimited_msg(stream, HopMessage)
                code = resp.status if resp.HasField("status") else StatusCode.UNUSED
                if code != StatusCode.OK:
                    await _close(stream)
                    raise PeerUnavailable(peer, f"relay {short_peer(rid.to_base58())} refused the circuit: {_status_name(code)}")
                circuit = multiaddr.Multiaddr(f"/p2p/{rid.to_base58()}/p2p-circuit/p2p/{peer}")
                raw = RawConnection(stream=stream, initiator=True, connection_type=ConnectionType.RELAYED,
                                    addresses=[circuit])
                await self.host.upgrade_outbound_connection(raw, dest)
        except PeerUnavailable:
            raise
        except trio.TooSlowError:
            raise PeerUnavailable(peer, "dial through the relay timed out") from None
        except Exception as exc:
            raise PeerUnavailable(peer, f"dial through the relay failed: {exc}") from None
        log.info("connected to %s through relay %s", short_peer(peer), short_peer(rid.to_base58()))
        return peer


def is_circuit(addr: str) -> bool:
    return "/p2p-circuit" in addr


def _relayed(stream: Any) -> bool:
    try:
        addrs = stream.muxed_conn.get_transport_addresses() or []
    except Exception:
        return False
    return any("/p2p-circuit" in str(a) for a in addrs)


def _remote_ip(stream: Any) -> str:
    try:
        addr = stream.get_remote_address()
        return str(ipaddress.ip_address(addr[0])) if addr else "?"
    except Exception:
        return "?"


def _status_name(code: int) -> str:
    try:
        return StatusCode(code).name
    except ValueError:
        return str(code)


async def _close(stream: Any) -> None:
    try:
        with trio.move_on_after(2):
            await stream.close()
    except Exception as exc:
        log.debug("close: %s", exc)


__all__ = ["HOP", "STOP", "RelayClient", "RelayLimits", "RelayService", "is_circuit"]
