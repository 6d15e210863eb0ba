"""What a stage replica hands over at a re-plan, or saves as a checkpoint: its state by parameter name.

A :class:`StageState` is keyed by OP-DAG tensor names, never by position, so that a re-plan may move
the fences: the new holder of a stage takes the entries of the names its program holds, from one or
several old stages (:func:`merge_states`). It carries

* ``tensors``: the stage's parameters and buffers;
* ``optimizer`` / ``optimizer_groups``: the local optimizer's state as ``"<param>::<key>"`` tensors
  and its param groups as JSON (:func:`optimizer_tensors`);
* ``momentum``: CO2's outer momentum. Replicas hold it sharded over the stage's flat parameter vector,
  so each replica hands over the slices it owns, per parameter: ``{param: (offset, values)}`` with
  ``values`` the flattened elements ``[offset, offset + len)`` of that parameter. Slices of replicas
  that died are missing and read as zero (:meth:`StageState.momentum_vector`).

The byte layout (safetensors, never pickle) is in ``jobs/checkpoint.py``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionp2p.errors import RemoteProtocolError


@dataclass(frozen=True, slots=True, kw_only=True)
class StageState:
    step: int                                    # steps completed (the next step to run)
    tensors: Mapping[str, torch.Tensor]
    optimizer: Mapping[str, torch.Tensor] = field(default_factory=dict)
    optimizer_groups: str = ""
    momentum: Mapping[str, tuple[tuple[int, torch.Tensor], ...]] = field(default_factory=dict)

    def momentum_vector(self, layout: Sequence[tuple[str, int]]) -> torch.Tensor | None:
        """The flat fp32 momentum for parameters *layout* (name, numel) in order; None without any slice."""
        if not self.momentum:
            return None
        out = torch.zeros(sum(n for _, n in layout), dtype=torch.float32)
        off = 0
        for name, n in layout:
            for start, vals in self.momentum.get(name, ()):
                end = min(n, start + vals.numel())
                if 0 <= start < end:
                    out[off + start:off + end] = vals[: end - start].to(torch.float32)
            off += n
        return out


def momentum_slices(layout: Sequence[tuple[str, int]], lo: int,
                    shard: torch.Tensor) -> dict[str, tuple[tuple[int, torch.Tensor], ...]]:
    """Cut a replica's momentum shard (flat ``[lo, lo + len)``) into per-parameter slices."""
    hi = lo + shard.numel()
    out: dict[str, tuple[tuple[int, torch.Tensor], ...]] = {}
    off = 0
    for name, n in layout:
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out[name] = ((a - off, shard[a - lo:b - lo].detach().clone()),)
        off += n
    return out


def merge_states(step: int, states: Iterable[StageState], names: Iterable[str]) -> StageState:
    """One state holding *names* (parameters and buffers of a new stage) from old stages' states.

    The first state holding a name gives its tensor and optimizer entries (list the preferred source
    first); momentum slices are gathered from every state, so that the shards of several replicas
    of one old stage add up to the whole vector. ``optimizer_groups`` comes from the first state.
    """
    wanted = set(names)
    states = list(states)
    tensors: dict[str, torch.Tensor] = {}
    optimizer: dict[str, torch.Tensor] = {}
    momentum: dict[str, list[tuple[int, torch.Tensor]]] = {}
    groups = ""
    for st in states:
        groups = groups or st.optimizer_groups
        for name in wanted - set(tensors):
            if name in st.tensors:
                tensors[name] = st.tensors[name]
                optimizer.update({k: v for k, v in st.optimizer.items() if k.rpartition("::")[0] == name})
        for name, slices in st.momentum.items():
            if name in wanted:
                have = {s for s, _ in momentum.get(name, [])}
                momentum.setdefault(name, []).extend(sl for sl in slices if sl[0] not in have)
    return StageState(step=step, tensors=tensors, optimizer=optimizer, optimizer_groups=groups,
                      momentum={k: tuple(v) for k, v in momentum.items()})


# ---- optimizer state, flattened to named tensors ---------------------------------------------------


def optimizer_tensors(opt: torch.optim.Optimizer, names: Mapping[torch.nn.Parameter, str]) -> tuple[dict[str, torch.Tensor], str]:
    """Flatten *opt*'s state to ``{"<param>::<key>": tensor}`` plus its param groups as JSON.

    Keys by parameter *name*, not position, so the state survives a re-plan that changes which
    parameters a stage holds (a stage loads the entries of the parameters it now owns).
    """
    sd = opt.state_dict()
    order = [p for g in opt.param_groups for p in g["params"]]
    out: dict[str, torch.Tensor] = {}
    for idx, st in sd["state"].items():
        pname = names[order[idx]]
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{pname}::{k}"] = v
            elif isinstance(v, int | float) and not isinstance(v, bool):
                out[f"{pname}::{k}"] = torch.tensor(float(v), dtype=torch.float64)
    groups = []
    pos = 0
    for g in sd["param_groups"]:
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({"hyper": hyper, "params": [names[order[pos + i]] for i in range(len(g["params"]))]})
        pos += len(g["params"])
    return out, json.dumps(groups, sort_keys=True)


def load_optimizer_tensors(
    opt: torch.optim.Optimizer, names: Mapping[torch.nn.Parameter, str], tensors: Mapping[str, torch.Tensor], groups: str
) -> None:
    """Restore state saved by :func:`optimizer_tensors` into *opt* (whose params are named by *names*).

    Hyper-parameters come from the saved groups; state entries of parameters *opt* does not hold are
    ignored, and parameters without saved state start fresh.
    """
    order = [p for g in opt.param_groups for p in g["params"]]
    index = {names[p]: i for i, p in enumerate(order)}
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        pname, _, k = key.rpartition("::")
        if pname in index:
            state.setdefault(index[pname], {})[k] = t
    try:
        saved = json.loads(groups) if groups else []
    except json.JSONDecodeError as exc:
        raise RemoteProtocolError(f"optimizer groups are not valid JSON: {exc}") from None
    cur = opt.state_dict()["param_groups"]
    pg: list[dict[str, Any]] = []
    for i, g in enumerate(cur):
        hyper = dict(saved[i]["hyper"]) if i < len(saved) else {k: v for k, v in g.items() if k != "params"}
        if "betas" in hyper and isinstance(hyper["betas"], list):
            hyper["betas"] = tuple(hyper["betas"])
        pg.append({**hyper, "params": g["params"]})
    opt.load_state_dict({"state": state, "param_groups": pg})


def stream_segments(layout: Sequence[tuple[str, int]], tied: Collection[str]) -> list[tuple[int, int]]:
    """Streaming CO2's segments of a stage's flat vector (*layout*: its parameters' names and sizes in
    order): every *tied* parameter alone, the runs between them whole. A tied parameter's elements then
    fall in the same fragments on every stage that holds a copy (the fragment cut of a segment depends only
    on its size), so the copies, averaged at the same steps with the same values, stay identical."""
    out: list[tuple[int, int]] = []
    off, run = 0, 0
    for name, n in layout:
        if name in tied:
            if off > run:
                out.append((run, off))
            out.append((off, off + n))
            run = off + n
        off += n
    if off > run or not out:
        out.append((run, off))
    return out


__all__ = ["StageState", "load_optimizer_tensors", "merge_states", "momentum_slices", "optimizer_tensors",
           "stream_segments"]
