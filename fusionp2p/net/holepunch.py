"""DCUtR hole punching within our limits (issue 43; docs/security.md, "Hole punching").

Theory of operation. Two nodes behind NATs that reach each other through a relay can upgrade to a
direct connection: over the relayed one, each sends the other its public addresses (``CONNECT``), and
both dial at once (``SYNC``), so that each NAT takes the other's SYN for the answer to its own
(libp2p spec ``relay/DCUtR.md``). py-libp2p 0.8.1 ships the protocol (``DCUtRProtocol``) and we keep
its exchange, timing and dials; but used as shipped it dials whatever a peer's ``CONNECT`` lists, from
anyone: one stranger with a circuit to a NAT'd node made it connect to 409 addresses of its choosing
(loopback, 10/8, 169.254.169.254, DNS names, QUIC), three rounds each, from the user's own IP.

:class:`GuardedDCUtR` keeps that protocol and bounds it at the four places every session goes through:

* a session (``/libp2p/dcutr`` stream) is accepted only over a *relayed* connection, from a *member*
  (the node's :data:`HolePunchPolicy` names the IPs it may be dialled at: those of its signed record),
  one inbound session per peer at a time; we initiate only towards members;
* a ``CONNECT``'s addresses are cut before anything stores them (py-libp2p puts them in the peerstore,
  which every later dial reads): TCP at an IP literal the policy names for that peer, at most
  ``HolePunchLimits.addrs`` of them;
* every dial (the unilateral attempt, each round of the punch, addresses py-libp2p adds from the
  peerstore) is checked again: an address the policy does not allow is never dialled, a peer's sessions
  dial at most ``addrs`` distinct addresses per ``memory`` seconds (each session alone picked its own few
  from the peerstore, which identify and the DHT reorder: a member holding sessions over the live hostile
  test had 6 of its 16 record ports dialled by punching on top of the 4 every other dial keeps to), and all sessions together at most
  ``dials`` per ``window``;
* QUIC's UDP spray is never sent (our nodes speak TCP only).

The policy is injected (``Libp2pTransport.set_hole_punch_policy``); until the swarm installs its view it
names nobody, so nothing is punched.
"""

from __future__ import annotations

import collections
import contextvars
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from multiaddr import Multiaddr

from fusionp2p.errors import ConfigError
from fusionp2p.net.addrs import addr_ip, ip_scope

log = logging.getLogger(__name__)

# peer -> the IPs it may be dialled at for hole punching (its signed record's); None: not a member
HolePunchPolicy = Callable[[str], Collection[str] | None]

# the peer of the session the current task runs (py-libp2p's address decoding is told no peer)
_SESSION: contextvars.ContextVar[ID | None] = contextvars.ContextVar("fusionp2p_dcutr_session", default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class HolePunchLimits:
    """What a hole-punching session may make this node dial, at most."""

    addrs: int = 4          # distinct addresses of a peer its sessions dial ...
    memory: float = 600.0   # ... per this many seconds (the first session's pick counts for the next ones)
    dials: int = 64         # dials of all sessions together ...
    window: float = 60.0    # ... per this many seconds

    def __post_init__(self) -> None:
        if self.addrs < 1 or self.dials < 1 or not self.window > 0 or not self.memory > 0:
            raise ConfigError("hole punch limits: addrs and dials must be >= 1, the window and memory positive")


def _relayed(conn: Any) -> bool:
    try:
        return any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses() or ())
    except Exception:
        return False


class GuardedDCUtR(DCUtRProtocol):
    """py-libp2p's DCUtR service with our limits (module docstring). ``stats`` counts sessions refused,
    addresses dropped, dials made and dials over the budget."""

    def __init__(self, host: Any, limits: HolePunchLimits, *, read_timeout: int, write_timeout: int,
                 dial_timeout: int) -> None:
        super().__init__(host, read_timeout=read_timeout, write_timeout=write_timeout, dial_timeout=dial_timeout)
        self.limits = limits
        self.policy: HolePunchPolicy = lambda peer: None
        self._inbound: set[ID] = set()
        self._peer_addrs: dict[ID, tuple[float, set[str]]] = {}   # peer -> (since, addresses dialled), bounded
        self._dialled: collections.deque[float] = collections.deque()
        self.stats: collections.Counter[str] = collections.Counter()

    def _ips(self, peer: ID | None) -> frozenset[str] | None:
        if peer is None:
            return None
        try:
            ips = self.policy(peer.to_base58())
        except Exception:   # a bug of ours must not let a stranger through
            log.exception("hole punch policy failed")
            return None
        return None if ips is None else frozenset(ips)

    async def _handle_dcutr_stream(self, stream: Any) -> None:
        peer: ID = stream.muxed_conn.peer_id
        why = ("not over a relayed connection" if not _relayed(stream.muxed_conn)
               else "not a member" if self._ips(peer) is None
               else "a session with it is under way" if peer in self._inbound else "")
        if why:
            self.stats["refused"] += 1
            log.debug("hole punch from %s refused: %s", peer, why)
            try:
                await stream.reset()
            except Exception as exc:
                log.debug("dcutr reset: %s", exc)
            return
        self._inbound.add(peer)
        token = _SESSION.set(peer)
        try:
            await super()._handle_dcutr_stream(stream)
        finally:
            _SESSION.reset(token)
            self._inbound.discard(peer)

    async def initiate_hole_punch(self, peer_id: ID) -> bool:
        if self._ips(peer_id) is None:
            return False
        token = _SESSION.set(peer_id)
        try:
            return await super().initiate_hole_punch(peer_id)
        finally:
            _SESSION.reset(token)

    def _allowed(self, peer: ID | None, addr: str) -> bool:
        ips = self._ips(peer)
        ip = addr_ip(addr)
        return ips is not None and ip is not None and ip in ips and ip_scope(ip) is not None

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[Multiaddr]:
        """The peer's CONNECT addresses, cut to the few we would dial before py-libp2p stores them."""
        peer = _SESSION.get()
        out: list[Multiaddr] = []
        for raw in addr_bytes:
            if len(out) >= self.limits.addrs:
                break
            out.extend(ma for ma in super()._decode_observed_addrs([raw]) if self._allowed(peer, str(ma)))
        self.stats["addrs_dropped"] += len(addr_bytes) - len(out)
        return out

    def _tried(self, peer: ID) -> set[str]:
        """The addresses *peer*'s sessions dialled in the last ``memory`` seconds (at most ``addrs``)."""
        now = trio.current_time()
        since, tried = self._peer_addrs.get(peer, (now, set()))
        if now - since > self.limits.memory:
            since, tried = now, set()
        self._peer_addrs[peer] = (since, tried)
        if len(self._peer_addrs) > 4096:    # bounded: the expired go, then the oldest
            self._peer_addrs = {p: v for p, v in self._peer_addrs.items() if now - v[0] <= self.limits.memory}
            while len(self._peer_addrs) > 4096:
                self._peer_addrs.pop(next(iter(self._peer_addrs)))
        return tried

    async def _dial_peer(self, peer_id: ID, addr: Multiaddr, source: tuple[str, int] | None = None,
                         as_responder: bool = False) -> None:
        s = str(addr)
        tried = self._tried(peer_id)
        if not self._allowed(peer_id, s) or (s not in tried and len(tried) >= self.limits.addrs):
            self.stats["addrs_dropped"] += 1
            return
        now = trio.current_time()
        while self._dialled and now - self._dialled[0] > self.limits.window:
            self._dialled.popleft()
        if len(self._dialled) >= self.limits.dials:
            self.stats["over_budget"] += 1
            log.debug("hole punch dial to %s at %s skipped: %d dials in %g s", peer_id, s, len(self._dialled),
                      self.limits.window)
            return
        tried.add(s)
        self._dialled.append(now)
        self.stats["dials"] += 1
        await super()._dial_peer(peer_id, addr, source, as_responder)

    async def _spam_udp_for_hole_punch(self, addr: Multiaddr, stop: trio.Event) -> None:
        """Never: our nodes speak TCP only, and the addresses would be a peer's to choose."""


__all__ = ["GuardedDCUtR", "HolePunchLimits", "HolePunchPolicy"]
