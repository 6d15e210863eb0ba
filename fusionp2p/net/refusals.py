"""Refused input, counted per peer and reason, and the penalty that keeps a liar out.

Every service loop that takes bytes from a peer (gossip, VIEW, JOB, probes, content, the data plane)
drops a message that does not decode, verify or fit its limits, and calls :meth:`Refusals.refuse`
instead of ending. The counts feed logs, ``fusionp2p status`` and the metrics endpoint; the penalty
decides when a peer is ignored for a while.

Penalty: each refusal adds ``weight`` to the peer's score, which decays exponentially with
``half_life`` seconds. A peer whose score reaches ``ban_score`` is *banned* until its score decays
below half of it: its streams are refused at once and its gossip is dropped unread. One bad message
from an honest peer with a bug costs it nothing noticeable; a flood bans the flooder within
``ban_score / weight`` messages. Time is passed in (``now``), so the class is sans-IO and
deterministic under test.

The table is bounded: at most ``max_peers`` peers are tracked (the lowest scores are forgotten
first), so a stranger cannot make it grow by rotating identities.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field

from fusionp2p.types import short_peer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RefusalConfig:
    half_life: float = 60.0       # seconds for a peer's score to halve
    ban_score: float = 20.0       # a score at or above this bans the peer ...
    max_peers: int = 4096         # peers tracked at most

    def __post_init__(self) -> None:
        if not (self.half_life > 0 and self.ban_score > 0 and self.max_peers > 0):
            raise ValueError("RefusalConfig: half_life, ban_score and max_peers must be positive")


@dataclass(slots=True)
class _Score:
    value: float = 0.0
    at: float = 0.0
    banned: bool = False


@dataclass(slots=True)
class Refusals:
    """Counts of refused messages by (peer, reason), by reason alone, and a decaying penalty per peer."""

    config: RefusalConfig = field(default_factory=RefusalConfig)
    by_reason: Counter[str] = field(default_factory=Counter)
    by_peer: Counter[tuple[str, str]] = field(default_factory=Counter)
    _scores: dict[str, _Score] = field(default_factory=dict)

    def refuse(self, peer: str, reason: str, *, now: float, weight: float = 1.0, detail: str = "") -> None:
        """Count one refused message from *peer* (*reason*: a short fixed tag such as ``"gossip/decode"``)."""
        reason = reason[:64]
        self.by_reason[reason] += 1
        if len(self.by_peer) < 16 * self.config.max_peers or (peer, reason) in self.by_peer:
            self.by_peer[(peer, reason)] += 1
        s = self._score(peer, now)
        s.value += weight
        if not s.banned and s.value >= self.config.ban_score:
            s.banned = True
            log.warning("peer %s banned for %.0f s: %d refused messages (last: %s %s)", short_peer(peer),
                        self.config.half_life, sum(c for (p, _), c in self.by_peer.items() if p == peer),
                        reason, detail[:200])
        else:
            log.info("refused %s from %s: %s", reason, short_peer(peer), detail[:200])
        if len(self._scores) > self.config.max_peers:
            self._forget(now)

    def score(self, peer: str, *, now: float) -> float:
        s = self._scores.get(peer)
        if s is None:
            return 0.0
        return self._decay(s, now)

    def banned(self, peer: str, *, now: float) -> bool:
        """True while *peer*'s score has not decayed below half the ban score since it was banned."""
        s = self._scores.get(peer)
        if s is None or not s.banned:
            return False
        if self._decay(s, now) < self.config.ban_score / 2:
            s.banned = False
        return s.banned

    def total(self) -> int:
        return sum(self.by_reason.values())

    def _decay(self, s: _Score, now: float) -> float:
        if now > s.at:
            s.value *= math.exp(-math.log(2) * (now - s.at) / self.config.half_life)
            s.at = now
        return s.value

    def _score(self, peer: str, now: float) -> _Score:
        s = self._scores.get(peer)
        if s is None:
            s = self._scores[peer] = _Score(at=now)
        self._decay(s, now)
        return s

    def _forget(self, now: float) -> None:
        keep = sorted(self._scores.items(), key=lambda kv: self._decay(kv[1], now), reverse=True)
        self._scores = dict(keep[: self.config.max_peers // 2])


__all__ = ["RefusalConfig", "Refusals"]
