"""Checked reads of decoded msgpack values: the only way a decoder turns a peer's value into ours.

Every helper takes the value, a short description of where it came from (``what``, used in the
error) and its bounds, and returns the value with its Python type, or raises
:class:`~fusionp2p.errors.RemoteProtocolError`. The bounds are part of the call, so that no decoder
reads an int without a range or a string without a length: a peer's ``inf`` where a byte count was
expected, or ``2**64`` where an epoch was, is refused here rather than raising ``OverflowError`` deep
inside ``int()`` or torch.

* numbers: ``bool`` is never a number; ints are accepted where floats are expected (msgpack packs
  ``2.0`` and ``2`` differently and some encoders do not care), floats never where ints are; floats
  are finite unless the caller asks otherwise (a diverged loss is news, not an attack);
* containers: lengths are bounded; maps have string keys, and with ``required``/``optional`` an
  unknown or missing key is refused;
* :func:`malformed` is the last line at a decoder's boundary: a ``ValueError``, ``TypeError``,
  ``KeyError``, ``IndexError``, ``AttributeError``, ``OverflowError`` or ``RecursionError`` raised while building our
  objects from a peer's (already type-checked) values becomes RemoteProtocolError, so a check we
  forgot costs the peer its message, never the node its task.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

from fusionp2p.errors import RemoteProtocolError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
U63 = 2**63 - 1          # counters, sequence numbers, steps: 0 ..= U63
MAX_NAME = 256           # peer ids, job ids, names, hashes: short strings unless a field says otherwise


def _show(v: Any) -> str:
    """A short description of a peer's value for an error message (never the whole value)."""
    if isinstance(v, str | bytes):
        return f"{type(v).__name__} of length {len(v)}"
    if isinstance(v, list | dict):
        return f"{type(v).__name__} of {len(v)} items"
    return repr(v)[:40]


def as_int(v: Any, what: str, *, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """*v* as an int in ``[lo, hi]`` (bool refused)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise RemoteProtocolError(f"{what}: expected an integer, got {_show(v)}")
    if not lo <= v <= hi:
        raise RemoteProtocolError(f"{what}: {v} outside [{lo}, {hi}]")
    return v


def as_float(v: Any, what: str, *, lo: float = -math.inf, hi: float = math.inf, finite: bool = True) -> float:
    """*v* (a float or an int) as a float in ``[lo, hi]``; NaN and infinities refused when *finite*."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise RemoteProtocolError(f"{what}: expected a number, got {_show(v)}")
    f = float(v)   # msgpack ints are at most 2**64: always within a double's range
    if math.isnan(f):
        if finite:
            raise RemoteProtocolError(f"{what}: NaN is not allowed")
        return f
    if finite and math.isinf(f):
        raise RemoteProtocolError(f"{what}: infinity is not allowed")
    if not lo <= f <= hi:
        raise RemoteProtocolError(f"{what}: {f!r} outside [{lo}, {hi}]")
    return f


def as_bool(v: Any, what: str) -> bool:
    if not isinstance(v, bool):
        raise RemoteProtocolError(f"{what}: expected true or false, got {_show(v)}")
    return v


def as_str(v: Any, what: str, *, max_len: int = MAX_NAME, min_len: int = 0,
           choices: Collection[str] | None = None) -> str:
    """*v* as a str of ``min_len ..= max_len`` characters (one of *choices* when given)."""
    if not isinstance(v, str):
        raise RemoteProtocolError(f"{what}: expected a string, got {_show(v)}")
    if not min_len <= len(v) <= max_len:
        raise RemoteProtocolError(f"{what}: string of length {len(v)} outside [{min_len}, {max_len}]")
    if choices is not None and v not in choices:
        raise RemoteProtocolError(f"{what}: {v[:40]!r} is not one of {sorted(choices)}")
    return v


def as_bytes(v: Any, what: str, *, max_len: int, min_len: int = 0) -> bytes:
    if not isinstance(v, bytes):
        raise RemoteProtocolError(f"{what}: expected bytes, got {_show(v)}")
    if not min_len <= len(v) <= max_len:
        raise RemoteProtocolError(f"{what}: {len(v)} bytes outside [{min_len}, {max_len}]")
    return v


def as_list(v: Any, what: str, *, max_len: int, min_len: int = 0) -> list[Any]:
    """*v* as a list of ``min_len ..= max_len`` items (items are checked by the caller)."""
    if not isinstance(v, list):
        raise RemoteProtocolError(f"{what}: expected a list, got {_show(v)}")
    if not min_len <= len(v) <= max_len:
        raise RemoteProtocolError(f"{what}: list of {len(v)} items outside [{min_len}, {max_len}]")
    return v


def as_map(v: Any, what: str, *, required: Collection[str] = (), optional: Collection[str] | None = None,
           max_len: int = 4096) -> dict[str, Any]:
    """*v* as a map with string keys. With *optional* given (``()`` for none), a key that is neither
    required nor optional is refused; a required key that is missing always is."""
    if not isinstance(v, dict):
        raise RemoteProtocolError(f"{what}: expected a map, got {_show(v)}")
    if not all(isinstance(k, str) for k in v):
        raise RemoteProtocolError(f"{what}: map keys must be strings")
    if optional is not None:
        unknown = set(v) - set(required) - set(optional)
        if unknown:
            raise RemoteProtocolError(f"{what}: unknown field(s) {sorted(k[:32] for k in unknown)[:8]}")
    missing = [k for k in required if k not in v]
    if missing:
        raise RemoteProtocolError(f"{what}: missing field(s) {sorted(missing)}")
    if len(v) > max_len:
        raise RemoteProtocolError(f"{what}: map of {len(v)} entries, limit {max_len}")
    return v


def as_pair_list(v: Any, what: str, *, max_len: int, arity: int) -> list[list[Any]]:
    """A list of lists of exactly *arity* items each (the project's compact record rows)."""
    rows = as_list(v, what, max_len=max_len)
    for row in rows:
        as_list(row, what, min_len=arity, max_len=arity)
    return rows


MAX_DIM = 2**40         # one dimension of a tensor shape
MAX_EXTENT = 2**48      # the product of a shape's dimensions, zeros counted as ones (torch's strides stay in int64)


def as_shape(v: Any, what: str, *, max_dims: int = 8, max_extent: int = MAX_EXTENT) -> tuple[int, ...]:
    """A tensor shape: at most *max_dims* dimensions in ``[0, MAX_DIM)`` whose product, with zeros
    counted as ones, is at most *max_extent*. (A zero-size shape such as ``[0, 2**39, 2**39, 2**39]``
    holds no bytes, yet torch refuses to build it: "Stride calculation overflowed".)"""
    dims = as_list(v, what, max_len=max_dims)
    out = tuple(as_int(d, what, lo=0, hi=MAX_DIM - 1) for d in dims)
    if math.prod(max(d, 1) for d in out) > max_extent:
        raise RemoteProtocolError(f"{what}: shape {list(out)[:8]} is too large")
    return out


@contextmanager
def malformed(what: str) -> Iterator[None]:
    """Turn the errors that building our objects from a peer's values can raise into
    RemoteProtocolError (see the module docstring). ConfigError is a ValueError: a constructor's
    validation refusing a peer's value is the peer's fault too."""
    try:
        yield
    except RemoteProtocolError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError, struct.error) as exc:
        raise RemoteProtocolError(f"{what}: {type(exc).__name__}: {str(exc)[:200]}") from None


__all__ = [
    "INT64_MAX", "INT64_MIN", "MAX_DIM", "MAX_EXTENT", "MAX_NAME", "U63", "as_bool", "as_bytes", "as_float", "as_int", "as_list", "as_map",
    "as_pair_list", "as_shape", "as_str", "malformed",
]
