"""An embedded swarm: a bootstrap and N nodes in this trio.run, running exactly what ``fusionp2p node`` runs.

Every node is a real :class:`~fusionp2p.swarm.node.SwarmNode` (heartbeats, membership, optional
probes, VIEW) with a real :class:`~fusionp2p.jobs.node.NodeJobService` (JOB protocol, content
store, plan election, the encrypted TCP data plane on 127.0.0.1, stage workers, checkpoints) over
the in-memory transport (``net/memory.py``) instead of libp2p. ``Swarm.local`` in the SDK is this
plus a :class:`~fusionp2p.jobs.publisher.Publisher`, the same one ``Swarm.connect`` uses, so the
embedded and the real swarm run one job path (tests/integration/test_job_conformance.py runs the
same checks against both).

With ``links`` (``EmbeddedConfig.links``: node index pairs -> rate) the swarm emulates a WAN on one
machine (``net/shaping.py``): the in-memory transport and the TCP data plane between those nodes move at
the given rates, the nodes probe their links as they would on a WAN (so the planner sees the measured
rates and AdaTopK compresses the slow fences), and ``open_embedded_swarm`` returns once every pair is
measured. Rates only: latency is not emulated.

Nodes can be stopped individually: :meth:`EmbeddedSwarm.kill` makes one vanish at once (its streams
break, its tasks are cancelled, like a SIGKILL), :meth:`EmbeddedSwarm.leave` makes it announce its
departure first (like SIGTERM), and :meth:`EmbeddedSwarm.add_node` starts another one (a joiner,
or a restart under the same identity). ``add_node(profile, startup=Startup(...))`` starts one whose
start-up is deferred as ``fusionp2p node``'s is (``swarm/startup.py``): it joins without a profile, a JOB
request before its start-up starts it (``Startup.early_job``), and once the start-up is wanted the node
takes *profile* (its "device benchmark"), announces it and starts its job service.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from fusionp2p.errors import ConfigError
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.node import NodeJobConfig, NodeJobService
from fusionp2p.net.identity import Identity
from fusionp2p.net.memory import MemoryNetwork, MemoryTransport, memory_network
from fusionp2p.net.shaping import LinkEmulator
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.startup import Startup
from fusionp2p.testbed.netns import parse_rate
from fusionp2p.types import DeviceProfile
from fusionp2p.wire.protocols import JOB

log = logging.getLogger(__name__)


LinkRate = float | str    # bytes/s, or a tc-style rate such as "20mbit" (bits/s)


def link_rate(rate: LinkRate) -> float:
    """*rate* in bytes/s: a number of bytes/s, or a string such as ``"20mbit"`` or ``"1gbit"``."""
    if isinstance(rate, str):
        return parse_rate(rate) / 8.0
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0 or rate == float("inf"):
        raise ConfigError(f"a link rate is a positive number of bytes/s or a string such as '20mbit', got {rate!r}")
    return float(rate)


def sites(sizes: Sequence[int], *, between: LinkRate, inside: LinkRate | None = None) -> dict[tuple[int, int], float]:
    """Links of nodes grouped into sites: ``sites([2, 2], between="20mbit")`` puts nodes 0-1 and 2-3 in two
    sites joined by 20 Mbit/s links (``inside``: the rate within a site; None leaves it unshaped)."""
    site = [k for k, n in enumerate(sizes) for _ in range(n)]
    out: dict[tuple[int, int], float] = {}
    for i in range(len(site)):
        for j in range(i + 1, len(site)):
            if site[i] != site[j]:
                out[(i, j)] = link_rate(between)
            elif inside is not None:
                out[(i, j)] = link_rate(inside)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddedConfig:
    """Settings of an embedded swarm (fast heartbeats: everything is in one process).

    ``links``: emulated rates between nodes, ``{(i, j): rate}`` by node index (bytes/s or ``"20mbit"``;
    :func:`sites` builds a two-level WAN); pairs not listed are not shaped. With links the nodes probe.
    """

    heartbeat: float = 0.25
    dead_timeout: float = 5.0          # training shares the process: a busy event loop must not look dead
    probing: bool = False              # links are not measured on the in-memory transport (unless emulated)
    jobs: NodeJobConfig = field(default_factory=NodeJobConfig)
    join_timeout: float = 30.0         # every node seen alive by the bootstrap within this
    links: Mapping[tuple[int, int], LinkRate] = field(default_factory=dict)
    links_timeout: float = 60.0        # every pair of nodes measured within this (with links)

    def __post_init__(self) -> None:
        if not (0 < self.heartbeat < self.dead_timeout) or self.join_timeout <= 0 or self.links_timeout <= 0:
            raise ConfigError("EmbeddedConfig: need 0 < heartbeat < dead_timeout and positive join and links timeouts")
        norm: dict[tuple[int, int], float] = {}
        for pair, rate in dict(self.links).items():
            if (not isinstance(pair, tuple) or len(pair) != 2 or not all(isinstance(i, int) and i >= 0 for i in pair)
                    or pair[0] == pair[1]):
                raise ConfigError(f"links: {pair!r} is not a pair of two different node indices (i, j)")
            norm[(min(pair), max(pair))] = link_rate(rate)
        object.__setattr__(self, "links", norm)

    def swarm(self, role: str = "node") -> SwarmConfig:
        return SwarmConfig(role=role, heartbeat=self.heartbeat, dead_timeout=self.dead_timeout,
                           probing=self.probing or bool(self.links))


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
        self.emulator: LinkEmulator | None = None
        self._peer_of: dict[int, str] = {}
        if config.links:
            self.emulator = net.emulator = LinkEmulator()
            config = dataclasses.replace(config, jobs=dataclasses.replace(
                config.jobs, data_plane=dataclasses.replace(config.jobs.data_plane, emulator=self.emulator)))
            self.config = config

    @property
    def bootstrap_addr(self) -> str:
        return self.bootstrap.transport.listen_addrs()[0]

    def alive(self) -> list[EmbeddedNode]:
        return [n for n in self.nodes if not n.stopped.is_set()]

    def add_host(self, identity: Identity | None = None) -> MemoryTransport:
        """A bare transport on this network (a publisher or a client)."""
        return self.net.add_host(identity)

    async def add_node(self, profile: DeviceProfile, *, identity: Identity | None = None,
                       startup: Startup | None = None) -> EmbeddedNode:
        """Start one more node (a fresh identity, or *identity* to restart a node that died); with *startup*,
        one that takes *profile* and starts its job service only when its start-up is wanted (module docstring)."""
        node: EmbeddedNode = await self._nursery.start(self._run_node, len(self.nodes), profile, identity, startup)
        self.nodes.append(node)
        return node

    async def _run_node(self, index: int, profile: DeviceProfile, identity: Identity | None,
                        startup: Startup | None, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        identity = identity or Identity.generate()
        self._shape(index, identity.peer_id)
        transport = self.net.add_host(identity)
        swarm = SwarmNode(transport, self.config.swarm(), profile if startup is None else None)
        stopped = trio.Event()
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    if startup is not None:   # as the CLI installs it (cli/daemon_cmd.py), before the node joins
                        transport.set_stream_handler(JOB, job_proto.serve(
                            startup.early_job, timeout=startup.config.on_demand_timeout + 600))
                    await nursery.start(swarm.run, [self.bootstrap_addr])
                    service = NodeJobService(swarm, self.home / f"node{index}-{swarm.peer_id[-8:]}", self.config.jobs)
                    if startup is None:
                        await nursery.start(service.run)
                    else:
                        nursery.start_soon(_deferred, swarm, service, profile, startup)
                    task_status.started(EmbeddedNode(index=index, identity=identity, swarm=swarm, jobs=service,
                                                     scope=scope, stopped=stopped))
        finally:
            stopped.set()

    def _shape(self, index: int, peer: str) -> None:
        """Emulate the links of node *index* (now *peer*) to the nodes started before it."""
        self._peer_of[index] = peer
        if self.emulator is None:
            return
        for (i, j), rate in self.config.links.items():
            other = j if i == index else i if j == index else None
            if other is not None and other in self._peer_of:
                self.emulator.set_rate(peer, self._peer_of[other], float(rate))

    async def wait_links(self, timeout: float | None = None) -> None:
        """Until the bootstrap holds a measured figure for every pair of live nodes (TooSlowError after
        *timeout*): a job published before would be planned with unmeasured links."""
        peers = [n.peer_id for n in self.alive()]
        boot = self.bootstrap

        def measured() -> bool:
            return all(boot.bandwidth.direct(a, b) is not None for i, a in enumerate(peers) for b in peers[i + 1:])

        await boot.wait_until(measured, self.config.links_timeout if timeout is None else timeout)

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


async def _deferred(swarm: SwarmNode, service: NodeJobService, profile: DeviceProfile, startup: Startup) -> None:
    """A node's deferred start-up (as ``swarm/daemon.py`` ``_serve`` runs it): once wanted, *profile* is its
    measured one, announced at once, then its job service runs and answers the requests that waited."""
    probing = swarm.config.probing
    await startup.trigger(swarm.prober.first_round if probing else None,
                          swarm.prober.links_measured if probing else None)
    swarm.profile = profile
    swarm.beat_soon()
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        startup.serve(service.handle)


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
        if cfg.links:
            await emb.wait_links()
        try:
            yield emb
        finally:
            nursery.cancel_scope.cancel()


__all__ = ["EmbeddedConfig", "EmbeddedNode", "EmbeddedSwarm", "LinkRate", "link_rate", "open_embedded_swarm", "sites"]
