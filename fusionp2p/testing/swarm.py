"""Many swarm nodes in one trio.run, on real libp2p over loopback or on the in-memory transport."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import trio
import trio.testing

from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport
from fusionp2p.net.memory import MemoryNetwork, memory_network
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.probe import ProbeConfig
from fusionp2p.types import DeviceProfile

TEST_PROFILE = DeviceProfile(device="cpu", kind="cpu", name="test-cpu", flops_fp32=1e10, flops_bf16=0.0, memory_bytes=4 * 2**30)


@asynccontextmanager
async def local_swarm(n: int, *, config: SwarmConfig | None = None, libp2p: bool = True,
                      profiles: list[DeviceProfile] | None = None) -> AsyncIterator[tuple[SwarmNode, list[SwarmNode]]]:
    """A bootstrap plus *n* nodes, all joined; yields (bootstrap, nodes)."""
    cfg = config or SwarmConfig(probe=ProbeConfig(bytes=256 * 1024))
    boot_cfg = SwarmConfig(role="bootstrap", heartbeat=cfg.heartbeat, dead_timeout=cfg.dead_timeout,
                           gossip_rate=cfg.gossip_rate)
    async with AsyncExitStack() as stack:
        if libp2p:
            transports = [await stack.enter_async_context(open_libp2p_transport(Identity.generate(), Libp2pConfig()))
                          for _ in range(n + 1)]
        else:
            net = await stack.enter_async_context(memory_network())
            transports = [net.add_host() for _ in range(n + 1)]  # type: ignore[misc]
        boot = SwarmNode(transports[0], boot_cfg, None)
        nodes = [SwarmNode(t, cfg, (profiles[i] if profiles else TEST_PROFILE)) for i, t in enumerate(transports[1:])]
        async with trio.open_nursery() as nursery:
            await start_swarm(nursery, boot, nodes, transports[0].listen_addrs()[0])
            try:
                yield boot, nodes
            finally:
                nursery.cancel_scope.cancel()


async def start_swarm(nursery: trio.Nursery, boot: SwarmNode, nodes: list[SwarmNode], addr: str) -> None:
    """Start the bootstrap *boot* (listening at *addr*), then every node of *nodes* joining through it."""
    await nursery.start(boot.run, [])
    for node in nodes:
        await nursery.start(node.run, [addr])


async def converge(nodes: list[SwarmNode], *, bandwidth: bool, timeout: float) -> None:
    """Wait until every node sees exactly *nodes* alive (and, optionally, a complete bandwidth matrix)."""
    ids = sorted(n.peer_id for n in nodes)
    for node in nodes:
        await node.wait_until(lambda node=node: node.members() == ids and (not bandwidth or node.bandwidth.complete(ids)),  # type: ignore[misc]
                              timeout)


def run_hand_driven(body: Callable[[MemoryNetwork, list[SwarmNode]], Awaitable[None]], *, dead_timeout: float) -> None:
    """*body(net, nodes)* on 3 nodes and a bootstrap, memory transport, probing off (driven by hand), once every
    node sees the others, on a mock clock (600 virtual seconds at most)."""
    async def main() -> None:
        cfg = SwarmConfig(heartbeat=1.0, dead_timeout=dead_timeout, probing=False, watch=0)
        async with memory_network() as net:
            hosts = [net.add_host() for _ in range(4)]
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=dead_timeout), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:]]
            with trio.fail_after(600):   # virtual seconds
                async with trio.open_nursery() as nursery:
                    await start_swarm(nursery, boot, nodes, hosts[0].listen_addrs()[0])
                    await converge(nodes, bandwidth=False, timeout=10)
                    await body(net, nodes)
                    nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
