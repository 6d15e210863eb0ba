"""The planner's view of a DAG: coarse units with costs, and the bytes between them.

``to_workload(dag, micro_batch)`` turns a (coarsened) OpDAG into a
:class:`fusionp2p.types.WorkloadGraph`: one Unit per coarse unit, in topological order, and one
Edge per pair of units that exchange tensors. Costs come from the trace: forward FLOPs counted by
``torch.utils.flop_counter`` per ATen op, backward taken as twice the forward (the usual estimate;
ALGORITHMS.md §1.4), activation bytes as the bytes every op of the unit produces, parameter bytes as
the tensors the unit reads (a tied weight counted once, in its first unit), and the largest
trainable one of them (a micro-batch's new gradient of it is a transient the planner prices). The DAG was traced for
``dag.batch_size`` samples; per-sample costs (FLOPs, activations, edge bytes) scale linearly to
*micro_batch*. Replicated nodes (built from constants only) never become edges.
"""

from __future__ import annotations

from fusionp2p.errors import ConfigError
from fusionp2p.graph.coarsen import CoarseDAG, coarsen
from fusionp2p.graph.dag import OpDAG
from fusionp2p.graph.partition import replicable_nodes
from fusionp2p.types import Edge, Unit, WorkloadGraph


def to_workload(graph: OpDAG | CoarseDAG, micro_batch: int) -> WorkloadGraph:
    """The WorkloadGraph of *graph* for micro-batches of *micro_batch* samples."""
    if micro_batch <= 0:
        raise ConfigError("micro_batch must be positive")
    coarse = graph if isinstance(graph, CoarseDAG) else coarsen(graph)
    dag = coarse.dag
    scale = micro_batch / dag.batch_size
    unit_of = coarse.unit_of()
    specs = {i.name: i for i in dag.inputs}
    nodes = {n.name: n for n in dag.nodes}
    shared = replicable_nodes(dag)
    counted: set[str] = set()
    edge_bytes: dict[tuple[int, int], int] = {}
    seen_edges: set[tuple[str, int]] = set()
    units: list[Unit] = []
    for j, u in enumerate(coarse.units):
        flops = 0.0
        act = 0
        params = largest = 0
        for name in u.nodes:
            n = nodes[name]
            flops += n.flops
            act += n.out_bytes
            for r in n.refs():
                spec = specs.get(r)
                if spec is not None:
                    if spec.kind != "input" and r not in counted:
                        counted.add(r)
                        params += spec.meta.nbytes
                        if spec.kind == "param":
                            largest = max(largest, spec.meta.nbytes)
                    continue
                i = unit_of[r]
                if i == j or r in shared or (r, j) in seen_edges:
                    continue
                seen_edges.add((r, j))
                src = nodes[r]
                nbytes = src.out[0].nbytes if not src.multi and src.out[0] is not None else 0
                edge_bytes[(i, j)] = edge_bytes.get((i, j), 0) + round(nbytes * scale)
        units.append(Unit(name=u.name, kind=u.kind, fwd_flops=flops * scale, bwd_flops=2.0 * flops * scale,
                          param_bytes=params, act_bytes=round(act * scale), max_param_bytes=largest))
    edges = tuple(Edge(src=i, dst=j, nbytes=b) for (i, j), b in sorted(edge_bytes.items()))
    return WorkloadGraph(units=tuple(units), edges=edges, micro_batch=micro_batch)
