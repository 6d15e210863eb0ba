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

import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.export.graph_signature import InputKind
from torch.utils.flop_counter import FlopCounterMode

from fusionp2p.errors import ConfigError
from fusionp2p.graph.dag import Arg, InputSpec, OpDAG, OpNode, Ref, TensorMeta, validate
from fusionp2p.graph.ops import DROPPED, GETITEM, WHITELIST, op_name, resolve

log = logging.getLogger(__name__)

_PREFIX = "model."
_PORTABLE = {"aten.view.default": "aten.reshape.default"}


class _Wrapped(nn.Module):
    """Calls the user's model with named inputs and returns the loss (or the flat tensor outputs).

    It returns a bare tensor exactly when it found a loss and a tuple otherwise; the exported output
    spec tells the two apart (export restores module attributes, so a flag set here would be lost).
    """

    def __init__(self, model: nn.Module, names: Sequence[str], as_kwargs: bool, n_loss: int,
                 loss_fn: Callable[..., torch.Tensor] | None) -> None:
        super().__init__()
        self.model = model
        self._names = tuple(names)
        self._as_kwargs = as_kwargs
        self._n_loss = n_loss
        self._loss_fn = loss_fn

    def forward(self, *args: torch.Tensor) -> Any:
        n_model = len(args) - self._n_loss
        model_args, loss_args = args[:n_model], args[n_model:]
        if self._as_kwargs:
            out = self.model(**dict(zip(self._names[:n_model], model_args)))
        else:
            out = self.model(*model_args)
        if self._loss_fn is not None:
            return self._loss_fn(out, *loss_args)
        loss = _pick_loss(out)
        if loss is not None:
            return loss
        return tuple(_tensor_leaves(out))


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


def trace(model: nn.Module, example_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | torch.Tensor,
          loss_fn: Callable[..., torch.Tensor] | None = None, *,
          loss_inputs: Sequence[torch.Tensor] = (), count_flops: bool = True) -> OpDAG:
    """Trace ``model`` on ``example_inputs`` into an :class:`OpDAG` ending at the loss.

    * ``example_inputs``: a tensor, a tuple (positional arguments) or a dict (keyword arguments, e.g.
      ``{"input_ids": ids, "labels": labels}`` for a Hugging Face model). Its names become the DAG's
      data inputs (``dag.data_inputs``), in order, followed by ``target``/``target_<i>`` for
      ``loss_inputs``.
    * ``loss_fn``: if given, the loss is ``loss_fn(model_output, *loss_inputs)``. Otherwise the loss is
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
    loss_inputs = tuple(loss_inputs)
    if loss_inputs and loss_fn is None:
        raise ConfigError("loss_inputs were given without a loss_fn")
    names += ["target"] if len(loss_inputs) == 1 else [f"target_{i}" for i in range(len(loss_inputs))]
    cfg = getattr(model, "config", None)
    if getattr(cfg, "use_cache", False) is True:
        raise ConfigError("the model's config has use_cache=True: a key/value cache cannot be traced for "
                          "training; set model.config.use_cache = False (or pass use_cache=False)")
    wrapped = _Wrapped(model, names, as_kwargs, len(loss_inputs), loss_fn)
    all_args = model_args + loss_inputs
    try:
        ep = torch.export.export(wrapped, all_args, strict=False)
    except Exception as exc:
        raise ConfigError(
            f"torch.export could not trace the model ({type(exc).__name__}: {str(exc)[:800]}). Hints: avoid "
            "data-dependent Python control flow in forward; for Hugging Face models set use_cache=False and "
            "attn_implementation='eager'; return the loss or pass loss_fn") from exc
    return _from_exported(ep, model, names, all_args, ep.call_spec.out_spec.is_leaf(), count_flops)


def _from_exported(ep: torch.export.ExportedProgram, model: nn.Module, names: list[str],
                   all_args: tuple[torch.Tensor, ...], has_loss: bool, count_flops: bool) -> OpDAG:
    sig = ep.graph_signature
    rename: dict[str, str] = {}
    inputs: list[InputSpec] = []
    tensors: dict[str, torch.Tensor] = {}
    user_i = 0
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
            tensors[name] = value.detach()
        rename[ph.name] = name
        inputs.append(InputSpec(name=name, kind=kind, meta=TensorMeta.of(value)))

    nodes: list[OpNode] = []
    unsupported: set[str] = set()
    scope_types: dict[str, str] = {}
    for fx_node in ep.graph.nodes:
        if fx_node.op != "call_function":
            continue
        name = op_name(fx_node.target)
        # the trace records view() where the traced kernels happened to produce viewable strides; another
        # device or kernel (and the meta check of the decoder) may not, and reshape is view when it can be
        name = _PORTABLE.get(name, name)
        if name in DROPPED:
            continue
        if name not in WHITELIST:
            unsupported.add(name)
            rename[fx_node.name] = fx_node.name  # keep collecting: report every unsupported op at once
            continue
        if fx_node.name in rename.values():
            raise ConfigError(f"node name {fx_node.name!r} collides with an input name; rename that input")
        rename[fx_node.name] = fx_node.name
        out, multi = _out_meta(fx_node.meta.get("val"))
        scope = ""
        stack = fx_node.meta.get("nn_module_stack") or {}
        if stack:
            path, _ = list(stack.values())[-1]
            scope = _strip(str(path))
            for p, t in stack.values():
                scope_types[_strip(str(p))] = (t if isinstance(t, str) else getattr(t, "__qualname__", str(t))
                                               ).rsplit(".", 1)[-1]
        nodes.append(OpNode(
            name=fx_node.name, op=name,
            args=tuple(_arg(a, rename) for a in fx_node.args),
            kwargs=tuple((k, _arg(v, rename)) for k, v in fx_node.kwargs.items()),
            out=out, multi=multi, scope=scope))
    if unsupported:
        raise ConfigError(f"the model uses operators outside the whitelist: {sorted(unsupported)}; rewrite "
                          "those parts with supported operations or ask for the whitelist to be extended")
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


def _count_flops(inputs: tuple[InputSpec, ...], nodes: list[OpNode], tensors: Mapping[str, torch.Tensor],
                 args: tuple[torch.Tensor, ...]) -> list[OpNode]:
    # one run on copies (in-place buffer updates such as batch-norm statistics must not leak back)
    env: dict[str, Any] = {}
    it = iter(args)
    for spec in inputs:
        env[spec.name] = next(it) if spec.kind == "input" else tensors[spec.name].clone()
    out: list[OpNode] = []
    with torch.no_grad():
        for n in nodes:
            fn = resolve(n.op)
            a = [materialize(x, env) for x in n.args]
            kw = {k: materialize(v, env) for k, v in n.kwargs}
            if n.op == GETITEM:
                env[n.name] = fn(*a)
                out.append(n)
                continue
            counter = FlopCounterMode(display=False)
            with counter:
                env[n.name] = fn(*a, **kw)
            out.append(dataclasses.replace(n, flops=float(counter.get_total_flops())))
    return out


def _module_names(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    by_id: dict[int, list[str]] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(t), []).append(n)
    own = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    out: dict[str, tuple[str, ...]] = {}
    for name in tensors:
        src = own.get(name)
        out[name] = tuple(by_id[id(src)]) if src is not None else ()
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
                if strict:
                    raise ConfigError(f"load_into: {name!r} has no counterpart in the module")
                continue
            for t in targets:
                state[t].copy_(value)
