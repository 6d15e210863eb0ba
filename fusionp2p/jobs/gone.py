"""Whether a followed job's members are gone (the publisher's ``JobDriver``, `job attach` included).

A job whose members all died cannot finish, and its follower would wait ``idle_timeout`` (10 minutes) in
silence: :class:`GoneCheck` ends it FAILED once none of its members (every one heard of, standbys too) has
been alive in the swarm's view for ``gone_after`` seconds with no news from them. The swarm's view is one
bootstrap's opinion, and under load it can be wrong: a member whose heartbeats came late is dead there
while it trains on, and at the end of a job its leader's final record (a DHT put) and report may take
longer than the view's verdict. An attach of a job that had finished all its steps ended FAILED "no
member alive for 45 s (last step 24 of 24)". So before believing the view, the check

1. asks the members directly (``op: status`` over JOB, at most ``ASK_AT_MOST`` of them at once, within
   ``ASK_TIMEOUT``): one that holds the job and answers is alive, whatever the view says, and the check
   starts over; one that answers that its part is done says that the last step is done (3.);
2. reads the job's status record again: a terminal one ends the job as it says;
3. a job whose last step is reached (the record's step, or the steps the follower saw) is not failed for
   gone members: a record whose newest complete checkpoint is of the last step names the trained model's
   stage files (a member's final state is its checkpoint of that step), and the job ends DONE from them;
   otherwise the follower waits up to ``final_wait`` seconds for the final record (a leader waits up to
   ``conclude_timeout``, 120 s, for every stage's done report before it writes it) and says so, and only
   then ends FAILED, saying that the steps were done but the model could not be collected.

No view (no bootstrap answered) concludes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable

import trio

from fusionp2p.errors import JobError, PeerUnavailable, RemoteProtocolError
from fusionp2p.jobs import proto as job_proto
from fusionp2p.net.transport import Transport
from fusionp2p.types import short_peer
from fusionp2p.wire.jobrecords import JobStatus

log = logging.getLogger(__name__)

ASK_AT_MOST = 8       # members asked directly at once (the current plan's first): bounded however large the job
ASK_TIMEOUT = 10.0    # seconds for their answers (a member too loaded to answer within it is not counted alive)
# a member holding the job in one of these can still finish it, or ("done") has finished its part
LIVE_STATES = frozenset(("pending", "planned", "running", "done"))


async def ask_members(t: Transport, job: str, peers: Iterable[str], *, timeout: float = ASK_TIMEOUT
                      ) -> tuple[str, str] | None:
    """The first of *peers* (at most ``ASK_AT_MOST``) that answers ``status`` holding *job* in a state in which it
    can still finish it (or has: "done"), with that state; None when none does within *timeout*."""
    found: list[tuple[str, str]] = []
    asked = list(dict.fromkeys(peers))[:ASK_AT_MOST]

    async def one(peer: str, scope: trio.CancelScope) -> None:
        try:
            reply = await job_proto.request(t, peer, {"op": "status", "job": job}, timeout=timeout)
        except (PeerUnavailable, RemoteProtocolError) as exc:
            log.debug("job %s: status of %s: %s", job, short_peer(peer), exc)
            return
        state = reply.get("state")
        if reply.get("ok") is True and isinstance(state, str) and state in LIVE_STATES:
            found.append((peer, state))
            scope.cancel()

    with trio.move_on_after(timeout) as scope:
        async with trio.open_nursery() as nursery:
            for p in asked:
                nursery.start_soon(one, p, scope)
    return found[0] if found else None


class GoneCheck:
    """The state of the gone check of one followed job (see the module docstring). :meth:`check` is called
    every ``view_poll`` seconds while the job runs."""

    def __init__(self, t: Transport, job: str, *, gone_after: float, final_wait: float,
                 discover: Callable[[], Awaitable[set[str]]], read_status: Callable[[], Awaitable[JobStatus | None]]
                 ) -> None:
        self.transport = t
        self.job = job
        self.gone_after = gone_after
        self.final_wait = final_wait
        self._discover = discover          # the live nodes of the swarm's view; PeerUnavailable: no view
        self._read_status = read_status    # the job's status record (verified), or None
        self.since: float | None = None    # since when none of the job's members is alive in the view (nor answers)
        self.finishing: float | None = None   # since when the last step is reached with its members gone

    async def check(self, now: float, *, known: set[str], current: tuple[str, ...], last_news: float,
                    reached: int, steps: int) -> JobStatus | None:
        """None while the job may go on; a status to end it with (terminal, or DONE from the record's checkpoint
        of the last step); JobError when its members are gone and it cannot finish."""
        try:
            alive = await self._discover()
        except PeerUnavailable as exc:
            log.info("job %s: no view of the swarm to check its members in: %s", self.job, exc)
            return None
        if known & alive or (self.since is not None and last_news > self.since):
            self._alive()
            return None
        if self.since is None:
            self.since = now
            log.warning("job %s: none of its %d members is alive in the swarm's view", self.job, len(known))
        if now - self.since < self.gone_after:
            return None
        # the view's verdict is due: the members themselves, then the status record, before believing it
        answer = await ask_members(self.transport, self.job, [*current, *sorted(known - set(current))])
        if answer is not None and answer[1] != "done":
            log.warning("job %s: member %s answers directly (%s) though the swarm's view has none of its members "
                        "alive: following on", self.job, short_peer(answer[0]), answer[1])
            self._alive()
            return None
        # a member that says its part is done: the job's steps are, and its final record is what is awaited
        done_here = answer is not None
        st = await self._read_status()
        if st is not None and st.terminal:
            return st
        if st is not None and st.checkpoint_step >= steps > 0 and st.checkpoint:
            log.warning("job %s: its members are gone after its last step %d; its final record did not come, and "
                        "its status record names the model's stage files (the checkpoint of step %d)",
                        self.job, steps, st.checkpoint_step)
            return dataclasses.replace(st, state="done", step=steps, final=st.checkpoint)
        last = max(reached, st.step if st is not None else -1, steps if done_here else -1)
        if steps > 0 and last >= steps:
            if self.finishing is None:
                self.finishing = now
                log.warning("job %s: its last step %d of %d is done and none of its members is alive in the "
                            "swarm's view%s: waiting up to %.0f s for its final record", self.job, last, steps,
                            " (one says its part is done)" if done_here else " or answers", self.final_wait)
            if now - self.finishing < self.final_wait:
                return None
            raise JobError(f"its last step {last} of {steps} is done, but no final record came within "
                           f"{self.final_wait:.0f} s and none of its {len(known)} members is alive in the swarm's "
                           "view, so its model cannot be collected; submit it again")
        names = ", ".join(short_peer(p) for p in sorted(known)[:8])
        raise JobError(f"none of its {len(known)} members ({names}) has been alive in the swarm for "
                       f"{now - self.since:.0f} s nor answers, so it cannot finish (last step {last} of "
                       f"{steps}); submit it again")

    def _alive(self) -> None:
        self.since = None
        self.finishing = None


__all__ = ["ASK_AT_MOST", "ASK_TIMEOUT", "GoneCheck", "ask_members"]
