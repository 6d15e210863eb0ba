"""How a job's failure reads: exception groups taken apart for the publisher's one line."""

from __future__ import annotations

import sys

import trio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


def split_cancelled(exc: BaseException) -> tuple[BaseException | None, BaseException | None]:
    """(the cancellation, everything else) of *exc*, either part None when empty."""
    if isinstance(exc, trio.Cancelled):
        return exc, None
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)
    return None, exc


def describe(exc: BaseException) -> str:
    """One line for the publisher: the first real error inside (possibly nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)]
        if not inner:
            break
        exc = inner[0]
    return f"{type(exc).__name__}: {exc}"[:2000]


__all__ = ["describe", "split_cancelled"]
