"""StageExecutor: runs one StageProgram forward and backward (remote autodiff, ALGORITHMS.md §1.3).

Theory of operation. The program is compiled once into a ``torch.fx.GraphModule`` whose Python code
calls the whitelisted ``torch.ops.aten`` overloads directly, so a forward costs what eager PyTorch
costs (no per-node interpretation). Per micro-batch:

* ``forward(micro, inputs)`` makes every received floating-point boundary tensor a leaf that requires
  grad, runs the module with autograd on, keeps ``(leaves, outputs)`` for that micro-batch and returns
  the outputs detached (the tensors to send, and the loss on the last stage);
* ``backward(micro, grad_outputs)`` runs ``torch.autograd.backward`` from the outputs with the given
  gradients (the loss gets ``loss_scale``, e.g. 1/num_micro_batches), which *accumulates* into the
  parameters' ``.grad``, frees the micro-batch's state and returns the gradients of the received
  tensors, to be sent back to their producers.

Micro-batches are independent: their forwards and backwards may run in any interleaving (GPipe,
1F1B...). :class:`Inbox` collects boundary messages per micro-batch and releases a complete set; it sums
the gradients of a fanned-out tensor in stage order, so arrival order never changes the numbers.
Parameter gradients are summed over micro-batches in the order their backwards run (float addition:
equal to within rounding whatever the order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusionp2p import device as dev
from fusionp2p.errors import RemoteProtocolError
from fusionp2p.graph.dag import Arg, Ref, written_inputs
from fusionp2p.graph.ops import resolve
from fusionp2p.graph.program import DATA, StageProgram

log = logging.getLogger(__name__)

# TrainConfig.precision -> the dtype autocast computes in (None: fp32 throughout)
COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp16's static loss scale: the loss gradient is multiplied by it, the parameter gradients divided by it
# before the optimizer step (unscale_grads); an overflow makes them non-finite and the step is skipped
FP16_SCALE = 2.0**12


def build_module(program: StageProgram, device: torch.device, *, evaluate: bool = False) -> torch.fx.GraphModule:
    """Compile *program* into a GraphModule taking ``program.inputs`` positionally, returning a tuple
    of ``program.outputs``. Device constants in arguments are replaced by *device*. Only whitelisted
    operator names are resolved (``resolve`` raises KeyError otherwise). With *evaluate*, dropout is
    the identity (its ``train`` argument false), as in ``model.eval()``."""
    g = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for i, spec in enumerate(program.inputs):
        env[spec.name] = g.placeholder(f"in_{i}")
    for n in program.nodes:
        fn = resolve(n.op)
        if evaluate and n.op == "aten.dropout.default" and len(n.args) == 3:
            env[n.name] = g.call_function(fn, (_fx_arg(n.args[0], env, device), _fx_arg(n.args[1], env, device), False), {})
            continue
        args = tuple(_fx_arg(a, env, device) for a in n.args)
        kwargs = {k: _fx_arg(v, env, device) for k, v in n.kwargs}
        env[n.name] = g.call_function(fn, args, kwargs)
    g.output(tuple(env[o] for o in program.outputs))
    g.lint()
    return torch.fx.GraphModule(nn.Module(), g, class_name=f"Stage{program.stage}")


def recomputable(program: StageProgram) -> bool:
    """Whether *program* may run with activation recomputation: no operator of it writes one of its inputs
    (a parameter, buffer or received tensor) in place, which the recomputation would write a second time
    (batch-norm's running statistics). A fresh intermediate written in place is no obstacle."""
    return not written_inputs(program.nodes, {s.name for s in program.inputs})


def _fx_arg(a: Arg, env: Mapping[str, torch.fx.Node], device: torch.device) -> Any:
    if isinstance(a, Ref):
        return env[a.name]
    if isinstance(a, (list, tuple)):
        return [_fx_arg(x, env, device) for x in a]
    if isinstance(a, torch.device):
        return device
    return a


class StageExecutor:
    """Runs a StageProgram; owns its parameters (``nn.Parameter``, grads accumulate) and buffers.

    Everything lives on *device*: parameters, buffers and the stash; received tensors are moved there
    (``fusionp2p.device``), and what forward and backward return stays there (the caller compresses it
    there and copies it to the host in a worker thread). With *precision* ``"bf16"`` or ``"fp16"`` the
    forward runs under autocast: parameters, their gradients and so the optimizer state stay fp32
    (master weights), and the floating boundary tensors of fp32 programs travel in the compute dtype
    (half the bytes), which this executor accepts beside the program's own dtype and widens on
    receipt. ``"fp16"`` scales the loss by ``FP16_SCALE`` (see ``unscale_grads``).

    With *synced* (the default) forward and backward return once the device has finished them, so
    that the caller's timings (step, stage and re-deal speeds) measure the kernels, not their launch;
    what they return is copied to the host right after anyway, which would wait for the same.

    With *recompute* (activation recomputation, ``TrainConfig.recompute``) a micro-batch in flight keeps
    only its received tensors and its outputs; its backward runs the forward again first (about one more
    forward of compute). The numbers are those without it: the same kernels run on the same values. A
    program that writes a tensor in place (batch-norm's running statistics) is never recomputed (the
    recomputation would write it twice): :func:`recomputable`."""

    def __init__(self, program: StageProgram, *, device: str | torch.device = "cpu", precision: str = "fp32",
                 synced: bool = True, recompute: bool = False) -> None:
        if precision not in COMPUTE_DTYPES:
            raise ValueError(f"precision must be one of {', '.join(COMPUTE_DTYPES)}, got {precision!r}")
        self.program = program
        self.device = dev.resolve(device)
        self.precision = precision
        self.compute_dtype = COMPUTE_DTYPES[precision]
        self.wire_half = self.compute_dtype   # what fp32 boundary tensors travel in (None: fp32)
        if self.compute_dtype == torch.bfloat16 and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            # a GPU without bf16 (before Ampere) computes this stage in fp32 but keeps the job's bf16 wire;
            # fp16 would need the job-wide loss scale of precision="fp16", which its neighbours do not apply
            log.warning("%s has no bf16: stage %d computes in fp32 (precision='fp16' for a whole job on such GPUs)",
                        self.device, program.stage)
            self.compute_dtype = None
        self.grad_scale = FP16_SCALE if precision == "fp16" else 1.0
        self.synced = synced
        if recompute and not recomputable(program):
            raise ValueError(f"stage {program.stage} writes a tensor in place: it cannot recompute its activations")
        self.recompute = recompute
        self._module = build_module(program, self.device)
        self._eval_module: torch.fx.GraphModule | None = None
        self._params: dict[str, nn.Parameter] = {}
        self._state: list[torch.Tensor] = []
        for spec in program.inputs:
            if spec.kind == "input":
                continue
            t = program.tensors[spec.name].detach().to(self.device).clone()
            if spec.kind == "param":
                p = nn.Parameter(t, requires_grad=t.is_floating_point())
                self._params[spec.name] = p
                self._state.append(p)
            else:
                self._state.append(t)
        self._buffers = {s.name: t for s, t in zip((s for s in program.inputs if s.kind != "input"), self._state)
                         if s.kind != "param"}
        # the program keeps this executor's own tensors from now on, not those it was built from (a node's
        # fetched stage weights): they are freed once the caller lets go of its program, not held beside the
        # copies above for the whole run (issue 37: a node's peak memory against its stage's figure)
        own = dict(zip((s.name for s in program.inputs if s.kind != "input"), self._state))
        self.program = dataclasses.replace(program, tensors={**program.tensors, **own})
        # micro -> (received leaves by name, outputs in program.outputs order)
        self._stash: dict[int, tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]] = {}

    # ---------------------------------------------------------------- state
    def parameters(self) -> dict[str, nn.Parameter]:
        """The stage's trainable parameters by DAG name (give them to an optimizer)."""
        return dict(self._params)

    def buffers(self) -> dict[str, torch.Tensor]:
        return dict(self._buffers)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers by DAG name (detached); see ``trace.load_into`` to go back to a module."""
        return {k: v.detach() for k, v in {**self._params, **self._buffers}.items()}

    def zero_grad(self) -> None:
        for p in self._params.values():
            p.grad = None

    def evaluate(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Forward only, without autograd and with dropout off: the outputs (and the loss) by name."""
        if self._eval_module is None:
            self._eval_module = build_module(self.program, self.device, evaluate=True)
        args = []
        for r in self.program.recv:
            t = inputs.get(r.name)
            if t is None or tuple(t.shape) != r.meta.shape or not self._accepts(t.dtype, r.meta.dtype):
                raise RemoteProtocolError(f"stage {self.program.stage}: boundary tensor {r.name!r} missing or misshapen")
            args.append(dev.to_device(t.detach(), self.device, dtype=r.meta.dtype))
        with torch.no_grad(), self._autocast():
            outs: tuple[torch.Tensor, ...] = self._eval_module(*args, *self._state)
        return self._outputs(outs)

    # ---------------------------------------------------------------- precision
    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a boundary tensor of the program's *dtype* travels in: the compute dtype for fp32
        under mixed precision, else *dtype* itself."""
        return self.wire_half if self.wire_half is not None and dtype == torch.float32 else dtype

    def _accepts(self, got: torch.dtype, want: torch.dtype) -> bool:
        # a data loader feeds the program's own dtype, a peer stage the wire dtype
        return got == want or got == self.wire_dtype(want)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _outputs(self, outs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Detached outputs by name, floating ones (not the loss) in their wire dtype."""
        sent = {o.name: o.meta.dtype for o in self.program.send}
        res: dict[str, torch.Tensor] = {}
        for name, o in zip(self.program.outputs, outs):
            o = o.detach()
            if name in sent and o.is_floating_point():
                o = o.to(self.wire_dtype(sent[name]))
            elif name == self.program.loss:
                o = o.float()
            res[name] = o
        return res

    def unscale_grads(self) -> None:
        """Divide the accumulated parameter gradients by the loss scale (fp16; a no-op otherwise). Call it
        once per step, before the optimizer step and any norm clipping or averaging."""
        if self.grad_scale == 1.0:
            return
        with torch.no_grad():
            for p in self._params.values():
                if p.grad is not None:
                    p.grad.mul_(1.0 / self.grad_scale)

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Micro-batches whose forward ran and whose backward has not."""
        return tuple(sorted(self._stash))

    # ---------------------------------------------------------------- compute
    def forward(self, micro: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the stage on one micro-batch. *inputs* holds every ``program.recv`` tensor by name.

        Returns the tensors to send (by name) and, on the loss stage, the loss (detached). A missing,
        misshapen or mistyped boundary tensor raises RemoteProtocolError (it came from a peer).
        """
        if micro in self._stash:
            raise ValueError(f"micro-batch {micro} is already in flight on stage {self.program.stage}")
        leaves: dict[str, torch.Tensor] = {}
        args: list[torch.Tensor] = []
        for r in self.program.recv:
            t = inputs.get(r.name)
            if t is None:
                raise RemoteProtocolError(f"stage {self.program.stage}: boundary tensor {r.name!r} missing")
            if tuple(t.shape) != r.meta.shape or not self._accepts(t.dtype, r.meta.dtype):
                raise RemoteProtocolError(f"stage {self.program.stage}: {r.name!r} has {tuple(t.shape)} {t.dtype}, "
                                          f"expected {r.meta.shape} {self.wire_dtype(r.meta.dtype)}")
            # a fresh leaf in the program's dtype (a bf16 activation is widened: autocast narrows it again
            # where a kernel wants it, and the gradient it gets back is fp32 like the parameters')
            x = dev.to_device(t.detach(), self.device, dtype=r.meta.dtype)
            if r.needs_grad:
                x = x.requires_grad_(True)
            leaves[r.name] = x
            args.append(x)
        outs: tuple[torch.Tensor, ...]
        with torch.enable_grad(), self._autocast():
            if self.recompute:
                # activation recomputation: autograd keeps the module's inputs (the received leaves; the
                # parameters and buffers are held anyway) and runs the forward again in backward, with the
                # random state of this forward (dropout draws the same mask) and under the same autocast
                outs = checkpoint(self._module, *args, *self._state, use_reentrant=False, preserve_rng_state=True)
            else:
                outs = self._module(*args, *self._state)
        self._stash[micro] = (leaves, outs)
        res = self._outputs(outs)
        if self.synced:
            dev.sync(self.device)
        return res

    def backward(self, micro: int, grad_outputs: Mapping[str, torch.Tensor], *,
                 loss_scale: float = 1.0) -> dict[str, torch.Tensor]:
        """Back-propagate one micro-batch; return the gradients of the received tensors that need one.

        *grad_outputs* holds the (already summed) gradient of every floating-point sent tensor; the loss,
        if on this stage, gets ``loss_scale``. Parameter gradients accumulate into ``.grad``. A received
        tensor that did not influence the outputs gets a zero gradient, so a producer always hears back.
        """
        if micro not in self._stash:
            raise ValueError(f"micro-batch {micro} has no forward state on stage {self.program.stage}")
        leaves, outs = self._stash[micro]
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for o, t in zip(self.program.send, outs):
            if not o.needs_grad:
                continue
            g = grad_outputs.get(o.name)
            if g is None:
                raise RemoteProtocolError(f"stage {self.program.stage}: gradient of {o.name!r} missing")
            if tuple(g.shape) != o.meta.shape or not self._accepts(g.dtype, o.meta.dtype):
                raise RemoteProtocolError(f"stage {self.program.stage}: gradient of {o.name!r} has shape "
                                          f"{tuple(g.shape)} {g.dtype}, expected {o.meta.shape} "
                                          f"{self.wire_dtype(o.meta.dtype)}")
            if t.requires_grad:
                roots.append(t)
                grads.append(dev.to_device(g, self.device, dtype=t.dtype))
        if self.program.loss is not None:
            loss = outs[-1]
            if loss.requires_grad:
                roots.append(loss)
                grads.append(torch.full_like(loss, loss_scale * self.grad_scale))
        del self._stash[micro]
        if roots:
            torch.autograd.backward(roots, grads)
        out: dict[str, torch.Tensor] = {}
        for r in self.program.recv:
            if r.needs_grad:
                x = leaves[r.name]
                g = x.grad if x.grad is not None else torch.zeros_like(x)
                out[r.name] = g.to(self.wire_dtype(g.dtype)) if g.is_floating_point() else g
        if self.synced:
            dev.sync(self.device)
        return out

    def drop(self, micro: int) -> None:
        """Forget a micro-batch's forward state (e.g. the step was abandoned)."""
        self._stash.pop(micro, None)


def tied_sum(grads: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The gradient of a tied parameter from its holders' partial gradients (in ascending stage order;
    a holder whose copy got no gradient gives None). Every holder computes this same sum in the same
    order, so every copy takes the very same step."""
    present = [g for g in grads if g is not None]
    if not present:
        return None
    total = present[0].clone()
    for g in present[1:]:
        total += dev.check(g, total.device, "a tied gradient")   # an in-place add would take a host part
    return total


class Inbox:
    """Collects one stage's boundary messages per micro-batch (pure; no I/O).

    ``put_activation`` returns the complete input dict of a micro-batch once every ``recv`` tensor
    (data inputs included) is there; ``put_grad`` returns the complete, summed gradient dict once every
    consuming stage of every sent tensor has answered. Sums run in ascending stage order, so the result
    does not depend on arrival order. Duplicates (same key) are ignored: retransmission is idempotent.
    """

    def __init__(self, program: StageProgram) -> None:
        self.program = program
        self._acts: dict[int, dict[str, torch.Tensor]] = {}
        self._grads: dict[int, dict[tuple[str, int], torch.Tensor]] = {}
        self._need_act = {r.name for r in program.recv}
        self._need_grad = {(o.name, d) for o in program.send if o.needs_grad for d in o.dsts}
        self._final = [o.name for o in program.send if o.needs_grad and not o.dsts]

    def put_activation(self, micro: int, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if name not in self._need_act:
            raise RemoteProtocolError(f"stage {self.program.stage} does not receive {name!r}")
        box = self._acts.setdefault(micro, {})
        box.setdefault(name, tensor)
        if len(box) == len(self._need_act):
            return self._acts.pop(micro)
        return None

    def put_grad(self, micro: int, name: str, src_stage: int, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """*src_stage* is the consumer that sent the gradient (DATA for a final output's gradient)."""
        key = (name, src_stage)
        if key not in self._need_grad and not (src_stage == DATA and name in self._final):
            raise RemoteProtocolError(f"stage {self.program.stage} expects no gradient of {name!r} from {src_stage}")
        box = self._grads.setdefault(micro, {})
        box.setdefault(key, tensor)
        need = len(self._need_grad) + len(self._final)
        if len(box) < need:
            return None
        del self._grads[micro]
        out: dict[str, torch.Tensor] = {}
        for (n, _), g in sorted(box.items(), key=lambda kv: kv[0]):
            out[n] = g.clone() if n not in out else out[n] + g
        return out

    def grads_needed(self) -> bool:
        """False when backward needs no incoming message (the loss stage, or nothing differentiable sent)."""
        return bool(self._need_grad or self._final)
