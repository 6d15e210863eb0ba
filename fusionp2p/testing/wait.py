"""The one shared polling helper for tests that watch *other processes* (which cannot send us events)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(probe: Callable[[], T | None], *, timeout: float, interval: float = 0.2, what: str = "condition") -> T:
    """Call *probe* until it returns a truthy value; AssertionError naming *what* after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        time.sleep(interval)
