"""A node's own reachability: what its bootstraps' dial-back checks found, and the relay slots it holds while
peers cannot dial it (``swarm/reach.py`` serves the checks; ``net/relay.py`` the slots).

Both run from the moment the node joined, before and independent of its deferred start-up (torch, the job
service, the device benchmark: ``swarm/startup.py``). Who dials whom (``reach.should_dial``) and whether the
node needs a relay slot depend on its libp2p address alone, which is known on joining; the data plane's
half of the verdict (``public`` rather than ``p2p``, ``data`` rather than ``private``) only tells peers
which path its tensors take, and the data plane listens only once the job service runs, so it is checked
then (``set_data_addrs``). Before, the first check waited for the data plane: a node behind a NAT was
unreachable, unrelayed and announced ``unknown`` for the 15-70 s of its deferred start-up (issue 40).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import trio

from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.net.addrs import addr_ip
from fusionp2p.net.transport import Relaying, Transport
from fusionp2p.swarm.reach import ReachConfig, check_reach, verdict
from fusionp2p.types import short_peer
from fusionp2p.wire.records import (
    REACH_DATA,
    REACH_P2P,
    REACH_PRIVATE,
    REACH_PUBLIC,
    REACH_UNKNOWN,
    NodeRecord,
)

log = logging.getLogger(__name__)


class SelfReach:
    """Our reach (announced in our record), the IP a bootstrap saw us at, and our relay slots.

    *servers()*: the bootstraps we joined (they serve the checks, and are our first relay candidates);
    *records()*: the members' records (dialable ones are further candidates); *announce()*: publish our
    record soon (a new verdict, new circuit addresses)."""

    def __init__(self, transport: Transport, config: ReachConfig, *, relays: int, relay_retry: float,
                 heartbeat: float, servers: Callable[[], set[str]], records: Callable[[], Mapping[str, NodeRecord]],
                 announce: Callable[[], None]) -> None:
        self.transport = transport
        self.config = config
        self.relays = relays
        self.relay_retry = relay_retry
        self.heartbeat = heartbeat
        self._servers = servers
        self._records = records
        self._announce = announce
        self.reach = REACH_UNKNOWN
        self.seen_ip = ""                        # the IP the last check saw us at (announced: hole punching)
        self.detail = ""                         # what the last check found, for logs
        self.data_addrs: tuple[str, ...] = ()    # the data plane's, once it listens
        self.check_now = trio.Event()
        self.relay_now = trio.Event()
        self._refused: dict[str, float] = {}     # relay candidate -> when it refused us a slot

    def set_data_addrs(self, addrs: tuple[str, ...]) -> None:
        """The data plane listens at *addrs*: check them (at once, or once the bootstraps' interval allows)."""
        self.data_addrs = addrs
        self.check_now.set()

    def needs_relay(self) -> bool:
        """Peers cannot open a libp2p connection to us (the dial-back check said so)."""
        return self.reach in (REACH_PRIVATE, REACH_DATA)

    # -- dial-back checks -------------------------------------------------------------------------
    async def check_loop(self) -> None:
        """Check at once on joining, again when the data plane's addresses are known, then every
        ``recheck`` seconds (``retry``, doubling, after every server refused); changes announced at once."""
        cfg = self.config
        wait, retry, last = 0.0, cfg.retry, -math.inf
        while True:
            if wait > 0:
                with trio.move_on_after(wait):
                    await self.check_now.wait()
            # a bootstrap serves one check per peer every min_interval: one wanted sooner (the data plane listening
            # moments after the join's check) waits for it, rather than being refused and asked again `retry` later.
            # Counted from the last answer: the bootstrap took the request at some moment before it
            await trio.sleep_until(last + cfg.min_interval)
            self.check_now = trio.Event()
            answered = await self._check()
            last = trio.current_time()
            if answered:
                wait, retry = cfg.recheck, cfg.retry
            else:
                # every server refused (busy, rate-limited): ask again soon, not in `recheck` (issue 43: a node
                # that met a busy bootstrap on joining stayed "unknown", so unrelayed, for five minutes)
                wait, retry = retry, min(cfg.recheck, 2 * retry)

    async def _check(self) -> bool:
        """One check by the first server that serves it; False if every one refused."""
        p2p = [a.rsplit("/p2p/", 1)[0] for a in self.transport.listen_addrs()]
        data = self.data_addrs
        for server in sorted(self._servers()):
            try:
                ok_p2p, ok_data, ip = await check_reach(self.transport, server, p2p=p2p, data=list(data),
                                                        timeout=self.config.request_timeout)
            except (PeerUnavailable, RemoteProtocolError) as exc:
                log.debug("reach check via %s: %s", short_peer(server), exc)
                continue
            if ip != self.seen_ip and addr_ip(f"/ip{6 if ':' in ip else 4}/{ip}/tcp/1") is not None:
                self.seen_ip = ip
                self._announce()
            # no data plane yet: its half reads "not dialable" until it listens and is checked
            reach = verdict(ok_p2p, ok_data) if data else (REACH_P2P if ok_p2p else REACH_PRIVATE)
            self.detail = (f"seen at {ip}; libp2p {'dialable' if ok_p2p else 'NOT dialable'} at "
                           f"{' '.join(p2p) or '-'}; data plane "
                           + (f"{'dialable' if ok_data else 'NOT dialable'} at {' '.join(data)}" if data
                              else "not listening yet"))
            if reach != self.reach:
                log.info("reachability: %s (%s)", reach, self.detail)
                if not ok_data and data:
                    log.warning("peers cannot reach this node's data plane (%s): its tensors go over the slower "
                                "libp2p connection; forward the port and pass --data-announce (docs/networking.md)",
                                " ".join(data))
                self.reach = reach
                self.relay_now.set()
                self._announce()
            return True
        return False

    # -- relay slots ------------------------------------------------------------------------------
    def candidates(self) -> list[str]:
        """Connected peers that may relay for us: our bootstraps first, then dialable members."""
        connected = set(self.transport.connected_peers())
        now = trio.current_time()
        boots = sorted(self._servers() & connected)
        public = sorted(p for p, r in self._records().items()
                        if p in connected and p not in boots and r.reach in (REACH_PUBLIC, REACH_P2P) and not r.leaving)
        return [p for p in boots + public if now - self._refused.get(p, -math.inf) > self.relay_retry]

    async def relay_loop(self, relay: Relaying) -> None:
        """While peers cannot dial us, hold ``relays`` slots on relays (circuit relay v2) and announce their
        circuit addresses in our record; refresh each slot at half its lifetime, replace lost ones; give
        them up when we become dialable."""
        due: dict[str, float] = {}       # relay -> when its slot is refreshed
        announced: list[str] = []
        while True:
            now = trio.current_time()
            if self.needs_relay():
                held = [r for r in relay.relays() if r in self.transport.connected_peers()]
                for r in relay.relays():
                    if r not in held:
                        relay.forget_relay(r)
                        due.pop(r, None)
                todo = [r for r in held if due.get(r, 0.0) <= now]
                todo += [c for c in self.candidates() if c not in held][: max(0, self.relays - len(held))]
                for r in todo:
                    try:
                        ttl = await relay.reserve(r)
                        due[r] = trio.current_time() + max(1.0, ttl / 2)
                    except PeerUnavailable as exc:
                        # a bootstrap that does not relay is news; a member that does not is the usual case
                        log.log(logging.INFO if r in self._servers() else logging.DEBUG, "relay %s: %s", r[:16], exc)
                        relay.forget_relay(r)
                        due.pop(r, None)
                        self._refused[r] = trio.current_time()
            else:
                for r in relay.relays():
                    relay.forget_relay(r)
                due.clear()
            addrs = relay.circuit_addrs()
            if addrs != announced:
                log.info("announcing %d relayed address(es)%s", len(addrs), "".join(f"\n  {a}" for a in addrs))
                announced = addrs
                self._announce()
            wait = min([*due.values(), trio.current_time() + self.heartbeat * 5]) - trio.current_time()
            with trio.move_on_after(max(0.1, wait)):
                await self.relay_now.wait()
            self.relay_now = trio.Event()


__all__ = ["SelfReach"]
