"""One glibc heap arena for the whole process (a node's memory stays what the planner priced).

glibc gives threads that allocate at once heaps (arenas) of their own, up to eight per core, and memory a
thread frees stays in its arena for that arena's next allocations only. A node's tensors are allocated by
whichever thread runs them: trio's worker threads (a stage's forward, backward and optimizer step, a new
one whenever the cached ones are busy) and the data plane's reader threads (each received message). With
the data plane's heap settings (:func:`keep_freed_heap`: freed memory is kept, not unmapped), each
arena kept its own copy of the stage's transients: measured on 4 CLI nodes of ``benchmarks.model_scale``
(--memory 768MiB, Llama 34.3M), the stages holding the 47 MiB embedding and head peaked 1.14-1.22x their
predicted size, 1.10-1.15x their offer, the resident size rising at each step's backward; in one process,
an embedding's steps on fresh threads peaked 338 MiB against 230 MiB priced (parameters, gradient, AdamW
state, one gradient transient), 243 MiB with one arena. Allocations are few and large (tensors, messages;
Python's small objects have their own allocator), so one arena's lock costs nothing measurable.

The limit binds arenas made after it is set: a thread that took an arena before keeps it (importing torch
starts one). The daemon sets it first thing (``cli/main.py``); ``MALLOC_ARENA_MAX=1`` in the environment
(``LocalCluster``'s node processes, the Docker image) sets it from the process's first allocation.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable

from fusionp2p.wire.limits import MiB

M_ARENA_MAX = -8   # glibc's mallopt parameter

log = logging.getLogger(__name__)

_done = False


def _mallopt() -> Callable[[int, int], int]:
    """glibc's ``mallopt``; OSError or AttributeError where there is no glibc."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt


def one_arena() -> None:
    """Make every thread allocate from one glibc arena from now on (threads that already have an arena of
    their own keep it: call this before the process starts its threads). Once per process; glibc only."""
    global _done
    if _done:
        return
    _done = True
    with contextlib.suppress(OSError, AttributeError):   # not glibc
        _mallopt()(M_ARENA_MAX, 1)


MMAP_THRESHOLD = 1 * MiB   # the data plane's pooled buffer size (tensor_stream.BufferPool.min_size)

_heap_kept = False


def keep_freed_heap() -> None:
    """Keep freed small blocks in glibc's heap; give every block of :data:`MMAP_THRESHOLD` or more a mapping
    of its own, returned to the kernel when freed.

    glibc's adaptive mmap threshold (at most 32 MiB) unmapped every incoming multi-MiB message on free, and
    the next one faulted in all its pages again (0.6-0.8 s per GB on the development VM, more than the
    AES-GCM work): the data plane now recycles its large buffers itself (``tensor_stream.BufferPool`` for
    received messages from 1 MiB up, the record-sized sealing buffers of ``bulk_channel`` for sent ones), so
    the heap is not what keeps them. It used to be: the mmap threshold was 256 MiB, and every tensor under
    it came from the one heap, where a freed large tensor left a hole that stayed resident and that a
    larger one could not use once a small block had been placed after it. The head stage of 4 CLI nodes
    (``benchmarks.model_scale --memory 768MiB``, a 31 MiB output weight sending 8 MiB logits) grew by one
    weight gradient (31 MiB, the arena's growth steps) at backward after backward with its live memory
    flat: 1.18x its predicted peak, 1.03x its offer; with this threshold 0.98x (the other stages 0.93-0.96x)
    for the same step CPU. The cost falls on transients that are neither pooled nor kept: the bf16
    all-reduce's conversions did (+41% CPU a round) until the round's pool took them in
    (``train/averager.round_buffer_pool``); a training step's activations and gradients of 1 MiB or more
    still do: 388k pages a step on a 512-wide GPT-2, +23-33% step CPU against 256 MiB for an 11-15% lower
    peak resident size, a few hundred pages on the demo's (``benchmarks.heap_step``; docs/dataplane.md).
    The trim threshold stays at 1 GiB.
    Once per process; glibc only; ``FUSIONP2P_KEEP_HEAP=0`` leaves glibc's defaults, and
    ``FUSIONP2P_MMAP_THRESHOLD=<bytes>`` sets another threshold (A/B runs: ``benchmarks.heap_step``).
    """
    global _heap_kept
    if _heap_kept:
        return
    _heap_kept = True
    if os.environ.get("FUSIONP2P_KEEP_HEAP", "1") == "0":
        return
    try:
        mallopt = _mallopt()
    except (OSError, AttributeError):
        return  # not glibc
    m_trim_threshold, m_mmap_threshold = -1, -3
    one_arena()   # kept freed memory in one arena, not one per thread
    mallopt(m_mmap_threshold, _threshold())
    mallopt(m_trim_threshold, 1024 * MiB)


def _threshold() -> int:
    """:data:`MMAP_THRESHOLD`, or ``FUSIONP2P_MMAP_THRESHOLD`` in bytes (a bad value keeps the default, with
    a warning that says what to give)."""
    raw = os.environ.get("FUSIONP2P_MMAP_THRESHOLD")
    if raw is None:
        return MMAP_THRESHOLD
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 < value <= 1 << 40:
        log.warning("FUSIONP2P_MMAP_THRESHOLD=%r is not a number of bytes (e.g. 4194304); using %d", raw, MMAP_THRESHOLD)
        return MMAP_THRESHOLD
    return value


__all__ = ["MMAP_THRESHOLD", "keep_freed_heap", "one_arena"]
