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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


@dataclass(frozen=True, slots=True, kw_only=True)
class DagBudget:
    """What a DAG from a peer may cost, checked from its declarations alone (:func:`check_budget`).

    ``max_bytes`` is the whole DAG: every input (data, parameters, buffers, constants) plus every
    value its nodes declare, as if none were ever freed (an upper bound of one micro-batch's forward).
    The job intake sets it to the node's memory; ``max_tensor_bytes`` bounds any one tensor and
    ``max_values`` the number of values all nodes declare together (a ``split`` into a million pieces
    is a million tensor objects even on the meta device).
    """

    max_bytes: int
    max_tensor_bytes: int
    max_values: int

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_tensor_bytes, self.max_values) < 1:
            raise ValueError("DagBudget bounds must be positive")


def check_budget(inputs: tuple[InputSpec, ...], nodes: tuple[OpNode, ...], budget: DagBudget,
                 err: type[Exception], *, what: str = "DAG") -> int:
    """Refuse a DAG whose declared tensors exceed *budget*; return its declared bytes.

    Pure arithmetic on the declared shapes: nothing is allocated and nothing runs, so this is the
    first check a peer's DAG meets. :func:`check_shapes` later proves the declarations true, so a DAG
    that passes both cannot compute anything larger than it declared.
    """
    total = 0
    for spec in inputs:
        nb = spec.meta.nbytes
        if nb > budget.max_tensor_bytes:
            raise err(f"{what}: input {spec.name!r} of {nb} bytes exceeds the {budget.max_tensor_bytes}-byte tensor limit")
        total += nb
    values = 0
    for n in nodes:
        values += len(n.out)
        for m in n.out:
            if m is not None and m.nbytes > budget.max_tensor_bytes:
                raise err(f"{what}: node {n.name!r} declares an output over {budget.max_tensor_bytes} bytes")
        total += n.out_bytes
    if values > budget.max_values:
        raise err(f"{what}: its nodes declare {values} values; the limit is {budget.max_values}")
    if total > budget.max_bytes:
        raise err(f"{what}: its tensors need {total} bytes, more than this node's budget of {budget.max_bytes}")
    return total


_META = torch.device("meta")


class _MetaOnly(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every operator call inside this mode runs on the ``meta`` device: a factory without a device
    argument (``zeros``, ``full``, ``arange``...) gets ``device=meta`` before it runs, and a result on
    any other device is refused. Shape inference then allocates no tensor memory and computes nothing.
    (Composite operators reach this mode again for each operator they decompose into.)"""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if any(a.name == "device" and a.kwarg_only for a in func._schema.arguments):
            kwargs["device"] = _META
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and t.device != _META:
                raise RuntimeError(f"{func} produced a tensor on {t.device} during shape inference")
        return out


def _dim_size(x: Any, dim: Any) -> int | None:
    if not isinstance(x, torch.Tensor) or type(dim) is not int or not -x.dim() <= dim < max(x.dim(), 1):
        return None
    return int(x.shape[dim]) if x.dim() else 1


def _count_bound(op: str, args: list[Any], kwargs: dict[str, Any]) -> int | None:
    """An upper bound of the number of tensors a list-returning operator will produce, computed from
    its arguments before it runs (None: not a list-returning operator with a data-sized count)."""
    def arg(i: int, name: str, default: Any) -> Any:
        return args[i] if len(args) > i else kwargs.get(name, default)

    x = arg(0, "self", None)
    if op == "aten.unbind.int":
        return _dim_size(x, arg(1, "dim", 0))
    if op == "aten.split.Tensor":
        size, n = arg(1, "split_size", None), _dim_size(x, arg(2, "dim", 0))
        if type(size) is not int or size < 1 or n is None:
            return None   # the operator rejects it itself
        return max(1, -(-n // size))
    if op == "aten.chunk.default":
        chunks, n = arg(1, "chunks", None), _dim_size(x, arg(2, "dim", 0))
        return min(chunks, max(n, 1)) if type(chunks) is int and n is not None else None
    if op == "aten.split_with_sizes.default":
        sizes = arg(1, "split_sizes", None)
        return len(sizes) if isinstance(sizes, list) else None
    return None


def check_shapes(inputs: tuple[InputSpec, ...], nodes: tuple[OpNode, ...], err: type[Exception], *,
                 what: str = "DAG") -> None:
    """Infer every node's output on ``meta`` tensors and check it against the node's declared meta.

    Shape inference only: the inputs are meta tensors, every operator runs under :class:`_MetaOnly`
    (no real allocation, no arithmetic, whatever device its arguments name), and a list-returning
    operator whose output count would exceed its declared outputs is refused before it runs. Call
    after :func:`check_budget` and :func:`validate` (which guarantees whitelisted operators and
    resolvable references). Any failure, including an operator rejecting its arguments, is *err*.
    """
    from fusionp2p.graph.ops import resolve  # local: ops is tiny, but keep the import graph flat

    env: dict[str, Any] = {}

    def conv(a: Any) -> Any:
        if isinstance(a, Ref):
            return env[a.name]
        if isinstance(a, (list, tuple)):
            return [conv(x) for x in a]
        return _META if isinstance(a, torch.device) else a

    with _MetaOnly():  # type: ignore[no-untyped-call]
        for s in inputs:
            env[s.name] = torch.empty(s.meta.shape, dtype=s.meta.dtype, device=_META)
        for n in nodes:
            args, kwargs = [conv(a) for a in n.args], {k: conv(v) for k, v in n.kwargs}
            bound = _count_bound(n.op, args, kwargs)
            if bound is not None and bound > len(n.out):
                raise err(f"{what}: node {n.name!r} ({n.op}) would produce {bound} outputs, it declares {len(n.out)}")
            try:
                val = resolve(n.op)(*args, **kwargs)
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


def written_inputs(nodes: Sequence[OpNode], inputs: set[str]) -> set[str]:
    """Of *inputs*, those an operator may write in place: the first argument of an in-place operator
    (``add_``, ``relu_``) and the running statistics of ``batch_norm`` (arguments 3 and 4), each followed
    back through the first arguments of the operators that made it (views, reshapes) to an input.
    Over-approximates; a fresh intermediate written in place (a mask being built) is no input's."""
    first = {n.name: n.args[0] for n in nodes if n.args}
    out: set[str] = set()
    for n in nodes:
        if n.op == "aten.batch_norm.default":
            targets = list(n.args[3:5])
        elif n.op.count(".") == 2 and n.op.split(".")[1].endswith("_") and n.args:
            targets = [n.args[0]]
        else:
            continue
        for a in targets:
            seen = 0
            while isinstance(a, Ref) and a.name not in inputs and a.name in first and seen < len(nodes):
                a, seen = first[a.name], seen + 1
            if isinstance(a, Ref) and a.name in inputs:
                out.add(a.name)
    return out
