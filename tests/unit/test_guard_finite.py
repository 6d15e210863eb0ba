"""The step guard's finiteness check (train/guard.py, issue 37): exact, and without a temporary of the
gradient's size. ``torch.isfinite(t).all()`` built ``t.abs()`` and two masks, 1.77x the tensor at once: on
4 CLI nodes of ``benchmarks.model_scale`` a node's peak went over its offer there, at every step, by that much
of its largest gradient (the vocabulary's embedding or head)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.train.guard import all_finite, finite_flag

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), at=st.integers(0, 299), bad=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
       dtype=st.sampled_from(_DTYPES), second=st.booleans())
def test_one_bad_value_anywhere_is_found(n: int, at: int, bad: float, dtype: torch.dtype, second: bool) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    other = torch.ones(3, dtype=dtype)
    assert all_finite([x, None, other])
    x[at % n] = bad
    assert not all_finite([other, x] if second else [x])
    assert not bool(finite_flag(x))


def test_edges() -> None:
    assert all_finite([])
    assert all_finite([torch.empty(0), torch.tensor(3.0), torch.arange(4)])   # empty, 0-d, integer (skipped)
    assert not all_finite([torch.tensor(float("inf"))])
    big = torch.full((8,), 3e38)   # finite values whose sum would overflow
    assert all_finite([big])
    x = torch.zeros(4, 5)
    x[:, 2] = float("nan")
    assert not all_finite([x.t()])   # a non-contiguous view


_CHECK = textwrap.dedent("""
    import torch
    from fusionp2p.train.guard import all_finite

    def status(key):
        return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(key)) * 1024

    torch.set_num_threads(1)
    grads = [torch.randn(16 << 20), torch.randn(1000)]
    all_finite(grads)   # code paths loaded
    open("/proc/self/clear_refs", "w").write("5")   # the peak from here on (Linux)
    before = status("VmRSS")
    assert all_finite(grads)
    print(status("VmHWM") - before, grads[0].numel() * 4)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_check_allocates_no_tensor_of_a_gradients_size() -> None:
    got = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=120, check=True)
    rise, largest = (int(x) for x in got.stdout.split())
    assert rise < largest // 8, f"the finiteness check's peak rose {rise >> 20} MiB over a {largest >> 20} MiB gradient"
