"""Our own state-topic messages reach `degree` peers even with an empty gossipsub mesh (py-libp2p has no
flood publishing: a node pruned by everyone while a swarm forms would otherwise reach nobody)."""

from __future__ import annotations

from types import SimpleNamespace

from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11

from fusionp2p.net.gossip_router import GossipRouter
from fusionp2p.net.identity import Identity


def _peer() -> ID:
    return ID.from_pubkey(Identity.generate().key_pair.public_key)


def _router(n_subscribed: int, mesh: int) -> tuple[GossipRouter, ID, list[ID]]:
    router = GossipRouter(("members",), protocols=[PROTOCOL_ID_V11], degree=6, degree_low=4, degree_high=12)
    router.scorer = None
    me, peers = _peer(), [_peer() for _ in range(n_subscribed)]
    router.pubsub = SimpleNamespace(my_id=me, peer_topics={"members": set(peers), "jobs": set(peers)})  # type: ignore[assignment]
    router.peer_protocol = dict.fromkeys(peers, PROTOCOL_ID_V11)
    router.mesh = {"members": set(peers[:mesh]), "jobs": set(peers[:mesh])}
    return router, me, peers


def test_own_heartbeat_reaches_degree_peers_with_an_empty_mesh() -> None:
    router, me, peers = _router(10, mesh=0)
    got = set(router._get_peers_to_send(["members"], me, me))
    assert len(got) == 6 and got <= set(peers)


def test_forwarded_messages_and_other_topics_keep_the_mesh_rule() -> None:
    router, me, peers = _router(10, mesh=0)
    assert set(router._get_peers_to_send(["jobs"], me, me)) == set()  # not a state topic
    other = peers[0]
    assert set(router._get_peers_to_send(["members"], other, other)) == set()  # not our message


def test_a_topic_nobody_subscribed_yet_is_fine() -> None:
    router, me, _ = _router(0, mesh=0)
    router.pubsub.peer_topics = {}  # type: ignore[union-attr]
    assert set(router._get_peers_to_send(["members"], me, me)) == set()


def test_a_healthy_mesh_is_used_as_is() -> None:
    router, me, peers = _router(10, mesh=5)
    assert set(router._get_peers_to_send(["members"], me, me)) == set(peers[:5])
