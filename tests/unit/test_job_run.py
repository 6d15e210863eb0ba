"""A job's failure or cancellation ends the job, never the node: ``NodeJobService._run`` with a stand-in
for the training (no swarm, no plan)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio

from fusionp2p.errors import PeerUnavailable
from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.jobs.node import NodeJobService, _Job
from fusionp2p.net.memory import memory_network


def test_a_cancel_racing_a_failing_send_ends_the_job_not_the_node(tmp_path: Path) -> None:
    """The publisher cancels while one of the job's tasks fails (a send to a peer that has already
    stopped): the job's nursery raises Cancelled and PeerUnavailable together; the job ends cancelled
    and ``_run`` returns (it used to re-raise the PeerUnavailable and take the node process down)."""
    reports: list[tuple[JobState, str]] = []

    async def main() -> None:
        with trio.fail_after(10):
            async with memory_network() as net:
                service = NodeJobService(SimpleNamespace(transport=net.add_host()), tmp_path)  # type: ignore[arg-type]
                training = trio.Event()

                async def train(nj: _Job, snap: Any) -> dict[str, Any]:
                    async def send_to_a_stopped_peer() -> None:
                        try:
                            await trio.sleep_forever()
                        finally:
                            raise PeerUnavailable("peer-b", "channel closed by peer")

                    async with trio.open_nursery() as n:
                        n.start_soon(send_to_a_stopped_peer)
                        n.start_soon(trio.sleep_forever)
                        training.set()
                    return {}

                async def report(nj: _Job, state: JobState, reason: str, result: Any) -> None:
                    reports.append((state, reason))

                service._train = train  # type: ignore[method-assign]
                service._report = report  # type: ignore[method-assign]
                nj = _Job(accepted=SimpleNamespace(spec=SimpleNamespace(job_id="j1")), publisher="pub")  # type: ignore[arg-type]
                async with trio.open_nursery() as n:
                    n.start_soon(service._run, nj, None)
                    await training.wait()
                    assert nj.scope is not None
                    nj.scope.cancel()  # the publisher's cancel
                assert nj.state == JobState.CANCELLED

    trio.run(main)
    assert reports == [(JobState.CANCELLED, "cancelled by the publisher")]
