"""Tracing: any PyTorch model (+ optional loss function) -> :class:`OpDAG` via ``torch.export``.

``torch.export.export`` (non-strict, training IR) gives an ATen graph in which parameters, buffers and
constants are lifted to graph inputs. We wrap the user's model in a small module whose forward calls
the model, finds or computes the loss (``loss_fn(output, *loss_inputs)``, or the ``loss`` field of a
dict/dataclass output, or the trailing scalar of a tuple such as ``(logits, loss)``) and returns it, so
that the exported graph ends at the loss and the targets are ordinary graph inputs. Every operator is
then checked against the whitelist (a clear ConfigError lists the ones that are not), and one
node-by-node run on the example inputs under ``FlopCounterMode`` fills in forward FLOPs.

The DAG is traced for the shapes of the example inputs: the micro-batch shape is fixed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import operator
import os
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.export.graph_signature import InputKind
from torch.utils.flop_counter import FlopCounterMode

from fusionp2p.errors import ConfigError
from fusionp2p.graph.dag import Arg, InputSpec, OpDAG, OpNode, Ref, TensorMeta, validate, written_inputs
from fusionp2p.graph.ops import DROPPED, GETITEM, WHITELIST, op_name, resolve

log = logging.getLogger(__name__)

_PREFIX = "model."
# detach_ appears on fresh tensors (``torch.tensor(...).detach_()``): the out-of-place detach is the same value
_PORTABLE = {"aten.view.default": "aten.reshape.default", "aten.detach_.default": "aten.detach.default"}


class _Wrapped(nn.Module):
    """Calls the user's model with named inputs and returns the loss (or the flat tensor outputs).

    It returns a bare tensor exactly when it found a loss and a tuple otherwise; the exported output
    spec tells the two apart (export restores module attributes, so a flag set here would be lost).
    """

    def __init__(self, model: nn.Module, names: Sequence[str], as_kwargs: bool, n_loss: int,
                 loss_fn: Callable[..., torch.Tensor] | None, loss_by_name: bool = False) -> None:
        super().__init__()
        self.model = model
        self._names = tuple(names)
        self._as_kwargs = as_kwargs
        self._n_loss = n_loss
        self._loss_fn = loss_fn
        self._loss_by_name = loss_by_name

    def forward(self, *args: torch.Tensor) -> Any:
        n_model = len(args) - self._n_loss
        model_args, loss_args = args[:n_model], args[n_model:]
        if self._as_kwargs:
            out = self.model(**dict(zip(self._names[:n_model], model_args)))
        else:
            out = self.model(*model_args)
        if self._loss_fn is not None:
            if self._loss_by_name:
                return self._loss_fn(out, **dict(zip(self._names[n_model:], loss_args)))
            return self._loss_fn(out, *loss_args)
        loss = _pick_loss(out)
        if loss is not None:
            return loss
        return tuple(_tensor_leaves(out))


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module) -> Iterator[None]:
    """Training never reads a key/value cache: trace Hugging Face models (whose configs often ship
    ``use_cache=True``) with it off, and give the user's config back as it was."""
    found = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())}   # configs may be unhashable
    cfgs: list[Any] = [c for c in found.values() if getattr(c, "use_cache", None) is True]
    for c in cfgs:
        c.use_cache = False
    try:
        yield
    finally:
        for c in cfgs:
            c.use_cache = True


_LIBS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _export_cause(exc: BaseException) -> str:
    """A torch.export failure cut down to its cause: the innermost exception's first lines, and the
    last frame of the model's own code (outside torch and fusionp2p) where it was raised."""
    chain: list[BaseException] = [exc]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(nxt)
    where = ""
    for e in reversed(chain):      # innermost first: where the model's code actually failed
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if not f.filename.startswith(_LIBS) and not f.filename.startswith("<")]
        if frames:
            f = frames[-1]
            where = f" (at {f.filename}:{f.lineno}: {(f.line or '').strip()[:120]})"
            break
    root = chain[-1] if len(chain) > 1 and not str(exc).strip() else exc
    lines = [ln for ln in str(root).splitlines() if ln.strip()]
    text = " ".join(lines[:2])[:300] if lines else ""
    return f"{type(root).__name__}: {text}{where}"


def _pick_loss(out: Any) -> torch.Tensor | None:
    if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]  # type: ignore[no-any-return]
    if not isinstance(out, Mapping) and isinstance(getattr(out, "loss", None), torch.Tensor):
        return out.loss  # type: ignore[no-any-return]
    if isinstance(out, (tuple, list)) and out and _is_scalar(out[-1]):
        return out[-1]  # type: ignore[no-any-return]
    if _is_scalar(out):
        return out  # type: ignore[no-any-return]
    return None


def _is_scalar(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point()


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _tensor_leaves(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensor_leaves(v)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in _tensor_leaves(getattr(out, f.name))]
    return []


def _input_names(model: nn.Module, n: int) -> list[str]:
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n]]
    return names + [f"input_{i}" for i in range(len(names), n)]


def preload() -> None:
    """Import what :func:`trace`'s first call imports: ``torch.export``'s tracer (``torch._dynamo``, sympy: some
    1,200 modules, ~1 CPU-s idle). ``Swarm.local`` calls it before its nodes' thread starts: imported by the
    first ``publish`` instead, while that thread ran an embedded swarm, every file the import opened waited
    for the GIL (swarm_scale's job on 8 of 30 nodes, load 21-26: 8.9 s of the 10.7 s from publish to RUNNING
    for 1.5 CPU-s; the same import 2.1 s before the thread started). A private module of torch's: a torch
    without it is traced as before (the import then happens in :func:`trace`)."""
    with contextlib.suppress(ImportError):
        import torch.export._trace  # noqa: F401


def trace(model: nn.Module, example_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | torch.Tensor,
          loss_fn: Callable[..., torch.Tensor] | None = None, *,
          loss_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] = (), count_flops: bool = True) -> OpDAG:
    """Trace ``model`` on ``example_inputs`` into an :class:`OpDAG` ending at the loss.

    * ``example_inputs``: a tensor, a tuple (positional arguments) or a dict (keyword arguments, e.g.
      ``{"input_ids": ids, "labels": labels}`` for a Hugging Face model). Its names become the DAG's
      data inputs (``dag.data_inputs``), in order, followed by ``target``/``target_<i>`` for
      ``loss_inputs``.
    * ``loss_fn``: if given, the loss is ``loss_fn(model_output, *loss_inputs)`` (or, when
      ``loss_inputs`` is a dict, ``loss_fn(model_output, **loss_inputs)``, its keys naming the inputs). Otherwise the loss is
      found in the output (``out["loss"]``, ``out.loss``, or a trailing scalar as in ``(logits, loss)``);
      if there is none the DAG returns every output tensor and ``dag.loss`` is None.

    The model is traced in its current mode (``train()``/``eval()``). Raises ConfigError when the model
    cannot be exported or uses an operator outside the whitelist, with what to change.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    as_kwargs = isinstance(example_inputs, Mapping)
    if as_kwargs:
        assert isinstance(example_inputs, Mapping)
        names = [str(k) for k in example_inputs]
        model_args = tuple(example_inputs.values())
    else:
        model_args = tuple(example_inputs)  # type: ignore[arg-type]
        names = _input_names(model, len(model_args))
    loss_by_name = isinstance(loss_inputs, Mapping)
    if isinstance(loss_inputs, Mapping):
        names += [str(k) for k in loss_inputs]
        loss_inputs = tuple(loss_inputs.values())
    else:
        loss_inputs = tuple(loss_inputs)
        names += ["target"] if len(loss_inputs) == 1 else [f"target_{i}" for i in range(len(loss_inputs))]
    if loss_inputs and loss_fn is None:
        raise ConfigError("loss_inputs were given without a loss_fn")
    wrapped = _Wrapped(model, names, as_kwargs, len(loss_inputs), loss_fn, loss_by_name)
    all_args = model_args + tuple(loss_inputs)
    try:
        with _no_kv_cache(model):
            ep = torch.export.export(wrapped, all_args, strict=False)
    except Exception as exc:
        raise ConfigError(
            f"torch.export could not trace the model: {_export_cause(exc)}. Hints: avoid data-dependent Python "
            "control flow in forward (an `if` on a tensor's values); return the loss or pass loss_fn") from exc
    return _from_exported(ep, model, names, all_args, ep.call_spec.out_spec.is_leaf(), count_flops)


def _from_exported(ep: torch.export.ExportedProgram, model: nn.Module, names: list[str],
                   all_args: tuple[torch.Tensor, ...], has_loss: bool, count_flops: bool) -> OpDAG:
    sig = ep.graph_signature
    rename: dict[str, str] = {}
    inputs: list[InputSpec] = []
    tensors: dict[str, torch.Tensor] = {}
    user_i = 0
    first_of: dict[int, str] = {}     # id of a lifted parameter -> its DAG name
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(sig.input_specs):
        raise ConfigError("unexpected exported program: placeholders and input specs differ")
    for ph, spec in zip(placeholders, sig.input_specs):
        if spec.kind == InputKind.USER_INPUT:
            name, kind, value = names[user_i], "input", all_args[user_i]
            user_i += 1
        else:
            kind = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer"}.get(spec.kind, "constant")
            target = str(spec.target)
            name = target[len(_PREFIX):] if target.startswith(_PREFIX) else target
            value = ep.state_dict[target] if target in ep.state_dict else ep.constants[target]
            if not isinstance(value, torch.Tensor):
                raise ConfigError(f"input {target!r} of kind {spec.kind.name} is not a tensor; not supported")
            if kind == "param" and id(value) in first_of:
                # a tied weight lifted once per name (``lm_head.weight = wte.weight``): one DAG parameter
                rename[ph.name] = first_of[id(value)]
                continue
            if kind == "param":
                first_of[id(value)] = name
            tensors[name] = value.detach()
        rename[ph.name] = name
        inputs.append(InputSpec(name=name, kind=kind, meta=TensorMeta.of(value)))

    nodes: list[OpNode] = []
    unsupported: dict[str, str] = {}
    scope_types: dict[str, str] = {}
    _Emitter(nodes, unsupported, scope_types, rename).graph(ep.graph, ep.graph_module, no_grad=False)
    if unsupported:
        raise ConfigError(unsupported_message(unsupported))
    (out_node,) = [n for n in ep.graph.nodes if n.op == "output"]
    flat_out = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else (out_node.args[0],)
    outputs = tuple(rename[a.name] for a in flat_out if isinstance(a, torch.fx.Node))
    if has_loss and len(outputs) != 1:
        raise ConfigError("the loss must be a single tensor")
    loss = outputs[0] if has_loss else None
    if loss is not None:
        m = next(n for n in nodes if n.name == loss).out
        if not m or m[0] is None or m[0].shape != () or not m[0].dtype.is_floating_point:
            raise ConfigError(f"the loss must be a floating-point scalar, got {m}")
    tin = tuple(inputs)
    validate(tin, tuple(nodes), outputs, tensors, ConfigError, what="traced DAG")
    if count_flops:
        nodes = _count_flops(tin, nodes, tensors, all_args)
    first = all_args[0] if all_args else None
    batch = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else 1
    dag = OpDAG(inputs=tin, nodes=tuple(nodes), outputs=outputs, loss=loss, tensors=tensors,
                module_names=_module_names(model, tensors), scope_types=scope_types, batch_size=batch)
    log.debug("traced %d nodes, %d params, %.3g GFLOP", len(nodes), len(dag.param_names), dag.total_flops / 1e9)
    return dag


class _Emitter:
    """Turns an exported FX graph into OpNodes (appended to *nodes*), inlining higher-order regions.

    ``wrap_with_set_grad_enabled(False, submodule, *args)`` is what export makes of a
    ``@torch.no_grad()`` function called from forward (the rotary embedding of Llama, Mistral, Qwen2):
    its operators are inlined under the region's name, and each of its outputs passes through
    ``aten.detach``, so that no gradient flows back through the region, exactly as under ``no_grad``
    (inside a stage, where grad mode is on, this is the only effect the region's mode has on the
    values and gradients). A region that enables grad is inlined as it is.
    """

    def __init__(self, nodes: list[OpNode], unsupported: dict[str, str], scope_types: dict[str, str],
                 rename: dict[str, str]) -> None:
        self.nodes = nodes
        self.unsupported = unsupported
        self.scope_types = scope_types
        self.top = rename
        self.taken = set(rename.values())
        self.regions: dict[str, list[str]] = {}     # region node (emitted name) -> its outputs' names

    def graph(self, graph: torch.fx.Graph, gm: torch.nn.Module, *, no_grad: bool, prefix: str = "",
              rename: dict[str, str] | None = None, scope: str = "") -> list[str]:
        """Emit *graph*'s operators; returns the names of its outputs (for an inlined region)."""
        rename = self.top if rename is None else rename
        outs: list[str] = []
        for fx_node in graph.nodes:
            if fx_node.op == "output":
                flat = fx_node.args[0] if isinstance(fx_node.args[0], (tuple, list)) else (fx_node.args[0],)
                outs = [rename[a.name] for a in flat if isinstance(a, torch.fx.Node)]
                continue
            if fx_node.op != "call_function":
                continue   # placeholders (mapped by the caller) and get_attr of region submodules
            if fx_node.target is torch.ops.higher_order.wrap_with_set_grad_enabled:
                self._region(fx_node, gm, rename, prefix, scope)
                continue
            if fx_node.target is operator.getitem and isinstance(fx_node.args[0], torch.fx.Node) \
                    and rename.get(fx_node.args[0].name) in self.regions:
                rename[fx_node.name] = self.regions[rename[fx_node.args[0].name]][int(fx_node.args[1])]
                continue
            self._op(fx_node, rename, prefix, scope)
        return outs

    def _fresh(self, name: str) -> str:
        out, i = name, 0
        while out in self.taken:
            i += 1
            out = f"{name}_{i}"
        self.taken.add(out)
        return out

    def _region(self, fx_node: torch.fx.Node, gm: torch.nn.Module, rename: dict[str, str], prefix: str,
                scope: str) -> None:
        enabled, sub_ref, *args = fx_node.args
        sub = getattr(gm, str(sub_ref.target)) if isinstance(sub_ref, torch.fx.Node) else None
        if not isinstance(sub, torch.fx.GraphModule) or not isinstance(enabled, bool):
            raise ConfigError(f"unexpected grad-mode region {fx_node.name!r} in the exported program")
        name = self._fresh(prefix + fx_node.name)
        local: dict[str, str] = {}
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if len(phs) != len(args):
            raise ConfigError(f"grad-mode region {fx_node.name!r}: {len(args)} arguments for {len(phs)} inputs")
        for ph, a in zip(phs, args):
            if not isinstance(a, torch.fx.Node) or a.name not in rename:
                raise ConfigError(f"grad-mode region {fx_node.name!r} reads a value the DAG cannot carry")
            local[ph.name] = rename[a.name]
        inner_scope = _scope_of(fx_node) or scope
        outs = self.graph(sub.graph, sub, no_grad=not enabled, prefix=name + "__", rename=local, scope=inner_scope)
        if not enabled:   # no gradient flows back out of a no_grad region
            outs = [self._detach(o, inner_scope) for o in outs]
        self.regions[name] = outs
        rename[fx_node.name] = name

    def _detach(self, src: str, scope: str) -> str:
        meta = next((n.out for n in reversed(self.nodes) if n.name == src), None)
        if meta is None or len(meta) != 1:
            return src   # an input passed through: it carries no gradient of the region's making
        name = self._fresh(src + "_nograd")
        self.nodes.append(OpNode(name=name, op="aten.detach.default", args=(Ref(src),), out=meta, scope=scope))
        return name

    def _op(self, fx_node: torch.fx.Node, rename: dict[str, str], prefix: str, scope: str) -> None:
        name = op_name(fx_node.target)
        # the trace records view() where the traced kernels happened to produce viewable strides; another
        # device or kernel (and the meta check of the decoder) may not, and reshape is view when it can be
        name = _PORTABLE.get(name, name)
        if name in DROPPED:
            return
        if name not in WHITELIST:
            self.unsupported.setdefault(name, _user_line(fx_node))
            rename[fx_node.name] = fx_node.name  # keep collecting: report every unsupported op at once
            return
        if not prefix and fx_node.name in self.taken:
            raise ConfigError(f"node name {fx_node.name!r} collides with an input name; rename that input")
        new = self._fresh(prefix + fx_node.name)
        rename[fx_node.name] = new
        out, multi = _out_meta(fx_node.meta.get("val"))
        stack = fx_node.meta.get("nn_module_stack") or {}
        for p, t in stack.values():
            self.scope_types[_strip(str(p))] = (t if isinstance(t, str) else getattr(t, "__qualname__", str(t))
                                                ).rsplit(".", 1)[-1]
        self.nodes.append(OpNode(
            name=new, op=name,
            args=tuple(_arg(a, rename) for a in fx_node.args),
            kwargs=tuple((k, _arg(v, rename)) for k, v in fx_node.kwargs.items()),
            out=out, multi=multi, scope=_scope_of(fx_node) or scope))


def _user_line(fx_node: torch.fx.Node) -> str:
    """``file:line: code`` of the innermost frame of the user's own code that made *fx_node* (frames
    inside torch left out), from the trace's stack; "" when the trace kept none."""
    lines = str(fx_node.meta.get("stack_trace") or "").splitlines()
    found = ""
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith("File ") and ", line " in line and f"{os.sep}torch{os.sep}" not in line:
            path, _, rest = line[5:].partition(", line ")
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            found = f"{os.path.basename(path.strip(chr(34)))}:{rest.split(',')[0]}: {code}"
    return found


def unsupported_message(unsupported: Mapping[str, str]) -> str:
    """One line naming the operators outside the whitelist and the user's line that made each.
    Symbolic-shape bookkeeping that torch.export adds after a data-dependent op (``aten.sym_size.int``,
    Python's ``ge``/``le`` on sizes) is left out when a real operator explains it: the user never wrote it."""
    def internal(op: str) -> bool:
        return op.startswith("aten.sym_") or not op.startswith(("aten.", "prims."))

    real = {op: where for op, where in unsupported.items() if not internal(op)} or dict(unsupported)
    ops = "; ".join(f"{op} (from {where})" if where else op for op, where in sorted(real.items()))
    return (f"the model uses operators outside the whitelist: {ops}. Rewrite that code with supported "
            "operations (docs/operators.md lists the supported ones), or extend the whitelist in fusionp2p/graph/ops.py")


def _scope_of(fx_node: torch.fx.Node) -> str:
    stack = fx_node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return _strip(str(path))


def _strip(path: str) -> str:
    if path in ("", "model"):
        return ""
    return path[len(_PREFIX):] if path.startswith(_PREFIX) else path


def _out_meta(val: Any) -> tuple[tuple[TensorMeta | None, ...], bool]:
    if isinstance(val, torch.Tensor):
        return (TensorMeta.of(val),), False
    if isinstance(val, (list, tuple)):
        return tuple(TensorMeta.of(v) if isinstance(v, torch.Tensor) else None for v in val), True
    raise ConfigError(f"an operator returned {type(val).__name__}, which the DAG cannot carry")


_CONST_TYPES = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _arg(a: Any, rename: Mapping[str, str]) -> Arg:
    if isinstance(a, torch.fx.Node):
        if a.name not in rename:
            raise ConfigError(f"reference to {a.name!r}, which was dropped or is not supported")
        return Ref(rename[a.name])
    if a is None or isinstance(a, _CONST_TYPES):
        return a  # type: ignore[no-any-return]
    if isinstance(a, (list, tuple)):
        return [_arg(x, rename) for x in a]
    raise ConfigError(f"unsupported operator argument of type {type(a).__name__}: {a!r}")


def materialize(a: Arg, env: Mapping[str, Any]) -> Any:
    """Replace every Ref in an argument by its value in *env*."""
    if isinstance(a, Ref):
        return env[a.name]
    if isinstance(a, (list, tuple)):
        return [materialize(x, env) for x in a]
    return a


def with_flops(dag: OpDAG, args: Sequence[torch.Tensor]) -> OpDAG:
    """*dag* (traced with ``count_flops=False``) with every node's forward FLOPs, from one run on the
    data inputs *args* (in ``dag.data_inputs`` order). ConfigError if the graph fails on them."""
    try:
        nodes = _count_flops(dag.inputs, list(dag.nodes), dag.tensors, tuple(args))
    except Exception as exc:
        raise ConfigError(f"the traced model fails on the example batch: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:300] if str(exc) else ''}") from exc
    return dataclasses.replace(dag, nodes=tuple(nodes))


def _count_flops(inputs: tuple[InputSpec, ...], nodes: list[OpNode], tensors: Mapping[str, torch.Tensor],
                 args: tuple[torch.Tensor, ...]) -> list[OpNode]:
    # One run on the real values, holding at most one copy of the weights (the publisher's peak is this
    # run's): a parameter is read in place, and copied only when an in-place operator may write it (through
    # a view); buffers and constants are copied (batch-norm's running statistics are updated in place and
    # must not leak back). Each intermediate is dropped after its last reader, so the run holds the live
    # activations of one micro-batch, not all of them.
    written = written_inputs(nodes, {s.name for s in inputs})
    env: dict[str, Any] = {}
    it = iter(args)
    for spec in inputs:
        if spec.kind == "input":
            env[spec.name] = next(it)
        else:
            t = tensors[spec.name]
            env[spec.name] = t.clone() if spec.kind != "param" or spec.name in written else t
    last = _last_use(nodes)
    out: list[OpNode] = []
    with torch.no_grad():
        for i, n in enumerate(nodes):
            fn = resolve(n.op)
            a = [materialize(x, env) for x in n.args]
            kw = {k: materialize(v, env) for k, v in n.kwargs}
            if n.op == GETITEM:
                env[n.name] = fn(*a)
                out.append(n)
            else:
                counter = FlopCounterMode(display=False)
                with counter:
                    env[n.name] = fn(*a, **kw)
                out.append(dataclasses.replace(n, flops=float(counter.get_total_flops())))
            del a, kw
            for name in last.get(i, ()):
                env.pop(name, None)
    return out


def _last_use(nodes: Sequence[OpNode]) -> dict[int, list[str]]:
    """Node index -> the values whose last reader it is (a value no node reads is dropped where it is made)."""
    last: dict[str, int] = {}
    for i, n in enumerate(nodes):
        last[n.name] = i
        for r in n.refs():
            last[r] = i
    by_node: dict[int, list[str]] = {}
    for name, i in last.items():
        by_node.setdefault(i, []).append(name)
    return by_node


def _module_names(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    """DAG tensor name -> every key of ``model.state_dict()`` that holds it (several for a tied weight;
    none for a non-persistent buffer, which ``state_dict`` leaves out and a download must too)."""
    keys = set(model.state_dict(keep_vars=True))
    by_id: dict[int, list[str]] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if n in keys:
            by_id.setdefault(id(t), []).append(n)
    own = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    out: dict[str, tuple[str, ...]] = {}
    for name in tensors:
        src = own.get(name)
        out[name] = tuple(by_id.get(id(src), ())) if src is not None else ()
    return out


def load_into(module: nn.Module, dag: OpDAG, values: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy DAG-named tensors (e.g. a trained checkpoint) into the module ``dag`` was traced from.

    Uses ``dag.module_names``; tied weights are written once per alias. With *strict*, every DAG
    parameter must be present in *values*.
    """
    state = module.state_dict(keep_vars=True)
    missing = [p for p in dag.param_names if p not in values]
    if strict and missing:
        raise ConfigError(f"load_into: no value for parameters {missing[:5]}")
    with torch.no_grad():
        for name, value in values.items():
            targets = dag.module_names.get(name, ())
            if not targets:
                if strict and name in dag.param_names:
                    raise ConfigError(f"load_into: {name!r} has no counterpart in the module")
                continue
            for t in targets:
                state[t].copy_(value)
