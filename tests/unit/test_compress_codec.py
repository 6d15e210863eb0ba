"""Codec properties: exact top-k, dense fallback, ratio 1.0 identity, idempotence, sizes, peer input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.compress import CastCodec, IdentityCodec, TopKCodec, decode, index_dtype, k_for, sparse_bytes
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
    vals, idx = payload
    assert meta["k"] == k == vals.numel() == idx.numel()
    assert idx.dtype == index_dtype(n)
    kept = x.abs()[idx.long()]
    dropped = torch.ones(n, dtype=torch.bool)
    dropped[idx.long()] = False
    if dropped.any():
        assert kept.min() >= x.abs()[dropped].max()
    assert torch.equal(vals, x[idx.long()])
    # payload size formula k·(b_val + b_idx)
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
    # fp32 values + int16 indices: 6 B per kept entry against 4 B dense, break-even at ρ = 2/3
    assert TopKCodec(ratio=0.6).encode(x)[1]["codec"] == "topk"
    assert TopKCodec(ratio=0.7).encode(x)[1]["codec"] == "id"
    # with fp16 values, 4 B per kept entry: dense from ρ = 1
    assert TopKCodec(ratio=0.9, value_dtype="f16").encode(x)[1]["codec"] == "topk"


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
    for codec in (IdentityCodec(), CastCodec(), TopKCodec(ratio=0.05), TopKCodec(ratio=0.05, per_row=True)):
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


@settings(max_examples=60, deadline=None)
@given(meta=st.dictionaries(st.sampled_from(["codec", "k", "row", "shape", "dtype"]),
                            st.one_of(st.integers(-5, 50), st.booleans(), st.text(max_size=4),
                                      st.lists(st.integers(-2, 12), max_size=3), st.sampled_from(["topk", "id", "cast", "f32"]))),
       n=st.integers(0, 12), idx_dtype=st.sampled_from([torch.uint8, torch.int16, torch.int64, torch.float32]))
def test_decode_never_crashes(meta: dict[str, object], n: int, idx_dtype: torch.dtype) -> None:
    payload = (torch.randn(n), torch.arange(n).to(idx_dtype))
    try:
        out = decode(payload, meta)
    except RemoteProtocolError:
        return
    assert isinstance(out, torch.Tensor)


def test_k_for() -> None:
    assert k_for(0.1, 100) == 10
    assert k_for(0.1, 101) == 11
    assert k_for(0.001, 10) == 1
    assert k_for(1.0, 7) == 7
    assert k_for(0.5, 0) == 0
    assert math.ceil(0.3 * 10) == k_for(0.3, 10)
