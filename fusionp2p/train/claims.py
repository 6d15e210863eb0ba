"""Claims against measurements: a replica's announced speed checked against when its work arrives.

Replicas of unequal speed re-deal a step's micro-batches by the seconds per micro-batch each announces
(``train/deal.py``). A replica that claims to be faster than it is takes more micro-batches than it can
run, and every other replica waits for it at each averaging boundary; the deal by its claim is what it
asked for, not what it does. What its peers see is when its work for a step arrives: under streaming CO2
every replica starts a step at about the same moment (they all waited for the same round) and sends its
part of the next round as soon as the step is done, so the arrival of replica ``k``'s part, less the
common start, is its step time, ``m_k`` micro-batches at its true speed.

:func:`measured` estimates the common start robustly from the claims themselves (the median over the
replicas of ``arrival_k - claim_k * m_k``: with fewer than half lying it is an honest replica's start) and
returns every replica's measured seconds per micro-batch, ``(arrival_k - start) / m_k``. :func:`checked`
keeps a claim its measurement bears out and replaces one it contradicts (measured slower than claimed by
more than ``slack``) by the measured figure; the deal then follows what the replica does.

Shared. Every replica must deal alike, so the measurement is the round's, not one observer's: each
owner puts in its anchor shard when every replica's scatter part of the round reached it
(``RoundMsg.arrived``, seconds after its own part: only differences count, so the owners' clocks need not
agree), a complete round hands every owner's figures to every replica (``RoundResult.arrivals``), and
:func:`shared` takes, per replica, the lower median over the OTHER owners of what each measured. A replica
cannot vouch for itself, and one lying owner (of three or more) can neither hide a liar nor make an honest
replica look slow (the lower median of two is the honest one). :class:`SpeedCheck` is the worker's side:
it keeps the deal of each round in flight (its micro-batches per replica) and turns a consumed round's
claimed speeds into the checked ones, the same on every replica (``train/worker.py``). It judges only the
step's last replica: one that waited for a slower one ran ahead, so the common start is not its own (judging
it blamed honest replicas for a liar's delay); and a contradicted replica's measured figure stays its floor
until it is the last again (dealt less, a liar arrives early and its claim alone would win the work back).

Limits. A replica can always claim to be *slower* than it is and hold its part back to match (it then
takes less work, which costs the job throughput, not correctness). With two replicas each one's figure is
the other's measurement alone: a liar can make the honest one look slow. A majority of colluding replicas
decides the medians. The common start is estimated from the claims: with half or more of the replicas
lying it is theirs.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

SLACK = 0.25     # measured may exceed the claim by this fraction (transfer time, jitter) before it contradicts it


def measured(claimed: Mapping[str, float], micros: Mapping[str, int], arrived: Mapping[str, float]) -> dict[str, float]:
    """Seconds per micro-batch of every replica in one step, from *arrived* (when its work for the step
    arrived, seconds on one observer's clock), its *micros* that step and the common start estimated from
    the *claimed* figures (see the module docstring). Replicas missing a figure are left out."""
    names = [k for k in claimed if k in micros and k in arrived and micros[k] > 0]
    if not names:
        return {}
    start = statistics.median(arrived[k] - claimed[k] * micros[k] for k in names)
    return {k: max(arrived[k] - start, 0.0) / micros[k] for k in names}


def checked(claimed: Sequence[tuple[str, float]], measured_s: Mapping[str, float], *, slack: float = SLACK
            ) -> tuple[list[tuple[str, float]], tuple[str, ...]]:
    """The speeds to deal by (*claimed*'s order and names), a claim contradicted by *measured_s* (slower
    than claimed by more than *slack*) replaced by the measured figure; and the names contradicted."""
    out: list[tuple[str, float]] = []
    liars: list[str] = []
    for name, s in claimed:
        m = measured_s.get(name)
        if m is not None and m > s * (1.0 + slack):
            out.append((name, m))
            liars.append(name)
        else:
            out.append((name, s))
    return out, tuple(liars)


def shared(claimed: Mapping[str, float], micros: Mapping[str, int],
           arrivals: Sequence[tuple[str, Sequence[tuple[str, float]]]]) -> dict[str, float]:
    """Per replica, the lower median over the other owners (not itself) of the seconds per micro-batch
    each owner measured (:func:`measured` on its *arrivals*: per owner, when each replica's part reached it)."""
    per: dict[str, list[float]] = {}
    for owner, arrived in arrivals:
        for name, s in measured(claimed, micros, dict(arrived)).items():
            if name != owner:
                per.setdefault(name, []).append(s)
    return {name: sorted(v)[(len(v) - 1) // 2] for name, v in per.items()}


class SpeedCheck:
    """The stage worker's check of the speeds its re-dealing rounds carry: :meth:`launched` records the
    micro-batches every replica ran in the step that launched a round; :meth:`check` turns the consumed
    round's claimed speeds into the ones to deal by (:func:`checked` against :func:`shared`)."""

    MAX_ROUNDS = 64   # rounds in flight remembered (a round is consumed a few steps after its launch)

    def __init__(self, *, slack: float = SLACK, enabled: bool = True) -> None:
        self.slack, self.enabled = slack, enabled
        self._micros: dict[int, dict[str, int]] = {}
        self.contradicted: dict[str, int] = {}   # rounds in which each replica's claim was contradicted
        self.measured: dict[str, float] = {}     # the latest shared measurement of each replica
        # a contradicted replica's measured figure, the floor of what it is dealt by from then on (until the
        # next time it is the step's last and measured again): dealt less, it arrives early, and its claim
        # alone would win the work back
        self.floor: dict[str, float] = {}

    def launched(self, round_id: int | None, counts: Sequence[int]) -> None:
        """The round *round_id* was launched after a step whose micro-batches per pipeline were *counts*."""
        if round_id is None or not counts:
            return
        self._micros[round_id] = {f"r{k}": c for k, c in enumerate(counts)}
        while len(self._micros) > self.MAX_ROUNDS:
            del self._micros[min(self._micros)]

    def check(self, round_id: int | None, speeds: Sequence[tuple[str, float]],
              arrivals: Sequence[tuple[str, Sequence[tuple[str, float]]]]) -> list[tuple[str, float]]:
        """The speeds of the consumed round *round_id* to deal by: *speeds* as claimed, each one the
        owners' shared measurement contradicts replaced by it (unchanged when disabled, when a replica has
        not measured, or the round's deal is unknown)."""
        micros = self._micros.pop(round_id, None) if round_id is not None else None
        if not self.enabled or micros is None or not arrivals or not all(s > 0 for _, s in speeds):
            return list(speeds)
        m = shared(dict(speeds), micros, arrivals)
        self.measured.update(m)
        # only the step's last replica is judged: a replica that waits for a slower one has no measured step
        # time of its own (it ran ahead; the common start is the slower one's), and judging it would blame
        # an honest replica for the liar's delay
        last = max(m, key=lambda k: (m[k] * micros.get(k, 0), k), default=None)
        if last is not None:
            self.floor.pop(last, None)
        out, liars = checked(speeds, {last: m[last]} if last is not None else {}, slack=self.slack)
        for name in liars:
            self.floor[name] = m[name]
        out = [(name, max(s, self.floor.get(name, 0.0))) for name, s in out]
        for name in liars:
            self.contradicted[name] = self.contradicted.get(name, 0) + 1
            if self.contradicted[name] == 1:
                log.warning("replica %s claims %.0f ms per micro-batch, its peers measure %.0f ms: dealing by the "
                            "measured figure", name, 1e3 * dict(speeds)[name], 1e3 * m[name])
        return out


__all__ = ["SLACK", "SpeedCheck", "checked", "measured", "shared"]
