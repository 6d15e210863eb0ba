"""Replicas that lie plausibly in CO2 averaging (issue 46), for tests and ``benchmarks/byzantine.py``.

Every lie is a finite part within the weight ratio, so every check that existed before robust averaging
let it through. A lie is made from what a replica of the stage knows: its own honest snapshot ``snap`` of
the averaged vector (or fragment) and the averages it received before (``history``, newest last):

* ``scale``: the update blown up, ``prev + SCALE * (snap - prev)`` (``LyingAverager.scale`` sets another factor);
* ``signflip``: the update reversed, ``prev - (snap - prev)`` (the honest norm: no norm bound catches it);
* ``noise``: ``prev`` plus Gaussian noise of the honest update's norm;
* ``stale``: the average of ``STALE`` rounds ago, replayed (it pulls the model back in time).

``prev`` is the last average of the same vector. Before any average exists the liar sends its honest
snapshot. :class:`LyingAverager` is a :class:`~fusionp2p.train.averager.ReplicaAverager` whose scatter
parts lie (its gather phase, the outer step of the shard it owns, is honest).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from fusionp2p.average.allreduce import RoundResult
from fusionp2p.train.averager import ReplicaAverager, _Round

ATTACKS = ("scale", "signflip", "noise", "stale")
SCALE = 10.0
STALE = 4


def lie(kind: str, snap: torch.Tensor, history: Sequence[torch.Tensor], generator: torch.Generator, *,
        scale: float = SCALE) -> torch.Tensor:
    """The part a liar of *kind* sends instead of *snap* (see the module docstring)."""
    if kind not in ATTACKS:
        raise ValueError(f"attack must be one of {ATTACKS}, got {kind!r}")
    if not history:
        return snap
    prev = history[-1]
    delta = snap - prev
    if kind == "scale":
        return prev + scale * delta
    if kind == "signflip":
        return prev - delta
    if kind == "noise":
        z = torch.randn(snap.shape, generator=generator, dtype=torch.float32)
        return prev + z * (float(torch.linalg.vector_norm(delta)) / max(float(torch.linalg.vector_norm(z)), 1e-30))
    return history[max(0, len(history) - STALE)]


class LyingAverager(ReplicaAverager):
    """A replica whose scatter parts are ``lie(attack, ...)`` of its honest snapshots: open it with
    ``open_replica_averager(..., cls=LyingAverager)`` and set ``attack`` (``None``: honest) and ``seed``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attack: str | None = None
        self.seed = 0
        self.scale = SCALE
        self._lie_history: dict[int | None, deque[torch.Tensor]] = {}
        self._lie_gen: torch.Generator | None = None

    def _history(self, fragment: int | None) -> deque[torch.Tensor]:
        return self._lie_history.setdefault(fragment, deque(maxlen=STALE + 1))

    async def _run_round(self, rnd: _Round, snap: torch.Tensor, lr: float | None) -> None:
        if self.attack is not None:
            if self._lie_gen is None:
                self._lie_gen = torch.Generator().manual_seed(self.seed)
            snap = lie(self.attack, snap, self._history(rnd.fragment), self._lie_gen, scale=self.scale)
        await super()._run_round(rnd, snap, lr)
        r: RoundResult | None = rnd.result
        if r is not None and r.complete and r.vector is not None:
            self._history(rnd.fragment).append(r.vector.clone())


__all__ = ["ATTACKS", "LyingAverager", "SCALE", "STALE", "lie"]
