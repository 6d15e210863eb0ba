"""The traffic meter: per (plane, peer) counts, live sources, a bounded table with monotonic rows."""

from __future__ import annotations

from fusionp2p.net.traffic import OTHER, Traffic


def test_adds_up_per_plane_and_peer() -> None:
    t = Traffic()
    t.add("control", "a", sent=10)
    t.add("control", "a", received=5)
    t.add("data", "a", sent=100, received=1)
    t.add("control", "b", received=7)
    assert t.snapshot() == {("control", "a"): (10, 5), ("data", "a"): (100, 1), ("control", "b"): (0, 7)}
    assert t.totals() == {"control": (10, 12), "data": (100, 1)}


def test_live_sources_are_read_at_snapshot_time_until_detached() -> None:
    t = Traffic()
    t.add("data", "a")                       # the data plane reserves the row when a channel opens
    live = {"sent": 3, "received": 4}
    detach = t.attach(lambda: [("data", "a", live["sent"], live["received"])])
    assert t.snapshot()[("data", "a")] == (3, 4)
    live["sent"] = 30
    assert t.snapshot()[("data", "a")] == (30, 4)
    # the channel closes: its final counts are folded in and the source detached; the row keeps its value
    t.add("data", "a", sent=30, received=4)
    detach()
    assert t.snapshot()[("data", "a")] == (30, 4)
    detach()   # twice is harmless


def test_table_is_bounded_and_rows_stay_monotonic() -> None:
    t = Traffic(max_peers=3)
    for i in range(10):
        t.add("control", f"p{i}", sent=1)
    snap = t.snapshot()
    assert len(snap) == 4                          # three peers and "other"
    assert snap[("control", OTHER)] == (7, 0)
    t.add("control", "p1", sent=5)                 # a tracked peer keeps its own row
    t.add("control", "p9", sent=5)                 # an overflowed one stays in "other"
    snap2 = t.snapshot()
    assert snap2[("control", "p1")] == (6, 0)
    assert snap2[("control", OTHER)] == (12, 0)
    assert all(snap2[k][0] >= v[0] for k, v in snap.items())
    t.add("data", "q", sent=1)                     # the bound is per plane
    assert t.snapshot()[("data", "q")] == (1, 0)
