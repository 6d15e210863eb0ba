"""swarm/gcfreeze.py: a node's long-lived objects leave the collector's generations, full collections timed."""

from __future__ import annotations

import gc

from fusionp2p.swarm.gcfreeze import freeze, watch_collections


def test_full_collections_are_counted_and_timed() -> None:
    stats = watch_collections()
    assert watch_collections() is stats   # one callback a process
    n, total = stats.count[2], stats.full_s
    gc.collect()
    assert stats.count[2] == n + 1 and stats.full_s > total and stats.full_max_s > 0


def test_frozen_objects_leave_the_generations_a_full_collection_walks() -> None:
    held = [[i] for i in range(20_000)]   # long-lived, tracked (lists)
    try:
        before = gc.get_freeze_count()
        freeze("test")
        assert gc.get_freeze_count() >= before + 20_000
        assert not any(o is held[0] for o in gc.get_objects())   # in the permanent generation
    finally:
        gc.unfreeze()
    assert any(o is held[0] for o in gc.get_objects())
