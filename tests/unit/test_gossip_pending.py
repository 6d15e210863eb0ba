"""The router's queue for peers whose subscriptions it has not seen: bounded, quiet, cheap, and without
stale state-topic messages (py-libp2p 0.8.1 logged a warning per routed message past its cap of 100)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11
from libp2p.pubsub.pb import rpc_pb2

from fusionp2p.net.gossip_router import PENDING_PER_PEER, PENDING_TTL, GossipRouter
from fusionp2p.net.identity import Identity


def _rpc(topic: str, n: int) -> rpc_pb2.RPC:
    return rpc_pb2.RPC(publish=[rpc_pb2.Message(topicIDs=[topic], data=n.to_bytes(4, "big"))])


def _queue(router: GossipRouter, peer: ID, rpc: rpc_pb2.RPC, ts: float | None = None) -> None:
    """What py-libp2p's publish does for a connected peer not known to subscribe: prune, then append."""
    router._prune_pending_messages(peer)
    router._pending_messages[peer].append((time.time() if ts is None else ts, rpc))


@pytest.fixture
def router() -> GossipRouter:
    return GossipRouter(("members",), protocols=[PROTOCOL_ID_V11], degree=6, degree_low=4, degree_high=12)


def test_a_peer_that_never_subscribes_costs_a_bounded_quiet_queue(router: GossipRouter,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    peer = ID.from_pubkey(Identity.generate().key_pair.public_key)
    with caplog.at_level(logging.DEBUG, logger="libp2p"):
        for n in range(500):
            _queue(router, peer, _rpc("jobs", n))
    queue = router._pending_messages[peer]
    keep = PENDING_PER_PEER + 1                      # pruned to the cap before each append
    assert [int.from_bytes(r.publish[0].data, "big") for _, r in queue] == list(range(500 - keep, 500))
    assert router.stats["pending_dropped"] == 500 - keep
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_expired_messages_leave_the_queue(router: GossipRouter) -> None:
    peer = ID.from_pubkey(Identity.generate().key_pair.public_key)
    old = time.time() - PENDING_TTL - 1
    for n in range(5):
        _queue(router, peer, _rpc("jobs", n), ts=old)
    _queue(router, peer, _rpc("jobs", 5))
    assert [int.from_bytes(r.publish[0].data, "big") for _, r in router._pending_messages[peer]] == [5]
    router._pending_messages[peer][0] = (old, router._pending_messages[peer][0][1])
    router._prune_pending_messages(peer)
    assert peer not in router._pending_messages


def test_the_flush_sends_queued_events_but_not_stale_state(router: GossipRouter) -> None:
    peer = ID.from_pubkey(Identity.generate().key_pair.public_key)
    sent: list[Any] = []

    async def write_msg(stream: object, rpc: rpc_pb2.RPC) -> bool:
        sent.append(rpc)
        return True

    router.scorer = None
    router.pubsub = SimpleNamespace(peers={peer: object()}, peer_topics={"members": {peer}, "jobs": {peer}},  # type: ignore[assignment]
                                    write_msg=write_msg)
    for n in range(4):
        _queue(router, peer, _rpc("members" if n % 2 else "jobs", n))
    trio.run(router.flush_pending_messages, peer)
    assert [(r.publish[0].topicIDs[0], int.from_bytes(r.publish[0].data, "big")) for r in sent] == [("jobs", 0), ("jobs", 2)]
    assert peer not in router._pending_messages
