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

Limits. A replica can always claim to be *slower* than it is and hold its part back to match (it then
takes less work, which costs the job throughput, not correctness). The measurement is one observer's
clock: for every replica to deal alike, the arrival times must be shared (as the owners share whom they
clipped, ``average/robust.py``); the worker does not take them yet (docs/security.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

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


__all__ = ["SLACK", "checked", "measured"]
