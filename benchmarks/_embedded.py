"""One job on the embedded swarm, as the cost benchmarks run it (benchmarks.shadow_cost, benchmarks.spot_cost).

Apart from ``_common`` because it imports the job stack (seconds of start-up that ``benchmarks.report`` and
the process benchmarks' parents need not pay).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from torch import nn

from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.build import BuiltJob, build_job
from fusionp2p.jobs.content import ContentService, ContentStore
from fusionp2p.jobs.embedded import EmbeddedConfig, open_embedded_swarm
from fusionp2p.jobs.host import NodeJobConfig
from fusionp2p.jobs.publisher import DriverConfig, Publisher
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.train.config import TrainConfig


@asynccontextmanager
async def embedded_job(nodes: int, home: Path, *, jobs: NodeJobConfig, model: nn.Module, dataset: BuiltinCorpus,
                       cfg: TrainConfig, nonce: bytes) -> AsyncIterator[tuple[Publisher, BuiltJob]]:
    """*nodes* embedded nodes (the node job service as in ``fusionp2p node``, one process, the in-memory
    transport: every message a real JOB request, every bundle fetched through the content store), all joined,
    and a publisher on a host of its own, running, with the job built and signed for it.

    Yields ``(publisher, built)``: the caller runs ``publisher.run_job(built, ...)`` (and whatever it measures
    around it) inside; the publisher and the swarm stop on exit. The caller sets the deadline.
    """
    async with open_embedded_swarm([TEST_PROFILE] * nodes, home, config=EmbeddedConfig(jobs=jobs)) as emb, \
            trio.open_nursery() as nursery:
        client = emb.add_host()
        boot = await client.connect(emb.bootstrap_addr)
        pub = Publisher(client, ContentService(client, ContentStore()), [boot], DriverConfig(idle_timeout=120))
        await nursery.start(pub.run)
        # tracing takes seconds of CPU: off the event loop, which runs every node of the swarm
        built = await trio.to_thread.run_sync(lambda: build_job(
            model, None, dataset, cfg, publisher=client.peer_id, sign=client.sign, now=1.0, nonce=nonce * 16))
        try:
            yield pub, built
        finally:
            nursery.cancel_scope.cancel()
