"""Stage programs: the part of an OpDAG one pipeline stage runs, with its boundary.

A :class:`StageProgram` is self-contained: its operator nodes (topological order), its parameters,
buffers and constants (``tensors``), the boundary tensors it receives (``recv``: name, shape/dtype and
the stage that sends it, ``-1`` for data fed by the job's loader: token ids, images, targets) and those
it sends (``send``: name and the stages that consume it; an empty tuple marks a final output of a DAG
without loss). Boundary tensors are named after the DAG node that produces them, which is unique, so
the same name identifies an activation on the way forward and its gradient on the way back.

Routing is direct: a tensor that skips stages (a long residual) goes from its producer straight to
every consuming stage, and its gradients come straight back; a producer sums the gradients of one
tensor from several consumers (fan-out) itself, in stage order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from fusionp2p.graph.dag import InputSpec, OpNode, TensorMeta, validate

DATA = -1  # the "stage" of data inputs: the job's data loader


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryIn:
    """A tensor this stage receives per micro-batch."""

    name: str
    meta: TensorMeta
    src: int            # producing stage, or DATA

    @property
    def needs_grad(self) -> bool:
        """Whether the producer expects this tensor's gradient back."""
        return self.src != DATA and self.meta.dtype.is_floating_point


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryOut:
    """A tensor this stage sends per micro-batch."""

    name: str
    meta: TensorMeta
    dsts: tuple[int, ...]   # consuming stages, ascending; () = a final output of the DAG

    @property
    def needs_grad(self) -> bool:
        return self.meta.dtype.is_floating_point


@dataclass(frozen=True, slots=True, kw_only=True)
class TiedParam:
    """A parameter that several stages read (tied input/output embeddings): one logical parameter.

    Each stage in ``stages`` (ascending, this one included) holds a copy; after the backward pass of
    a step the copies' gradients are summed in ascending stage order on every holder, so every copy
    takes the same optimizer step from the same value and the copies stay identical (Megatron does
    this for the embeddings of the first and last pipeline stages).
    """

    name: str
    stages: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class StageProgram:
    """Everything a node needs to run one stage; built only from data (see wire/dag.py)."""

    stage: int
    num_stages: int
    inputs: tuple[InputSpec, ...]      # boundary inputs (kind "input", in recv order) + param/buffer/constant
    recv: tuple[BoundaryIn, ...]
    nodes: tuple[OpNode, ...]
    send: tuple[BoundaryOut, ...]
    loss: str | None = None
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    tied: tuple[TiedParam, ...] = ()

    @property
    def peer_stages(self) -> tuple[int, ...]:
        """Every other stage this stage exchanges tensors with: its boundary peers and tied holders."""
        peers = {r.src for r in self.recv if r.src != DATA} | {d for o in self.send for d in o.dsts}
        peers |= {t for tp in self.tied for t in tp.stages}
        return tuple(sorted(peers - {self.stage}))

    @property
    def outputs(self) -> tuple[str, ...]:
        """Values the stage returns from forward: every sent tensor, then the loss (if here)."""
        return tuple(o.name for o in self.send) + ((self.loss,) if self.loss is not None else ())

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs if i.kind == "param")

    @property
    def flops(self) -> float:
        return sum(n.flops for n in self.nodes)

    def check(self, err: type[Exception]) -> None:
        """Validate the structure (see dag.validate) and the boundary; raise *err* on a violation."""
        what = f"stage program {self.stage}"
        if not 0 <= self.stage < self.num_stages:
            raise err(f"{what}: stage index out of range 0..{self.num_stages - 1}")
        validate(self.inputs, self.nodes, self.outputs, self.tensors, err, what=what)
        data = [i for i in self.inputs if i.kind == "input"]
        if [i.name for i in data] != [r.name for r in self.recv]:
            raise err(f"{what}: boundary inputs and recv list differ")
        for spec, r in zip(data, self.recv):
            if spec.meta != r.meta:
                raise err(f"{what}: recv {r.name!r} meta differs from its input spec")
            if not (r.src == DATA or 0 <= r.src < self.stage):
                raise err(f"{what}: recv {r.name!r} from stage {r.src}, which is not an earlier stage")
        produced = {n.name: n for n in self.nodes}
        for o in self.send:
            n = produced.get(o.name)
            if n is None or n.multi or n.out[0] != o.meta:
                raise err(f"{what}: sends {o.name!r}, which is not a tensor node of this stage with that meta")
            if any(not (self.stage < d < self.num_stages) for d in o.dsts) or list(o.dsts) != sorted(set(o.dsts)):
                raise err(f"{what}: send {o.name!r} has bad destinations {o.dsts}")
        params = set(self.param_names)
        for tp in self.tied:
            if (tp.name not in params or self.stage not in tp.stages or len(tp.stages) < 2
                    or list(tp.stages) != sorted(set(tp.stages)) or not all(0 <= t < self.num_stages for t in tp.stages)):
                raise err(f"{what}: tied parameter {tp.name!r} on stages {tp.stages} is not one of its parameters "
                          "shared with other stages")
        if len({tp.name for tp in self.tied}) != len(self.tied):
            raise err(f"{what}: a tied parameter is listed twice")
        if self.loss is not None:
            n = produced.get(self.loss)
            if n is None or n.multi or n.out[0] is None or n.out[0].shape != ():
                raise err(f"{what}: loss {self.loss!r} is not a scalar node of this stage")
