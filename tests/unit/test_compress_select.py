"""The fast approximate top-k selection stays within its documented bound (compress/select.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fusionp2p.compress.select as select_mod
from fusionp2p.compress import TopKCodec, approx_topk_indices, decode, exact_topk_indices, k_for, select_topk

torch.set_num_threads(1)


def _check_bound(mag: torch.Tensor, idx: torch.Tensor, k: int, tol: float) -> None:
    n = mag.numel()
    assert k <= idx.numel() <= math.ceil((1 + tol) * k)
    assert idx.unique().numel() == idx.numel()
    assert int(idx.min()) >= 0
    assert int(idx.max()) < n
    kept = torch.zeros(n, dtype=torch.bool)
    kept[idx] = True
    # threshold-closed: nothing dropped is larger than the smallest kept magnitude
    if (~kept).any():
        assert mag[~kept].max() <= mag[kept].min()
    # hence it contains an exact top-k set
    assert mag[kept].sort(descending=True).values[:k].equal(mag.sort(descending=True).values[:k])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**20), ratio=st.sampled_from([0.005, 0.01, 0.05, 0.1, 0.3]),
       dist=st.sampled_from(["normal", "heavy", "lowrank", "ties"]), tol=st.sampled_from([0.0, 0.02, 0.05, 0.2]))
def test_approx_selection_bound(seed: int, ratio: float, dist: str, tol: float) -> None:
    g = torch.Generator().manual_seed(seed)
    n = 60_000
    if dist == "normal":
        x = torch.randn(n, generator=g)
    elif dist == "heavy":
        x = torch.randn(n, generator=g) ** 3
    elif dist == "lowrank":
        x = (torch.randn(300, 1, generator=g) * torch.randn(1, 200, generator=g)).reshape(-1)
    else:
        x = torch.randint(0, 5, (n,), generator=g).float()
    mag = x.abs()
    k = k_for(ratio, n)
    idx = approx_topk_indices(mag, k, generator=torch.Generator().manual_seed(seed), tolerance=tol, sample_size=2048)
    if dist == "ties":
        # with massive ties the set stays threshold-closed and contains a top-k; the count may exceed the band
        assert idx.numel() >= k
        kept = torch.zeros(n, dtype=torch.bool)
        kept[idx] = True
        assert (~kept).sum() == 0 or mag[~kept].max() <= mag[kept].min()
        return
    _check_bound(mag, idx, k, tol)


def test_exact_k_variant_is_exact() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(3))
    mag = x.abs()
    for ratio in (0.01, 0.1):
        k = k_for(ratio, x.numel())
        idx = approx_topk_indices(mag, k, generator=torch.Generator().manual_seed(0), sample_size=1024, exact_k=True)
        assert torch.equal(idx, exact_topk_indices(mag, k))


def test_codec_approx_error_no_worse_than_exact() -> None:
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(4))
    exact = decode(*TopKCodec(ratio=0.05).encode(x))
    payload, meta = TopKCodec(ratio=0.05, approx=True, sample_size=4096).encode(x)
    approx = decode(payload, meta)
    assert 10_000 <= meta["k"] <= math.ceil(1.05 * 10_000)
    assert (x - approx).norm() <= (x - exact).norm() + 1e-6


def test_small_inputs_use_exact_path() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5)).abs()
    assert torch.equal(approx_topk_indices(x, 17, generator=torch.Generator()), exact_topk_indices(x, 17))
    assert approx_topk_indices(x, 0, generator=torch.Generator()).numel() == 0
    assert approx_topk_indices(x, 5000, generator=torch.Generator()).numel() == 1000


def test_signed_and_bf16_inputs_select_by_magnitude() -> None:
    x = torch.randn(60_000, generator=torch.Generator().manual_seed(6))
    for values in (x, x.bfloat16(), x.double()):
        idx = approx_topk_indices(values, 600, generator=torch.Generator().manual_seed(0), sample_size=2048)
        _check_bound(values.abs().float(), idx, 600, 0.05)


def _count_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    passes: list[int] = []
    real = select_mod._threshold_pass

    def counting(*args: object, **kwargs: object) -> object:
        passes.append(0)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(select_mod, "_threshold_pass", counting)
    return passes


@pytest.mark.parametrize("ratio", [0.01, 0.3, 0.7])
@pytest.mark.parametrize("bitmap", [False, True])
def test_tiny_sample_stays_in_bound(monkeypatch: pytest.MonkeyPatch, ratio: float, bitmap: bool) -> None:
    # a 16-element sample misjudges the quantile: trims (c > hi; with a bitmap, a second pass) keep the bound
    passes = _count_passes(monkeypatch)
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(11))
    k = k_for(ratio, x.numel())
    calls = []
    for seed in range(12):
        before = len(passes)
        vals, idx, bits = select_topk(x, k, approx=True, generator=torch.Generator().manual_seed(seed),
                                      sample_size=16, index_dtype=None if bitmap else torch.int64, bitmap=bitmap)
        calls.append(len(passes) - before)
        if bitmap:
            assert bits is not None
            mask = torch.from_numpy(__import__("numpy").unpackbits(bits.numpy(), count=20_000, bitorder="little"))
            idx = mask.nonzero().view(-1)
        assert idx is not None
        assert torch.equal(vals, x[idx])
        _check_bound(x.abs(), idx, k, 0.05)
    assert max(calls) == (2 if bitmap else 1)


def test_sample_far_too_high_falls_back_to_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    # plant huge values exactly where the sampler will look: the threshold is far too high, c < k every time
    passes = _count_passes(monkeypatch)
    n, k = 20_000, 2_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(13))
    pos = torch.randint(0, n, (16,), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    x[pos.long()] = 1e6
    idx = approx_topk_indices(x, k, generator=torch.Generator().manual_seed(5), sample_size=16)
    assert len(passes) == 2  # a lower threshold, then the lowest sampled magnitude, then exact
    assert torch.equal(idx, exact_topk_indices(x.abs(), k))


@pytest.mark.parametrize("approx", [False, True])
@pytest.mark.parametrize("exact_k", [False, True])
def test_bitmap_and_indices_describe_the_same_set(approx: bool, exact_k: bool) -> None:
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(12))
    k = 5_000
    kw = {"approx": approx, "tolerance": 0.05, "sample_size": 1024, "exact_k": exact_k}
    v1, idx, none = select_topk(x, k, generator=torch.Generator().manual_seed(1), index_dtype=torch.int32, **kw)
    v2, none2, bits = select_topk(x, k, generator=torch.Generator().manual_seed(1), index_dtype=None, bitmap=True,
                                  **kw)
    assert none is None and none2 is None and idx is not None and bits is not None
    assert idx.dtype == torch.int32 and bits.dtype == torch.uint8 and bits.numel() == 50_000 // 8
    assert torch.equal(v1, v2)
    assert torch.equal(v1, x[idx.long()])
    mask = torch.zeros(50_000, dtype=torch.bool)
    mask[idx.long()] = True
    packed = torch.from_numpy(__import__("numpy").packbits(mask.numpy(), bitorder="little"))
    assert torch.equal(bits, packed)
    if exact_k or not approx:
        assert idx.numel() == k
    _check_bound(x.abs(), idx.long(), k, 0.05)
