"""Serialization of OpDAGs and stage programs: round trips, and every bad input -> RemoteProtocolError."""

from __future__ import annotations

import contextlib
import dataclasses
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.graph import OpDAG, Ref, StageExecutor, TensorMeta, partition, single_stage, trace
from fusionp2p.models import GPT2, MLP, GPT2Config, MLPConfig
from fusionp2p.wire import packb, unpackb
from fusionp2p.wire.dag import MAGIC, decode_dag, decode_stage, encode_dag, encode_stage

torch.set_num_threads(1)
_HEAD = struct.Struct(">4sBBI")


@pytest.fixture(scope="module")
def small() -> OpDAG:
    torch.manual_seed(0)
    return trace(MLP(MLPConfig(in_features=4, hidden=(3,), out_features=2)), (torch.randn(2, 4),))


@pytest.fixture(scope="module")
def gpt() -> OpDAG:
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (1, 8))
    return trace(GPT2(GPT2Config.tiny(vocab_size=64, n_layer=2, n_embd=16)), (idx, idx.clone()))


def split(blob: bytes) -> tuple[int, dict, bytes]:  # type: ignore[type-arg]
    _, _, kind, hlen = _HEAD.unpack_from(blob)
    return kind, unpackb(blob[_HEAD.size:_HEAD.size + hlen], max_size=1 << 30), blob[_HEAD.size + hlen:]


def join(kind: int, head: dict, payload: bytes) -> bytes:  # type: ignore[type-arg]
    h = packb(head)
    return _HEAD.pack(MAGIC, 1, kind, len(h)) + h + payload


def test_round_trip_dag_and_execution(gpt: OpDAG) -> None:
    back = decode_dag(encode_dag(gpt))
    assert back.nodes == gpt.nodes
    assert back.inputs == gpt.inputs
    assert back.outputs == gpt.outputs
    assert back.loss == gpt.loss
    assert back.module_names == gpt.module_names
    assert back.batch_size == gpt.batch_size
    for k, t in gpt.tensors.items():
        assert torch.equal(back.tensors[k], t)
    idx = torch.randint(0, 64, (1, 8))
    a, b = StageExecutor(single_stage(gpt)), StageExecutor(single_stage(back))
    inputs = dict(zip(gpt.data_inputs, (idx, idx)))
    assert gpt.loss is not None
    assert torch.equal(a.forward(0, inputs)[gpt.loss], b.forward(0, inputs)[gpt.loss])


def test_round_trip_stage_programs(gpt: OpDAG) -> None:
    for p in partition(gpt, [0, 0, 1, 1, 1]):
        q = decode_stage(encode_stage(p))
        assert (q.stage, q.num_stages, q.recv, q.send, q.nodes, q.loss) == (
            p.stage, p.num_stages, p.recv, p.send, p.nodes, p.loss)


def test_golden_header(small: OpDAG) -> None:
    blob = encode_dag(small)
    assert blob[:6] == b"FPDG\x01\x01"
    kind, head, payload = split(blob)
    assert kind == 1
    assert [n["op"] for n in head["nodes"]] == ["aten.linear.default", "aten.gelu.default", "aten.linear.default"]
    assert head["nodes"][0]["a"] == [{"r": "x_BF"}, {"r": "layers.0.weight"}, {"r": "layers.0.bias"}]
    assert len(payload) == 4 * (4 * 3 + 3 + 3 * 2 + 2)


def _mutated(dag: OpDAG, **changes: object) -> OpDAG:
    return dataclasses.replace(dag, **changes)  # type: ignore[arg-type]


def test_unknown_operator_rejected(small: OpDAG) -> None:
    kind, head, payload = split(encode_dag(small))
    head["nodes"][1]["op"] = "aten._fused_evil.default"
    with pytest.raises(RemoteProtocolError, match="not whitelisted"):
        decode_dag(join(kind, head, payload))
    head["nodes"][1]["op"] = "builtins.exec"
    with pytest.raises(RemoteProtocolError, match="not whitelisted"):
        decode_dag(join(kind, head, payload))


def test_wrong_shape_rejected(small: OpDAG) -> None:
    kind, head, payload = split(encode_dag(small))
    head["nodes"][0]["o"] = [["f32", [2, 5]]]      # a linear declared with the wrong output shape
    with pytest.raises(RemoteProtocolError, match="declares"):
        decode_dag(join(kind, head, payload))
    kind, head, payload = split(encode_dag(small))
    assert head["inputs"][0][:2] == ["layers.0.weight", "param"]
    head["inputs"][0][3] = [4, 3]                   # weight declared transposed: bytes fit, ops do not
    with pytest.raises(RemoteProtocolError):
        decode_dag(join(kind, head, payload))


def test_truncated_buffer_rejected(small: OpDAG) -> None:
    blob = encode_dag(small)
    for cut in (3, _HEAD.size + 5, len(blob) - 1):
        with pytest.raises(RemoteProtocolError):
            decode_dag(blob[:cut])
    with pytest.raises(RemoteProtocolError, match="trailing"):
        decode_dag(blob + b"\x00")


def test_missing_node_and_cycle_rejected(small: OpDAG) -> None:
    kind, head, payload = split(encode_dag(small))
    head["nodes"][1]["a"][0] = {"r": "no_such_node"}
    with pytest.raises(RemoteProtocolError, match="no_such_node"):
        decode_dag(join(kind, head, payload))
    kind, head, payload = split(encode_dag(small))
    first, last = head["nodes"][0]["n"], head["nodes"][-1]["n"]
    head["nodes"][0]["a"][0] = {"r": last}          # a back edge: node 0 reads the last node
    with pytest.raises(RemoteProtocolError, match="earlier node"):
        decode_dag(join(kind, head, payload))
    assert first != last


def test_bad_header_fields_rejected(small: OpDAG) -> None:
    blob = encode_dag(small)
    with pytest.raises(RemoteProtocolError, match="magic"):
        decode_dag(b"XXXX" + blob[4:])
    with pytest.raises(RemoteProtocolError, match="version"):
        decode_dag(blob[:4] + b"\x09" + blob[5:])
    with pytest.raises(RemoteProtocolError, match="kind"):
        decode_stage(blob)
    kind, head, payload = split(blob)
    head["nodes"][1]["a"] = [{"x": "pickle"}]
    with pytest.raises(RemoteProtocolError, match="unsupported argument"):
        decode_dag(join(kind, head, payload))
    with pytest.raises(RemoteProtocolError):
        decode_dag(blob, max_bytes=10)


def test_stage_program_bad_boundary_rejected(gpt: OpDAG) -> None:
    p = partition(gpt, [0, 0, 1, 1, 1])[1]
    kind, head, payload = split(encode_stage(p))
    head["recv"][0][1] = 1                             # claims to receive from itself
    with pytest.raises(RemoteProtocolError, match="earlier stage"):
        decode_stage(join(kind, head, payload))


def test_inmemory_objects_validate(small: OpDAG) -> None:
    assert isinstance(small.nodes[0].args[0], Ref)
    assert small.data_inputs == ("x_BF",)
    assert small.meta_of("x_BF") == TensorMeta(shape=(2, 4), dtype=torch.float32)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_decode_or_raise(data: bytes) -> None:
    for fn in (decode_dag, decode_stage):
        with contextlib.suppress(RemoteProtocolError):
            fn(data)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mutated_blob_decodes_or_raises(small: OpDAG, data: st.DataObject) -> None:
    blob = bytearray(encode_dag(small))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    with contextlib.suppress(RemoteProtocolError):
        decode_dag(bytes(blob))


def test_huge_declared_output_rejected_before_running(small: OpDAG) -> None:
    kind, head, payload = split(encode_dag(small))
    head["nodes"][0]["o"] = [["f32", [1 << 20, 1 << 20]]]   # 4 TiB: never allocated, rejected on sight
    with pytest.raises(RemoteProtocolError, match="over"):
        decode_dag(join(kind, head, payload))
    kind, head, payload = split(encode_dag(small))
    head["nodes"][0]["f"] = -1.0
    with pytest.raises(RemoteProtocolError, match="flops"):
        decode_dag(join(kind, head, payload))
