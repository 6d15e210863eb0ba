"""A node joins before its heavy start-up (issue 40): ``run_daemon`` listens and joins the swarm, then (here at
once: no deferral, swarm/startup.py) imports torch and runs its device benchmark in a worker thread, and
announces its profile once it has one; the job service (``extra_services``) starts only then. Real libp2p
on loopback, one process."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import trio

from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport
from fusionp2p.net.relay import RelayLimits
from fusionp2p.swarm import device
from fusionp2p.swarm.daemon import DaemonConfig, run_daemon
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.startup import Startup, StartupConfig
from fusionp2p.testing.swarm import TEST_PROFILE


def test_a_node_joins_before_its_profile_and_announces_it_when_measured(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    monkeypatch.setattr(device, "measure_profile", lambda dev: TEST_PROFILE)   # no torch in this test
    served: list[SwarmNode] = []

    def prepare() -> None:   # the CLI's torch import, held until the test lets it go
        release.wait(60)

    async def main() -> None:
        cfg = SwarmConfig(heartbeat=0.5, dead_timeout=5.0, probing=False, watch=0)
        with trio.fail_after(60):
            async with open_libp2p_transport(Identity.generate(), Libp2pConfig()) as bt:
                boot = SwarmNode(bt, SwarmConfig(role="bootstrap", heartbeat=0.5, dead_timeout=5.0), None)
                async with trio.open_nursery() as nursery:
                    await nursery.start(boot.run, [])
                    addrs: list[str] = []
                    dcfg = DaemonConfig(role="node", home=tmp_path, listen=("/ip4/127.0.0.1/tcp/0",),
                                        bootstrap=(bt.listen_addrs()[0],), swarm=cfg)
                    nursery.start_soon(lambda: run_daemon(dcfg, on_ready=addrs.extend,
                                                          extra_services=lambda s, _n: served.append(s),
                                                          prepare=prepare,
                                                          startup=Startup(StartupConfig(defer=0))))
                    # a member of the swarm while it still prepares: no profile yet, no job service
                    await boot.wait_until(lambda: len(boot.members()) == 1, 30)
                    peer = boot.members()[0]
                    assert boot.view.records[peer].profile is None and not served
                    release.set()
                    await boot.wait_until(lambda: boot.view.records[peer].profile is not None, 30)
                    assert boot.view.records[peer].profile == TEST_PROFILE
                    assert served and served[0].peer_id == peer and served[0].profile == TEST_PROFILE
                    nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        release.set()


def test_a_node_behind_a_nat_knows_its_reach_and_holds_a_relay_slot_before_its_start_up(tmp_path: Path) -> None:
    """Issue 40: the dial-back check and the relay reservation run on joining, not after the deferred start-up.
    Before, the first check waited for the data plane's addresses (the job service, after the start-up): a node
    behind a NAT announced reach "unknown" and no circuit for the 15-70 s of ``--defer-startup`` and its patience.
    Here the start-up is held back (600 s) and the node announces a libp2p address that refuses connections, as a
    NAT'd node's LAN address is to the bootstrap."""
    prepared = threading.Event()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = int(sock.getsockname()[1])

    async def main() -> None:
        cfg = SwarmConfig(heartbeat=0.5, dead_timeout=5.0, probing=False, watch=0)
        startup = Startup(StartupConfig(defer=600))
        with trio.fail_after(30):
            async with open_libp2p_transport(Identity.generate(), Libp2pConfig(relay=RelayLimits())) as bt:
                boot = SwarmNode(bt, SwarmConfig(role="bootstrap", heartbeat=0.5, dead_timeout=5.0), None)
                async with trio.open_nursery() as nursery:
                    await nursery.start(boot.run, [])
                    dcfg = DaemonConfig(role="node", home=tmp_path, listen=("/ip4/127.0.0.1/tcp/0",),
                                        announce=(f"/ip4/127.0.0.1/tcp/{closed}",),
                                        bootstrap=(bt.listen_addrs()[0],), swarm=cfg)
                    nursery.start_soon(lambda: run_daemon(dcfg, on_ready=lambda a: None, prepare=prepared.set,
                                                          startup=startup))
                    await boot.wait_until(lambda: len(boot.members()) == 1, 20)
                    peer = boot.members()[0]
                    # what peers see: private, reachable at a circuit through the bootstrap's relay ...
                    await boot.wait_until(lambda: boot.view.records[peer].reach == "private" and any(
                        f"/p2p/{bt.peer_id}/p2p-circuit" in a for a in boot.view.records[peer].addrs), 15)
                    # ... while the start-up has not run: no torch, no job service, no profile
                    assert not startup.wanted.is_set() and not prepared.is_set()
                    assert boot.view.records[peer].profile is None and boot.view.records[peer].data == ()
                    nursery.cancel_scope.cancel()

    trio.run(main)
