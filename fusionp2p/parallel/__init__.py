"""AxoNN-style 4D tensor parallelism inside a fast cluster, on torch.distributed (ALGORITHMS.md §3).

The communication model and configuration search are pure and live in :mod:`fusionp2p.plan.axonn`;
this package holds the torch.distributed side: rendezvous, process groups, the parallel linear
layers with their overlaps, module conversion and the measured trial of candidate configurations.
"""

from fusionp2p.parallel.comm import Comm, CommCounter, Handle, ProcessGrid
from fusionp2p.parallel.convert import (
    ParallelLinearIO,
    ParallelMLP,
    gather_batch,
    gather_features,
    gather_full_weight,
    gather_output,
    parallelize_gpt2_block,
    parallelize_linears,
    scatter_features,
    shard_batch,
    shard_input,
)
from fusionp2p.parallel.linear import OverlapConfig, TensorParallel, TensorParallelLinear
from fusionp2p.parallel.rendezvous import (
    RendezvousSpec,
    init_distributed,
    launch_local,
    select_device,
    shutdown,
)
from fusionp2p.parallel.search import (
    TrialConfig,
    TrialResult,
    choose_config,
    measure_bandwidth,
    measure_config,
)

__all__ = [
    "Comm",
    "CommCounter",
    "Handle",
    "OverlapConfig",
    "ParallelLinearIO",
    "ParallelMLP",
    "ProcessGrid",
    "RendezvousSpec",
    "TensorParallel",
    "TensorParallelLinear",
    "TrialConfig",
    "TrialResult",
    "choose_config",
    "gather_batch",
    "gather_features",
    "gather_full_weight",
    "gather_output",
    "init_distributed",
    "launch_local",
    "measure_bandwidth",
    "measure_config",
    "parallelize_gpt2_block",
    "parallelize_linears",
    "scatter_features",
    "select_device",
    "shard_batch",
    "shard_input",
    "shutdown",
]
