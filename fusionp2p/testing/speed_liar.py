"""A replica that claims to train faster than it does (issue 46), for tests and benchmarks.

Replicas of one stage under streaming CO2 re-deal a step's micro-batches by the seconds per micro-batch
each announces in its averaging shards (``train/deal.py``). :class:`SpeedLiar` is a
:class:`~fusionp2p.train.averager.ReplicaAverager` that announces its honest figure divided by ``factor``
(``factor`` 1: honest): taken at its word, it is dealt more micro-batches than it can run and every other
replica waits for it at each boundary. Open it with ``open_replica_averager(..., cls=SpeedLiar)``.
"""

from __future__ import annotations

from typing import Any

from fusionp2p.train.averager import ReplicaAverager

FACTOR = 8.0   # the liar claims to be this many times faster than it measures


class SpeedLiar(ReplicaAverager):
    """A replica whose announced speed is ``factor`` times faster than the one the worker measures."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.factor = FACTOR
        self._honest = 0.0
        super().__init__(*args, **kwargs)

    @property   # type: ignore[override]
    def speed(self) -> float:
        return self._honest / self.factor

    @speed.setter
    def speed(self, value: float) -> None:
        self._honest = value


__all__ = ["FACTOR", "SpeedLiar"]
