"""The reachability service's limits, pushed past one by one, and its refusals read as refusals (issue 43).

A refusal (busy, rate-limited, not a bootstrap, the requester's address not seen) must leave the asker's
reachability as it was: before, it read as "nothing dialable", and sixteen strangers holding the service's
slots made every honest node checked meanwhile announce itself private. A check that arrives over a
relayed connection is refused: the IP seen there is the relay's, and the bootstrap would probe its host."""

from __future__ import annotations

import dataclasses
import functools
import socket
from contextlib import AsyncExitStack

import pytest
import trio

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport
from fusionp2p.net.memory import memory_network
from fusionp2p.net.relay import RelayLimits
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.reach import ReachConfig, ReachService, _request, check_reach
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.testing.wait import poll_until
from fusionp2p.wire import reach as wr
from fusionp2p.wire.protocols import REACH
from fusionp2p.wire.records import REACH_DATA


def test_busy_rate_limited_and_wrong_server_refusals_are_not_verdicts() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net, trio.open_nursery() as nursery:
                cfg = ReachConfig(max_concurrent=1, min_interval=60.0)
                boot = SwarmNode(net.add_host(), SwarmConfig(role="bootstrap", heartbeat=0.2, dead_timeout=5.0,
                                                             reach=cfg), None)
                await nursery.start(boot.run, [])
                addr = boot.transport.listen_addrs()[0]
                svc = boot.reach_service
                # one slot, held by a check whose dials are slow (they wait on an event here)
                release = trio.Event()
                dial = svc._any_dialable

                async def slow(ip: str, addrs: list[str]) -> bool:
                    await release.wait()
                    return await dial(ip, addrs)

                svc._any_dialable = slow  # type: ignore[method-assign]
                hog, asker = net.add_host(), net.add_host()
                for t in (hog, asker):
                    await t.connect(addr)
                nursery.start_soon(functools.partial(check_reach, hog, boot.peer_id, p2p=[], data=[], timeout=20))
                await poll_until(lambda: svc._busy == 1)
                with pytest.raises(PeerUnavailable, match="busy"):
                    await check_reach(asker, boot.peer_id, p2p=[], data=[], timeout=5)
                release.set()
                await poll_until(lambda: svc._busy == 0)
                svc._any_dialable = dial  # type: ignore[method-assign]

                # a node checked once, on joining, learns its reach (its data port answers; in-memory libp2p
                # addresses cannot be dialled); its next check within min_interval is refused, and the node
                # keeps what it learned (before: it went "private"). The node itself asks at once (its own
                # min_interval 0; with the bootstrap's it would wait out the minute rather than be refused)
                node = SwarmNode(net.add_host(), SwarmConfig(heartbeat=0.2, dead_timeout=5.0, probing=False,
                                                             reach=dataclasses.replace(cfg, min_interval=0.0)),
                                 TEST_PROFILE)
                node.set_data_addrs((f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}",))
                await nursery.start(node.run, [addr])
                await node.wait_until(lambda: node.reach == REACH_DATA, 10)
                refused = svc.served["refused"]
                node.set_data_addrs(node.data_addrs)                    # check again, at once
                await poll_until(lambda: svc.served["refused"] == refused + 1)
                with pytest.raises(trio.TooSlowError):                  # the node's verdict does not move
                    await node.wait_until(lambda: node.reach != REACH_DATA, 1.0)
                with pytest.raises(PeerUnavailable, match="one request every"):
                    await check_reach(node.transport, boot.peer_id, p2p=[], data=[], timeout=5)

                # a node is not a bootstrap: it refuses checks, and says so
                with pytest.raises(PeerUnavailable, match="not a bootstrap"):
                    await check_reach(asker, node.peer_id, p2p=[], data=[], timeout=5)
                # nor does it dial anyone on a stranger's word: "dial" is taken from its bootstraps only
                before = node.reach_service.served["dial"]
                reply = await _request(asker, node.peer_id, wr.encode("dial", peer=hog.peer_id,
                                                                      addrs=["/ip4/127.0.0.1/tcp/1"]), 5)
                ok, why = wr.decode_ok_reply(reply)
                assert not ok and "bootstraps only" in why and node.reach_service.served["dial"] == before
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        listener.close()


def test_a_check_over_a_relayed_connection_is_refused() -> None:
    """Before: the bootstrap dialled the requester's ports at the IP it saw, the relay's."""
    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                relay = await st.enter_async_context(open_libp2p_transport(
                    Identity.generate(), Libp2pConfig(relay=RelayLimits())))
                boot, asker = [await st.enter_async_context(open_libp2p_transport(Identity.generate())) for _ in range(2)]
                svc = ReachService(boot, serve_checks=True, servers=set)
                boot.set_stream_handler(REACH, svc)
                await boot.connect(relay.listen_addrs()[0])
                await boot.reserve(relay.peer_id)
                [circuit] = [c for c in boot.circuit_addrs() if "/ip4/127.0.0.1/" in c]
                await asker.connect(circuit)
                assert asker.is_relayed(boot.peer_id)
                # the asker listens on the relay's IP: dialled there, the check would "succeed"
                mine = [a.rsplit("/p2p/", 1)[0] for a in asker.listen_addrs()]
                with pytest.raises(PeerUnavailable, match="cannot see your address"):
                    await check_reach(asker, boot.peer_id, p2p=mine, data=[], timeout=10)
                assert svc.served["check"] == 0

    trio.run(main)


def test_one_address_holds_at_most_per_ip_slots() -> None:
    """Before: the only bound was ``max_concurrent`` over all requesters, so one host's identities (each
    allowed a request every ``min_interval``, each held ``request_timeout`` by ports that drop SYNs) held
    every slot. Here five identities on 127.0.0.1 ask at once; two are served, three refused as busy."""
    async def main() -> None:
        with trio.fail_after(60):
            async with AsyncExitStack() as st:
                boot = await st.enter_async_context(open_libp2p_transport(Identity.generate()))
                svc = ReachService(boot, serve_checks=True, servers=set, config=ReachConfig(max_concurrent=16, per_ip=2))
                release = trio.Event()

                async def slow(ip: str, addrs: list[str]) -> bool:   # a dial to a port that drops SYNs
                    await release.wait()
                    return False

                svc._any_dialable = slow  # type: ignore[method-assign]
                boot.set_stream_handler(REACH, svc)
                askers = [await st.enter_async_context(open_libp2p_transport(Identity.generate())) for _ in range(5)]
                for t in askers:
                    await t.connect(boot.listen_addrs()[0])
                outcomes: list[str] = []

                async def ask(t: object) -> None:
                    try:
                        await check_reach(t, boot.peer_id, p2p=[], data=[], timeout=20)  # type: ignore[arg-type]
                        outcomes.append("served")
                    except PeerUnavailable as exc:
                        outcomes.append("from your address" if "from your address" in str(exc) else str(exc))

                async with trio.open_nursery() as nursery:
                    for t in askers:
                        nursery.start_soon(ask, t)
                    await poll_until(lambda: svc._busy == 2 and svc.served["refused"] == 3)
                    release.set()
                assert sorted(outcomes) == ["from your address"] * 3 + ["served"] * 2, outcomes
                assert svc._busy == 0 and not svc._busy_ip

    trio.run(main)


def test_a_node_refused_on_joining_asks_again_soon() -> None:
    """Before: a node whose first check met a busy bootstrap kept its reach unknown (so held no relay slot
    when it needed one) until ``recheck``, five minutes later."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net, trio.open_nursery() as nursery:
                cfg = ReachConfig(max_concurrent=1, min_interval=0.0, retry=0.5)
                boot = SwarmNode(net.add_host(), SwarmConfig(role="bootstrap", heartbeat=0.2, dead_timeout=5.0,
                                                             reach=cfg), None)
                await nursery.start(boot.run, [])
                addr = boot.transport.listen_addrs()[0]
                svc = boot.reach_service
                release = trio.Event()
                dial = svc._any_dialable

                async def slow(ip: str, addrs: list[str]) -> bool:
                    await release.wait()
                    return await dial(ip, addrs)

                svc._any_dialable = slow  # type: ignore[method-assign]
                hog = net.add_host()
                await hog.connect(addr)
                nursery.start_soon(functools.partial(check_reach, hog, boot.peer_id, p2p=[], data=[], timeout=20))
                await poll_until(lambda: svc._busy == 1)
                node = SwarmNode(net.add_host(), SwarmConfig(heartbeat=0.2, dead_timeout=5.0, probing=False, reach=cfg),
                                 TEST_PROFILE)
                await nursery.start(node.run, [addr])
                node.set_data_addrs((f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}",))
                await poll_until(lambda: svc.served["refused"] >= 1)      # its first check: busy
                release.set()
                svc._any_dialable = dial  # type: ignore[method-assign]
                await node.wait_until(lambda: node.reach == REACH_DATA, 10)   # asked again within seconds
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        listener.close()


def test_a_check_wanted_within_the_interval_waits_for_it_rather_than_being_refused() -> None:
    """A node checks on joining (issue 40), and again when its data plane listens, which may be moments later (a
    job request starts the start-up at once): that second check waits out the bootstraps' ``min_interval``
    instead of being refused and asked again ``retry`` (10 s) later."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net, trio.open_nursery() as nursery:
                cfg = ReachConfig(min_interval=1.0, retry=60.0)
                boot = SwarmNode(net.add_host(), SwarmConfig(role="bootstrap", heartbeat=0.2, dead_timeout=5.0,
                                                             reach=cfg), None)
                await nursery.start(boot.run, [])
                svc = boot.reach_service
                node = SwarmNode(net.add_host(), SwarmConfig(heartbeat=0.2, dead_timeout=5.0, probing=False, reach=cfg),
                                 TEST_PROFILE)
                await nursery.start(node.run, [boot.transport.listen_addrs()[0]])
                await node.wait_until(lambda: node.reach == "private", 10)    # on joining: no data plane yet
                t0 = trio.current_time()
                node.set_data_addrs((f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}",))
                await node.wait_until(lambda: node.reach == REACH_DATA, 10)
                assert svc.served["check"] == 2 and svc.served["refused"] == 0, svc.served
                assert trio.current_time() - t0 < 5.0        # within the interval, not after `retry`
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        listener.close()
