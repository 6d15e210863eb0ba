"""A job epoch's data-plane links: the part of :class:`~fusionp2p.jobs.run.JobRun` that opens and closes them.

The links of an epoch are the pipeline's (to the neighbour stages of the same replica index, named
``e<epoch>/p<replica>:<lower>-<upper>``) and the stage's replicas' (``e<epoch>/s<stage>:<i>-<j>``). The lower
stage (or replica index) dials, the other claims the incoming channel from the node's acceptor. Names carry
the epoch, so channels of two epochs never mix. Every link is up within ``link_timeout`` or the pipeline is
broken (its leader re-plans).

This mixin holds no state of its own: :class:`JobRun` owns every attribute named below.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import trio

from fusionp2p.errors import PeerUnavailable, leaf_errors
from fusionp2p.jobs.failures import describe
from fusionp2p.jobs.host import JobHost
from fusionp2p.net.channel import TensorChannel
from fusionp2p.net.dataplane_config import PATH_LIBP2P, PATH_RELAY
from fusionp2p.net.resilient import ResilientChannel, open_resilient_channel
from fusionp2p.net.transport import Relaying
from fusionp2p.plan import Plan
from fusionp2p.types import short_peer

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger(__name__)

HALT_CLOSE_TIMEOUT = 0.3    # seconds a halted epoch's channel waits for a link to say goodbye on


class Linking:
    """The epoch's links (see the module docstring); mixed into :class:`JobRun`."""

    # owned and initialised by JobRun
    svc: JobHost
    job_id: str
    epoch: int
    channels: list[ResilientChannel]
    closed: trio.Event
    _broken: bool

    def _alive(self, peer: str) -> bool:
        raise NotImplementedError   # Leading's

    def _path(self, ch: Any) -> str:
        """A link's path for the LinksUp event: ``direct``, ``libp2p`` (the fallback stream), or ``relay``
        (that stream, on a libp2p connection carried by a circuit relay: net/relay.py)."""
        path = getattr(ch, "path", "") or "pending"
        t = self.svc.transport
        if path == PATH_LIBP2P and isinstance(t, Relaying) and t.is_relayed(ch.remote_peer):
            return PATH_RELAY
        return str(path)

    async def _open_links(self, plan: Plan, programs: list[Any], s: int, r: int,
                          holders: trio.Nursery) -> tuple[dict[int, TensorChannel], list[TensorChannel]]:
        """Channels to this pipeline's neighbour stages and to the other replicas of stage *s*."""
        dial: list[tuple[str, str, int | None]] = []     # (link name, peer, pipeline stage or None)
        accept: list[tuple[str, str, int | None]] = []
        e = plan.epoch
        for p in programs:
            for src in sorted(t for t in p.peer_stages if t < p.stage):   # boundary and tied-weight peers
                name = f"e{e}/p{r}:{src}-{p.stage}"
                if src == s:
                    dial.append((name, plan.stages[p.stage].replicas[r], p.stage))
                elif p.stage == s:
                    accept.append((name, plan.stages[src].replicas[r], src))
        reps = plan.stages[s].replicas
        for j, peer in enumerate(reps):
            if j != r:
                name = f"e{e}/s{s}:{min(r, j)}-{max(r, j)}"
                (dial if r < j else accept).append((name, peer, None))
        got: dict[str, TensorChannel] = {}
        self.closed = trio.Event()
        with trio.move_on_after(self.svc.config.link_timeout):
            async with trio.open_nursery() as nursery:
                for name, peer, _ in dial:
                    nursery.start_soon(self._dial_link, name, peer, got, holders)
                for name, peer, _ in accept:
                    nursery.start_soon(self._claim_link, name, peer, got)
        if late := [(name, peer) for name, peer, _ in [*dial, *accept] if name not in got]:   # a broken pipeline, not a
            # failed job: its leader re-plans (issue 43: a NAT'd peer's relay link dropped under a loaded machine)
            raise PeerUnavailable(late[0][1], f"link {late[0][0]} not up within {self.svc.config.link_timeout:.0f} s")
        links = {st: got[name] for name, _, st in [*dial, *accept] if st is not None}
        peers = [got[f"e{e}/s{s}:{min(r, j)}-{max(r, j)}"] for j in range(len(reps)) if j != r]
        return links, peers

    async def _dial_link(self, name: str, peer: str, got: dict[str, TensorChannel], holders: trio.Nursery) -> None:
        delay = 0.2
        while True:
            if not self._alive(peer):
                raise PeerUnavailable(peer, f"gone before link {name} was set up")
            try:
                ch: ResilientChannel = await holders.start(self._hold_channel, name, peer)
                break
            except (PeerUnavailable, BaseExceptionGroup) as exc:
                if not all(isinstance(e, PeerUnavailable) for e in leaf_errors(exc)):
                    raise
                log.info("data plane to %s: %s; retrying", short_peer(peer), describe(exc))
                await trio.sleep(delay)     # retry backoff, bounded by link_timeout
                delay = min(2.0, delay * 2)
        got[name] = ch

    async def _hold_channel(self, name: str, peer: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Dial one channel and keep it open until the epoch's channels are closed. In the job's nursery: an
        epoch ends when its channels said goodbye, not when their links' sockets closed (a link's close waits, shielded,
        up to ``dead_after`` for a peer that reads no more after a halt: 3 s of each re-plan in benchmarks.churn)."""
        closed = self.closed
        async with open_resilient_channel(self.svc.data_plane, peer, name=f"{self.job_id}/{name}",
                                          config=self.svc.config.channels(), peer_gone=self.svc.peer_gone) as ch:
            self.channels.append(ch)
            task_status.started(ch)
            await closed.wait()

    async def _claim_link(self, name: str, peer: str, got: dict[str, TensorChannel]) -> None:
        ch = await self.svc.claim(self.job_id, name, peer, alive=self._alive)
        self.channels.append(ch)
        got[name] = ch

    async def _close_channels(self) -> None:
        """Goodbye on each of the epoch's channels, all at once (each bounded by close_timeout; briefly
        after a halt "now", when every member is tearing its channels down and nobody waits for goodbyes)."""
        timeout = HALT_CLOSE_TIMEOUT if self._broken else None
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as n:
                for ch in self.channels:
                    n.start_soon(lambda ch=ch: ch.aclose(timeout=timeout))
            self.channels.clear()
            self.closed.set()
            self.svc.drop_arrived(self.job_id, older_than=self.epoch + 1)



__all__ = ["HALT_CLOSE_TIMEOUT", "Linking"]
