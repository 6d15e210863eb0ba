"""Top-k selection by magnitude: exact (``torch.topk``) and fast approximate, in two output forms.

:func:`select_topk` returns the kept values plus either ascending indices (narrowed to the caller's
integer type) or an LSB-first bitmap of ``⌈n/8⌉`` bytes; :func:`approx_topk_indices` and
:func:`exact_topk_indices` are the index-only views of it.

Theory of operation of the fast path (``approx=True``, tens of millions of elements):

1. Draw ``s`` positions with the caller's generator and take a quantile of their magnitudes as the
   threshold ``t``; ``s`` is ``sample_size``, or fewer where fewer already put 3σ (below) inside half
   the tolerance band: ``s >= 36·(1-ρ)/(ρ·tol²)`` (≈34K at ρ = 0.3, tol = 0.05). The quantile aims at ``k·(1 + max(tol/2, 3σ))`` elements above
   ``t``, where ``σ = sqrt((1-ρ)/(ρ·s))`` is the relative standard deviation of that count: the middle
   of the tolerance band when the sample is precise enough, otherwise a margin that makes ``c < k``
   a >3σ event.
2. One fused pass over the tensor in cache-sized chunks (2^18 elements) compares against ``±t``
   (no ``|x|`` tensor), turns each chunk's mask into local indices (``np.flatnonzero``), gathers the
   chunk's values and writes either the global indices or the packed mask bits: ``c`` candidates.
   Every buffer larger than a chunk is a numpy allocation: numpy asks for transparent huge pages,
   which makes a fresh 100 MB buffer ~4x cheaper to fault in than torch's allocator on our VMs.
3. Correction: if ``c > ⌈(1+tol)·k⌉`` the threshold is raised to the exact ``k``-th largest magnitude
   among the candidates (a partition over ``c`` values, not ``n``) and the candidates are filtered
   (bitmap output: the pass is redone at the new threshold); if ``c < k`` the pass is repeated with a
   lower sample quantile (up to 3 times, then exact ``torch.topk``).

**Error bound (the contract, tested).** The returned set ``S`` is always *threshold-closed*: every
element whose magnitude is strictly greater than the smallest kept magnitude is kept. Hence ``S`` is an
exact top-``|S|`` set, it contains an exact top-``k`` set, and ``k <= |S| <= ⌈(1+tol)·k⌉`` (ties at the
threshold may add more only when they are all equal to it). So the reconstruction error
``||x - x̂||`` is never larger than exact top-``k``'s, and the payload is at most ``1+tol`` times the
exact one. ``exact_k=True`` trims ``S`` to exactly ``k`` with a top-k over the candidates only.
NaN is never selected by the fast path (inputs are expected finite).

**Off the host** (a CUDA stage; ``meta`` in tests) the selection runs in torch on the tensor's device
(:func:`_select_torch`): exact ``torch.topk`` (on a GPU it is a few ms even at tens of millions of
elements, so the sampled threshold, which exists to spare a CPU's memory bandwidth, is not needed), the
bitmap packed by torch ops, and the results left on the device for the caller to copy to the host in
one go. Never a ``.numpy()`` on a device tensor.
"""

from __future__ import annotations

import math

import numpy as np
import torch

CHUNK = 1 << 18  # elements per fused-pass chunk: 1 MiB of fp32 plus a 256 KiB mask stay in L2 (multiple of 8)

# numpy dtype with the same bits as each torch float dtype (bf16 has no numpy dtype: moved as int16 bits)
RAW_NP = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16, torch.bfloat16: np.int16}
_RAW_TORCH = {torch.float32: torch.float32, torch.float64: torch.float64, torch.float16: torch.float16,
              torch.bfloat16: torch.int16}


def k_for(ratio: float, n: int) -> int:
    """``k = ⌈ρ·n⌉`` clamped to ``[min(1, n), n]`` (ALGORITHMS.md §1.6)."""
    if n <= 0:
        return 0
    return min(n, max(1, math.ceil(ratio * n - 1e-9)))


def exact_topk_indices(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, ascending, on *mag*'s device) of the ``k`` largest entries of the 1-D tensor *mag*."""
    if k >= mag.numel():
        return torch.arange(mag.numel(), dtype=torch.int64, device=mag.device)
    idx = torch.topk(mag, k, sorted=False).indices
    return torch.sort(idx).values


def raw_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of the bits of a contiguous float tensor (bf16 as int16)."""
    return t.detach().view(_RAW_TORCH[t.dtype]).numpy()


def from_raw(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`raw_numpy`: a tensor of *dtype* sharing *a*'s memory."""
    return torch.from_numpy(a).view(dtype)


def _magnitudes(values: torch.Tensor) -> np.ndarray:
    """``|values|`` as a numpy float array in which every value of *values* is exact (f64 or f32)."""
    wide = values.double() if values.dtype == torch.float64 else values.float()
    mags: np.ndarray = np.abs(wide.numpy())
    return mags


def _threshold_pass(
    values: torch.Tensor, t: float, *, index_dtype: np.dtype | None, bitmap: bool
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """All positions with ``|x| >= t``: (raw values, global indices or None, packed bits or None)."""
    n = values.numel()
    raw = raw_numpy(values)
    native = values.dtype in (torch.float32, torch.float64)
    cmp_dtype = np.float64 if values.dtype == torch.float64 else np.float32
    conv = None if native else torch.empty(min(n, CHUNK), dtype=torch.float32)  # f16/bf16 -> f32 per chunk
    hi_t, lo_t = cmp_dtype(t), cmp_dtype(-t)
    mask = np.empty(min(n, CHUNK), dtype=np.bool_)
    tmp = np.empty(min(n, CHUNK), dtype=np.bool_)
    vals: list[np.ndarray] = []
    idxs: list[np.ndarray] = []
    bits = np.empty((n + 7) // 8, dtype=np.uint8) if bitmap else None
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        m, s = mask[: b - a], tmp[: b - a]
        if conv is None:
            chunk = raw[a:b]
        else:
            chunk = conv[: b - a].copy_(values[a:b]).numpy()
        # |x| >= t without an |x| temporary: x >= t or x <= -t (NaN fails both, like |NaN| >= t)
        np.greater_equal(chunk, hi_t, out=m)
        np.less_equal(chunk, lo_t, out=s)
        np.logical_or(m, s, out=m)
        loc = np.flatnonzero(m)
        vals.append(raw[a:b].take(loc))
        if index_dtype is not None:
            loc += a
            idxs.append(loc.astype(index_dtype, copy=False))
        if bits is not None:
            bits[a >> 3 : (b + 7) >> 3] = np.packbits(m, bitorder="little")
    out_vals = np.concatenate(vals) if vals else np.empty(0, dtype=raw.dtype)
    out_idx = None
    if index_dtype is not None:
        out_idx = np.concatenate(idxs) if idxs else np.empty(0, dtype=index_dtype)
    return out_vals, out_idx, bits


def _bits_from_indices(idx: np.ndarray, n: int) -> np.ndarray:
    mask = np.zeros(n, dtype=np.bool_)
    mask[idx] = True
    return np.packbits(mask, bitorder="little")


def select_topk(
    flat: torch.Tensor,
    k: int,
    *,
    approx: bool,
    generator: torch.Generator | None = None,
    tolerance: float = 0.05,
    sample_size: int = 1 << 18,
    exact_k: bool = False,
    index_dtype: torch.dtype | None = torch.int64,
    bitmap: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The kept set of the 1-D float tensor *flat* as ``(values, indices, bits)``.

    * ``values``: the kept entries in ascending position order, in *flat*'s dtype;
    * ``indices``: their positions (ascending) in *index_dtype*, or ``None`` when *index_dtype* is None;
    * ``bits``: ``⌈n/8⌉`` uint8 bytes, bit ``i % 8`` (LSB first) of byte ``i // 8`` set when position
      ``i`` is kept, padding bits zero; ``None`` unless *bitmap*.

    ``approx=False`` is exact ``torch.topk``. ``approx=True`` is the sampled-threshold selection of the
    module docstring (inputs of at most ``4·sample_size`` elements use the exact path).
    """
    n = flat.numel()
    if flat.dim() != 1 or flat.dtype not in RAW_NP:
        raise ValueError("select_topk needs a 1-D float tensor")
    if not 0.0 <= tolerance <= 1.0:
        raise ValueError("tolerance must be in [0, 1]")
    flat = flat.detach().contiguous()
    if flat.device.type != "cpu":
        return _select_torch(flat, max(0, min(k, n)), index_dtype=index_dtype, bitmap=bitmap)
    np_idx = None if index_dtype is None else torch.empty((), dtype=index_dtype).numpy().dtype
    k = max(0, min(k, n))
    picked: tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None = None
    if approx and 0 < k < n and n > 4 * sample_size:
        if generator is None:
            raise ValueError("approx selection needs a generator")
        picked = _approx(flat, k, generator=generator, tolerance=tolerance, sample_size=sample_size,
                         exact_k=exact_k, index_dtype=np_idx, bitmap=bitmap)
    if picked is None:  # exact path
        idx64 = exact_topk_indices(flat.abs(), k).numpy()
        vals_np = raw_numpy(flat).take(idx64)
        picked = (vals_np, None if np_idx is None else idx64.astype(np_idx, copy=False),
                  _bits_from_indices(idx64, n) if bitmap else None)
    vals_np, idx_np, bits_np = picked
    return (from_raw(vals_np, flat.dtype),
            None if idx_np is None else torch.from_numpy(idx_np),
            None if bits_np is None else torch.from_numpy(bits_np))


_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)   # LSB first


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """``np.packbits(mask, bitorder="little")`` in torch, on *mask*'s device: ``⌈n/8⌉`` uint8 bytes."""
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.reshape(-1).to(torch.uint8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _select_torch(flat: torch.Tensor, k: int, *, index_dtype: torch.dtype | None,
                  bitmap: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`select_topk`'s exact path in torch on *flat*'s device (see the module docstring)."""
    idx = exact_topk_indices(flat.abs(), k) if k > 0 else torch.zeros(0, dtype=torch.int64, device=flat.device)
    bits = None
    if bitmap:
        mask = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        mask[idx] = True
        bits = pack_bits(mask)
    return flat[idx], None if index_dtype is None else idx.to(index_dtype), bits


def _approx(
    flat: torch.Tensor, k: int, *, generator: torch.Generator, tolerance: float, sample_size: int,
    exact_k: bool, index_dtype: np.dtype | None, bitmap: bool,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None:
    """The fast path; ``None`` when it gives up (the caller then runs the exact path)."""
    n = flat.numel()
    hi = math.ceil((1.0 + tolerance) * k)
    rho = k / n
    if tolerance > 0:  # no bigger sample than needed to put 3σ inside half the band
        sample_size = min(sample_size, max(1024, math.ceil(36.0 * (1.0 - rho) / (rho * tolerance**2))))
    pos = torch.randint(0, n, (sample_size,), generator=generator,
                        dtype=torch.int32 if n < 2**31 else torch.int64)
    sample = _magnitudes(flat.index_select(0, pos))
    sigma = math.sqrt((1.0 - rho) / (rho * sample_size))
    above = k * (1.0 + max(tolerance / 2.0, 3.0 * sigma))
    # exact_k keeps position order through a trim, so it needs the indices even for a bitmap
    want_idx = index_dtype if not exact_k else np.dtype(np.int64)
    for _ in range(3):
        m = max(1, min(sample_size, math.ceil(above / n * sample_size)))
        j = sample_size - m  # ascending position of the threshold: ~m sample values are >= it
        t = float(np.partition(sample, j)[j])
        vals, idx, bits = _threshold_pass(flat, t, index_dtype=want_idx, bitmap=bitmap and not exact_k)
        c = vals.size
        if c >= k:
            break
        if j == 0:
            return None  # already at the smallest sampled magnitude
        above *= 1.5 * k / max(c, 1)  # too high: aim lower
    else:
        return None
    if c <= hi and not exact_k:
        return vals, idx, bits
    mags = _magnitudes(from_raw(vals, flat.dtype))
    if exact_k:
        keep = np.sort(torch.topk(torch.from_numpy(mags), k, sorted=False).indices.numpy())
        assert idx is not None
        idx64 = idx[keep]
        return (vals[keep], None if index_dtype is None else idx64.astype(index_dtype, copy=False),
                _bits_from_indices(idx64, n) if bitmap else None)
    # raise the threshold to the k-th largest candidate: still threshold-closed, count >= k
    kth = float(np.partition(mags, c - k)[c - k])
    if idx is None:  # bitmap only: redo the pass at the exact threshold (rare at the ratios that use it)
        return _threshold_pass(flat, kth, index_dtype=None, bitmap=bitmap)
    keep_mask = mags >= kth
    idx = idx[keep_mask]
    return vals[keep_mask], idx, _bits_from_indices(idx, n) if bits is not None else None


def approx_topk_indices(
    values: torch.Tensor,
    k: int,
    *,
    generator: torch.Generator,
    tolerance: float = 0.05,
    sample_size: int = 1 << 18,
    exact_k: bool = False,
) -> torch.Tensor:
    """Indices (int64, ascending) of a threshold-closed set of between ``k`` and ``⌈(1+tol)k⌉``
    largest-magnitude entries of the 1-D, finite tensor *values* (see the module docstring for the
    bound). Selection is by ``|values|``; a non-negative tensor selects by value.

    Small inputs (``n <= 4·sample_size``) use the exact path, where sampling saves nothing.
    """
    _, idx, _ = select_topk(values, k, approx=True, generator=generator, tolerance=tolerance,
                            sample_size=sample_size, exact_k=exact_k, index_dtype=torch.int64)
    assert idx is not None
    return idx
