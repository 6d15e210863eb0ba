"""A node's full collections timed, and the collector paused on request (issue 40).

A full (generation-2) collection walks every tracked object the process holds and keeps the GIL while it
does: on a node's heap after torch's import one took ~0.5 s, and meanwhile the node answers no ping, no
heartbeat and no probe.

:func:`watch_collections` counts every collection per generation and logs each full one over ``slow_ms`` at
debug, with its duration (``gc.callbacks``, ``perf_counter``): ``grep 'gc: full collection' <node log>``.

:func:`collector_paused` pauses the collector, nested across threads, while a plan is made
(jobs/plan_thread.py: without it a plan's allocations set off a full collection every other plan).

Measured and NOT adopted (2026-11-30): pausing the collector during the node's start-up and ``gc.freeze()``
after it. In the 20-process benchmark (``--quick --sizes 20 --timeout 150``, loads 17-48, back to back) no
full collection over 20 ms ran after the start-up (2-3 of 1.3-4.4 s in every node's start-up before), yet
deaths were 591, 409, 594 with it against 408, 401, 88, 93 without: not explained (docs/swarm.md).
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


__all__ = ["GcStats", "collector_paused", "watch_collections"]
