"""The job lifecycle as a transition table (STYLE.md 2: everything that affects it lives here).

::

    PENDING ──► PLANNED ──► RUNNING ──► DONE
       │          │  ▲         │
       │          │  └─────────┤  re-plan on a membership change (new epoch)
       │          ▼            ▼
       └──────► FAILED | CANCELLED  (from any non-terminal state)

``PLANNED → PLANNED`` is a re-plan before training started (a node joined or left while the plan
was being agreed). DONE, FAILED and CANCELLED are terminal. An illegal transition raises
:class:`IllegalTransition` at once; the caller decides whether that is our bug or a peer's lie.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from fusionp2p.errors import LocalProtocolError

log = logging.getLogger(__name__)


class JobState(enum.Enum):
    PENDING = "pending"
    PLANNED = "planned"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return not TRANSITIONS[self]


_S = JobState
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.PENDING: frozenset({_S.PLANNED, _S.FAILED, _S.CANCELLED}),
    _S.PLANNED: frozenset({_S.RUNNING, _S.PLANNED, _S.FAILED, _S.CANCELLED}),
    _S.RUNNING: frozenset({_S.DONE, _S.PLANNED, _S.FAILED, _S.CANCELLED}),
    _S.DONE: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}


class IllegalTransition(LocalProtocolError):
    """A transition the table does not allow."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Transition:
    """One entry of a job's history."""

    src: JobState
    dst: JobState
    at: float       # injected time (trio.current_time() or wall clock), seconds
    reason: str = ""


class JobLifecycle:
    """The state of one job, with its history. Time is passed in (sans-IO)."""

    __slots__ = ("epoch", "history", "job_id", "state")

    def __init__(self, job_id: str, *, now: float, state: JobState = JobState.PENDING) -> None:
        self.job_id = job_id
        self.state = state
        self.epoch = 0  # bumped on every (re-)plan: the plan epoch the job is in
        self.history: list[Transition] = [Transition(src=state, dst=state, at=now, reason="created")]

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def can(self, dst: JobState) -> bool:
        return dst in TRANSITIONS[self.state]

    def to(self, dst: JobState, *, now: float, reason: str = "") -> Transition:
        """Move to *dst*; raises IllegalTransition (and changes nothing) if the table forbids it."""
        if dst not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"job {self.job_id}: {self.state.value} -> {dst.value} is not allowed")
        t = Transition(src=self.state, dst=dst, at=now, reason=reason)
        if dst is JobState.PLANNED:
            self.epoch += 1
        self.state = dst
        self.history.append(t)
        log.debug("job %s: %s -> %s%s", self.job_id, t.src.value, dst.value, f" ({reason})" if reason else "")
        return t
