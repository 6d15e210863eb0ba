"""The node's dialer: connect directly to every member we learn of (again if the connection dropped).

Gossip and probes then do not depend on the bootstrap. A member is dialled at its heartbeat when we are
not connected to it (``SwarmNode._apply_record`` says when: only the larger peer id dials, see
``swarm/reach.py``), at a few of its announced addresses in our scopes (``net/addrs.py``: a record's
addresses are its sender's claim, issue 43); one whose addresses all fail is dialled again after 2, 4, ...
300 s, not at every heartbeat (an attacker announcing unreachable addresses and reach=public had every
NAT'd node dial 4 of them each second). Moved out of ``swarm/node.py`` (its size).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from fusionp2p.errors import ConfigError, PeerUnavailable
from fusionp2p.net.addrs import peer_dial_addrs
from fusionp2p.net.transport import Transport
from fusionp2p.types import short_peer
from fusionp2p.wire.records import NodeRecord

log = logging.getLogger("fusionp2p.swarm.node")   # the node's log
MAX_WAIT = 300.0        # seconds: the longest wait before a member whose dials failed is dialled again
MAX_BACKOFFS = 4096     # members with a wait held (bounded: the oldest 1,024 go past it)


class MemberDialer:
    """Dials queued by :meth:`spawn`, one at a time (:meth:`run`)."""

    def __init__(self, transport: Transport, *, connected: Callable[[], set[str]], alive: Callable[[str], bool],
                 scopes: Callable[[], frozenset[str]]) -> None:
        self.transport = transport
        self.connected = connected   # the peers we are connected to (the node's cached set: we add our dials)
        self.alive = alive
        self.scopes = scopes
        self.queued: set[str] = set()   # dials queued or under way
        # member -> (when we may dial it again, the wait after the next failure)
        self.after: dict[str, float] = {}
        self.wait: dict[str, float] = {}
        self._send, self._recv = trio.open_memory_channel[NodeRecord](1024)

    def due(self, peer: str) -> bool:
        """Neither queued nor waiting after failed dials."""
        return peer not in self.queued and trio.current_time() >= self.after.get(peer, 0.0)

    def spawn(self, rec: NodeRecord) -> None:
        self.queued.add(rec.peer)
        try:
            self._send.send_nowait(rec)
        except trio.WouldBlock:
            self.queued.discard(rec.peer)  # retried at its next heartbeat

    async def run(self) -> None:
        async for rec in self._recv:
            try:
                if rec.peer in self.connected() or not self.alive(rec.peer):
                    continue
                if not await self.dial(rec):
                    wait = min(self.wait.get(rec.peer, 1.0) * 2, MAX_WAIT)
                    self.wait[rec.peer] = wait
                    self.after[rec.peer] = trio.current_time() + wait
                    if len(self.after) > MAX_BACKOFFS:
                        for p in list(self.after)[:1024]:
                            self.after.pop(p, None)
                            self.wait.pop(p, None)
            finally:
                self.queued.discard(rec.peer)

    async def dial(self, rec: NodeRecord) -> bool:
        """Connect to *rec*'s member at a few of its addresses in our scopes, in turn; whether one answered."""
        addrs = peer_dial_addrs(rec.addrs, self.scopes())
        if len(addrs) < len(rec.addrs):
            log.debug("dial %s: %d of its %d addresses left out", short_peer(rec.peer), len(rec.addrs) - len(addrs),
                      len(rec.addrs))
        for addr in addrs:
            try:
                await self.transport.connect(f"{addr}/p2p/{rec.peer}")
            except (PeerUnavailable, ConfigError) as exc:
                log.debug("dial %s at %s: %s", short_peer(rec.peer), addr, exc)
                continue
            self.connected().add(rec.peer)
            self.after.pop(rec.peer, None)
            self.wait.pop(rec.peer, None)
            return True
        return False

__all__ = ["MemberDialer"]
