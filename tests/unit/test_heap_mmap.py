"""A node's large tensors do not leave resident holes in the heap (net/heap.py: keep_freed_heap).

With the data plane's old heap settings (every allocation under 256 MiB from glibc's heap, freed memory kept),
a freed large tensor stayed resident as a hole that a larger one could not use: the head stage of 4 CLI nodes
(benchmarks.model_scale) grew by its output weight's gradient (31 MiB) at each backward, 1.18x its prediction.
Run in a fresh process: the heap settings bind from the first call, once per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

MiB = 2**20

SCRIPT = textwrap.dedent("""
    from fusionp2p.net.heap import keep_freed_heap
    keep_freed_heap()
    import torch

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    base = rss()
    a = torch.ones(8 * 2**20)      # 32 MiB: a micro-batch's new gradient of a large weight
    pin = torch.ones(16 * 2**10)   # 64 KiB allocated after it (a message, a small tensor) and kept
    del a
    b = torch.ones(10 * 2**20)     # 40 MiB: does not fit the hole a left
    print(rss() - base)
""")


def test_a_freed_large_tensor_leaves_no_resident_hole() -> None:
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "FUSIONP2P_KEEP_HEAP": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120, check=True)
    grown = int(out.stdout.split()[-1])
    # live: b (40 MiB) and the pin; the old settings kept a's 32 MiB resident too (72 MiB)
    assert grown < 48 * MiB, f"resident size grew {grown / MiB:.1f} MiB for 40 MiB live"


def test_the_old_threshold_leaves_the_hole() -> None:
    """``FUSIONP2P_MMAP_THRESHOLD`` (A/B runs of benchmarks.heap_step) sets the threshold: at the old 256 MiB
    the freed 32 MiB block stays resident beside the 40 MiB one (the probe above tells the settings apart)."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "FUSIONP2P_KEEP_HEAP": "1", "FUSIONP2P_MMAP_THRESHOLD": str(256 * MiB)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.split()[-1]) >= 70 * MiB


def test_a_bad_threshold_keeps_the_default(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from fusionp2p.net import heap

    monkeypatch.setenv("FUSIONP2P_MMAP_THRESHOLD", "4MiB")
    assert heap._threshold() == heap.MMAP_THRESHOLD
    assert "not a number of bytes" in caplog.text
    monkeypatch.setenv("FUSIONP2P_MMAP_THRESHOLD", str(4 * MiB))
    assert heap._threshold() == 4 * MiB
