"""Reachability, known rather than assumed: dial-back checks and connection reversal (issue 21).

Theory of operation (docs/networking.md):

* **Dial-back check.** A node asks a bootstrap it joined (``check``) to open TCP connections to the
  libp2p and data-plane addresses it announces. The bootstrap dials only addresses at the IP it sees
  the request come from (the AutoNAT rule against using it to attack third parties; an unspecified
  address, ``0.0.0.0``, stands for that IP), one request per peer every ``min_interval`` seconds, at
  most ``max_concurrent`` at once, each dial bounded by ``dial_timeout``. The answer sets the node's
  ``reach`` (``wire/records.py``: public / p2p / data / private), which it announces in its signed
  record; it asks on joining, when its data plane listens and every ``recheck`` seconds
  (``swarm/self_reach.py``). py-libp2p 0.8.1's AutoNAT was not used: its server
  "dials back" with ``host.connect``, which returns the connection the requester already has open to
  it, so it reports every peer as public; and it does not know our data-plane port.
* **Who dials whom.** Two members connect once (``swarm/node.py``): normally the larger peer id
  dials, but a node whose libp2p address cannot be dialled dials every member that can be, and is
  never dialled by them (:func:`should_dial`).
* **Connection reversal.** A peer that must reach a node behind a NAT and has no connection to it
  (the publisher offering a job) asks a bootstrap (``reverse``); the bootstrap, which the node keeps a
  connection to, asks the node (``dial``) to dial the requester at the requester's observed IP; the
  node does so only when asked by a bootstrap it joined, at most once per requester every
  ``min_interval``. The transport then opens its stream on that connection
  (``Libp2pTransport.set_reverse_dialer``). A relay of bytes (circuit relay v2) is not needed for
  this: the bootstrap carries two small messages and nothing else.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from fusionp2p.errors import ConfigError, PeerUnavailable, RemoteProtocolError
from fusionp2p.net.addrs import DIAL_LIMIT
from fusionp2p.net.transport import Stream, Transport
from fusionp2p.types import short_peer
from fusionp2p.wire import reach as wr
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.protocols import REACH
from fusionp2p.wire.records import REACH_DATA, REACH_P2P, REACH_PRIVATE, REACH_PUBLIC, REACH_UNKNOWN

log = logging.getLogger(__name__)

_DIALABLE = (REACH_PUBLIC, REACH_P2P)   # peers can open a libp2p connection to it


@dataclass(frozen=True, kw_only=True, slots=True)
class ReachConfig:
    """Settings of the REACH protocol (both sides)."""

    dial_timeout: float = 3.0      # one dial-back TCP connect
    request_timeout: float = 15.0  # one request, its dials included
    min_interval: float = 5.0      # per requesting peer, between two requests served (a node spaces its own so)
    max_concurrent: int = 16       # requests served at once ...
    per_ip: int = 2                # ... of them from one IP (many identities on one host hold no more)
    recheck: float = 300.0         # a node re-checks its reachability this often
    retry: float = 10.0            # ... and this soon after every server refused (busy): doubling up to recheck

    def __post_init__(self) -> None:
        if min(self.dial_timeout, self.request_timeout, self.recheck, self.retry) <= 0 or self.min_interval < 0:
            raise ConfigError("ReachConfig timeouts must be positive")
        if self.max_concurrent < 1 or self.per_ip < 1:
            raise ConfigError("ReachConfig.max_concurrent and per_ip must be >= 1")


def verdict(p2p: bool, data: bool) -> str:
    """The reach a node announces after a dial-back check."""
    if p2p:
        return REACH_PUBLIC if data else REACH_P2P
    return REACH_DATA if data else REACH_PRIVATE


def should_dial(me: str, my_reach: str, peer: str, peer_reach: str) -> bool:
    """Whether *me* dials *peer* (exactly one of a pair dials, so that no duplicate connection forms):
    the side that cannot be dialled dials the one that can; otherwise the larger peer id."""
    if REACH_UNKNOWN not in (my_reach, peer_reach):
        mine, theirs = my_reach in _DIALABLE, peer_reach in _DIALABLE
        if mine != theirs:
            return theirs
    return peer < me


def _endpoint(addr: str, observed: str) -> tuple[str, int] | None:
    """(ip, port) of ``/ip4|ip6/IP/tcp/PORT...`` if it may be dialled back for a requester seen at
    *observed* (an unspecified IP stands for it); None otherwise."""
    parts = addr.split("/")
    # ASCII digits only: str.isdigit() also accepts "²" (int() refuses it) and "٣" (int() reads it as 3)
    if len(parts) < 5 or parts[0] or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" \
            or not (parts[4].isascii() and parts[4].isdigit() and len(parts[4]) <= 5):
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
        seen = ipaddress.ip_address(observed)
    except ValueError:
        return None
    port = int(parts[4])
    if not 0 < port < 65536:
        return None
    if ip.is_unspecified:
        ip = seen
    return (str(ip), port) if ip == seen else None


async def _exchange(stream: Stream, payload: bytes, timeout: float) -> bytes:
    """Send one frame, read one frame (RemoteProtocolError or PeerUnavailable)."""
    with trio.fail_after(timeout):
        await stream.send_all(encode_frame(payload, max_frame=wr.MAX_MESSAGE))
        return await _read_frame(stream)


async def _read_frame(stream: Stream) -> bytes:
    dec = FrameDecoder(max_frame=wr.MAX_MESSAGE)
    while True:
        data = await stream.receive_some(wr.MAX_MESSAGE)
        if not data:
            dec.check_eof()
            raise PeerUnavailable(stream.remote_peer, "reach stream closed without an answer")
        frames = dec.feed(data)
        if frames:
            return frames[0]


async def _request(transport: Transport, server: str, payload: bytes, timeout: float) -> bytes:
    try:
        with trio.fail_after(timeout):
            stream = await transport.open_stream(server, REACH)
    except trio.TooSlowError:
        raise PeerUnavailable(server, "reach request timed out") from None
    try:
        return await _exchange(stream, payload, timeout)
    except trio.TooSlowError:
        raise PeerUnavailable(server, "reach request timed out") from None
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def check_reach(transport: Transport, server: str, *, p2p: list[str], data: list[str],
                      timeout: float) -> tuple[bool, bool, str]:
    """Ask *server* to dial our addresses back: (libp2p dialable, data plane dialable, our observed IP).
    PeerUnavailable if it refuses (busy, rate-limited): a refusal tells nothing about our reachability."""
    reply = wr.decode_check_reply(await _request(
        transport, server, wr.encode("check", p2p=p2p[: wr.MAX_ADDRS], data=data[: wr.MAX_ADDRS]), timeout))
    if reply.refused:
        raise PeerUnavailable(server, f"refused the reachability check: {reply.refused}"[:600])
    return reply.p2p, reply.data, reply.ip


async def request_reversal(transport: Transport, server: str, target: str, *, timeout: float) -> tuple[bool, str]:
    """Ask *server* to have *target* dial us: (ok, why not)."""
    return wr.decode_ok_reply(await _request(transport, server, wr.encode("reverse", target=target), timeout))


def install_reversal(transport: Transport, servers: Callable[[], list[str]], *, timeout: float = 15.0) -> None:
    """Let *transport* reach peers behind NATs through connection reversal by one of *servers()* (the
    bootstraps we joined). A no-op for transports without ``set_reverse_dialer`` (the in-memory one)."""
    setter = getattr(transport, "set_reverse_dialer", None)
    if setter is None:
        return

    async def reverse(peer: str) -> bool:
        for server in servers():
            if server == peer:
                continue
            try:
                ok, why = await request_reversal(transport, server, peer, timeout=timeout)
            except (PeerUnavailable, RemoteProtocolError) as exc:
                log.debug("reversal of %s via %s: %s", short_peer(peer), short_peer(server), exc)
                continue
            if ok:
                log.info("reached %s by connection reversal via %s", short_peer(peer), short_peer(server))
                return True
            log.info("reversal of %s via %s refused: %s", short_peer(peer), short_peer(server), why)
        return False

    setter(reverse)


def _refusal(why: str) -> bytes:
    """A request not served. No ``p2p``/``data`` fields: a node before issue 43 read ``false`` there as
    "not dialable" and went private; without them it finds the reply malformed and keeps its reach."""
    return wr.encode("reply", ok=False, why=why)


class ReachService:
    """The REACH handler of a node or bootstrap: bootstraps serve ``check`` and ``reverse``; every node
    serves ``dial``, for the bootstraps it joined (``servers()``)."""

    def __init__(self, transport: Transport, *, serve_checks: bool, servers: Callable[[], set[str]],
                 config: ReachConfig | None = None) -> None:
        self.transport = transport
        self.config = config or ReachConfig()
        self._serve_checks = serve_checks
        self._servers = servers
        self._last: dict[str, float] = {}     # requester (or requested dial-back target) -> when last served
        self._busy = 0
        self._busy_ip: collections.Counter[str] = collections.Counter()   # requests under way per source IP
        self.served: dict[str, int] = {"check": 0, "reverse": 0, "dial": 0, "refused": 0}

    def _admit(self, key: str, ip: str | None) -> str:
        """"" if a request keyed *key* from *ip* may be served now, else why not (and it is not)."""
        now = trio.current_time()
        if self._busy >= self.config.max_concurrent:
            return "busy"
        if ip is not None and self._busy_ip[ip] >= self.config.per_ip:
            # one host's many identities would otherwise hold every slot (issue 43: sixteen strangers
            # asking checks of ports that drop SYNs kept every honest node from learning its reach)
            return f"busy: {self.config.per_ip} requests from your address under way"
        if now - self._last.get(key, -float("inf")) < self.config.min_interval:
            return f"one request every {self.config.min_interval:g} s"
        if len(self._last) > 4096:   # bounded: forget requesters older than the interval
            self._last = {k: t for k, t in self._last.items() if now - t < self.config.min_interval}
        self._last[key] = now
        return ""

    async def __call__(self, stream: Stream) -> None:
        peer = stream.remote_peer
        ip = getattr(stream, "remote_ip", None)
        try:
            with trio.fail_after(self.config.request_timeout):
                op, f = wr.decode_request(await _read_frame(stream))
                # per (requester, target): a publisher may reach several NATed nodes at once, each once a while
                why = self._admit(f"{op}:{peer}:{f.get('peer') or f.get('target') or ''}", ip)
                if why:
                    self.served["refused"] += 1
                    reply = _refusal(why)
                else:
                    self._busy += 1      # counted before any await: requests at once cannot all pass
                    if ip is not None:
                        self._busy_ip[ip] += 1
                    try:
                        reply = await self._serve(op, f, stream)
                    finally:
                        self._busy -= 1
                        if ip is not None:
                            self._busy_ip[ip] -= 1
                            if not self._busy_ip[ip]:
                                del self._busy_ip[ip]
                await stream.send_all(encode_frame(reply, max_frame=wr.MAX_MESSAGE))
        except (RemoteProtocolError, PeerUnavailable, trio.TooSlowError) as exc:
            log.debug("reach request from %s: %s", short_peer(peer), exc)

    async def _serve(self, op: str, f: dict[str, Any], stream: Stream) -> bytes:
        ip = getattr(stream, "remote_ip", None)
        if op == "dial":
            return await self._dial(stream.remote_peer, f["peer"], f["addrs"])
        if not self._serve_checks:
            return _refusal("not a bootstrap")
        if ip is None:
            # among others a request over a relayed connection: the IP seen is the relay's, and dialling
            # it back would probe the relay's host (Libp2pStream.remote_ip)
            return _refusal("cannot see your address (is your connection to this bootstrap relayed?)")
        self.served[op] += 1
        if op == "check":
            p2p, data = await self._any_dialable(ip, f["p2p"]), await self._any_dialable(ip, f["data"])
            return wr.encode("reply", p2p=p2p, data=data, ip=ip)
        ok, why = await self._reverse(stream.remote_peer, ip, f["target"])
        return wr.encode("reply", ok=ok, why=why)

    async def _any_dialable(self, ip: str, addrs: list[str]) -> bool:
        for addr in addrs:
            ep = _endpoint(addr, ip)
            if ep is None:
                continue
            try:
                with trio.fail_after(self.config.dial_timeout):
                    s = await trio.open_tcp_stream(*ep)
                await trio.aclose_forcefully(s)
                return True
            except (OSError, trio.TooSlowError):
                continue
        return False

    async def _reverse(self, requester: str, ip: str, target: str) -> tuple[bool, str]:
        if target not in self.transport.connected_peers():
            return False, "this bootstrap has no connection to the target"
        ports = []
        for a in self.transport.peer_addrs(requester):
            parts = a.split("/")
            if len(parts) > 4 and parts[3] == "tcp" and parts[4].isascii() and parts[4].isdigit() \
                    and parts[4] not in ports:
                ports.append(parts[4])
        # a few (the requester's own claims, from its identify): the target dials each (net/addrs.py), the same
        # few every time: in the peerstore's order (which trims and identify pushes reshuffle) an attacker
        # claiming 16 ports had honest nodes dial 14 of them over one run of the live hostile test
        addrs = [f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{p}" for p in sorted(ports)[:DIAL_LIMIT]]
        if not addrs:
            return False, "no listening address of yours is known here"
        try:
            reply = await _request(self.transport, target, wr.encode("dial", peer=requester, addrs=addrs),
                                   self.config.request_timeout - 1)
        except (PeerUnavailable, RemoteProtocolError) as exc:
            return False, f"the target did not answer: {exc}"[:500]
        return wr.decode_ok_reply(reply)

    async def _dial(self, server: str, peer: str, addrs: list[str]) -> bytes:
        if server not in self._servers():
            return wr.encode("reply", ok=False, why="dial-back requests are taken from our bootstraps only")
        self.served["dial"] += 1
        if peer in self.transport.connected_peers():
            return wr.encode("reply", ok=True, why="")
        last = ""
        for addr in addrs:
            try:
                with trio.fail_after(self.config.dial_timeout):
                    await self.transport.connect(f"{addr}/p2p/{peer}")
                log.info("dialled %s at %s on request of %s (connection reversal)", short_peer(peer), addr, short_peer(server))
                return wr.encode("reply", ok=True, why="")
            except (PeerUnavailable, ConfigError, trio.TooSlowError) as exc:
                last = str(exc)
        return wr.encode("reply", ok=False, why=f"could not dial you: {last}"[:500])


__all__ = ["ReachConfig", "ReachService", "check_reach", "install_reversal", "request_reversal",
           "should_dial", "verdict"]
