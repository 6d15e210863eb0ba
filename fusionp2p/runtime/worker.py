"""Job worker attached to a node daemon (filled in by the jobs runtime)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import trio

from fusionp2p.runtime.swarm import SwarmNode


def attach_worker(home: Path) -> Callable[[SwarmNode, trio.Nursery], None] | None:
    """Return a hook that starts the node's job services, or None when there are none."""
    return None
