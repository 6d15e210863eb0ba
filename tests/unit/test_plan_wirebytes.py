"""The shared AdaTopK byte model (plan/wirebytes.py) against the codec's real payloads, and its inverse."""

from __future__ import annotations

import math
from typing import Literal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.compress import LinkCost, TopKCodec, index_dtype, k_for
from fusionp2p.compress import sparse_bytes as codec_sparse_bytes
from fusionp2p.compress import uses_bitmap as codec_uses_bitmap
from fusionp2p.plan.config import PlannerConfig
from fusionp2p.plan.estimator import compressed_bytes
from fusionp2p.plan.wirebytes import (
    bytes_per_element,
    dense_ratio,
    index_itemsize,
    kept,
    max_kept,
    max_ratio,
    sends_dense,
    sparse_bytes,
    uses_bitmap,
    wire_bytes,
)

RATIOS = [0.005, 0.01, 0.03, 0.05, 0.1, 0.3, 0.6, 0.9]


def _payload_nbytes(codec: TopKCodec, x: torch.Tensor) -> tuple[int, bool]:
    payload, meta = codec.encode(x)
    return sum(t.nbytes for t in payload), meta["codec"] == "id"


@pytest.mark.parametrize("n", [40_000, 100_003, 1 << 20])
@pytest.mark.parametrize("rho", [*RATIOS, 0.96, 0.97, 0.99])
def test_model_bytes_equal_encoded_payload(n: int, rho: float) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    got, dense = _payload_nbytes(TopKCodec(ratio=rho), x)
    want = wire_bytes(n, rho, dense_bytes=4, value_bytes=4, index_bytes=4)
    assert got == want  # exact: the model counts the payload tensors' bytes (meta is a few dozen more)
    assert dense == sends_dense(n, rho, dense_bytes=4, value_bytes=4, index_bytes=4)
    assert dense == (rho >= 0.97)  # fp32 values, int32 indices: dense only from ~31/32
    # every consumer prices the same bytes: the planner (bytes in, n = bytes / 4) and the policy
    assert compressed_bytes(4 * n, rho, PlannerConfig()) == want
    assert LinkCost(n=n, alpha=0.0, beta=1.0).wire_bytes(rho) == want


@pytest.mark.parametrize("n", [200, 5_000, 40_000])
@pytest.mark.parametrize("value_dtype", [None, "f16"])
@pytest.mark.parametrize("rho", RATIOS)
def test_model_follows_index_type_and_value_dtype(n: int, value_dtype: Literal["f16"] | None, rho: float) -> None:
    # small tensors get u8/i16 indices; fp16 values of an fp32 tensor are 2 bytes, dense stays 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(7))
    got, dense = _payload_nbytes(TopKCodec(ratio=rho, value_dtype=value_dtype), x)
    b_val = 2 if value_dtype else 4
    sizes = {"dense_bytes": 4, "value_bytes": b_val, "index_bytes": index_itemsize(n)}
    assert got == wire_bytes(n, rho, **sizes)
    assert dense == sends_dense(n, rho, **sizes)


def test_approximate_selection_stays_within_its_tolerance() -> None:
    n = 1 << 21  # above 4 * sample_size: the sampled-threshold path
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    for rho in (0.01, 0.1, 0.3):
        got, dense = _payload_nbytes(TopKCodec(ratio=rho, approx=True, tolerance=0.05), x)
        want = wire_bytes(n, rho, dense_bytes=4, value_bytes=4, index_bytes=4)
        assert not dense
        assert want <= got <= want * 1.05 + 8


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 1 << 31), rho=st.floats(1e-6, 1.0))
def test_pure_pieces_match_the_codec(n: int, rho: float) -> None:
    assert kept(rho, n) == k_for(rho, n)
    b_idx = index_itemsize(n)
    assert b_idx == torch.empty((), dtype=index_dtype(n)).element_size()
    k = kept(rho, n)
    assert uses_bitmap(n, rho, index_bytes=b_idx) == codec_uses_bitmap(k, n)
    assert sparse_bytes(n, rho, value_bytes=4, index_bytes=b_idx) == codec_sparse_bytes(k, n=n, value_itemsize=4)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 10**10), budget=st.floats(0, 1e11), b_val=st.sampled_from([2, 4]),
       b_idx=st.sampled_from([1, 2, 4, 8]))
def test_max_ratio_is_the_inverse(n: int, budget: float, b_val: int, b_idx: int) -> None:
    sizes = {"value_bytes": b_val, "index_bytes": b_idx}
    k = max_kept(n, budget, **sizes)
    rho = max_ratio(n, budget, **sizes)
    assert 0 <= k <= n and 0.0 <= rho <= 1.0
    if k > 0:
        assert kept(rho, n) == k
        assert sparse_bytes(n, rho, **sizes) <= budget
    if k < n:  # one more kept entry does not fit
        assert sparse_bytes(n, (k + 1) / n, **sizes) > budget


def test_crossover_and_break_even() -> None:
    n = 10**7
    sizes = {"value_bytes": 4, "index_bytes": 4}
    # indices below ρ = 1/(8·b_idx) = 1/32, bitmap above
    assert not uses_bitmap(n, 0.031, index_bytes=4) and uses_bitmap(n, 0.032, index_bytes=4)
    assert sparse_bytes(n, 0.01, **sizes) == 0.01 * n * 8
    assert sparse_bytes(n, 0.3, **sizes) == 0.3 * n * 4 + n / 8
    # the inverse is piecewise the same way
    assert max_ratio(n, 0.01 * n * 8, **sizes) == pytest.approx(0.01)
    assert max_ratio(n, 0.3 * n * 4 + n / 8, **sizes) == pytest.approx(0.3)
    # large-n forms: per element and the dense break-even
    assert bytes_per_element(0.01, **sizes) == pytest.approx(0.08)
    assert bytes_per_element(0.3, **sizes) == pytest.approx(1.325)
    assert dense_ratio(dense_bytes=4, **sizes) == pytest.approx(31 / 32)
    assert PlannerConfig().dense_ratio == pytest.approx(31 / 32)
    assert dense_ratio(dense_bytes=4, value_bytes=2, index_bytes=2) == 1.0
    assert not sends_dense(n, 0.968, dense_bytes=4, **sizes)
    assert sends_dense(n, 0.969, dense_bytes=4, **sizes)
    for m in (1000, 40_000, n):  # bytes_per_element is a lower bound at every size
        for rho in RATIOS:
            assert sparse_bytes(m, rho, **sizes) >= m * bytes_per_element(rho, **sizes)
            assert sparse_bytes(m, rho, **sizes) <= m * bytes_per_element(rho, **sizes) + 8 + 1


def test_degenerate_inputs() -> None:
    sizes = {"value_bytes": 4, "index_bytes": 4}
    assert kept(0.5, 0) == 0 and sparse_bytes(0, 0.5, **sizes) == 0
    assert wire_bytes(0, 0.5, dense_bytes=4, **sizes) == 0
    assert max_ratio(0, 100.0, **sizes) == 1.0
    assert max_kept(10, -1.0, **sizes) == 0 and max_kept(10, math.nan, **sizes) == 0
    assert max_kept(10, math.inf, **sizes) == 10
    assert sends_dense(1, 0.5, dense_bytes=4, **sizes)   # 4 + 1 bytes for 1 element: dense
    assert wire_bytes(100, 1.0, dense_bytes=4, **sizes) == 400
