"""Our GossipSub router: py-libp2p 0.8.1's, with what it costs a forming swarm taken out.

Kept beside ``net/libp2p_host.py``, which builds it with the node's topics and degrees.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from typing import Any

from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub

# py-libp2p queues every message it routes for each connected peer not (yet) known to subscribe to its topic,
# for the race between a connection and its subscriptions; its defaults hold 100 messages for 30 s per peer.
PENDING_PER_PEER = 32
PENDING_TTL = 10.0


class GossipRouter(GossipSub):
    """GossipSub that does not replay its message cache to new peers on *state_topics*, and keeps its queue
    for peers whose subscriptions it has not seen cheap and quiet.

    py-libp2p 0.8.1 sends every cached message of a topic (the last ``gossip_window`` heartbeats), one RPC
    each, to every peer that subscribes. For heartbeats that is pure overhead, since the next heartbeat
    supersedes them, and it lands exactly when a swarm forms: measured at 20 processes, 50-90 received
    messages/s per node during the first 10 s for 2-10 new ones.
    """

    def __init__(self, state_topics: tuple[str, ...], **kwargs: Any) -> None:
        kwargs.setdefault("max_pending_messages_per_peer", PENDING_PER_PEER)
        kwargs.setdefault("pending_messages_ttl", PENDING_TTL)
        super().__init__(**kwargs)
        self._state_topics = frozenset(state_topics)
        self.stats: collections.Counter[str] = collections.Counter()   # control messages received, by kind

    async def handle_rpc(self, rpc: Any, sender_peer_id: ID) -> None:
        if rpc.HasField("control"):
            c = rpc.control
            for kind in ("ihave", "iwant", "graft", "prune"):
                if n := len(getattr(c, kind)):
                    self.stats[kind] += n
        await super().handle_rpc(rpc, sender_peer_id)

    def _prune_pending_messages(self, peer_id: ID) -> None:
        """py-libp2p's prune rebuilds a peer's whole queue on every message routed and logs a warning for
        every message past the cap: a peer that never subscribes to a busy topic (a publisher that only
        follows its job, a node of another job) costs a list rebuild and a log line per message, measured
        as 1,056 warnings in one demo node's log. The queue is in arrival order, so the expired and the
        excess are a prefix: cut it, and count it."""
        queue = self._pending_messages.get(peer_id)
        if queue is None:
            return
        expired_before = time.time() - self._pending_messages_ttl
        cut = 0
        while cut < len(queue) and queue[cut][0] < expired_before:
            cut += 1
        cut = max(cut, len(queue) - self._max_pending_messages_per_peer)
        if cut:
            del queue[:cut]
            self.stats["pending_dropped"] += cut
        if not queue:
            del self._pending_messages[peer_id]

    async def flush_pending_messages(self, peer_id: ID) -> None:
        """The queued messages of state topics are not sent when the peer's subscription arrives: as with
        the replay below, the next one supersedes them."""
        queue = self._pending_messages.get(peer_id)
        if queue:
            queue[:] = [(ts, rpc) for ts, rpc in queue
                        if not all(t in self._state_topics for m in rpc.publish for t in m.topicIDs)]
        await super().flush_pending_messages(peer_id)

    async def send_recent_messages(self, peer_id: ID, topic: str) -> None:
        if topic not in self._state_topics:
            await super().send_recent_messages(peer_id, topic)

    def _get_peers_to_send(self, topic_ids: Iterable[str], msg_forwarder: ID, origin: ID,
                           msg_id: bytes | None = None) -> Iterable[ID]:
        """Our own messages on a state topic reach at least ``degree`` peers even when our mesh is thin.

        py-libp2p 0.8.1 sends a published message only to the topic's mesh, and has no flood publishing.
        A node whose grafts were all pruned while a swarm forms (more than D_high grafts at once) sits
        out the 60 s prune backoff with an empty mesh, and its heartbeats reach nobody: at 20 processes
        that showed up as every member being alive at once only after 63 s. Topping up to ``degree``
        subscribed peers costs nothing while the mesh is healthy.
        """
        topics = list(topic_ids)
        peers = set(super()._get_peers_to_send(topics, msg_forwarder, origin, msg_id))
        if self.pubsub is None or origin != self.pubsub.my_id:
            return peers
        for topic in topics:
            want = self.degree - len(peers)
            if (want > 0 and topic in self._state_topics and topic in self.pubsub.peer_topics
                    and len(self.mesh.get(topic, ())) < self.degree_low):
                extra = self._get_in_topic_gossipsub_peers_from_minus(topic, want, peers | {msg_forwarder, origin})
                peers.update(extra)
        return peers
