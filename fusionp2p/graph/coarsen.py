"""Coarsening: group the thousands of ATen nodes into tens of layer-level units.

Rule. Each node carries the module path that issued it (``scope``). Its *key* is the path cut just
after the first numbered child of a container that is iterated in Python (an ``nn.ModuleList``:
``blocks.3.attn.c_attn`` -> ``blocks.3``; ``transformer.h.0.mlp`` -> ``transformer.h.0``), or its
first component when there is none (``embed.wte`` -> ``embed``; a ``Sequential`` such as ``stem.0`` is
called as a whole, so it stays ``stem``). Top-level code (``F.cross_entropy`` in ``forward``) has the
empty key. A unit is a maximal run of consecutive nodes (in topological order) with the same key, so
each unit is an interval of the order and every edge between units goes forward: the planner can
put fences between any two units. The fine graph stays untouched and available as ``coarse.dag``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fusionp2p.errors import ConfigError
from fusionp2p.graph.dag import OpDAG, OpNode


@dataclass(frozen=True, slots=True, kw_only=True)
class CoarseUnit:
    name: str                 # the key, with "@k" appended for its k-th further run
    kind: str                 # "embedding", "block", "head", "loss", "ops", ...
    nodes: tuple[str, ...]    # fine node names, in topological order


@dataclass(frozen=True, slots=True, kw_only=True)
class CoarseDAG:
    """An OpDAG plus a grouping of its nodes into consecutive units."""

    dag: OpDAG
    units: tuple[CoarseUnit, ...]

    def unit_of(self) -> dict[str, int]:
        return {n: i for i, u in enumerate(self.units) for n in u.nodes}

    def assignment(self, unit_stages: Sequence[int]) -> dict[str, int]:
        """Fine assignment (node -> stage) from one stage index per unit."""
        if len(unit_stages) != len(self.units):
            raise ConfigError(f"assignment has {len(unit_stages)} entries for {len(self.units)} units")
        return {n: int(s) for u, s in zip(self.units, unit_stages) for n in u.nodes}


def stages_from_fences(n_units: int, fences: Sequence[int]) -> list[int]:
    """Stage index per unit when a new stage starts at each unit index in *fences* (ascending, in 1..n-1)."""
    fs = list(fences)
    if fs != sorted(set(fs)) or any(not 0 < f < n_units for f in fs):
        raise ConfigError(f"fences {fs} must be distinct, ascending and inside 1..{n_units - 1}")
    out, stage = [], 0
    for i in range(n_units):
        if stage < len(fs) and i == fs[stage]:
            stage += 1
        out.append(stage)
    return out


def _key(scope: str, scope_types: dict[str, str]) -> str:
    if not scope:
        return ""
    parts = scope.split(".")
    for i in range(1, len(parts)):
        if parts[i].isdigit():
            parent = ".".join(parts[:i])
            # a container that was called as a module (Sequential) is one unit; an iterated ModuleList is not
            if scope_types.get(parent, "ModuleList") == "ModuleList":
                return ".".join(parts[: i + 1])
    return parts[0]


def _kind(key: str, nodes: Sequence[OpNode], loss: str | None, scope_types: dict[str, str]) -> str:
    if not key:
        return "loss" if loss is not None and any(n.name == loss for n in nodes) else "ops"
    t = scope_types.get(key, "").lower()
    for word, kind in (("embed", "embedding"), ("block", "block"), ("layer", "block"), ("head", "head"),
                       ("conv", "conv"), ("linear", "linear"), ("norm", "norm")):
        if word in t or word in key.rsplit(".", 1)[-1].lower():
            return kind
    return t or "ops"


def coarsen(dag: OpDAG) -> CoarseDAG:
    """Group *dag*'s nodes into layer-level units (see the module docstring). Deterministic."""
    types = dict(dag.scope_types)
    runs: list[tuple[str, list[OpNode]]] = []
    for n in dag.nodes:
        k = _key(n.scope, types)
        if runs and runs[-1][0] == k:
            runs[-1][1].append(n)
        else:
            runs.append((k, [n]))
    seen: dict[str, int] = {}
    units: list[CoarseUnit] = []
    for k, nodes in runs:
        c = seen.get(k, 0)
        seen[k] = c + 1
        base = k or "top"
        units.append(CoarseUnit(name=base if c == 0 else f"{base}@{c}", kind=_kind(k, nodes, dag.loss, types),
                                nodes=tuple(n.name for n in nodes)))
    return CoarseDAG(dag=dag, units=tuple(units))
