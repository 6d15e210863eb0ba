"""Our GossipSub router and Pubsub: py-libp2p 0.8.1's, with what it costs a forming swarm taken out.

Kept beside ``net/libp2p_host.py``, which builds them with the node's topics and degrees.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Iterable
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamClosed, StreamReset
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import RpcQueue
from libp2p.pubsub.subscription import TrioSubscriptionAPI
from libp2p.utils.varint import encode_uvarint

# py-libp2p queues every message it routes for each connected peer not (yet) known to subscribe to its topic,
# for the race between a connection and its subscriptions; its defaults hold 100 messages for 30 s per peer.
PENDING_PER_PEER = 32
PENDING_TTL = 10.0
# bytes of queued RPCs written to a peer's pubsub stream in one write (at least one RPC, whatever its size)
SEND_BATCH_BYTES = 64 * 1024
# messages a subscription holds before our pump takes them (py-libp2p: 32, and it drops the rest)
SUBSCRIPTION_BUFFER = 1024


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

    def _handle_dropped_rpc(self, peer_id: ID, rpc: Any, reason: str) -> None:
        """py-libp2p drops an RPC when the peer's outbound queue is full, with a debug line on its own
        logger only: count the messages so dropped (``queue_dropped``) and the control-only RPCs."""
        self.stats["queue_dropped" if rpc.publish else "queue_dropped_control"] += len(rpc.publish) or 1
        super()._handle_dropped_rpc(peer_id, rpc, reason)

    def _check_spam_protection(self, peer_id: ID, msg: Any) -> bool:
        """py-libp2p's per-(forwarder, topic) rate limit, its rejections counted (``spam_rejected``): a
        rejected message is delivered here but not forwarded."""
        ok: bool = super()._check_spam_protection(peer_id, msg)
        if not ok:
            self.stats["spam_rejected"] += 1
        return ok

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


class GossipPubsub(Pubsub):
    """Pubsub whose per-peer sending loop writes every RPC queued for the peer in one stream write.

    py-libp2p 0.8.1 queues at most 32 RPCs per peer (``rpc_queue.OutBoundQueueSize``, as go-libp2p-pubsub)
    and *drops* what comes past that, with a debug line on its own logger only. Its sending loop writes one
    RPC per ``stream.write``: one yamux frame, one Noise message and one syscall each, with the
    connection's write lock and a scheduler turn around every one. go-libp2p-pubsub drains its queue into a
    buffered writer and flushes once the queue is empty. Measured at 20 processes on 2 shared cores
    (docs/networking.md): the loops fell behind, the queues of a node sat at 31-32 for most of its peers,
    with the yamux send window at 16 MiB (nothing waited on the peer), and each node dropped hundreds of
    messages. Here whatever is queued (up to ``SEND_BATCH_BYTES``) goes out in one write; the framing on
    the wire is unchanged (each RPC keeps its own varint length prefix), so a peer reads the same RPCs.

    On the receiving side py-libp2p hands each message to a subscription channel of 32 and drops it (a
    WARNING on its logger, which nodes silence) when the channel is full: a batch of more than 32 read
    before our pump runs. The channel here holds ``SUBSCRIPTION_BUFFER`` and its drops are counted.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # our own messages "published"; "rpcs" sent in "writes"; "sub_dropped": received messages our
        # subscription channel had no room for
        self.send_stats: collections.Counter[str] = collections.Counter()

    async def publish(self, topic_id: str | list[str], data: bytes) -> None:
        self.send_stats["published"] += 1
        await super().publish(topic_id, data)

    async def subscribe(self, topic_id: str) -> TrioSubscriptionAPI:
        """py-libp2p's ``Pubsub.subscribe`` with a ``SUBSCRIPTION_BUFFER`` channel instead of 32."""
        if topic_id in self.topic_ids:
            return self.subscribed_topics_receive[topic_id]
        send, recv = trio.open_memory_channel[rpc_pb2.Message](SUBSCRIPTION_BUFFER)
        subscription = TrioSubscriptionAPI(recv, unsubscribe_fn=functools.partial(self.unsubscribe, topic_id))
        self.subscribed_topics_send[topic_id] = send
        self.subscribed_topics_receive[topic_id] = subscription
        packet, subopt = self._build_announce_rpc(topic_id, subscribe=True)
        await self.message_all_peers(packet.SerializeToString(), announce=subopt)
        await self.router.join(topic_id)
        return subscription

    def notify_subscriptions(self, publish_message: rpc_pb2.Message) -> None:
        for topic in publish_message.topicIDs:
            if topic in self.topic_ids:
                try:
                    self.subscribed_topics_send[topic].send_nowait(publish_message)
                except trio.WouldBlock:
                    self.send_stats["sub_dropped"] += 1

    async def handle_sending_messages(self, peer_id: ID, stream: INetStream, queue: RpcQueue) -> None:
        try:
            while (rpc := await queue.pop()) is not None:
                buf = bytearray()
                n = 0
                while rpc is not None:
                    data = rpc.SerializeToString()
                    buf += encode_uvarint(len(data))
                    buf += data
                    n += 1
                    if len(buf) >= SEND_BATCH_BYTES:
                        break
                    rpc = queue._queue.pop()   # what else is queued, without waiting (None: empty)
                try:
                    await stream.write(bytes(buf))
                except (StreamClosed, StreamReset):
                    self._handle_dead_peer(peer_id)   # as Pubsub.write_msg does
                    return
                self.send_stats["rpcs"] += n
                self.send_stats["writes"] += 1
        except Exception:
            self._handle_dead_peer(peer_id)   # as py-libp2p's loop does
