"""Watchers: a dead peer is noticed within a bound that does not grow with the swarm.

Heartbeat records reach every node by gossip, so their period stretches with the swarm
(``SwarmNode.period``: members / gossip_rate, to bound the gossip) and the timeout of a silent peer
with it (``dead_beats`` periods: some 1,000 s at 1,000 members). Liveness therefore does not wait for
them: each node watches the few members it chose (``membership.chosen``, ``SwarmConfig.watch`` of them;
each node is so watched by as many on average, and by all the others in a swarm that small). It pings
each one once it has heard nothing of it for half ``watch_timeout`` (10 s) (a record or an answer: a small swarm's
records are beats enough, and cost no pings), then every heartbeat, on a PROBE stream kept open while
in use; one that has answered nothing and sent no
record for ``watch_timeout``, after two tries at least, is declared dead: the watcher marks it so and publishes its
own record at once with the peer in ``gone`` (``NodeRecord.gone``). A node takes such a notice from a
watcher of the peer by its own view (:func:`watches`), and an accused node that is alive answers with a
record at once, which revives it everywhere: a lying watcher costs its victims one flap, not their
membership. So a death is known everywhere within ``watch_timeout`` + one heartbeat + one gossip hop,
whatever the swarm's size; the timeout on records stays as the backstop (a peer none of whose watchers
is alive), and is all there is while it is as quick (``dead_beats`` periods at most ``watch_timeout``: up
to about 20 members by default, where the watchers stand by and send nothing).

The decision per watched peer is the pure :class:`Watch`; :class:`Watcher` is the trio shell.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.transport import Transport
from fusionp2p.swarm.membership import chosen
from fusionp2p.swarm.probe import SERVER_IDLE, ProbeSession, open_probe
from fusionp2p.types import short_peer

log = logging.getLogger("fusionp2p.swarm.node")   # the node's log
SESSION_IDLE = SERVER_IDLE / 2   # a watch stream unused this long is opened anew before the next ping


def watches(watcher: str, peer: str, members: list[str], k: int) -> bool:
    """Whether *watcher* watches *peer* in a swarm of *members* (each node's *k* chosen members, and the
    ones that chose it). Costs two passes over *members*: a notice is checked once."""
    return peer in chosen(watcher, members, k) or watcher in chosen(peer, members, k)


@dataclass
class Watch:
    """One watched peer's liveness from our pings (times from the caller's clock)."""

    dead_after: float     # seconds without an answer
    last_ok: float        # the last answer (or when we began to watch it)
    failures: int = 0     # tries in a row that got no answer

    def ok(self, now: float) -> None:
        self.last_ok, self.failures = now, 0

    def failed(self) -> None:
        self.failures += 1

    def dead(self, now: float) -> bool:
        """Silent for ``dead_after`` and at least two tries in a row failed (one may have been held up by
        our own event loop, busy elsewhere, with the answer unread)."""
        return self.failures >= 2 and now - self.last_ok > self.dead_after


class Watcher:
    """Watch the members this node chose (``SwarmNode.watcher``); *declare* is called for each found dead."""

    def __init__(self, transport: Transport, *, k: int, heartbeat: float, dead_after: float,
                 members: Callable[[], list[str]], heard: Callable[[str], float | None],
                 timeout_of: Callable[[str], float],
                 declare: Callable[[str], Awaitable[None]]) -> None:
        self.transport = transport
        self.peer_id = transport.peer_id
        self.k = k
        self.heartbeat = heartbeat
        self.dead_after = dead_after
        self.members = members
        self.heard = heard            # when the peer's last record came (None: none held)
        self.timeout_of = timeout_of  # after how long the records' own timeout declares it dead
        self.declare = declare
        self.scopes: dict[str, trio.CancelScope] = {}   # the peers watched now, each its task's scope
        self.pings = 0
        # recomputed when the members change (the view hands out a new list object then, equal or not)
        self._chosen: tuple[list[str] | None, list[str]] = (None, [])

    def chosen(self) -> list[str]:
        members = self.members()
        if members is not self._chosen[0] and members != self._chosen[0]:
            self._chosen = (members, chosen(self.peer_id, members, self.k))
        return self._chosen[1]

    async def run(self) -> None:
        """Keep one task per chosen member, every heartbeat, until cancelled."""
        async with trio.open_nursery() as nursery:
            while True:
                want = set(self.chosen())
                for peer in list(self.scopes):
                    if peer not in want:
                        self.scopes.pop(peer).cancel()
                for peer in sorted(want - set(self.scopes)):
                    self.scopes[peer] = trio.CancelScope()
                    nursery.start_soon(self._watch, peer, self.scopes[peer])
                await trio.sleep(self.heartbeat)

    async def _watch(self, peer: str, scope: trio.CancelScope) -> None:
        w = Watch(dead_after=self.dead_after, last_ok=trio.current_time())
        session: ProbeSession | None = None
        used = 0.0   # when the session last carried a ping
        with scope:
            try:
                while True:
                    due = trio.current_time() + self.heartbeat
                    seen = self.heard(peer)
                    if seen is not None and seen > w.last_ok:
                        w.ok(seen)
                    now = trio.current_time()
                    if self.timeout_of(peer) <= self.dead_after:
                        w.ok(now)   # a small swarm: its records' own timeout is as quick, the watcher stands by
                    if now - w.last_ok < self.dead_after / 2:
                        await trio.sleep_until(due)   # heard of it lately: no ping needed
                        continue
                    if session is not None and now - used > SESSION_IDLE:
                        # the peer's server closes a silent stream (probe.SERVER_IDLE): a new one, not a failure
                        with trio.CancelScope(shield=True):
                            await session.aclose()
                        session = None
                    try:
                        with trio.fail_after(self.dead_after):
                            if session is None:
                                session = await open_probe(self.transport, peer, pings=1)
                            else:
                                await session.ping()
                        self.pings += 1
                        used = trio.current_time()
                        w.ok(used)
                    except (PeerUnavailable, trio.TooSlowError) as exc:
                        w.failed()
                        log.debug("watch %s: no answer (%s)", short_peer(peer), str(exc) or "timed out")
                        if session is not None:
                            with trio.CancelScope(shield=True):
                                await session.aclose()
                            session = None
                    if w.dead(trio.current_time()):
                        log.info("member %s: no answer for %.1f s, declared dead", short_peer(peer),
                                 trio.current_time() - w.last_ok)
                        break
                    await trio.sleep_until(due)
            finally:
                if session is not None:
                    with trio.CancelScope(shield=True):
                        await session.aclose()
        if self.scopes.get(peer) is scope:
            del self.scopes[peer]
        if not scope.cancelled_caught:
            await self.declare(peer)
