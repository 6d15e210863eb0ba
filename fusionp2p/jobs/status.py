"""What a node can tell about its jobs, for the status views and the metrics (plain data, no torch).

:meth:`fusionp2p.jobs.node.NodeJobService.status` returns one :class:`JobView` per job the node
holds; ``fusionp2p/ops`` reads only this, so the job service may change inside without the
dashboard noticing.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusionp2p.plan.plan import Plan
from fusionp2p.types import AveragingStats


@dataclass(frozen=True, slots=True, kw_only=True)
class StepStats:
    """This node's latest training step of a job (its own stage replica)."""

    step: int
    stage: int
    replica: int
    wall_s: float              # the whole step
    compute_s: float           # forward, backward and optimizer
    tokens: int                # tokens its pipeline processed in the step
    loss: float | None = None  # on the loss stage only
    averaging: AveragingStats | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def compute_util(self) -> float:
        return min(1.0, self.compute_s / self.wall_s) if self.wall_s > 0 else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class JobView:
    """One job as this node holds it."""

    job: str
    state: str                  # a fusionp2p.jobs.lifecycle.JobState value
    publisher: str
    steps: int                  # configured training steps
    reason: str = ""
    role: tuple[int, int] | None = None   # (stage, replica) once the plan gave this node one
    plan: Plan | None = None              # the adopted plan, once elected
    last: StepStats | None = None


__all__ = ["JobView", "StepStats"]


class ProgressBatch:
    """The loss stage's per-step progress, batched for gossip (pure: the caller passes the clock).

    Steps are held while they are consecutive, younger than *interval* and fewer than *limit*; the next
    step that is not held goes out carrying them (``StepProgress.earlier``, with their tokens/s and
    times). A gap in the steps drops what was held: the members' final reports fill those steps in."""

    def __init__(self, interval: float, limit: int) -> None:
        self.interval = interval
        self.limit = limit
        self._held: list[tuple[int, float, float, float]] = []   # (step, loss, tokens/s, wall time)
        self._sent_at = float("-inf")

    def add(self, step: int, loss: float, tokens_per_s: float, at: float, *, now: float,
            last: bool) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]] | None:
        """None: *step* is held; else send it now with these (losses, tokens/s, times) of the held steps
        before it. *last*: the epoch's last step, which goes out at once."""
        if self._held and self._held[-1][0] != step - 1:
            self._held.clear()
        if not last and now - self._sent_at < self.interval and len(self._held) < self.limit:
            self._held.append((step, loss, tokens_per_s, at))
            return None
        earlier = (tuple(h[1] for h in self._held), tuple(h[2] for h in self._held), tuple(h[3] for h in self._held))
        self._held.clear()
        self._sent_at = now
        return earlier
