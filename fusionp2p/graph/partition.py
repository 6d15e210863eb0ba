"""Partitioning: an OpDAG plus an assignment of its nodes to stages -> one StageProgram per stage.

Rules (each violation is a ConfigError saying what to change):

* an assignment gives a stage to every operator node (directly, or per coarse unit);
* data flows forward only: a node never reads a value from a later stage (else stages would wait on
  each other in a cycle);
* ``getitem`` nodes live with the operator whose sequence they read (sequences never cross stages);
* nodes that depend on no data input and no parameter (index ranges, masks built from constants) are
  *replicated* into every stage that reads them instead of being sent: they are cheap and carry no
  gradient;
* a parameter read by several stages (tied input and output embeddings) is copied to each of them
  and listed in their ``tied`` entries: one logical parameter whose gradients the holders sum every
  step (see :class:`~fusionp2p.graph.program.TiedParam`); buffers and constants are copied, read-only,
  to every stage that reads them;
* a parameter or buffer that no operator reads (a pooler a head does not use) is kept on the last
  stage, so that checkpoints and the download hold every tensor of the model's ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fusionp2p.errors import ConfigError
from fusionp2p.graph.coarsen import CoarseDAG, coarsen
from fusionp2p.graph.dag import InputSpec, OpDAG, OpNode, Ref, TensorMeta
from fusionp2p.graph.ops import GETITEM
from fusionp2p.graph.program import DATA, BoundaryIn, BoundaryOut, StageProgram, TiedParam


def single_stage(dag: OpDAG) -> StageProgram:
    """The whole DAG as one stage program (for one node, or to check tracing)."""
    return partition(dag, {n.name: 0 for n in dag.nodes})[0]


def replicable_nodes(dag: OpDAG) -> set[str]:
    """Nodes that depend on no data input and no parameter (transitively): copied, never sent."""
    kinds = {i.name: i.kind for i in dag.inputs}
    out: set[str] = set()
    for n in dag.nodes:
        if all(kinds.get(r) in ("buffer", "constant") or r in out for r in n.refs()):
            out.add(n.name)
    return out


def partition(graph: OpDAG | CoarseDAG, assignment: Mapping[str, int] | Sequence[int]) -> list[StageProgram]:
    """Cut *graph* into stage programs.

    *assignment* is either a mapping from every fine node name to its stage, or a sequence with one
    stage per coarse unit (``graph`` is then coarsened first if it is a plain OpDAG). Stages are
    numbered 0..S-1 and none may be empty.
    """
    if isinstance(assignment, Mapping):
        dag = graph.dag if isinstance(graph, CoarseDAG) else graph
        fine = dict(assignment)
    else:
        coarse = graph if isinstance(graph, CoarseDAG) else coarsen(graph)
        dag = coarse.dag
        fine = coarse.assignment(assignment)
    missing = [n.name for n in dag.nodes if n.name not in fine]
    if missing:
        raise ConfigError(f"assignment misses {len(missing)} nodes, e.g. {missing[:3]}")
    num_stages = max(fine.values(), default=0) + 1
    if min(fine.values(), default=0) < 0:
        raise ConfigError("stage indices must be >= 0")
    kinds = {i.name: i.kind for i in dag.inputs}
    by_name = {n.name: n for n in dag.nodes}
    specs = {i.name: i for i in dag.inputs}

    replicable = replicable_nodes(dag)

    stage_of: dict[str, int] = {}
    for n in dag.nodes:
        s = fine[n.name]
        if n.op == GETITEM and isinstance(n.args[0], Ref):
            s = stage_of[n.args[0].name]
        stage_of[n.name] = s
        for r in n.refs():
            if r in stage_of and r not in replicable and stage_of[r] > s:
                raise ConfigError(f"node {n.name!r} on stage {s} reads {r!r} from the later stage {stage_of[r]}; "
                                  "assign stages in topological order")

    # stages that hold each node: its own, or (replicated) every stage that reads it
    consumers = dag.consumers()
    holders: dict[str, set[int]] = {}
    for n in reversed(dag.nodes):
        if n.name in replicable and consumers[n.name]:
            holders[n.name] = set().union(*(holders[c] for c in consumers[n.name]))
        else:
            holders[n.name] = {stage_of[n.name]}

    programs = []
    recv_by_stage: list[dict[str, int]] = []
    stage_nodes = []
    for s in range(num_stages):
        nodes = [n for n in dag.nodes if s in holders[n.name]]
        if not any(n.name not in replicable for n in nodes):
            raise ConfigError(f"stage {s} has no operators")
        local = {n.name for n in nodes}
        recv: dict[str, int] = {}
        for n in nodes:
            for r in n.refs():
                if r in local or r in recv:
                    continue
                if r in kinds:
                    if kinds[r] == "input":
                        recv[r] = DATA
                else:
                    recv[r] = stage_of[r]
        recv_by_stage.append(recv)
        stage_nodes.append(nodes)

    param_users: dict[str, list[int]] = {}
    for s in range(num_stages):
        for r in dict.fromkeys(r for n in stage_nodes[s] for r in n.refs()):
            if kinds.get(r) == "param":
                param_users.setdefault(r, []).append(s)
    read = {r for n in dag.nodes for r in n.refs()}
    unused = [i.name for i in dag.inputs if i.kind in ("param", "buffer") and i.name not in read]

    for s in range(num_stages):
        nodes = stage_nodes[s]
        recv = recv_by_stage[s]
        dsts = {}
        for n in nodes:
            if n.name in replicable or n.multi:
                continue
            d = tuple(t for t in range(s + 1, num_stages) if recv_by_stage[t].get(n.name) == s)
            if d or (n.name in dag.outputs and n.name != dag.loss):
                dsts[n.name] = d
        state: list[InputSpec] = []
        used = dict.fromkeys(r for n in nodes for r in n.refs() if r in kinds and kinds[r] != "input")
        if s == num_stages - 1:
            used.update(dict.fromkeys(unused))
        state.extend(specs[name] for name in used)
        tied = tuple(TiedParam(name=name, stages=tuple(param_users[name])) for name in used
                     if kinds[name] == "param" and len(param_users.get(name, ())) > 1)
        recv_list = tuple(BoundaryIn(name=r, meta=_meta(specs, by_name, r), src=src) for r, src in recv.items())
        inputs = tuple(InputSpec(name=b.name, kind="input", meta=b.meta) for b in recv_list) + tuple(state)
        send = tuple(BoundaryOut(name=k, meta=_meta(specs, by_name, k), dsts=v) for k, v in dsts.items())
        loss = dag.loss if dag.loss is not None and dag.loss in {n.name for n in nodes} else None
        prog = StageProgram(stage=s, num_stages=num_stages, inputs=inputs, recv=recv_list, nodes=tuple(nodes),
                            send=send, loss=loss, tensors={i.name: dag.tensors[i.name] for i in state}, tied=tied)
        prog.check(ConfigError)
        programs.append(prog)
    if dag.loss is not None and programs[-1].loss is None:
        raise ConfigError("the loss must be computed on the last stage; assign the loss unit to it")
    return programs


def _meta(specs: Mapping[str, InputSpec], by_name: Mapping[str, OpNode], name: str) -> TensorMeta:
    m = specs[name].meta if name in specs else (None if by_name[name].multi else by_name[name].out[0])
    if m is None:
        raise ConfigError(f"{name!r} is not a single tensor and cannot cross a stage boundary")
    return m
