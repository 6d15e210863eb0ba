"""What a node's repeatedly contradicted capacity claims cost it: its word on links is no longer taken.

``swarm/membership.py``'s ``BandwidthTable`` checks each bandwidth report's announced capacities against
the best rate *other* nodes measured on a link of the node (``CAPACITY_SLACK``): a contradicted
announcement is replaced by that measured rate and counted (``strikes``). One contradicted report is
what an honest node behind a fast LAN and a slow WAN may send (its uplink is its best own measurement;
its WAN peers measure less); a node contradicted report after report is lying, or cannot be told from a
liar. This module decides when that is so and what it changes, alike on every node (each judges the same
gossiped, signed reports):

* **When.** A node whose reports were contradicted ``strikes`` times in its last ``window`` reports
  (:class:`TrustConfig`, 3 of 8) is *distrusted* (:class:`StrikeHistory`). It is trusted again after
  enough honest reports that fewer than ``strikes`` of its last ``window`` were contradicted: at least 6
  honest reports in a row at 3 of 8, so "for a while" is counted in its own reports, which a liar cannot
  hurry (a report is a new measurement) and honest probing renews.
* **What.** Its announced capacities count for nothing while distrusted (each is the best rate others
  measured of it, contradicted this report or not: a liar cannot alternate), and so do its *own
  measurements of its pairs* (its report's ``measurements``: a pair is probed from one side, so these are
  its word alone) unless the other end corroborates one (:func:`corroborated`: the other end's own
  announced capacity reaches the figure within the slack; its probe server timed the same transfer, so
  an honest fast LAN pair stands) or the other end measured the pair itself (then that figure wins,
  whatever sample count the distrusted one claims). A pair without a credible measurement is estimated
  from capacities, which for the distrusted node are others' measurements: it is planned from what
  others measured of it, never above that.

Why not exclude it from jobs: the evidence is others' *best* measurement of it, which Sybils cannot
lower for a node honest nodes measure, but can for a node only they measure; and an honest clustered node
may be contradicted too. Planning by measurements errs low and costs a framed node a slower plan, not
its place. Bounded: a history of ``window`` booleans per reporting node.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from fusionp2p.errors import ConfigError
from fusionp2p.wire.records import BandwidthReport, Measurement

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrustConfig:
    """A node is distrusted while ``strikes`` of its last ``window`` bandwidth reports were contradicted."""

    strikes: int = 3
    window: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.strikes <= self.window <= 1024:
            raise ConfigError(f"TrustConfig needs 1 <= strikes <= window <= 1024, got {self.strikes}, {self.window}")


class StrikeHistory:
    """Per node, whether each of its last ``window - 1`` superseded reports was contradicted; with the
    verdict on its current report (which new measurements may still change), whether it is distrusted."""

    def __init__(self, config: TrustConfig | None = None) -> None:
        self.config = config or TrustConfig()
        self._past: dict[str, deque[bool]] = {}
        self.distrusted: set[str] = set()

    def settle(self, peer: str, struck: bool) -> None:
        """*peer*'s report was superseded by a newer one; *struck*: it had been contradicted."""
        h = self._past.get(peer)
        if h is None:
            if not struck:
                return   # a history of honest reports only is no history: nothing kept for most nodes
            h = self._past[peer] = deque(maxlen=self.config.window - 1)
        h.append(struck)
        if not any(h):
            del self._past[peer]

    def judge(self, peer: str, current_struck: bool) -> bool:
        """Update and return whether *peer* is distrusted, its current report contradicted or not."""
        h = self._past.get(peer)
        n = (sum(h) if h is not None else 0) + current_struck
        now = n >= self.config.strikes
        if now != (peer in self.distrusted):
            if now:
                self.distrusted.add(peer)
                log.warning("%s: %d of its last %d bandwidth reports announced capacities that others' "
                            "measurements contradict: planned from those measurements only", peer[:16], n,
                            self.config.window)
            else:
                self.distrusted.discard(peer)
                log.info("%s: its bandwidth reports are trusted again", peer[:16])
        return now

    def assume(self, peers: Iterable[str]) -> None:
        """*peers* were distrusted by another node's history (a bootstrap's view: ``judged_links``): each is
        taken as ``strikes`` contradicted reports, so it stays distrusted until its honest reports here
        outweigh them, as if this node had seen its lies."""
        for p in peers:
            self._past[p] = deque([True] * self.config.strikes, maxlen=self.config.window - 1)

    def forget(self, peer: str) -> None:
        self._past.pop(peer, None)
        self.distrusted.discard(peer)


def corroborated(m: Measurement, other_end: BandwidthReport | None, slack: float) -> bool:
    """Whether the other end of *m* backs its figure: its own announced capacity (either way: a pair's
    measurement is the link's figure in both directions) is at least ``m.bandwidth / slack``."""
    return other_end is not None and slack * max(other_end.uplink, other_end.downlink) >= m.bandwidth


__all__ = ["StrikeHistory", "TrustConfig", "corroborated"]
