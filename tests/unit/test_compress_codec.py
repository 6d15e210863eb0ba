"""Codec properties: exact top-k, dense fallback, ratio 1.0 identity, idempotence, sizes, peer input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fusionp2p.compress.codec as codec_mod
import fusionp2p.compress.select as select_mod
from fusionp2p.compress import (
    CastCodec,
    IdentityCodec,
    TopKCodec,
    decode,
    index_dtype,
    k_for,
    kept_mask,
    sparse_bytes,
    uses_bitmap,
)
from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.wire.msg import packb, unpackb

torch.set_num_threads(1)


def _payload_bytes(payload: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


def _rand(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 3000), ratio=st.floats(0.001, 0.45))
def test_topk_keeps_exactly_k_largest(seed: int, n: int, ratio: float) -> None:
    x = _rand(seed, (n,))
    codec = TopKCodec(ratio=ratio)
    payload, meta = codec.encode(x)
    k = k_for(ratio, n)
    if codec.is_dense(x):
        assert meta["codec"] == "id"
        return
    vals, where = payload
    assert meta["k"] == k == vals.numel()
    if uses_bitmap(k, n):  # the smaller of the two encodings
        assert meta["fmt"] == "bitmap"
        assert where.dtype == torch.uint8
        assert where.numel() == (n + 7) // 8 < k * where.new_empty((), dtype=index_dtype(n)).element_size()
    else:
        assert "fmt" not in meta
        assert where.dtype == index_dtype(n)
        assert where.numel() == k
    mask = kept_mask(payload, meta)
    assert mask is not None
    assert int(mask.sum()) == k
    if (~mask).any():
        assert x.abs()[mask].min() >= x.abs()[~mask].max()
    assert torch.equal(vals, x[mask])
    # payload size formula k·b_val + min(k·b_idx, ⌈n/8⌉)
    assert _payload_bytes(payload) == sparse_bytes(k, n=n, value_itemsize=4)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 20), cols=st.integers(2, 300), ratio=st.floats(0.01, 0.4),
       per_row=st.booleans(), vdt=st.sampled_from([None, "f16", "bf16"]))
def test_decode_encode_idempotent(seed: int, rows: int, cols: int, ratio: float, per_row: bool, vdt: str | None) -> None:
    x = _rand(seed, (rows, cols))
    codec = TopKCodec(ratio=ratio, per_row=per_row, value_dtype=vdt)  # type: ignore[arg-type]
    once = decode(*codec.encode(x))
    twice = decode(*codec.encode(once))
    assert once.shape == x.shape
    assert once.dtype == x.dtype
    assert torch.equal(once, twice)


def test_per_row_keeps_k_in_every_row() -> None:
    x = _rand(1, (7, 100))
    payload, meta = TopKCodec(ratio=0.1, per_row=True).encode(x)
    vals, idx = payload
    assert meta["row"]
    assert meta["k"] == 10
    assert vals.shape == (7, 10)
    assert idx.dtype == torch.uint8
    xh = decode(payload, meta)
    assert torch.equal((xh != 0).sum(dim=1), torch.full((7,), 10))
    for r in range(7):
        assert set(idx[r].long().tolist()) == set(torch.topk(x[r].abs(), 10).indices.tolist())


@pytest.mark.parametrize("shape", [(10,), (3, 4, 5), (1000,), (0,)])
def test_ratio_one_is_bit_exact(shape: tuple[int, ...]) -> None:
    x = _rand(2, shape)
    payload, meta = TopKCodec(ratio=1.0).encode(x)
    assert meta == {"codec": "id"}
    out = decode(payload, meta)
    assert out.dtype == x.dtype
    assert torch.equal(out, x)


def test_dense_when_sparse_saves_nothing() -> None:
    x = _rand(3, (1000,))
    # fp32 values + a 125 B bitmap against 4000 B dense: break-even at k = 969
    assert TopKCodec(ratio=0.968).encode(x)[1]["codec"] == "topk"
    assert TopKCodec(ratio=0.969).encode(x)[1]["codec"] == "id"
    # with fp16 values sparse always saves bytes below ρ = 1
    assert TopKCodec(ratio=0.99, value_dtype="f16").encode(x)[1]["codec"] == "topk"
    # per row keeps indices: fp32 + uint8 (cols <= 256) is 5 B per kept entry, break-even at ρ = 0.8
    y = _rand(3, (10, 100))
    assert TopKCodec(ratio=0.79, per_row=True).encode(y)[1]["codec"] == "topk"
    assert TopKCodec(ratio=0.8, per_row=True).encode(y)[1]["codec"] == "id"
    # every value tied: the kept set is everything, and it goes dense rather than bigger
    assert TopKCodec(ratio=0.1, approx=True, sample_size=16).encode(torch.ones(5000))[1]["codec"] == "id"


def test_index_and_bitmap_formats_switch_at_the_smaller_size() -> None:
    x = _rand(8, (100_000,))  # int32 indices; the bitmap is 12500 B = 3125 indices
    assert not uses_bitmap(3125, 100_000)
    assert uses_bitmap(3126, 100_000)
    for ratio, fmt in ((0.03, None), (0.0313, "bitmap"), (0.3, "bitmap")):
        for approx in (False, True):
            payload, meta = TopKCodec(ratio=ratio, approx=approx, sample_size=1024).encode(x)
            assert meta.get("fmt") == fmt
            exact = decode(*TopKCodec(ratio=ratio).encode(x))
            out = decode(payload, meta)
            assert (out != 0).sum() >= k_for(ratio, x.numel())
            assert torch.equal(out[exact != 0], exact[exact != 0])  # contains the exact top-k, values exact
            assert torch.equal(out[out != 0], x[out != 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ratio", [0.01, 0.2])
def test_fast_path_across_chunks_and_dtypes(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, ratio: float) -> None:
    # tiny chunks so a small tensor crosses many chunk boundaries, including a ragged last one
    monkeypatch.setattr(select_mod, "CHUNK", 64)
    monkeypatch.setattr(codec_mod, "CHUNK", 64)
    x = _rand(9, (37, 101)).to(dtype)
    codec = TopKCodec(ratio=ratio, approx=True, sample_size=256)
    payload, meta = codec.encode(x)
    k = k_for(ratio, x.numel())
    assert meta.get("fmt") == ("bitmap" if ratio > 0.1 else None)
    assert k <= meta["k"] <= math.ceil(1.05 * k)
    out = decode(payload, meta)
    assert out.dtype == dtype
    assert out.shape == x.shape
    mask = kept_mask(payload, meta)
    assert mask is not None
    assert torch.equal(mask, out != 0)
    assert torch.equal(out[mask], x[mask])
    assert x.abs()[mask].min() >= x.abs()[~mask].max()
    # decoding into a dirty caller buffer gives the same tensor
    buf = torch.full(x.shape, 7.0, dtype=dtype)
    assert decode(payload, meta, out=buf) is buf
    assert torch.equal(buf, out)


@pytest.mark.parametrize("codec", [IdentityCodec(), CastCodec(), TopKCodec(ratio=0.05), TopKCodec(ratio=0.3),
                                   TopKCodec(ratio=0.2, per_row=True), TopKCodec(ratio=0.3, value_dtype="bf16")])
def test_decode_into_out_buffer(codec: object) -> None:
    x = _rand(10, (30, 40))
    payload, meta = codec.encode(x)  # type: ignore[attr-defined]
    fresh = decode(payload, meta)
    buf = torch.full((30, 40), -3.0)
    assert decode(payload, meta, out=buf) is buf
    assert torch.equal(buf, fresh)
    with pytest.raises(RemoteProtocolError):
        decode(payload, meta, out=torch.empty(30, 41))
    with pytest.raises(RemoteProtocolError):
        decode(payload, meta, out=torch.empty(30, 40, dtype=torch.float64))
    with pytest.raises(ValueError):
        decode(payload, meta, out=torch.empty(40, 30).t())


def test_index_dtype_is_narrowest() -> None:
    assert index_dtype(256) == torch.uint8
    assert index_dtype(257) == torch.int16
    assert index_dtype(1 << 15) == torch.int16
    assert index_dtype((1 << 15) + 1) == torch.int32
    assert index_dtype((1 << 31) + 1) == torch.int64


def test_value_dtype_reduces_bytes_and_decodes_close() -> None:
    x = _rand(4, (4096,))
    p32, _ = TopKCodec(ratio=0.1).encode(x)
    p16, m16 = TopKCodec(ratio=0.1, value_dtype="bf16").encode(x)
    assert p16[0].dtype == torch.bfloat16
    assert _payload_bytes(p16) < _payload_bytes(p32)
    assert torch.allclose(decode(p16, m16), decode(*TopKCodec(ratio=0.1).encode(x)), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("wire", ["f16", "bf16"])
def test_cast_codec(wire: str) -> None:
    x = _rand(5, (33, 7)).double()
    payload, meta = CastCodec(wire_dtype=wire).encode(x)  # type: ignore[arg-type]
    out = decode(payload, meta)
    assert out.dtype == torch.float64
    assert torch.allclose(out, x, rtol=1e-2, atol=1e-2)
    assert torch.equal(IdentityCodec().decode(*IdentityCodec().encode(x)), x)


def test_meta_is_msgpack_safe() -> None:
    x = _rand(6, (20, 30))
    for codec in (IdentityCodec(), CastCodec(), TopKCodec(ratio=0.05), TopKCodec(ratio=0.05, per_row=True),
                  TopKCodec(ratio=0.3)):
        payload, meta = codec.encode(x)
        meta2 = unpackb(packb(meta))
        assert meta2 == meta
        assert decode(payload, meta2).shape == x.shape


def test_bad_config_rejected() -> None:
    for kwargs in ({"ratio": 0.0}, {"ratio": 1.5}, {"ratio": 0.1, "tolerance": 2.0}, {"ratio": 0.1, "value_dtype": "f64"}):
        with pytest.raises(ConfigError):
            TopKCodec(**kwargs)  # type: ignore[arg-type]


def _good() -> tuple[tuple[torch.Tensor, ...], dict[str, object]]:
    return TopKCodec(ratio=0.1).encode(_rand(7, (100,)))


def _good_bitmap() -> tuple[tuple[torch.Tensor, ...], dict[str, object]]:
    p, m = TopKCodec(ratio=0.3).encode(_rand(7, (101,)))  # 13 B bitmap, 3 padding bits
    assert m["fmt"] == "bitmap"
    return p, m


def _flip(bits: torch.Tensor, byte: int, mask: int) -> torch.Tensor:
    out = bits.clone()
    out[byte] ^= mask
    return out


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p, m: (p, {**m, "codec": "zip"}),
        lambda p, m: (p, {**m, "k": -1}),
        lambda p, m: (p, {**m, "k": 11}),
        lambda p, m: (p, {**m, "k": True}),
        lambda p, m: (p, {**m, "shape": [10**13]}),
        lambda p, m: (p, {**m, "shape": "x"}),
        lambda p, m: (p, {**m, "dtype": "i64"}),
        lambda p, m: (p, {**m, "row": 1}),
        lambda p, m: (p[:1], m),
        lambda p, m: ((p[0], p[1].to(torch.int32) + 1000), m),
        lambda p, m: ((p[0], p[1].to(torch.int32) - 1000), m),
        lambda p, m: ((p[0], p[1].float()), m),
        lambda p, m: ((p[0][:3], p[1][:3]), m),
        lambda p, m: (p, {**m, "row": True}),
        lambda p, m: (p, []),
    ],
)
def test_decode_rejects_peer_garbage(mutate: object) -> None:
    p, m = _good()
    bad_p, bad_m = mutate(p, m)  # type: ignore[operator]
    with pytest.raises(RemoteProtocolError):
        decode(bad_p, bad_m)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p, m: (p, {**m, "fmt": "rle"}),
        lambda p, m: (p, {**m, "fmt": 1}),
        lambda p, m: (p, {**m, "row": True}),
        lambda p, m: (p, {**m, "k": m["k"] + 1}),
        lambda p, m: (p, {**m, "shape": [109]}),
        lambda p, m: ((p[0], p[1][:-1]), m),
        lambda p, m: ((p[0], torch.cat([p[1], p[1][:1]])), m),
        lambda p, m: ((p[0], p[1].to(torch.int16)), m),
        lambda p, m: ((p[0][:-1], p[1]), m),
        lambda p, m: ((p[0], _flip(p[1], 12, 0x80)), m),               # a padding bit (n = 101)
        lambda p, m: ((p[0], _flip(p[1], 0, 0x01)), m),                # popcount != k
    ],
)
def test_decode_rejects_bad_bitmaps(mutate: object) -> None:
    p, m = _good_bitmap()
    bad_p, bad_m = mutate(p, m)  # type: ignore[operator]
    with pytest.raises(RemoteProtocolError):
        decode(bad_p, bad_m)
    with pytest.raises(RemoteProtocolError):
        kept_mask(bad_p, bad_m)


@settings(max_examples=60, deadline=None)
@given(meta=st.dictionaries(st.sampled_from(["codec", "k", "row", "shape", "dtype", "fmt"]),
                            st.one_of(st.integers(-5, 50), st.booleans(), st.text(max_size=4),
                                      st.lists(st.integers(-2, 12), max_size=3),
                                      st.sampled_from(["topk", "id", "cast", "f32", "bitmap", "idx"]))),
       n=st.integers(0, 12), idx_dtype=st.sampled_from([torch.uint8, torch.int16, torch.int64, torch.float32]),
       bits=st.lists(st.integers(0, 255), max_size=3))
def test_decode_never_crashes(meta: dict[str, object], n: int, idx_dtype: torch.dtype, bits: list[int]) -> None:
    for payload in ((torch.randn(n), torch.arange(n).to(idx_dtype)),
                    (torch.randn(n), torch.tensor(bits, dtype=torch.uint8))):
        try:
            out = decode(payload, meta)
        except RemoteProtocolError:
            continue
        assert isinstance(out, torch.Tensor)


def test_k_for() -> None:
    assert k_for(0.1, 100) == 10
    assert k_for(0.1, 101) == 11
    assert k_for(0.001, 10) == 1
    assert k_for(1.0, 7) == 7
    assert k_for(0.5, 0) == 0
    assert math.ceil(0.3 * 10) == k_for(0.3, 10)


def test_bitmap_message_survives_the_wire() -> None:
    from fusionp2p.wire.tensor import decode_tensor, encode_tensor

    x = _rand(11, (64, 129))
    payload, meta = TopKCodec(ratio=0.3, approx=True, sample_size=256).encode(x)
    assert meta["fmt"] == "bitmap"
    received = []
    for t in payload:
        header, data = encode_tensor(t)
        received.append(decode_tensor(unpackb(packb(header)), bytes(data)))
    assert torch.equal(decode(tuple(received), unpackb(packb(meta))), decode(payload, meta))
