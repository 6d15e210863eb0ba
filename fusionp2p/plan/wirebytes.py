"""Bytes on the wire of an AdaTopK (global top-k) message, and the inverse: the ratio a byte budget buys.

The one byte model shared by the planner (``plan.estimator``, ``plan.predict``) and the online ratio
policy (``compress.policy``); it mirrors ``compress.codec`` (``TopKCodec.encode``, ``sparse_bytes``),
which is checked against it by tests/unit/test_plan_wirebytes.py. Pure and torch-free.

For ``n`` elements at kept fraction ``ρ``, with ``k = ⌈ρ·n⌉`` (clamped to ``[1, n]``, as
``compress.select.k_for``), ``b_val`` bytes per kept value and ``b_idx`` per index::

    sparse(n, ρ) = k·b_val + min(k·b_idx, ⌈n/8⌉)

the kept values plus either their indices or a ``⌈n/8⌉``-byte bitmap, whichever is smaller. The
index form is the smaller one below the crossover ``ρ = 1/(8·b_idx)`` (1/32 with int32 indices), the
bitmap above it. The message is sent dense (``n·b_dense`` bytes, unchanged) when ``ρ >= 1`` or when
``sparse(n, ρ) >= n·b_dense``: from ``ρ ≈ max(b_dense/(b_val+b_idx), (b_dense − 1/8)/b_val)``, i.e.
31/32 ≈ 0.97 for fp32 values and dense tensors (it was 0.5 when only indices existed).

The inverse, the largest ratio whose sparse bytes fit a budget ``B``, is piecewise too::

    k_max(B) = max(⌊B/(b_val+b_idx)⌋, ⌊(B − ⌈n/8⌉)/b_val⌋),   ρ_fit(B) = clip(k_max, 0, n) / n

(``sparse(n, ρ) <= B`` iff either form fits, since ``sparse`` is the smaller of the two).

Large-``n`` per-element forms (no ceilings) are here as well, for the places that need a factor
linear in the bytes: :func:`bytes_per_element` and :func:`dense_ratio`. The codec's index type is the
narrowest that holds ``[0, n)`` (:func:`index_itemsize`): int32 for ``32768 < n <= 2^31``, which is
what the planner's default ``index_bytes = 4`` assumes.
"""

from __future__ import annotations

import math

BITS_PER_BYTE = 8


def kept(rho: float, n: int) -> int:
    """``k = ⌈ρ·n⌉`` clamped to ``[min(1, n), n]`` (the codec's ``k_for``)."""
    if n <= 0:
        return 0
    return min(n, max(1, math.ceil(rho * n - 1e-9)))


def bitmap_bytes(n: int) -> int:
    """Size of the kept-set bitmap of *n* elements: ``⌈n/8⌉``."""
    return (max(n, 0) + BITS_PER_BYTE - 1) // BITS_PER_BYTE


def index_itemsize(n: int) -> int:
    """Bytes of the narrowest wire integer type the codec uses for indices in ``[0, n)``
    (u8 up to 2^8 elements, i16 up to 2^15, i32 up to 2^31, else i64)."""
    if n <= 1 << 8:
        return 1
    if n <= 1 << 15:
        return 2
    if n <= 1 << 31:
        return 4
    return 8


def uses_bitmap(n: int, rho: float, *, index_bytes: int) -> bool:
    """Whether the kept set travels as a bitmap (strictly smaller than ``k`` indices)."""
    return bitmap_bytes(n) < kept(rho, n) * index_bytes


def sparse_bytes(n: int, rho: float, *, value_bytes: int, index_bytes: int) -> int:
    """Payload bytes of a sparse top-k message: ``k·b_val + min(k·b_idx, ⌈n/8⌉)``."""
    k = kept(rho, n)
    return k * value_bytes + min(k * index_bytes, bitmap_bytes(n))


def sends_dense(n: int, rho: float, *, dense_bytes: int, value_bytes: int, index_bytes: int) -> bool:
    """The codec's dense fallback: ``ρ >= 1``, nothing to send, or sparse saves no bytes."""
    if rho >= 1.0 or n <= 0:
        return True
    return sparse_bytes(n, rho, value_bytes=value_bytes, index_bytes=index_bytes) >= n * dense_bytes


def wire_bytes(n: int, rho: float, *, dense_bytes: int, value_bytes: int, index_bytes: int) -> int:
    """Bytes on the wire for *n* elements at kept fraction *rho*: sparse, or ``n·b_dense`` when dense."""
    if sends_dense(n, rho, dense_bytes=dense_bytes, value_bytes=value_bytes, index_bytes=index_bytes):
        return max(n, 0) * dense_bytes
    return sparse_bytes(n, rho, value_bytes=value_bytes, index_bytes=index_bytes)


def max_kept(n: int, budget: float, *, value_bytes: int, index_bytes: int) -> int:
    """The largest ``k`` in ``[0, n]`` whose sparse bytes fit *budget* (0 when not even one fits)."""
    if n <= 0 or not budget >= 0:  # also NaN
        return 0
    if math.isinf(budget):
        return n
    by_index = math.floor(budget / (value_bytes + index_bytes))
    by_bitmap = math.floor((budget - bitmap_bytes(n)) / value_bytes)
    return min(n, max(0, by_index, by_bitmap))


def max_ratio(n: int, budget: float, *, value_bytes: int, index_bytes: int) -> float:
    """The largest kept fraction whose sparse bytes fit *budget*: ``k_max/n``, in ``[0, 1]``; 1.0 for
    ``n = 0``. Not clipped to a floor and not checked against dense: the caller does both.

    ``kept`` of the result is ``k_max`` again: where ``(k/n)·n`` rounds above ``k`` by more than
    ``kept``'s 1e-9 slack (large ``n``), the ratio is stepped down by a few ulps."""
    if n <= 0:
        return 1.0
    k = max_kept(n, budget, value_bytes=value_bytes, index_bytes=index_bytes)
    rho = k / n
    for _ in range(64):
        if k == 0 or kept(rho, n) <= k:
            return rho
        rho = math.nextafter(rho, 0.0)
    return (k - 0.5) / n  # not reached for n < 2^53


def bytes_per_element(rho: float, *, value_bytes: int, index_bytes: int) -> float:
    """Large-``n`` sparse bytes per element: ``min(ρ·(b_val+b_idx), ρ·b_val + 1/8)`` (a lower bound of
    ``sparse(n, ρ)/n`` for every ``n``: the ceilings only add)."""
    return min(rho * (value_bytes + index_bytes), rho * value_bytes + 1.0 / BITS_PER_BYTE)


def dense_ratio(*, dense_bytes: int, value_bytes: int, index_bytes: int) -> float:
    """Large-``n`` kept fraction from which a message goes dense:
    ``min(1, max(b_dense/(b_val+b_idx), (b_dense − 1/8)/b_val))`` (31/32 for 4/4/4 bytes)."""
    return min(1.0, max(dense_bytes / (value_bytes + index_bytes),
                        (dense_bytes - 1.0 / BITS_PER_BYTE) / value_bytes))
