"""The ops service of a daemon: the state reader and the HTTP server, under one task."""

from __future__ import annotations

from typing import Any

import trio

from fusionp2p.ops.http import HttpConfig, serve_http
from fusionp2p.ops.state import JobSource, OpsLimits, OpsState
from fusionp2p.swarm.node import SwarmNode


async def serve_ops(swarm: SwarmNode, config: HttpConfig, *, jobs: JobSource | None = None,
                    limits: OpsLimits | None = None, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Serve *swarm*'s (and *jobs*') state over HTTP until cancelled; ``task_status.started(url)``."""
    state = OpsState(swarm, jobs, limits or OpsLimits())
    async with trio.open_nursery() as nursery:
        await nursery.start(state.run)
        url = await nursery.start(serve_http, state, config)
        task_status.started(url)


__all__ = ["serve_ops"]
