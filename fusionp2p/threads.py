"""Compute a cancelled wait leaves running in a worker thread, and the process's exit.

``trio.to_thread.run_sync(..., abandon_on_cancel=True)`` lets a deadline or a cancelled job return at once while
the thread goes on until its function ends (a plan, a spot check, the device benchmark: seconds of torch or
numpy). Such a thread is a daemon thread. If the interpreter finalizes while it runs native C++ (torch, numpy 2's
``unique``), the thread is ended by ``pthread_exit`` when it takes the GIL back, and the forced unwind through
C++ frames calls ``std::terminate``: the process aborts ("terminate called without an active exception",
SIGABRT, exit status 134) after its own work was done. Measured 2026-11-30: ``benchmarks.swarm_scale --job-only
--quick`` ended so in 2 of 6 runs (gdb: a plan abandoned in numpy's ``unique`` when the swarm was cancelled).

:func:`run_abandonable` counts such calls while their function runs, and the process's exit (``atexit``, which
runs before the interpreter stops its daemon threads) waits for them, ``EXIT_WAIT`` seconds at most.
"""

from __future__ import annotations

import atexit
import functools
import threading
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")

EXIT_WAIT = 30.0   # seconds the process's exit waits for abandoned compute (a plan or a check takes seconds)

_running = 0
_changed = threading.Condition()


def _counted(fn: Callable[[], T]) -> Callable[[], T]:
    @functools.wraps(fn)
    def call() -> T:
        global _running
        with _changed:
            _running += 1
        try:
            return fn()
        finally:
            with _changed:
                _running -= 1
                _changed.notify_all()
    return call


async def run_abandonable(fn: Callable[[], T], *, limiter: trio.CapacityLimiter | None = None) -> T:
    """*fn* in a worker thread; a cancelled wait abandons it (it keeps *limiter*'s token until it ends), and the
    process does not exit under it (:func:`wait_for_abandoned`)."""
    # trio-typing (a py-libp2p dependency) ships stubs older than abandon_on_cancel (trio 0.23)
    return await trio.to_thread.run_sync(_counted(fn), limiter=limiter,  # type: ignore[call-arg,no-any-return]
                                         abandon_on_cancel=True)


def running() -> int:
    """How many :func:`run_abandonable` functions run now (abandoned or not)."""
    with _changed:
        return _running


def wait_for_abandoned(timeout: float = EXIT_WAIT) -> bool:
    """Block until no :func:`run_abandonable` function runs, *timeout* seconds at most; whether none does."""
    with _changed:
        return _changed.wait_for(lambda: _running == 0, timeout)


atexit.register(wait_for_abandoned)
