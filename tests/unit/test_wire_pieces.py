"""The weight manifest (wire/pieces.py, issue 37): pieces round-trip, every bound and mismatch is a
RemoteProtocolError before any piece is fetched, and the three ways of STYLE.md 4 (golden bytes are
in test_wire_golden.py; any input decodes or raises RemoteProtocolError in test_fuzz_decoders.py)."""

from __future__ import annotations

import contextlib
import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.errors import ConfigError, IntegrityError, RemoteProtocolError
from fusionp2p.graph import OpDAG
from fusionp2p.wire.msg import packb, unpackb
from fusionp2p.wire.pieces import (
    MAX_MANIFEST_BYTES,
    MAX_PIECE_BYTES,
    TensorPieces,
    WeightManifest,
    check_against,
    join_pieces,
    make_manifest,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(40, 30, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "idx": torch.arange(5), "flag": torch.tensor([True, False]), "none": torch.empty(0, 3)}


def _declared(ts: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {k: (v.dtype, tuple(v.shape)) for k, v in ts.items()}


@pytest.mark.parametrize("piece", [1024, 1500, 4096, 1 << 20])
def test_tensors_round_trip_through_their_pieces(piece: int) -> None:
    ts = _tensors()
    man, blobs = make_manifest(ts, piece)
    back = WeightManifest.decode(man.encode(), expected_hash=man.content_hash)
    assert back == man
    check_against(back, _declared(ts))
    for entry in back.tensors:
        sizes = back.piece_sizes(entry)
        assert sum(sizes) == entry.nbytes and all(0 < n <= piece for n in sizes)
        assert [len(blobs[h]) for h in entry.pieces] == sizes
        assert all(hashlib.sha256(blobs[h]).hexdigest() == h for h in entry.pieces)
        got = join_pieces(back, entry, [blobs[h] for h in entry.pieces])
        assert got.dtype == ts[entry.name].dtype and torch.equal(got, ts[entry.name])
    assert man.total_bytes == sum(v.numel() * v.element_size() for v in ts.values())


def test_pieces_of_names_only_the_tensors_asked_for() -> None:
    man, _ = make_manifest(_tensors(), 1024)
    w = man.by_name()["w"]
    assert list(man.pieces_of(["w"])) == list(zip(w.pieces, man.piece_sizes(w), strict=True))
    assert len(w.pieces) == 5   # 4800 bytes in pieces of 1024


def test_a_piece_of_the_wrong_size_or_count_is_refused() -> None:
    ts = _tensors()
    man, blobs = make_manifest(ts, 1024)
    w = man.by_name()["w"]
    pieces = [bytes(blobs[h]) for h in w.pieces]
    with pytest.raises(RemoteProtocolError, match="piece 4 has"):
        join_pieces(man, w, [*pieces[:-1], pieces[-1] + b"x"])
    with pytest.raises(RemoteProtocolError, match="pieces, expected"):
        join_pieces(man, w, pieces[:-1])


def test_a_manifest_that_does_not_match_the_model_is_refused() -> None:
    ts = _tensors()
    man, _ = make_manifest(ts, 1024)
    with pytest.raises(RemoteProtocolError, match="missing"):
        check_against(man, {**_declared(ts), "extra": (torch.float32, (1,))})
    with pytest.raises(RemoteProtocolError, match="extra"):
        check_against(man, {k: v for k, v in _declared(ts).items() if k != "w"})
    with pytest.raises(RemoteProtocolError, match="declares"):
        check_against(man, {**_declared(ts), "w": (torch.float32, (30, 40))})
    with pytest.raises(RemoteProtocolError, match="declares"):
        check_against(man, {**_declared(ts), "w": (torch.float16, (40, 30))})


def _raw(man: WeightManifest) -> dict:  # type: ignore[type-arg]
    return unpackb(man.encode(), max_size=MAX_MANIFEST_BYTES)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda m: m.update(v=2), "version"),
    (lambda m: m.update(piece=512), "piece size"),
    (lambda m: m.update(piece=MAX_PIECE_BYTES + 1), "piece size"),
    (lambda m: m["tensors"][0][3].pop(), "lists 4 pieces"),
    (lambda m: m["tensors"][0][3].append("e" * 64), "lists 6 pieces"),
    (lambda m: m["tensors"][0].__setitem__(3, ["E" * 64] * 5), "malformed piece hash"),
    (lambda m: m["tensors"][0].__setitem__(1, "c64"), "dtype"),
    (lambda m: m["tensors"].append(list(m["tensors"][0])), "duplicate"),
    (lambda m: m["tensors"][0].__setitem__(2, [-1]), "outside"),
    (lambda m: m["tensors"][0].__setitem__(2, [2**39, 2**39]), "too large"),
    (lambda m: m["tensors"].__setitem__(0, ["w", "f32"]), "bad tensor entry"),
])
def test_a_malformed_manifest_is_refused(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    raw = _raw(make_manifest(_tensors(), 1024)[0])
    mutate(raw)
    with pytest.raises(RemoteProtocolError, match=match):
        WeightManifest.decode(packb(raw))


def test_bounds_and_integrity() -> None:
    man, _ = make_manifest(_tensors(), 1024)
    data = man.encode()
    with pytest.raises(IntegrityError):
        WeightManifest.decode(data, expected_hash="0" * 64)
    with pytest.raises(RemoteProtocolError, match="exceeds the limit"):
        WeightManifest.decode(b"\x00" * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(RemoteProtocolError):
        WeightManifest.decode(data + b"\x00")               # trailing bytes
    with pytest.raises(RemoteProtocolError):
        WeightManifest.decode(data[:-1])                    # truncated
    raw = _raw(man)
    with pytest.raises(RemoteProtocolError, match="canonically"):
        WeightManifest.decode(packb({"extra": 1, **raw}))
    with pytest.raises(ConfigError):
        make_manifest(_tensors(), MAX_PIECE_BYTES + 1)
    with pytest.raises(ConfigError):
        WeightManifest(piece_bytes=10, tensors=(TensorPieces(name="x", dtype="f32", shape=(1,), pieces=("a" * 64,)),))


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=400))
def test_any_bytes_decode_or_raise_remote_protocol_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        WeightManifest.decode(data)


def test_every_prefix_of_a_manifest_is_refused_and_the_whole_decodes() -> None:
    data = make_manifest(_tensors(), 1024)[0].encode()
    for i in range(len(data)):
        with pytest.raises(RemoteProtocolError):
            WeightManifest.decode(data[:i])
    WeightManifest.decode(data)


def _mlp_dag() -> OpDAG:
    from fusionp2p.graph import trace
    from fusionp2p.models import MLP, MLPConfig

    torch.manual_seed(0)
    return trace(MLP(MLPConfig(in_features=4, hidden=(3,), out_features=2)), (torch.randn(2, 4),))


def test_a_dag_without_weights_decodes_to_declarations_only() -> None:
    from fusionp2p.wire.dag import decode_dag, encode_dag

    dag = _mlp_dag()
    blob = encode_dag(dag, weights=False)
    assert len(blob) < len(encode_dag(dag))
    back = decode_dag(blob)
    assert set(back.tensors) == set(dag.tensors)
    for name, t in back.tensors.items():
        assert t.device.type == "meta" and t.shape == dag.tensors[name].shape and t.dtype == dag.tensors[name].dtype
    assert [n.name for n in back.nodes] == [n.name for n in dag.nodes]


@pytest.mark.parametrize(("change", "match"), [
    ({"weights": 0}, "must be a boolean"),
    ({"weights": False, "tensors": [["layers.0.weight", 48]]}, "lists tensors"),
])
def test_a_malformed_weightless_header_is_refused(change: dict, match: str) -> None:  # type: ignore[type-arg]
    import struct

    from fusionp2p.wire.dag import decode_dag, encode_dag

    blob = encode_dag(_mlp_dag(), weights=False)
    magic, version, kind, hlen = struct.unpack_from(">4sBBI", blob, 0)
    head = unpackb(blob[10:10 + hlen], max_size=1 << 22)
    head.update(change)
    h = packb(head)
    with pytest.raises(RemoteProtocolError, match=match):
        decode_dag(struct.pack(">4sBBI", magic, version, kind, len(h)) + h)
