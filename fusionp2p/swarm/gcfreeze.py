"""A node's full collections timed; the collector paused or objects frozen on request (issue 40).

Measured and NOT adopted for the node's start-up (2026-11-30, m20b): the daemon paused the collector during
its start-up and froze the objects after it and after its own start; in the 20-process benchmark
(``--quick --sizes 20 --timeout 150``, loads 17-48 on 2 cores, back to back) deaths were 591, 409, 594 with
it against 408, 401, 88, 93 without, although no full collection over 20 ms ran after the start-up (2-3
in every node's start-up before, 1.3-4.4 s each). Not explained; the daemon now only installs
:func:`watch_collections`. What follows describes the mechanism as it was tried.

A full (generation-2) collection walks every tracked object the process holds and keeps the GIL while it
does: on a node's heap after torch's import (some half a million objects: modules, functions, classes,
torch's op registrations) one took ~0.5 s in the planner's process (jobs/plan_thread.py), and while it
runs the node answers no ping, no heartbeat and no probe. Those objects live as long as the process, so
:func:`freeze` moves them into the permanent generation (``gc.freeze``) once they exist: after the
daemon's own start (its libp2p host, the swarm layer) and again once the heavy start-up is done (torch,
the job service, the device benchmark: ``swarm/daemon.py``). A later collection walks only what was
allocated since. Frozen objects are never collected: only what the process keeps for its lifetime
belongs there, which is why the calls sit at those two moments and nowhere in a job's life. Garbage in
cycles at those moments stays too: after torch's import ~6,600 objects (~1 MB, once), which a collection
before the freeze would have freed at the price of walking all 250,000 (0.10 CPU-s with the GIL held,
seconds of wall time on a loaded machine: the stall this module removes), so none is made.

:func:`watch_collections` counts every collection per generation and logs each full one over
``slow_ms`` at debug, with its duration (``gc.callbacks``, ``perf_counter``): the figure to compare
before and after (``grep 'gc: full collection' <node log>``).

:func:`collector_paused` pauses the collector, nested across threads (the planner's, jobs/plan_thread.py, and
the start-up's): torch's import allocates ~170,000 long-lived objects and set off 2-3 full collections in
every node of the 20-process benchmark, 1.3-4.4 s each (wall, load 32-42 on 2 cores, 2026-11-30), all in the
start-up; paused while it runs, then frozen, they are walked by none.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GcStats:
    """Collections seen per generation, and the full ones' total and longest duration (seconds)."""

    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    full_s: float = 0.0
    full_max_s: float = 0.0
    _t0: float = 0.0


_stats: GcStats | None = None


def watch_collections(slow_ms: float = 20.0) -> GcStats:
    """Install (once per process) the callback that counts collections and times the full ones."""
    global _stats
    if _stats is not None:
        return _stats
    stats = _stats = GcStats()

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        gen = info.get("generation", 0)
        if phase == "start":
            stats._t0 = time.perf_counter()
            return
        stats.count[gen] += 1
        if gen == 2:
            took = time.perf_counter() - stats._t0
            stats.full_s += took
            stats.full_max_s = max(stats.full_max_s, took)
            if took * 1e3 >= slow_ms:
                log.debug("gc: full collection %.1f ms (%d collected; full collections %d, %.2f s)",
                          took * 1e3, info.get("collected", 0), stats.count[2], stats.full_s)

    gc.callbacks.append(on_gc)
    return stats


_gc = threading.Lock()
_paused = [0, True]   # pausers running; whether the collector was enabled before the first


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused, nested across threads: the last pauser to end enables it
    again, unless it was disabled before the first began. Garbage is still freed by reference counts;
    what is left in cycles is collected once the collector runs again."""
    with _gc:
        if _paused[0] == 0:
            _paused[1] = gc.isenabled()
            gc.disable()
        _paused[0] += 1
    try:
        yield
    finally:
        with _gc:
            _paused[0] -= 1
            if _paused[0] == 0 and _paused[1]:
                gc.enable()


def freeze(reason: str) -> None:
    """Move every object the collector tracks now into the permanent generation (O(1): the generations' lists
    are spliced; ``gc.get_freeze_count`` would walk them all, so it is not called here)."""
    t = time.perf_counter()
    gc.freeze()
    log.info("gc: froze the objects held now (%s) in %.1f ms", reason, (time.perf_counter() - t) * 1e3)


__all__ = ["GcStats", "collector_paused", "freeze", "watch_collections"]
