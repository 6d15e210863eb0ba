"""fusionp2p: peer-to-peer decentralized training (FusionLLM OP-DAG + OP-Fence + AdaTopK, CO2, AxoNN).

The public API::

    import fusionp2p as fp
    with fp.Swarm.local(n_nodes=4) as swarm:                       # or fp.Swarm.connect(bootstrap=[...])
        job = swarm.publish(model=model, dataset=fp.data.BuiltinCorpus(seq_len=64),
                            config=fp.TrainConfig(steps=100, micro_batch=8, micro_batches=4, averaging=fp.CO2(tau=4)))
        for event in job.events(): ...
        job.wait(); job.download("out/")

Heavy parts (torch, the SDK) load on first use, so that ``fusionp2p bootstrap`` and ``fusionp2p
status`` start quickly and never import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from fusionp2p.errors import (
    ConfigError,
    FusionError,
    IntegrityError,
    JobError,
    LocalProtocolError,
    PeerUnavailable,
    PlanError,
    ProtocolError,
    RemoteProtocolError,
)

__version__ = "0.1.0"

_LAZY = {
    "Swarm": ("fusionp2p.sdk", "Swarm"),
    "Job": ("fusionp2p.sdk", "Job"),
    "TrainConfig": ("fusionp2p.train.config", "TrainConfig"),
    "CO2": ("fusionp2p.train.config", "CO2"),
    "AdaTopK": ("fusionp2p.train.config", "AdaTopK"),
    "LRSchedule": ("fusionp2p.train.config", "LRSchedule"),
    "trace": ("fusionp2p.graph", "trace"),
    "empty_parameters": ("fusionp2p.jobs.publish_file", "empty_parameters"),
    "data": ("fusionp2p.data", None),
    "models": ("fusionp2p.models", None),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'fusionp2p' has no attribute {name!r}") from None
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


__all__ = [
    "CO2",
    "AdaTopK",
    "ConfigError",
    "FusionError",
    "IntegrityError",
    "Job",
    "JobError",
    "LRSchedule",
    "LocalProtocolError",
    "PeerUnavailable",
    "PlanError",
    "ProtocolError",
    "RemoteProtocolError",
    "Swarm",
    "TrainConfig",
    "__version__",
    "data",
    "empty_parameters",
    "models",
    "trace",
]
