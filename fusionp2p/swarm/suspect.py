"""Suspects: a member whose heartbeats stopped is pinged before it is declared dead (SWIM's suspicion).

A missed heartbeat alone is weak evidence on a loaded host: twenty node processes on two cores starve
each other's event loops and gossip (2026-11-30: 1,840 "dead" events in 5 minutes, members declared dead
5-6 s after they joined, then revived by their next record, each flap costing re-probes). So a member
silent past its timeout is only *suspect* (``MembershipView.suspects``, still a member) for
``SwarmConfig.confirm`` seconds, and :class:`Confirmer` pings it directly meanwhile (a PROBE stream, one
ping): an answer vouches for it (``MembershipView.vouch``: as good as a record), a refused stream or dial
(no connection left to it) declares it dead at once (any other failed try is tried again), and silence until the suspicion ends lets the view declare it dead then. A
starved-but-alive node answers late, not never. Detection stays bounded: the records' timeout plus
``confirm`` at most, whatever the pings do (a suspect that was never pinged dies at the same deadline).

Bounded work: at most ``limit`` pings at once, each bounded by its suspect's deadline, and only to members
our own view found silent (a peer cannot name others for us to ping); suspects beyond the limit wait for
a slot, and die at their deadline if none came.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.transport import Transport
from fusionp2p.swarm.membership import MembershipView
from fusionp2p.swarm.probe import open_probe
from fusionp2p.types import short_peer

log = logging.getLogger("fusionp2p.swarm.node")   # the node's log
CLOSE_TIMEOUT = 2.0   # seconds a ping's stream may take to close once answered
RETRY = 0.5           # seconds between a timed-out try and the next one


class Confirmer:
    """Ping the view's suspects (``SwarmNode.confirmer``); *dead* is called with a peer whose ping and dial
    were refused."""

    def __init__(self, transport: Transport, view: MembershipView, *, limit: int, dead: Callable[[str], None],
                 redial: Callable[[str], Awaitable[bool]], vouched: Callable[[str], None] = lambda _: None) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.transport = transport
        self.view = view
        self.limit = limit
        self.dead = dead
        self.redial = redial      # connect to the peer at its record's addresses: whether one answered
        self.vouched = vouched
        self.pinging: set[str] = set()
        self.answered = 0    # suspects that answered (each a false death avoided)
        self.refused = 0     # suspects whose ping was refused (declared dead at once)
        self.silent = 0      # suspects that did not answer before their deadline
        self._kick = trio.Event()

    def kick(self) -> None:
        """The view has suspects (the reaper found some): look at them now."""
        self._kick.set()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                await self._kick.wait()
                self._kick = trio.Event()
                self.start(nursery)

    def start(self, nursery: trio.Nursery) -> None:
        """A ping for each suspect not pinged yet, earliest deadline first, while fewer than ``limit`` run."""
        if len(self.pinging) >= self.limit:
            return
        now = trio.current_time()
        for until, peer in sorted((u, p) for p, u in self.view.suspects.items() if p not in self.pinging and u > now):
            if len(self.pinging) >= self.limit:
                break
            self.pinging.add(peer)
            nursery.start_soon(self._ping, peer, until)

    async def _ping(self, peer: str, until: float) -> None:
        try:
            outcome = await self._ask(peer, until)
        finally:
            self.pinging.discard(peer)
            if self.view.suspects:
                self.kick()   # a slot is free: the next suspect
        if outcome == "answered":
            self.answered += 1
            if self.view.vouch(peer, trio.current_time()):
                log.debug("suspect %s answered a ping: alive", short_peer(peer))
                self.vouched(peer)
        elif outcome == "refused":
            self.refused += 1
            if peer in self.view.suspects:
                log.debug("suspect %s refused a ping: dead", short_peer(peer))
                self.dead(peer)
        elif outcome == "silent":
            self.silent += 1

    async def _ask(self, peer: str, until: float) -> str:
        """"answered", "refused", "silent" (no answer by the suspect's deadline) or "cleared" (a record of
        it came, or it died, meanwhile). Refused: a try failed at once, we hold no connection to the peer,
        and a dial at its record's addresses fails (a killed process: its connection dropped and a new
        dial is refused). Any other failed try is tried again until the deadline: one that timed out (the
        transport's own stream deadline: a loaded peer, or our own loop), or failed on a connection we still
        hold, or without one but dialled again (20 live processes at load 20-30, 2026-11-30: "Failed to
        create stream" on held connections, 26 false deaths in 150 s taken as refusals; then, without a
        connection, 38 more, half of them py-libp2p's "No known addresses": its peerstore's, not the peer's)."""
        with trio.move_on_at(until):
            while True:
                try:
                    session = await open_probe(self.transport, peer, pings=1)
                except PeerUnavailable as exc:
                    if peer not in self.view.suspects:
                        return "cleared"
                    log.debug("suspect %s: %s", short_peer(peer), exc)
                    # no connection left: dial its announced addresses (py-libp2p's peerstore may have let
                    # them expire: "No known addresses"); refused there, it is dead
                    if ("timed out" not in str(exc) and peer not in self.transport.connected_peers()
                            and not await self.redial(peer)):
                        return "refused"
                    await trio.sleep(RETRY)
                    continue
                with trio.CancelScope(shield=True) as cs:
                    cs.deadline = trio.current_time() + CLOSE_TIMEOUT
                    await session.aclose()
                return "answered"
        return "silent" if peer in self.view.suspects else "cleared"

__all__ = ["Confirmer"]
