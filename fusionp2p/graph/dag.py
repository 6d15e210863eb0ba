"""The OP-DAG data model: operator nodes in topological order, named inputs, lifted tensors.

Theory of operation. ``torch.export`` gives an ATen graph in which parameters, buffers and constants
are graph inputs ("lifted"). We keep that shape: an :class:`OpDAG` has

* ``inputs``: every graph input, each an :class:`InputSpec` of kind ``input`` (data fed per
  micro-batch: token ids, images, targets), ``param`` (trainable), ``buffer`` (state such as batch-norm
  running statistics) or ``constant``; the values of the last three are in ``tensors``;
* ``nodes``: :class:`OpNode` s in topological order, each naming a whitelisted operator, with
  arguments that are :class:`Ref` s to earlier nodes/inputs or constants;
* ``outputs``: the node names returned, and ``loss``, the one that training differentiates.

Because a reference may only name an input or an *earlier* node, a DAG in this form cannot contain a
cycle or a dangling reference; :func:`validate` checks exactly that (plus the whitelist) and raises
the error type its caller chooses (``RemoteProtocolError`` for a peer's bytes).

Arguments (``Arg``) are: ``Ref``, ``None``, ``bool``, ``int``, ``float``, ``str``, ``torch.dtype``,
``torch.device``, ``torch.layout``, ``torch.memory_format``, and lists/tuples of these.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch

from fusionp2p.graph.ops import GETITEM, WHITELIST

INPUT_KINDS = ("input", "param", "buffer", "constant")


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to the value of a node or graph input, by name."""

    name: str


Arg: TypeAlias = (Ref | bool | int | float | str | torch.dtype | torch.device | torch.layout
                  | torch.memory_format | list["Arg"] | tuple["Arg", ...] | None)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMeta:
    """Shape and dtype of one tensor (fixed at trace time: the DAG is traced for one micro-batch shape)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        return cls(shape=tuple(int(d) for d in t.shape), dtype=t.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True, kw_only=True)
class InputSpec:
    name: str
    kind: str            # one of INPUT_KINDS
    meta: TensorMeta

    def __post_init__(self) -> None:
        if self.kind not in INPUT_KINDS:
            raise ValueError(f"input {self.name}: unknown kind {self.kind!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class OpNode:
    """One ATen operator application.

    ``out`` describes the result: one entry for a single tensor, one per element when ``multi`` (the
    operator returns a sequence, read through ``getitem`` nodes); ``None`` for a non-tensor element.
    ``scope`` is the module path that issued the op (``"blocks.3.attn"``; ``""`` at top level), used by
    coarsening. ``flops`` are forward FLOPs per traced micro-batch (``torch.utils.flop_counter``).
    """

    name: str
    op: str
    args: tuple[Arg, ...] = ()
    kwargs: tuple[tuple[str, Arg], ...] = ()
    out: tuple[TensorMeta | None, ...] = ()
    multi: bool = False
    scope: str = ""
    flops: float = 0.0

    @property
    def out_bytes(self) -> int:
        """Bytes of the tensors this node produces (its activation footprint)."""
        if self.op == GETITEM:
            return 0  # a view of its producer's output, already counted there
        return sum(m.nbytes for m in self.out if m is not None)

    def refs(self) -> Iterator[str]:
        """Names this node reads, in argument order (duplicates kept)."""
        yield from iter_refs(self.args)
        yield from iter_refs(tuple(v for _, v in self.kwargs))


def iter_refs(value: Any) -> Iterator[str]:
    if isinstance(value, Ref):
        yield value.name
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_refs(v)


@dataclass(frozen=True, slots=True, kw_only=True)
class OpDAG:
    """A traced model (see the module docstring). ``batch_size`` is dim 0 of the first data input."""

    inputs: tuple[InputSpec, ...]
    nodes: tuple[OpNode, ...]
    outputs: tuple[str, ...]
    loss: str | None = None
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # DAG tensor name -> every state_dict name of the source module holding it (several when tied)
    module_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # module path -> module class name (for unit kinds)
    scope_types: Mapping[str, str] = field(default_factory=dict)
    batch_size: int = 1

    def node(self, name: str) -> OpNode:
        return self._index()[name]

    def _index(self) -> dict[str, OpNode]:
        return {n.name: n for n in self.nodes}

    @property
    def data_inputs(self) -> tuple[str, ...]:
        """Names of the per-micro-batch inputs, in the order ``trace`` received them."""
        return tuple(i.name for i in self.inputs if i.kind == "input")

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs if i.kind == "param")

    def consumers(self) -> dict[str, list[str]]:
        """name -> the nodes reading it (each once, in topological order)."""
        out: dict[str, list[str]] = {i.name: [] for i in self.inputs}
        for n in self.nodes:
            out[n.name] = []
        for n in self.nodes:
            for r in dict.fromkeys(n.refs()):
                out[r].append(n.name)
        return out

    def meta_of(self, name: str) -> TensorMeta | None:
        """The tensor meta of a graph input or single-output node (None for sequences/non-tensors)."""
        for i in self.inputs:
            if i.name == name:
                return i.meta
        n = self.node(name)
        return None if n.multi or not n.out else n.out[0]

    @property
    def total_flops(self) -> float:
        return sum(n.flops for n in self.nodes)


def validate(inputs: tuple[InputSpec, ...], nodes: tuple[OpNode, ...], outputs: tuple[str, ...],
             tensors: Mapping[str, torch.Tensor], err: type[Exception], *, what: str = "DAG") -> None:
    """Check the structural invariants; raise *err* naming the first violation.

    * every operator is whitelisted; names are unique;
    * every reference names a graph input or an earlier node (so: no cycle, nothing dangling);
    * ``getitem`` reads a ``multi`` node with an in-range constant index;
    * every param/buffer/constant has a tensor of exactly the declared shape and dtype, and vice versa;
    * every output names a known value.
    """
    seen: dict[str, OpNode | None] = {}
    for spec in inputs:
        if spec.name in seen:
            raise err(f"{what}: duplicate name {spec.name!r}")
        seen[spec.name] = None
        if spec.kind != "input":
            t = tensors.get(spec.name)
            if t is None:
                raise err(f"{what}: no tensor for {spec.kind} {spec.name!r}")
            if tuple(t.shape) != spec.meta.shape or t.dtype != spec.meta.dtype:
                raise err(f"{what}: tensor {spec.name!r} has shape {tuple(t.shape)} {t.dtype}, "
                          f"declared {spec.meta.shape} {spec.meta.dtype}")
    extra = set(tensors) - {s.name for s in inputs if s.kind != "input"}
    if extra:
        raise err(f"{what}: tensors not declared as inputs: {sorted(extra)[:5]}")
    for n in nodes:
        if n.op not in WHITELIST:
            raise err(f"{what}: node {n.name!r} uses operator {n.op!r}, which is not whitelisted")
        if n.name in seen:
            raise err(f"{what}: duplicate name {n.name!r}")
        for r in n.refs():
            if r not in seen:
                raise err(f"{what}: node {n.name!r} refers to {r!r}, which is not an input or an earlier node")
            src = seen[r]
            if src is not None and src.multi and n.op != GETITEM:
                raise err(f"{what}: node {n.name!r} reads the sequence {r!r} without getitem")
        if n.op == GETITEM:
            _check_getitem(n, seen, err, what)
        if not n.out:
            raise err(f"{what}: node {n.name!r} declares no output")
        seen[n.name] = n
    for o in outputs:
        if o not in seen:
            raise err(f"{what}: output {o!r} is not a known value")


def _check_getitem(n: OpNode, seen: Mapping[str, OpNode | None], err: type[Exception], what: str) -> None:
    if len(n.args) != 2 or not isinstance(n.args[0], Ref) or type(n.args[1]) is not int or n.kwargs:
        raise err(f"{what}: getitem node {n.name!r} must read (ref, int)")
    src = seen[n.args[0].name]
    if src is None or not src.multi:
        raise err(f"{what}: getitem node {n.name!r} reads {n.args[0].name!r}, which is not a sequence")
    if not 0 <= n.args[1] < len(src.out):
        raise err(f"{what}: getitem node {n.name!r} index {n.args[1]} out of range")


def check_shapes(inputs: tuple[InputSpec, ...], nodes: tuple[OpNode, ...], err: type[Exception], *,
                 what: str = "DAG") -> None:
    """Run the nodes on ``meta`` tensors (no data, no memory) and check every declared output meta.

    Call after :func:`validate` (which guarantees whitelisted operators and resolvable references).
    Any failure, including an operator rejecting its arguments, is reported as *err*.
    """
    from fusionp2p.graph.ops import resolve  # local: ops is tiny, but keep the import graph flat

    meta = torch.device("meta")
    env: dict[str, Any] = {s.name: torch.empty(s.meta.shape, dtype=s.meta.dtype, device=meta) for s in inputs}

    def conv(a: Any) -> Any:
        if isinstance(a, Ref):
            return env[a.name]
        if isinstance(a, (list, tuple)):
            return [conv(x) for x in a]
        return meta if isinstance(a, torch.device) else a

    for n in nodes:
        try:
            val = resolve(n.op)(*[conv(a) for a in n.args], **{k: conv(v) for k, v in n.kwargs})
        except Exception as exc:
            raise err(f"{what}: node {n.name!r} ({n.op}) rejects its inputs: {type(exc).__name__}: "
                      f"{str(exc)[:200]}") from exc
        got = tuple(val) if n.multi and isinstance(val, (list, tuple)) else (val,)
        if n.multi != isinstance(val, (list, tuple)) or len(got) != len(n.out):
            raise err(f"{what}: node {n.name!r} declares {len(n.out)} outputs, the operator gives another structure")
        for m, v in zip(n.out, got):
            if m is None:
                continue
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != m.shape or v.dtype != m.dtype:
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise err(f"{what}: node {n.name!r} declares {m.shape} {m.dtype}, computes {shape}")
        env[n.name] = val
