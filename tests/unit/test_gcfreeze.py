"""swarm/gcfreeze.py: a node's full collections counted and timed."""

from __future__ import annotations

import gc

from fusionp2p.swarm.gcfreeze import watch_collections


def test_full_collections_are_counted_and_timed() -> None:
    stats = watch_collections()
    assert watch_collections() is stats   # one callback a process
    n, total = stats.count[2], stats.full_s
    gc.collect()
    assert stats.count[2] == n + 1 and stats.full_s > total and stats.full_max_s > 0
