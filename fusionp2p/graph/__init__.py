"""OP-DAG: tracing (torch.export -> ATen graph), op whitelist, coarsening, stage programs, RAD executor.

Typical flow (publisher, planner, stage nodes)::

    dag = trace(model, (idx, targets))                 # loss computed inside; targets a graph input
    blob = wire.dag.encode_dag(dag)                    # msgpack + raw tensor bytes, no pickle (wire/)
    coarse = coarsen(dag); wl = to_workload(coarse, micro_batch=8)   # for the planner
    programs = partition(coarse, stages_from_fences(len(coarse.units), fences))
    ex = StageExecutor(programs[s], device="cuda")
    outs = ex.forward(micro, inputs); grads_in = ex.backward(micro, grad_outputs)

See docs/graph.md.
"""

from fusionp2p.graph.coarsen import CoarseDAG, CoarseUnit, coarsen, stages_from_fences
from fusionp2p.graph.dag import InputSpec, OpDAG, OpNode, Ref, TensorMeta
from fusionp2p.graph.executor import Inbox, StageExecutor
from fusionp2p.graph.local import LocalPipeline
from fusionp2p.graph.ops import WHITELIST
from fusionp2p.graph.partition import partition, single_stage
from fusionp2p.graph.program import DATA, BoundaryIn, BoundaryOut, StageProgram
from fusionp2p.graph.trace import load_into, trace
from fusionp2p.graph.workload import to_workload

__all__ = [
    "DATA",
    "WHITELIST",
    "BoundaryIn",
    "BoundaryOut",
    "CoarseDAG",
    "CoarseUnit",
    "Inbox",
    "InputSpec",
    "LocalPipeline",
    "OpDAG",
    "OpNode",
    "Ref",
    "StageExecutor",
    "StageProgram",
    "TensorMeta",
    "coarsen",
    "load_into",
    "partition",
    "single_stage",
    "stages_from_fences",
    "to_workload",
    "trace",
]
