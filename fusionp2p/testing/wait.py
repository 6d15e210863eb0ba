"""The shared polling helpers of tests: :func:`wait_until` for tests that watch *other processes* (which
cannot send us events), :func:`poll_until` for state that a library's own trio tasks change without an
event to wait on (py-libp2p's relay and DCUtR tasks, a service's counters)."""

from __future__ import annotations

from collections.abc import Callable

import trio

from fusionp2p.cli.cluster import wait_until


async def poll_until(pred: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> None:
    """Return once *pred()* is true; ``trio.TooSlowError`` after *timeout* seconds."""
    with trio.fail_after(timeout):
        while not pred():  # noqa: ASYNC110 (no event to wait on: see the module docstring)
            await trio.sleep(interval)


__all__ = ["poll_until", "wait_until"]
