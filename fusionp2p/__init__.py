"""fusionp2p: peer-to-peer decentralized training (FusionLLM OP-DAG + OP-Fence + AdaTopK, CO2, AxoNN)."""

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

__all__ = [
    "ConfigError",
    "FusionError",
    "IntegrityError",
    "JobError",
    "LocalProtocolError",
    "PeerUnavailable",
    "PlanError",
    "ProtocolError",
    "RemoteProtocolError",
    "__version__",
]
