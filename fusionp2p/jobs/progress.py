"""Per-step progress of a job, aggregated over the loss stage's replicas (pure; used by the job's leader
and by the publisher).

Every replica of the last stage reports every step's loss (its pipeline's mean), several fast steps in one
gossiped :class:`StepProgress` (its ``earlier``).
:class:`ProgressBook` turns them into one event per step: the mean loss of the replicas that reported,
their summed tokens/s. A step is emitted once all current loss replicas reported it, or as soon as a
later step is complete (a lost gossip message never holds the job's curve back). After a re-plan that
went back to a checkpoint, steps are trained again: a report of a newer epoch replaces the older one. A
report of an older epoch that arrives after the new plan is kept (the new plan may have resumed from a
survivor's live state past that step and never train it again), unless the step was already emitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fusionp2p.jobs.events import StepProgress, expand_steps


@dataclass
class ProgressBook:
    job: str
    steps: int
    history: dict[int, float] = field(default_factory=dict)       # step -> emitted mean loss
    _pending: dict[int, dict[str, StepProgress]] = field(default_factory=dict)
    _emitted: dict[int, int] = field(default_factory=dict)         # step -> epoch emitted in
    _replicas: frozenset[str] = frozenset()
    _epoch: int = 0
    _stage: int = 0

    def set_plan(self, epoch: int, last_stage: int, replicas: Iterable[str]) -> None:
        """The loss stage of the plan now in force and its replicas."""
        self._epoch, self._stage, self._replicas = epoch, last_stage, frozenset(replicas)

    @property
    def reached(self) -> int:
        """Steps completed as far as reports tell (the next step to run)."""
        return max(self._emitted, default=-1) + 1

    def add(self, sender: str, ev: StepProgress, *, now: float) -> list[StepProgress]:
        """A gossiped report (of one step, or several: ``StepProgress.earlier``); returns the aggregated
        events it completes (maybe none)."""
        out: list[StepProgress] = []
        for one in expand_steps(ev):
            out += self._add(sender, one, now=now)
        return out

    def _add(self, sender: str, ev: StepProgress, *, now: float) -> list[StepProgress]:
        if ev.job != self.job or ev.loss is None or ev.peer != sender or not 0 <= ev.step < self.steps:
            return []
        if self._emitted.get(ev.step, -1) >= ev.epoch:
            return []
        got = self._pending.setdefault(ev.step, {})
        if ev.epoch < self._epoch:
            # a step the old plan trained that the new plan may never train again (it resumed from a survivor's
            # live state past it), heard after the new plan: keep it, emitted with the next complete step or at
            # the end, unless the new plan trains the step again first
            if all(e.epoch <= ev.epoch for e in got.values()):
                got[sender] = ev
            return []
        if ev.epoch > self._epoch:   # its PlanChanged has not arrived (yet): emit reports as they come
            self._epoch, self._stage, self._replicas = ev.epoch, ev.stage, frozenset()
        elif self._replicas and (sender not in self._replicas or ev.stage != self._stage):
            return []
        for old in [p for p, e in got.items() if e.epoch < ev.epoch]:
            del got[old]              # the step trained again under a newer plan: its reports replace the old
        got[sender] = ev
        if len(got) < len(self._replicas):
            return []
        return self._flush(upto=ev.step, now=now)

    def fill(self, losses: Mapping[int, Iterable[float]], *, now: float) -> list[StepProgress]:
        """Steps never (or partly) heard on gossip, from the members' final reports."""
        out = []
        for step in sorted(losses):
            vals = list(losses[step])
            if step in self._emitted or not vals or not 0 <= step < self.steps:
                continue
            epoch = self._epoch_of(step)
            self._pending[step] = {f"report{i}": StepProgress(job=self.job, step=step, epoch=epoch,
                                                              stage=self._stage, loss=v) for i, v in enumerate(vals)}
        out += self._flush(upto=None, now=now)
        return out

    def _epoch_of(self, step: int) -> int:
        """The epoch that trained a *step* only the final reports carry (its gossip was lost). The curve's
        epochs never decrease with the step (a new plan trains on from where it resumed), so a step between
        emitted steps takes the epoch of the one before it; one past every emitted step, the current plan's.
        (The current epoch for all of them put a lost step of epoch 0 at epoch 1 and made the re-plan look
        as if it had resumed before its checkpoint.)"""
        if not any(t > step for t in self._emitted):
            return self._epoch
        return max((e for t, e in self._emitted.items() if t < step), default=0)

    def flush(self, *, now: float) -> list[StepProgress]:
        """Everything still pending (the job ended)."""
        return self._flush(upto=None, now=now)

    def _flush(self, *, upto: int | None, now: float) -> list[StepProgress]:
        out = []
        for step in sorted(self._pending):
            if upto is not None and step > upto:
                break
            got = self._pending.pop(step)
            evs = [e for e in got.values() if e.loss is not None]
            if not evs:
                continue
            epoch = max(e.epoch for e in evs)
            loss = sum(e.loss for e in evs if e.loss is not None) / len(evs)
            self._emitted[step] = epoch
            self.history[step] = loss
            utils = [e.compute_util for e in evs if e.compute_util is not None]
            # the replicas that reported (peer: comma-separated) and when the step ended, not when it was emitted
            reporters = ",".join(sorted(p for p in got if not p.startswith("report")))
            ended = max((e.at for e in evs), default=0.0)
            out.append(StepProgress(job=self.job, step=step, epoch=epoch, stage=self._stage, peer=reporters, loss=loss,
                                    tokens_per_s=sum(e.tokens_per_s for e in evs),
                                    compute_util=max(utils) if utils else None, at=ended if ended > 0 else now))
        return out

    def recent(self, n: int) -> tuple[tuple[int, float], ...]:
        """The newest *n* (step, loss) pairs, oldest first."""
        return tuple(sorted(self.history.items())[-n:])


__all__ = ["ProgressBook"]
