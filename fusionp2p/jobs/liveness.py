"""Death probes: a job member whose data-plane link broke is asked directly whether it lives.

Why (issue 41). A SIGKILLed member's pipeline neighbours see its link close at once, but a lost link is
also what a live peer's brief hiccup looks like, so the membership view declares the peer dead only after
a heartbeat timeout (``--dead-timeout``, 3 s in benchmarks.churn and more by default) and until then no
job even starts to re-plan. A direct question answers in milliseconds: a killed process's port refuses
the dial.

So the data plane's reconnecting channels (net/resilient.py) report every lost link's peer here (``the
node's peer_gone``), and a background task asks it a job-protocol ``status`` question (any answer, even
"unknown job", means alive). A question that **fails before its deadline** (the dial refused, the
connection reset) confirms the death for ``ttl`` seconds and calls ``on_dead``; one that merely times
out proves nothing (a live node on a busy CPU can be slow).

What a verdict is used for (``Leading.on_dead``, ``Leading._leader``): a member whose plan names the
dead peer takes its pipeline as broken, so that the job's leader re-plans at once (itself, or told by
``op: replan``), and the choice of the leader passes over the dead peer (a member told to re-plan asks
the leader it sees, so a dead leader's successor learns it in one question). The re-plan's halt asks
every member the view calls alive, so a live peer wrongly confirmed dead answers and stays in the plan:
a wrong verdict costs one re-plan, never a member. The channels do not use it (they wait for the view,
as before): the removed first version ended their waits on it, and a leader's death then stalled the
job (test_the_leader_dies_and_the_next_lowest_id_carries_the_job_on, no new plan within 40 s).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from fusionp2p.errors import ConfigError, PeerUnavailable, RemoteProtocolError
from fusionp2p.jobs import proto as job_proto
from fusionp2p.net.transport import Transport
from fusionp2p.types import short_peer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeConfig:
    """Deadlines of the death probes (seconds)."""

    enabled: bool = True
    timeout: float = 2.0    # one question; a failure before it is a refusal (dead), reaching it proves nothing
    every: float = 1.0      # the same peer is asked again at most this often
    ttl: float = 15.0       # a confirmed death holds this long (a node restarted with its identity comes back)

    def __post_init__(self) -> None:
        if not (self.timeout > 0 and self.every > 0 and self.ttl > 0):
            raise ConfigError("ProbeConfig deadlines must be positive")


class DeathProbes:
    """See the module docstring. ``suspect`` and ``confirmed`` are synchronous (called from the channels'
    polls); ``serve`` asks the questions."""

    MAX_QUEUED = 64

    def __init__(self, transport: Transport, config: ProbeConfig | None = None,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.transport = transport
        self.config = config or ProbeConfig()
        self.on_dead = on_dead
        self._dead: dict[str, float] = {}      # peer -> when its death was confirmed
        self._asked: dict[str, float] = {}     # peer -> when it was last asked
        self._send, self._recv = trio.open_memory_channel[str](self.MAX_QUEUED)

    def confirmed(self, peer: str) -> bool:
        """Whether a question confirmed *peer*'s death within the last ``ttl`` seconds."""
        when = self._dead.get(peer)
        if when is None:
            return False
        if trio.current_time() - when > self.config.ttl:
            del self._dead[peer]
            return False
        return True

    def forget(self, peer: str) -> None:
        """*peer* was heard from again (the membership view saw it join or revive)."""
        self._dead.pop(peer, None)
        self._asked.pop(peer, None)

    def suspect(self, peer: str) -> None:
        """A link to *peer* is lost: ask it (at most every ``every`` s, also once its death is confirmed, so
        that a wrong verdict lasts one question)."""
        if not self.config.enabled:
            return
        now = trio.current_time()
        if now - self._asked.get(peer, -math.inf) >= self.config.every:
            self._asked[peer] = now
            with contextlib.suppress(trio.WouldBlock):   # many links lost at once: the view's verdict still comes
                self._send.send_nowait(peer)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for peer in self._recv:
                nursery.start_soon(self.ask, peer)

    async def ask(self, peer: str) -> None:
        """One question to *peer* (see the module docstring)."""
        t0 = trio.current_time()
        timeout = self.config.timeout
        try:
            await job_proto.request(self.transport, peer, {"op": "status", "job": ""}, timeout=timeout)
            self._dead.pop(peer, None)   # it answered: alive (a refusal before was a hiccup)
        except RemoteProtocolError:
            self._dead.pop(peer, None)   # it answered, if badly: alive
        except PeerUnavailable as exc:
            took = trio.current_time() - t0
            if took < 0.9 * timeout:   # refused or reset, not merely slow
                fresh = not self.confirmed(peer)
                self._dead[peer] = trio.current_time()
                if fresh:
                    log.info("peer %s refused a direct question after its link broke (%.2f s: %s): dead",
                             short_peer(peer), took, exc)
                    if self.on_dead is not None:
                        self.on_dead(peer)
        for p in [p for p, t in self._asked.items() if trio.current_time() - t > self.config.ttl]:
            del self._asked[p]   # bounded by the peers suspected within ttl


__all__ = ["DeathProbes", "ProbeConfig"]
