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
