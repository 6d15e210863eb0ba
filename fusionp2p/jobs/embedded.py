"""An embedded swarm: a bootstrap and N nodes in this trio.run, running exactly what ``fusionp2p node`` runs.

Every node is a real :class:`~fusionp2p.swarm.node.SwarmNode` (heartbeats, membership, optional
probes, VIEW) with a real :class:`~fusionp2p.jobs.node.NodeJobService` (JOB protocol, content
store, plan election, the encrypted TCP data plane on 127.0.0.1, stage workers, checkpoints) over
the in-memory transport (``net/memory.py``) instead of libp2p. ``Swarm.local`` in the SDK is this
plus a :class:`~fusionp2p.jobs.publisher.Publisher`, the same one ``Swarm.connect`` uses, so the
embedded and the real swarm run one job path (tests/integration/test_job_conformance.py runs the
same checks against both).

Nodes can be stopped individually: :meth:`EmbeddedSwarm.kill` makes one vanish at once (its streams
break, its tasks are cancelled, like a SIGKILL), :meth:`EmbeddedSwarm.leave` makes it announce its
departure first (like SIGTERM), and :meth:`EmbeddedSwarm.add_node` starts another one (a joiner,
or a restart under the same identity).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from fusionp2p.errors import ConfigError
from fusionp2p.jobs.node import NodeJobConfig, NodeJobService
from fusionp2p.net.identity import Identity
from fusionp2p.net.memory import MemoryNetwork, MemoryTransport, memory_network
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.types import DeviceProfile

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddedConfig:
    """Settings of an embedded swarm (fast heartbeats: everything is in one process)."""

    heartbeat: float = 0.25
    dead_timeout: float = 5.0          # training shares the process: a busy event loop must not look dead
    probing: bool = False              # links are not measured on the in-memory transport
    jobs: NodeJobConfig = field(default_factory=NodeJobConfig)
    join_timeout: float = 30.0         # every node seen alive by the bootstrap within this

    def __post_init__(self) -> None:
        if not (0 < self.heartbeat < self.dead_timeout) or self.join_timeout <= 0:
            raise ConfigError("EmbeddedConfig: need 0 < heartbeat < dead_timeout and a positive join_timeout")

    def swarm(self, role: str = "node") -> SwarmConfig:
        return SwarmConfig(role=role, heartbeat=self.heartbeat, dead_timeout=self.dead_timeout, probing=self.probing)


@dataclass
class EmbeddedNode:
    """One node of the embedded swarm and the scope that stops it."""

    index: int
    identity: Identity
    swarm: SwarmNode
    jobs: NodeJobService
    scope: trio.CancelScope
    stopped: trio.Event

    @property
    def peer_id(self) -> str:
        return self.swarm.peer_id


class EmbeddedSwarm:
    """Handle on a running embedded swarm; create with :func:`open_embedded_swarm`."""

    def __init__(self, net: MemoryNetwork, bootstrap: SwarmNode, home: Path, config: EmbeddedConfig,
                 nursery: trio.Nursery) -> None:
        self.net = net
        self.bootstrap = bootstrap
        self.home = home
        self.config = config
        self.nodes: list[EmbeddedNode] = []
        self._nursery = nursery

    @property
    def bootstrap_addr(self) -> str:
        return self.bootstrap.transport.listen_addrs()[0]

    def alive(self) -> list[EmbeddedNode]:
        return [n for n in self.nodes if not n.stopped.is_set()]

    def add_host(self, identity: Identity | None = None) -> MemoryTransport:
        """A bare transport on this network (a publisher or a client)."""
        return self.net.add_host(identity)

    async def add_node(self, profile: DeviceProfile, *, identity: Identity | None = None) -> EmbeddedNode:
        """Start one more node (a fresh identity, or *identity* to restart a node that died)."""
        node: EmbeddedNode = await self._nursery.start(self._run_node, len(self.nodes), profile, identity)
        self.nodes.append(node)
        return node

    async def _run_node(self, index: int, profile: DeviceProfile, identity: Identity | None, *,
                        task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        identity = identity or Identity.generate()
        transport = self.net.add_host(identity)
        swarm = SwarmNode(transport, self.config.swarm(), profile)
        stopped = trio.Event()
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    await nursery.start(swarm.run, [self.bootstrap_addr])
                    service = NodeJobService(swarm, self.home / f"node{index}-{swarm.peer_id[-8:]}", self.config.jobs)
                    await nursery.start(service.run)
                    task_status.started(EmbeddedNode(index=index, identity=identity, swarm=swarm, jobs=service,
                                                     scope=scope, stopped=stopped))
        finally:
            stopped.set()

    def kill(self, node: EmbeddedNode) -> None:
        """Stop *node* at once, without a goodbye (its peers see it go silent, like a SIGKILL)."""
        self.net.kill(node.peer_id)
        node.scope.cancel()

    async def leave(self, node: EmbeddedNode) -> None:
        """Stop *node* after it announced its departure (like SIGTERM)."""
        await node.swarm.leave()
        node.scope.cancel()
        await node.stopped.wait()
        self.net.kill(node.peer_id)

    async def wait_members(self, n: int, timeout: float | None = None) -> None:
        """Until the bootstrap sees exactly *n* live nodes (TooSlowError after *timeout*)."""
        await self.bootstrap.wait_until(lambda: len(self.bootstrap.members()) == n,
                                        self.config.join_timeout if timeout is None else timeout)


@asynccontextmanager
async def open_embedded_swarm(profiles: Sequence[DeviceProfile], home: str | Path, *,
                              config: EmbeddedConfig | None = None) -> AsyncIterator[EmbeddedSwarm]:
    """A bootstrap and one node per profile, all joined (the bootstrap sees them alive) on entry."""
    cfg = config or EmbeddedConfig()
    root = Path(home)
    async with memory_network() as net, trio.open_nursery() as nursery:
        boot = SwarmNode(net.add_host(), cfg.swarm("bootstrap"), None)
        await nursery.start(boot.run, [])
        emb = EmbeddedSwarm(net, boot, root, cfg, nursery)
        for prof in profiles:
            await emb.add_node(prof)
        await emb.wait_members(len(profiles))
        try:
            yield emb
        finally:
            nursery.cancel_scope.cancel()


__all__ = ["EmbeddedConfig", "EmbeddedNode", "EmbeddedSwarm", "open_embedded_swarm"]
