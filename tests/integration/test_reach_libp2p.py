"""Reachability over the real libp2p adapter on loopback (issue 21): a bootstrap's dial-back check
tells a node whether its libp2p and data-plane addresses can be dialled, and connection reversal lets
a peer that cannot dial a node reach it through their common bootstrap."""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack

import pytest
import trio

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import open_libp2p_transport
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.reach import ReachConfig, install_reversal, should_dial, verdict
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.testing.wait import poll_until
from fusionp2p.wire.protocols import PROBE  # a protocol every node serves

FAST = ReachConfig(min_interval=0.0, dial_timeout=2.0, request_timeout=8.0)


def _port(listening: bool) -> tuple[int, socket.socket | None]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    if listening:
        sock.listen()
        return port, sock
    sock.close()
    return port, None


def test_verdict_and_who_dials() -> None:
    assert [verdict(a, b) for a, b in ((True, True), (True, False), (False, True), (False, False))] == \
        ["public", "p2p", "data", "private"]
    # the node that cannot be dialled dials the one that can, whatever their ids
    assert should_dial("a", "private", "b", "public") and not should_dial("b", "public", "a", "private")
    assert should_dial("z", "private", "b", "p2p") and not should_dial("b", "p2p", "z", "private")
    # otherwise (both dialable, both not, or not known yet) exactly one of a pair dials: the larger id
    for ra, rb in (("public", "public"), ("private", "private"), ("unknown", "private"), ("public", "unknown")):
        assert should_dial("b", ra, "a", rb) != should_dial("a", rb, "b", ra)


def test_dial_back_check_and_connection_reversal() -> None:
    closed, _ = _port(listening=False)
    open_port, listener = _port(listening=True)
    cfg = SwarmConfig(heartbeat=0.3, dead_timeout=5.0, probing=False, reach=FAST)

    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                tb, tn, tc = [await st.enter_async_context(open_libp2p_transport(Identity.generate())) for _ in range(3)]
                nursery = await st.enter_async_context(trio.open_nursery())
                boot = SwarmNode(tb, SwarmConfig(role="bootstrap", heartbeat=0.3, dead_timeout=5.0, reach=FAST), None)
                await nursery.start(boot.run, [])
                node = SwarmNode(tn, cfg, TEST_PROFILE)
                await nursery.start(node.run, [tb.listen_addrs()[0]])
                # checked on joining, before any data plane listens: libp2p answers (issue 40: before, the
                # first check waited for the data plane, i.e. for the node's deferred start-up)
                await node.wait_until(lambda: node.reach == "p2p", 20)
                assert "not listening yet" in node.own_reach.detail and boot.reach_service.served["check"] == 1
                node.set_data_addrs((f"/ip4/127.0.0.1/tcp/{closed}",))
                await poll_until(lambda: f"NOT dialable at /ip4/127.0.0.1/tcp/{closed}" in node.own_reach.detail, 20)
                assert node.reach == "p2p"                                       # libp2p answers, the data port not
                await boot.wait_until(lambda: tn.peer_id in boot.view.records
                                      and boot.view.records[tn.peer_id].reach == "p2p", 10)   # and it says so
                node.set_data_addrs((f"/ip4/127.0.0.1/tcp/{open_port}",))
                await node.wait_until(lambda: node.reach == "public", 20)
                # an address at another IP than the one the bootstrap sees is never dialled for us
                node.set_data_addrs(("/ip4/192.0.2.1/tcp/4002",))
                await node.wait_until(lambda: node.reach == "p2p", 20)
                assert boot.reach_service.served["check"] >= 4

                # connection reversal: a client that knows no address of the node (as if it sat behind a
                # NAT) opens a stream to it through the bootstrap both are connected to
                await tc.connect(tb.listen_addrs()[0])
                with pytest.raises(PeerUnavailable):
                    await tc.open_stream(tn.peer_id, PROBE)                     # no way to dial it
                install_reversal(tc, lambda: [tb.peer_id])
                s = await tc.open_stream(tn.peer_id, PROBE)                      # the node dialled us
                await s.aclose()
                assert tn.peer_id in tc.connected_peers()
                assert node.reach_service.served["dial"] == 1
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        if listener is not None:
            listener.close()
