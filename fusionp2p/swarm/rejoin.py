"""Stay joined: a node whose connection to a bootstrap dropped dials it again (issue 40).

A node learns the swarm through its bootstraps: the VIEW pull on joining and the gossip that reaches it
over that first connection. A member it has heard of is dialled again at its next heartbeat
(``SwarmNode._apply_record``), but a bootstrap connection that drops while the swarm forms, before the
node heard of anyone, was never redialled: the node then knew no member, no member knew it (its records
reached nobody), and it stayed alone for good. Seen with 8 node processes on the loaded 2-core machine
(2026-11-29, load 17-33): py-libp2p reset two nodes' bootstrap connections 15 s after they joined, both
sides' stream negotiations having timed out, and those two nodes never appeared in the bootstrap's view.

:func:`keep_joined` checks once a heartbeat whether each bootstrap we joined through is still connected,
dials a missing one again (after 1, 2, 4 ... at most ``MAX_BACKOFF`` heartbeats while the dials fail) and,
connected again, pulls its view, as on joining.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.transport import Transport
from fusionp2p.types import short_peer

log = logging.getLogger(__name__)

MAX_BACKOFF = 16     # heartbeats between failed redials of one bootstrap, at most


async def keep_joined(transport: Transport, addrs: dict[str, str], *, period: Callable[[], float],
                      pull: Callable[[str], Awaitable[None]], dial_timeout: float) -> None:
    """Forever: redial each bootstrap in *addrs* (peer id -> the address we joined it at) that is no longer
    connected, then ``pull(peer)`` its view. Every dial has *dial_timeout*."""
    failures = dict.fromkeys(addrs, 0)
    next_try = dict.fromkeys(addrs, 0.0)
    while True:
        await trio.sleep(period())   # the check's own cadence, not a readiness wait
        connected = set(transport.connected_peers())
        now = trio.current_time()
        for peer, addr in addrs.items():
            if peer in connected or now < next_try[peer]:
                continue
            try:
                with trio.fail_after(dial_timeout):
                    await transport.connect(addr)
            except (PeerUnavailable, trio.TooSlowError) as exc:
                failures[peer] += 1
                next_try[peer] = trio.current_time() + period() * min(2 ** failures[peer], MAX_BACKOFF)
                log.debug("bootstrap %s still unreachable (%d): %s", short_peer(peer), failures[peer], exc)
                continue
            failures[peer] = 0
            log.info("bootstrap %s connected again", short_peer(peer))
            await pull(peer)
