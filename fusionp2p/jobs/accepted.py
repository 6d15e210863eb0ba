"""What a node holds of a job it accepted (``jobs/build.NodeJobs`` makes it): a module of its own, below both
``jobs/build.py`` and ``jobs/data_shards.py``, which build imports (data_shards needed only this of build)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusionp2p.graph import OpDAG
from fusionp2p.jobs.spec import JobSpec
from fusionp2p.wire.pieces import WeightManifest


@dataclass(kw_only=True)
class AcceptedJob:
    """What a node holds after verifying a job: the spec, the DAG (its tensors on the ``meta`` device
    until a stage's are fetched), the weight manifest naming their pieces, the data."""

    spec: JobSpec
    dag: OpDAG
    tokens: Any       # np.ndarray, ShardedTokens or ShardedExamples
    envelope: bytes = b""   # the publisher-signed spec (offered on to joiners)
    weights: WeightManifest | None = None


__all__ = ["AcceptedJob"]
