"""Byte layout of OP-DAGs and stage programs: msgpack header + raw tensor bytes. No pickle.

Layout (version 1)::

    b"FPDG" | u8 version | u8 kind (1 = OpDAG, 2 = StageProgram) | u32 BE header length
    | msgpack header | tensor bytes, concatenated in header["tensors"] order

A job's DAG is encoded without its tensors (header ``"weights": false``, no tensor bytes): it decodes
with every parameter, buffer and constant as a ``meta`` tensor of its declared shape, and a node
fills in only its own stage's from the job's weight pieces (``wire/pieces.py``, issue 37).

The header names operators as strings; arguments are msgpack scalars, lists, or one-key maps for
non-scalar constants: ``{"r": name}`` a reference, ``{"t": "f32"}`` a dtype, ``{"d": "cpu"}`` a device,
``{"l": "strided"}`` a layout, ``{"mf": "contiguous_format"}`` a memory format. Tensor dtypes/shapes come
from the input specs, so a tensor's byte count is fixed by the header and checked exactly.

Decoding is bounded (``Limits``) and validates everything before anything is built to run: every
operator whitelisted, every reference to an input or an earlier node (so no cycle), declared shapes
re-derived by shape inference on the ``meta`` device (``graph.dag.check_shapes``: no allocation, no
compute), exact tensor byte counts. Before any of that, the declared tensors of the whole graph are
checked against a budget (``graph.dag.check_budget``: every tensor, the count of values, and the total
against the node's memory). Any violation raises
:class:`~fusionp2p.errors.RemoteProtocolError` naming it.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from typing import Any

import torch

from fusionp2p.errors import LocalProtocolError, RemoteProtocolError
from fusionp2p.graph.dag import (
    Arg,
    DagBudget,
    InputSpec,
    OpDAG,
    OpNode,
    Ref,
    TensorMeta,
    check_budget,
    check_shapes,
    validate,
)
from fusionp2p.graph.program import BoundaryIn, BoundaryOut, StageProgram
from fusionp2p.wire.check import as_shape
from fusionp2p.wire.limits import DEFAULT_LIMITS, Limits
from fusionp2p.wire.msg import expect_map, packb, typed_field, unpackb
from fusionp2p.wire.tensor import DTYPES, decode_tensor, dtype_name

MAGIC = b"FPDG"
VERSION = 1
KIND_DAG = 1
KIND_STAGE = 2
_HEAD = struct.Struct(">4sBBI")
_MAX_DEPTH = 6
_DEVICE_RE = re.compile(r"^(cpu|cuda|meta|mps)(:\d{1,3})?$")
_LAYOUTS = {"strided": torch.strided}
_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
            "preserve_format": torch.preserve_format}
_FORMAT_NAMES = {v: k for k, v in _FORMATS.items()}


# ------------------------------------------------------------------------------------------ encode
def _enc_arg(a: Arg) -> Any:
    if isinstance(a, Ref):
        return {"r": a.name}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, torch.dtype):
        return {"t": dtype_name(a)}
    if isinstance(a, torch.device):
        return {"d": str(a)}
    if isinstance(a, torch.layout):
        if a != torch.strided:
            raise LocalProtocolError(f"layout {a} cannot be encoded")
        return {"l": "strided"}
    if isinstance(a, torch.memory_format):
        return {"mf": _FORMAT_NAMES[a]}
    if isinstance(a, (list, tuple)):
        return [_enc_arg(x) for x in a]
    raise LocalProtocolError(f"argument {a!r} cannot be encoded")


def _enc_meta(m: TensorMeta | None) -> Any:
    return None if m is None else [dtype_name(m.dtype), list(m.shape)]


def _enc_node(n: OpNode) -> dict[str, Any]:
    return {"n": n.name, "op": n.op, "a": [_enc_arg(a) for a in n.args], "k": {k: _enc_arg(v) for k, v in n.kwargs},
            "o": [_enc_meta(m) for m in n.out], "m": n.multi, "s": n.scope, "f": float(n.flops)}


def _enc_common(inputs: tuple[InputSpec, ...], nodes: tuple[OpNode, ...], outputs: tuple[str, ...],
                loss: str | None, tensors: Mapping[str, torch.Tensor], weights: bool = True
                ) -> tuple[dict[str, Any], list[bytes]]:
    order = [s.name for s in inputs if s.kind != "input"] if weights else []
    blobs = [_tensor_bytes(tensors[name]) for name in order]
    head: dict[str, Any] = {"inputs": [[s.name, s.kind, *_enc_meta(s.meta)] for s in inputs],
                            "nodes": [_enc_node(n) for n in nodes], "outputs": list(outputs), "loss": loss,
                            "tensors": [[name, len(b)] for name, b in zip(order, blobs)]}
    if not weights:
        head["weights"] = False   # the tensors travel as pieces (wire/pieces.py); decoded as meta tensors
    return head, blobs


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    flat = t.reshape(-1)  # 1-D first: a 0-dim tensor cannot be viewed as bytes
    raw = flat.view(torch.uint8) if t.dtype != torch.bool else flat.to(torch.uint8)
    return raw.numpy().tobytes()


def _pack(kind: int, head: dict[str, Any], blobs: list[bytes]) -> bytes:
    h = packb(head)
    return b"".join([_HEAD.pack(MAGIC, VERSION, kind, len(h)), h, *blobs])


def encode_dag(dag: OpDAG, *, weights: bool = True) -> bytes:
    """Serialize an OpDAG with its parameters, buffers and constants; with ``weights=False`` without
    them (a job's DAG: its tensors travel as pieces named in a ``wire.pieces.WeightManifest``)."""
    head, blobs = _enc_common(dag.inputs, dag.nodes, dag.outputs, dag.loss, dag.tensors, weights)
    head |= {"module_names": {k: list(v) for k, v in dag.module_names.items()},
             "scope_types": dict(dag.scope_types), "batch_size": dag.batch_size}
    return _pack(KIND_DAG, head, blobs)


def encode_stage(p: StageProgram) -> bytes:
    """Serialize a StageProgram with its own parameters, buffers and constants."""
    head, blobs = _enc_common(p.inputs, p.nodes, p.outputs, p.loss, p.tensors)
    head |= {"stage": p.stage, "num_stages": p.num_stages, "recv": [[r.name, r.src] for r in p.recv],
             "send": [[o.name, list(o.dsts)] for o in p.send]}
    return _pack(KIND_STAGE, head, blobs)


# ------------------------------------------------------------------------------------------ decode
def _dec_arg(a: Any, depth: int = 0) -> Arg:
    if depth > _MAX_DEPTH:
        raise RemoteProtocolError("argument nested too deeply")
    if a is None or isinstance(a, (bool, int, float, str)):
        return a  # type: ignore[no-any-return]
    if isinstance(a, list):
        return [_dec_arg(x, depth + 1) for x in a]
    if isinstance(a, dict) and len(a) == 1:
        ((k, v),) = a.items()
        if isinstance(v, str):
            if k == "r":
                return Ref(v)
            if k == "t" and v in DTYPES:
                return DTYPES[v]
            if k == "d" and _DEVICE_RE.match(v):
                return torch.device(v)
            if k == "l" and v in _LAYOUTS:
                return _LAYOUTS[v]
            if k == "mf" and v in _FORMATS:
                return _FORMATS[v]
    raise RemoteProtocolError(f"unsupported argument {str(a)[:80]}")


def _dec_meta(m: Any, what: str) -> TensorMeta:
    if not isinstance(m, list) or len(m) != 2 or not isinstance(m[0], str) or m[0] not in DTYPES:
        raise RemoteProtocolError(f"{what}: bad tensor meta {str(m)[:80]}")
    return TensorMeta(shape=as_shape(m[1], f"{what}: tensor shape"), dtype=DTYPES[m[0]])


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise RemoteProtocolError(f"{what}: expected a string")
    return v


def _dec_node(raw: Any) -> OpNode:
    m = expect_map(raw, "node")
    name = typed_field(m, "n", str, "node")
    what = f"node {name!r}"
    kw = expect_map(typed_field(m, "k", dict, what), what)
    outs = typed_field(m, "o", list, what)
    return OpNode(name=name, op=typed_field(m, "op", str, what), args=tuple(_dec_arg(a) for a in typed_field(m, "a", list, what)),
                  kwargs=tuple((k, _dec_arg(v)) for k, v in kw.items()),
                  out=tuple(None if o is None else _dec_meta(o, what) for o in outs),
                  multi=typed_field(m, "m", bool, what), scope=typed_field(m, "s", str, what), flops=typed_field(m, "f", float, what))


def _unpack(data: bytes | bytearray | memoryview, kind: int, limits: Limits, max_bytes: int | None
            ) -> tuple[dict[str, Any], memoryview]:
    bound = limits.max_tensor_bytes if max_bytes is None else max_bytes
    if len(data) > bound:
        raise RemoteProtocolError(f"serialized graph of {len(data)} bytes exceeds the limit of {bound}")
    if len(data) < _HEAD.size:
        raise RemoteProtocolError("serialized graph truncated before its header")
    magic, version, got_kind, hlen = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise RemoteProtocolError("not a serialized graph (bad magic)")
    if version != VERSION:
        raise RemoteProtocolError(f"serialized graph version {version} is not supported (want {VERSION})")
    if got_kind != kind:
        raise RemoteProtocolError(f"serialized graph kind {got_kind}, expected {kind}")
    view = memoryview(data)
    if _HEAD.size + hlen > len(data):
        raise RemoteProtocolError("serialized graph truncated inside its header")
    if hlen > limits.max_dag_header:
        raise RemoteProtocolError(f"graph header of {hlen} bytes exceeds the limit of {limits.max_dag_header}")
    head = expect_map(unpackb(view[_HEAD.size:_HEAD.size + hlen], limits=limits, max_size=limits.max_dag_header), "graph")
    return head, view[_HEAD.size + hlen:]


def _dec_common(head: dict[str, Any], payload: memoryview, limits: Limits, budget: DagBudget
                ) -> tuple[tuple[InputSpec, ...], tuple[OpNode, ...], tuple[str, ...], str | None, dict[str, torch.Tensor]]:
    raw_inputs = typed_field(head, "inputs", list, "graph")
    inputs: list[InputSpec] = []
    for r in raw_inputs:
        if not isinstance(r, list) or len(r) != 4:
            raise RemoteProtocolError("graph: bad input spec")
        name, kind = _str(r[0], "input"), _str(r[1], "input")
        try:
            inputs.append(InputSpec(name=name, kind=kind, meta=_dec_meta([r[2], r[3]], f"input {name!r}")))
        except ValueError as exc:
            raise RemoteProtocolError(f"graph: {exc}") from exc
    raw_nodes = typed_field(head, "nodes", list, "graph")
    if len(raw_nodes) > limits.max_dag_nodes:
        raise RemoteProtocolError(f"graph has {len(raw_nodes)} nodes; limit is {limits.max_dag_nodes}")
    nodes = tuple(_dec_node(n) for n in raw_nodes)
    for n in nodes:
        if not 0.0 <= n.flops < float("inf"):
            raise RemoteProtocolError(f"graph: node {n.name!r} has flops {n.flops}")
    # the whole DAG's declared memory against the budget, before any tensor is built or any node runs
    check_budget(tuple(inputs), nodes, budget, RemoteProtocolError, what="graph")
    outputs = tuple(_str(o, "output") for o in typed_field(head, "outputs", list, "graph"))
    loss = head.get("loss")
    if loss is not None and not isinstance(loss, str):
        raise RemoteProtocolError("graph: loss must be a string or nil")
    specs = {s.name: s for s in inputs}
    tensors: dict[str, torch.Tensor] = {}
    weights = head.get("weights", True)
    if weights is not True and weights is not False:
        raise RemoteProtocolError("graph: 'weights' must be a boolean")
    raw_tensors = typed_field(head, "tensors", list, "graph")
    if not weights:
        if raw_tensors:
            raise RemoteProtocolError("graph: a graph without weights lists tensors")
        # declarations only, on the meta device: no memory; the node fills in its stage's from pieces
        try:
            tensors = {s.name: torch.empty(s.meta.shape, dtype=s.meta.dtype, device="meta")
                       for s in inputs if s.kind != "input"}
        except RuntimeError as exc:
            raise RemoteProtocolError(f"graph: a declared tensor cannot be built: {str(exc)[:120]}") from exc
    off = 0
    for t in raw_tensors:
        if not isinstance(t, list) or len(t) != 2 or not isinstance(t[0], str) or type(t[1]) is not int:
            raise RemoteProtocolError("graph: bad tensor entry")
        name, n = t
        spec = specs.get(name)
        if spec is None or spec.kind == "input" or name in tensors:
            raise RemoteProtocolError(f"graph: tensor {name!r} is not a declared param/buffer/constant")
        if n < 0 or off + n > len(payload):
            raise RemoteProtocolError(f"graph: tensor {name!r} runs past the end of the buffer (truncated?)")
        tensors[name] = decode_tensor({"dtype": dtype_name(spec.meta.dtype), "shape": list(spec.meta.shape)},
                                      payload[off:off + n], limits=limits)
        off += n
    if off != len(payload):
        raise RemoteProtocolError(f"graph: {len(payload) - off} trailing bytes after the tensors")
    tin = tuple(inputs)
    validate(tin, nodes, outputs, tensors, RemoteProtocolError, what="graph")
    if loss is not None and loss not in outputs:
        raise RemoteProtocolError(f"graph: loss {loss!r} is not an output")
    check_shapes(tin, nodes, RemoteProtocolError, what="graph")
    return tin, nodes, outputs, loss, tensors


def dag_budget(limits: Limits, memory_bytes: int | None = None) -> DagBudget:
    """The budget of a DAG from a peer: *limits*, and the whole DAG within *memory_bytes* (the node's
    memory) when given."""
    total = limits.max_dag_bytes if memory_bytes is None else min(limits.max_dag_bytes, max(memory_bytes, 1))
    return DagBudget(max_bytes=total, max_tensor_bytes=limits.max_tensor_bytes, max_values=limits.max_dag_values)


def decode_dag(data: bytes | bytearray | memoryview, *, limits: Limits = DEFAULT_LIMITS,
               max_bytes: int | None = None, memory_bytes: int | None = None) -> OpDAG:
    """Decode and fully validate an OpDAG; RemoteProtocolError on anything wrong.

    Validation is bounded and allocates no tensor memory beyond the blob's own parameters: the
    declared tensors of the whole DAG are checked against :func:`dag_budget` (the node's
    *memory_bytes*) first, then the shapes are proven by inference on the meta device."""
    head, payload = _unpack(data, KIND_DAG, limits, max_bytes)
    inputs, nodes, outputs, loss, tensors = _dec_common(head, payload, limits, dag_budget(limits, memory_bytes))
    mn = expect_map(head.get("module_names", {}), "module_names")
    st = expect_map(head.get("scope_types", {}), "scope_types")
    if not all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in mn.values()):
        raise RemoteProtocolError("graph: module_names must map names to lists of strings")
    if not all(isinstance(v, str) for v in st.values()):
        raise RemoteProtocolError("graph: scope_types must map to strings")
    batch = typed_field(head, "batch_size", int, "graph")
    if batch <= 0:
        raise RemoteProtocolError("graph: batch_size must be positive")
    return OpDAG(inputs=inputs, nodes=nodes, outputs=outputs, loss=loss, tensors=tensors,
                 module_names={k: tuple(v) for k, v in mn.items()}, scope_types=dict(st), batch_size=batch)


def decode_stage(data: bytes | bytearray | memoryview, *, limits: Limits = DEFAULT_LIMITS,
                 max_bytes: int | None = None, memory_bytes: int | None = None) -> StageProgram:
    """Decode and fully validate a StageProgram; RemoteProtocolError on anything wrong (bounded as
    :func:`decode_dag`)."""
    head, payload = _unpack(data, KIND_STAGE, limits, max_bytes)
    inputs, nodes, outputs, loss, tensors = _dec_common(head, payload, limits, dag_budget(limits, memory_bytes))
    stage = typed_field(head, "stage", int, "stage program")
    num = typed_field(head, "num_stages", int, "stage program")
    metas = {s.name: s.meta for s in inputs}
    metas |= {n.name: n.out[0] for n in nodes if not n.multi and n.out and n.out[0] is not None}
    recv, send = [], []
    for r in typed_field(head, "recv", list, "stage program"):
        if not (isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and type(r[1]) is int) or r[0] not in metas:
            raise RemoteProtocolError("stage program: bad recv entry")
        recv.append(BoundaryIn(name=r[0], meta=metas[r[0]], src=r[1]))
    for o in typed_field(head, "send", list, "stage program"):
        if not (isinstance(o, list) and len(o) == 2 and isinstance(o[0], str) and isinstance(o[1], list)
                and all(type(d) is int for d in o[1])) or o[0] not in metas:
            raise RemoteProtocolError("stage program: bad send entry")
        send.append(BoundaryOut(name=o[0], meta=metas[o[0]], dsts=tuple(o[1])))
    prog = StageProgram(stage=stage, num_stages=num, inputs=inputs, recv=tuple(recv), nodes=nodes, send=tuple(send),
                        loss=loss, tensors=tensors)
    if prog.outputs != outputs:
        raise RemoteProtocolError("stage program: outputs do not match send list and loss")
    prog.check(RemoteProtocolError)
    return prog
