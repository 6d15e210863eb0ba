"""GossipPubsub's sending loop (net/gossip_router.py): what is queued for a peer goes out in one write.

py-libp2p 0.8.1 queues at most 32 RPCs per peer and drops the rest; its loop wrote one RPC per stream write,
so a publisher faster than one write per scheduler turn overflowed the queue (measured at 20 processes:
queues at 31-32, hundreds of messages dropped per node). Real hosts on loopback TCP.
"""

from contextlib import AsyncExitStack

import trio
import trio.lowlevel

from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport

ROUNDS, PER_ROUND = 160, 2   # 320 messages, 2 per scheduler turn


def test_a_burst_of_publishes_reaches_the_peer_without_queue_drops() -> None:
    async def main() -> None:
        # the receiver's per-peer rate limit well above the burst (its drops would hide ours)
        cfg = Libp2pConfig(gossip_max_rate=100_000.0, gossip_buffer=4096)
        with trio.fail_after(30):
            async with AsyncExitStack() as st:
                a = await st.enter_async_context(open_libp2p_transport(Identity.generate(), cfg))
                b = await st.enter_async_context(open_libp2p_transport(Identity.generate(), cfg))
                await a.connect(b.listen_addrs()[0])
                sa, sb = await a.subscribe("t"), await b.subscribe("t")
                while True:   # until the mesh carries a message to b (a heartbeat grafts it)
                    await a.publish("t", b"ready")
                    await sa.receive()
                    with trio.move_on_after(0.5):
                        if (await sb.receive()).data == b"ready":
                            break
                for r in range(ROUNDS):
                    for i in range(PER_ROUND):
                        await a.publish("t", f"{r}/{i}".encode())
                    await trio.lowlevel.checkpoint()
                want = {f"{r}/{i}".encode() for r in range(ROUNDS) for i in range(PER_ROUND)}
                got: set[bytes] = set()
                with trio.move_on_after(10):
                    while not want <= got:
                        got.add((await sb.receive()).data)
                assert a.router.stats["queue_dropped"] == 0 and b.pubsub.send_stats["sub_dropped"] == 0
                assert len(want - got) == 0, f"{len(want - got)} of {len(want)} messages never reached the peer"
                sent = a.pubsub.send_stats
                assert sent["rpcs"] >= len(want) and sent["writes"] < sent["rpcs"]

    trio.run(main)
