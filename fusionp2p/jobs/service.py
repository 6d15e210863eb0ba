"""Job worker attached to a node daemon: installs the node's job service (``jobs/node.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import trio

from fusionp2p.jobs.node import NodeJobConfig, NodeJobService
from fusionp2p.swarm.node import SwarmNode


def attach_worker(home: Path, config: NodeJobConfig | None = None) -> Callable[[SwarmNode, trio.Nursery], None]:
    """Return the daemon hook that starts the node's job service in the daemon's nursery.

    The service serves the JOB control protocol, fetches job content by hash, joins plan
    elections, and trains its stage over the encrypted data plane. A job's failure is reported to
    its publisher and never ends the node.
    """

    def hook(swarm: SwarmNode, nursery: trio.Nursery) -> None:
        nursery.start_soon(NodeJobService(swarm, home, config).run)

    return hook


__all__ = ["attach_worker"]
