"""OP-DAG: tracing (torch.export -> ATen graph), op whitelist, coarsening, stage programs, RAD executor.

Typical flow (publisher, planner, stage nodes)::

    dag = trace(model, (idx, targets))                 # loss computed inside; targets a graph input
    blob = encode_dag(dag)                             # msgpack + raw tensor bytes, no pickle
    coarse = coarsen(dag); wl = to_workload(coarse, micro_batch=8)   # for the planner
    programs = partition(coarse, stages_from_fences(len(coarse.units), fences))
    ex = StageExecutor(decode_stage(encode_stage(programs[s])), device="cuda")
    outs = ex.forward(micro, inputs); grads_in = ex.backward(micro, grad_outputs)

See docs/graph.md.
"""

from typing import TYPE_CHECKING, Any

from fusionp2p.graph.coarsen import CoarseDAG, CoarseUnit, coarsen, stages_from_fences
from fusionp2p.graph.dag import InputSpec, OpDAG, OpNode, Ref, TensorMeta
from fusionp2p.graph.executor import Inbox, StageExecutor
from fusionp2p.graph.local import LocalPipeline
from fusionp2p.graph.ops import WHITELIST
from fusionp2p.graph.partition import partition, single_stage
from fusionp2p.graph.program import DATA, BoundaryIn, BoundaryOut, StageProgram
from fusionp2p.graph.trace import load_into, trace
from fusionp2p.graph.workload import to_workload

if TYPE_CHECKING:
    from fusionp2p.wire.dag import decode_dag, decode_stage, encode_dag, encode_stage

# wire/dag.py imports this package's data model, so its functions are re-exported lazily
_WIRE = ("decode_dag", "decode_stage", "encode_dag", "encode_stage")


def __getattr__(name: str) -> Any:
    if name in _WIRE:
        from fusionp2p.wire import dag as _wire_dag

        return getattr(_wire_dag, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
    "decode_dag",
    "decode_stage",
    "encode_dag",
    "encode_stage",
    "load_into",
    "partition",
    "single_stage",
    "stages_from_fences",
    "to_workload",
    "trace",
]
