"""Which of a step's micro-batches a replica runs, and their re-deal by the speeds the replicas measure.

A plan whose data-parallel replicas differ in speed deals each step's ``M x r`` micro-batches by speed
(``Plan.micro`` per ``Plan.micro_period`` steps, :func:`plan.micro_schedule`); in lockstep (``()``)
every replica runs ``M``. Replica ``k`` takes micro-batches ``first .. first + count`` of the step, the
pipelines before it the ones before (so a step trains on the same samples however they are dealt).

Under streaming CO2 a one-stage plan re-deals them in band (:func:`redeals_in_band`): every shard a
replica publishes in an averaging round carries its seconds per micro-batch (``ReplicaAverager.speed``),
a complete round hands every owner's figure to every replica (``RoundResult.speeds``), and at the step
each round is applied, the same step on every replica (``OuterConfig.lag``), :meth:`Deal.redeal` takes
the deal for those speeds when it is predicted ``REDEAL_GAIN`` faster: a pure function of the round and
the deal in force, so every replica deals the same samples without a message (docs/planning.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from fusionp2p.errors import ConfigError
from fusionp2p.plan.plan import MAX_MICRO_PERIOD, deal_by_speed, micro_schedule
from fusionp2p.train.config import CO2

# Re-dealing by measured speed: in eighths of a micro-batch a step, when predicted at least REDEAL_GAIN
# faster than the deal in force. A hysteresis above the noise of the figures: two equal replicas on one busy
# host measure speeds up to ~13% apart from round to round (benchmarks.churn, issue 41: 147/128, 175/160,
# 159/141 ms a micro-batch), a deal by them is predicted up to ~7% faster, and at a 5% bar the deal swung
# 4.125/3.875 -> 3.75/4.25 -> 4/4 -> 3.75/4.25 over six steps, each swing running one replica ~6% over its
# share. At 10% such noise keeps the deal in force; a replica 25% slower still moves it (10% faster) ...
REDEAL_PERIOD = 8
REDEAL_GAIN = 0.10
# ... once every replica has measured this many micro-batches (benchmarks.wan's `slow`: a deal by the first
# two steps' figures gave a DSL replica 3.125 a step, and the next two deals took it back to 2.5)
REDEAL_MIN_MICROS = 8


def redeals_in_band(co2: CO2 | None, micro: Sequence[int], stages: int) -> bool:
    """Whether replicas dealt *micro* on a plan of *stages* stages re-deal them by the speeds their
    averaging rounds carry: one stage, micro-batches by speed, streaming CO2 (elsewhere a round is
    consumed at a step that depends on timing, or a pipeline's stages would have to switch together)."""
    return bool(micro) and stages == 1 and co2 is not None and co2.stream and not co2.sync


class Deal:
    """This replica's view of the deal in force: micro-batches of every pipeline per *period* steps
    (``()``: lockstep, ``micro_batches`` each)."""

    def __init__(self, micro: Sequence[int], period: int, *, replica: int, replicas: int, micro_batches: int) -> None:
        if not 1 <= period <= MAX_MICRO_PERIOD or (micro and (
                len(micro) != replicas or sum(micro) != micro_batches * replicas * period or min(micro) < period)):
            raise ConfigError(f"micro-batches per pipeline {tuple(micro)} over {period} step(s) do not deal out "
                              f"{micro_batches} x {replicas} a step")
        self.replica, self.replicas, self.micro_batches = replica, replicas, micro_batches
        self.micro, self.period = tuple(micro), period
        # the micro-batches this pipeline runs at most in a step (what its message budget is sized for)
        self.most = max(self.counts(t)[replica] for t in range(period)) if micro else micro_batches
        self.redeals = 0

    @property
    def share(self) -> float:
        """This pipeline's micro-batches a step on average: its weight in the averages."""
        return self.micro[self.replica] / self.period if self.micro else float(self.micro_batches)

    def counts(self, step: int) -> tuple[int, ...]:
        """Every pipeline's micro-batches at *step* (``()`` in lockstep)."""
        return micro_schedule(self.micro, self.period, step)

    def at(self, step: int) -> tuple[int, int]:
        """(micro-batches this pipeline runs at *step*, how many of the step's the pipelines before it run)."""
        if not self.micro:
            return self.micro_batches, self.replica * self.micro_batches
        counts = self.counts(step)
        return counts[self.replica], sum(counts[:self.replica])

    def redeal(self, speeds: Sequence[tuple[str, float]]) -> list[float] | None:
        """Take the deal for the seconds per micro-batch every replica measured (a consumed round's
        ``speeds``, keyed ``r<replica>``, the same on every replica) when it is predicted ``REDEAL_GAIN``
        faster than the deal in force; the speeds it was taken for, or None (kept: nothing new, or a
        replica has not measured)."""
        r = self.replicas
        if not self.micro:
            return None
        secs: dict[int, float] = {}
        for name, s in speeds:
            if name.startswith("r") and name[1:].isdigit():
                secs[int(name[1:])] = s
        if sorted(secs) != list(range(r)) or not all(s > 0 for s in secs.values()):
            return None
        v = [secs[k] for k in range(r)]
        micro, period = deal_by_speed([1.0 / x for x in v], self.micro_batches, REDEAL_PERIOD)

        def step_s(counts: Sequence[int], per: int) -> float:
            return max(c / per * x for c, x in zip(counts, v, strict=True))

        if step_s(micro, period) > (1.0 - REDEAL_GAIN) * step_s(self.micro, self.period):
            return None
        self.micro, self.period = micro, period
        self.redeals += 1
        return v


__all__ = ["REDEAL_GAIN", "REDEAL_MIN_MICROS", "REDEAL_PERIOD", "Deal", "redeals_in_band"]
