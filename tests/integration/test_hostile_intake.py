"""No intake loop ends because of one message (issue 15, item 1): a hostile peer sends a bad message to
each of a node's intake loops (members gossip, the publisher's jobs-topic loop, VIEW, JOB, PROBE,
CONTENT); the loop drops it, counts it in the node's Refusals (per peer and reason), and serves the
next good message. Many nodes in one trio.run on the in-memory transport."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import trio

from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.content import ContentService, ContentStore
from fusionp2p.jobs.events import StepProgress, encode_event
from fusionp2p.jobs.publisher import Publisher
from fusionp2p.net.memory import MemoryTransport, memory_network
from fusionp2p.net.refusals import Refusals
from fusionp2p.swarm.node import VIEW, SwarmConfig, SwarmNode
from fusionp2p.swarm.probe import probe
from fusionp2p.testing.swarm import TEST_PROFILE, converge
from fusionp2p.wire.framing import encode_frame
from fusionp2p.wire.msg import packb
from fusionp2p.wire.protocols import JOB, PROBE, TOPIC_JOBS, TOPIC_MEMBERS
from fusionp2p.wire.records import NodeRecord, encode_signed

CFG = SwarmConfig(heartbeat=1.0, dead_timeout=4.0, probing=False)


def _signed_body(t: MemoryTransport, body: dict[str, Any], kind: str = "node") -> bytes:
    raw = packb(body)
    return packb({"v": 1, "t": kind, "b": raw, "s": t.sign(kind.encode() + b"\x00" + raw)})


async def _send_raw(t: MemoryTransport, peer: str, protocol: str, data: bytes) -> bytes:
    """Open a stream, send *data*, half-close, and return whatever comes back until the end."""
    s = await t.open_stream(peer, protocol)
    try:
        await s.send_all(data)
        await s.send_eof()
        out = b""
        while chunk := await s.receive_some():
            out += chunk
        return out
    finally:
        await s.aclose()


def test_members_gossip_survives_bad_records_and_applies_the_next_good_one() -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net:
                boot_host, host, evil = net.add_host(), net.add_host(), net.add_host()
                boot = SwarmNode(boot_host, SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=4.0), None)
                node = SwarmNode(host, CFG, TEST_PROFILE)
                async with trio.open_nursery() as nursery:
                    await nursery.start(boot.run, [])
                    await nursery.start(node.run, [boot_host.listen_addrs()[0]])
                    await converge([node], bandwidth=False, timeout=10)
                    await evil.subscribe(TOPIC_MEMBERS)
                    good = NodeRecord(peer=evil.peer_id, role="node", addrs=(), profile=TEST_PROFILE, started=1.0, seq=1)
                    body = good.body()
                    # the heartbeat that used to end a node and its bootstrap: memory_bytes = +inf, validly signed
                    inf = _signed_body(evil, {**body, "profile": {**body["profile"], "memory_bytes": math.inf}})
                    for bad in (b"\xc1garbage", inf, packb([b"x"] * 9), _signed_body(evil, {**body, "seq": 2**64 - 1})):
                        await evil.publish(TOPIC_MEMBERS, bad)
                    await evil.publish(TOPIC_MEMBERS, encode_signed(good, evil.sign))
                    await node.wait_until(lambda: evil.peer_id in node.view.records, 10)
                    await boot.wait_until(lambda: evil.peer_id in boot.view.records, 10)
                    for sw in (node, boot):
                        assert sw.refusals.by_peer[(evil.peer_id, "gossip/record")] == 2
                        assert sw.refusals.by_peer[(evil.peer_id, "gossip/malformed")] == 2
                        assert sw.refusals.score(evil.peer_id, now=trio.current_time()) > 0
                    nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_flooding_peer_is_banned_and_then_read_no_more() -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net:
                host, evil = net.add_host(), net.add_host()
                node = SwarmNode(host, CFG, TEST_PROFILE, refusals=Refusals())
                async with trio.open_nursery() as nursery:
                    await nursery.start(node.run, [])
                    await evil.subscribe(TOPIC_MEMBERS)
                    limit = int(node.refusals.config.ban_score)
                    for _ in range(limit + 5):
                        await evil.publish(TOPIC_MEMBERS, b"\xc1")
                    good = NodeRecord(peer=evil.peer_id, role="node", addrs=(), profile=TEST_PROFILE, started=1.0, seq=1)
                    await evil.publish(TOPIC_MEMBERS, encode_signed(good, evil.sign))
                    await node.wait_until(lambda: node.counters.bad_records >= limit + 5, 10)
                    assert node.refusals.banned(evil.peer_id, now=trio.current_time())
                    # the score decays a little between messages: the ban comes at the limit or just after it
                    assert limit <= node.refusals.by_peer[(evil.peer_id, "gossip/malformed")] <= limit + 2
                    assert evil.peer_id not in node.view.records   # banned: even its good record is not read
                    nursery.cancel_scope.cancel()

    trio.run(main)


class _Driver:
    """Records the progress the publisher routes to a job (stands in for a JobDriver)."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.got = trio.Event()

    def on_progress(self, peer: str, ev: Any) -> None:
        self.events.append(ev)
        self.got.set()


def test_the_publishers_jobs_topic_loop_survives_a_malformed_event() -> None:
    """Before: {"type": []} on the jobs topic raised TypeError in Publisher.run and ended it."""
    async def main() -> None:
        with trio.fail_after(20):
            async with memory_network() as net:
                pub_host, evil = net.add_host(), net.add_host()
                pub = Publisher(pub_host, ContentService(pub_host, ContentStore()), [])
                driver = _Driver()
                pub.drivers["j"] = driver  # type: ignore[assignment]
                async with trio.open_nursery() as nursery:
                    await nursery.start(pub.run)
                    await evil.subscribe(TOPIC_JOBS)
                    for bad in ({"type": [], "job": "j"}, {"type": {}, "job": "j"}, {"type": "step", "job": "j", "step": 1, "at": math.inf}):
                        await evil.publish(TOPIC_JOBS, packb(bad))
                    await evil.publish(TOPIC_JOBS, encode_event(StepProgress(job="j", step=3, loss=1.5)))
                    await driver.got.wait()
                    assert [e.step for e in driver.events] == [3]
                    nursery.cancel_scope.cancel()

    trio.run(main)


def test_job_probe_content_and_view_servers_answer_after_bad_requests() -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net:
                boot_host, host, evil, honest = net.add_host(), net.add_host(), net.add_host(), net.add_host()
                boot = SwarmNode(boot_host, SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=4.0), None)
                node = SwarmNode(host, CFG, TEST_PROFILE)
                table = node.refusals
                store = ContentStore()
                h = store.put(b"blob" * 100)
                ContentService(host, store, refusals=table).install()

                async def on_job(peer: str, req: dict[str, Any]) -> dict[str, Any]:
                    return {"ok": True, "op": req["op"]}

                host.set_stream_handler(JOB, job_proto.serve(on_job, timeout=5, refusals=table))
                async with trio.open_nursery() as nursery:
                    await nursery.start(boot.run, [])
                    await nursery.start(node.run, [boot_host.listen_addrs()[0]])
                    me = host.peer_id
                    # JOB: a frame that is not msgpack, an unknown op, a request that is not a map
                    for bad in (b"\xc1\xc1", packb({"op": ["offer"]}), packb([1, 2])):
                        await _send_raw(evil, me, JOB, encode_frame(bad, max_frame=1 << 20))
                    assert (await job_proto.request(honest, me, {"op": "status", "job": "j"}, timeout=5))["ok"]
                    # PROBE: a control frame without an op, and one whose op is a list
                    for bad in (packb({"n": 5}), packb({"op": []}), b"\xc1"):
                        await _send_raw(evil, me, PROBE, encode_frame(bad, max_frame=4096))
                    res = await probe(honest, me, nbytes=64 * 1024, timeout=10)
                    assert res.bandwidth > 0
                    # CONTENT: a request with a huge cap that is a float, and one with a list for a hash
                    for bad in (packb({"op": "get", "hash": h, "max": math.inf}), packb({"op": "get", "hash": [h], "max": 1})):
                        await _send_raw(evil, me, "/fusionp2p/content/1.0.0", encode_frame(bad, max_frame=1 << 20))
                    assert await ContentService(honest, ContentStore()).fetch_from(me, h, max_size=1 << 20) == b"blob" * 100
                    # VIEW: the server reads nothing, but the client's decoder refuses a bad answer (RemoteProtocolError only)
                    assert evil.peer_id in [p for (p, _r) in table.by_peer]
                    reasons = {r for (p, r) in table.by_peer if p == evil.peer_id}
                    assert reasons == {"job/request", "probe/protocol", "content/request"}
                    assert table.by_peer[(evil.peer_id, "job/request")] == 3
                    assert table.by_peer[(evil.peer_id, "probe/protocol")] == 3
                    assert table.by_peer[(evil.peer_id, "content/request")] == 2
                    assert not any(p == honest.peer_id for (p, _r) in table.by_peer)
                    nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_joiner_survives_a_bootstrap_that_answers_view_with_garbage(tmp_path: Path) -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net:
                boot_host, evil, host = net.add_host(), net.add_host(), net.add_host()
                boot = SwarmNode(boot_host, SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=4.0), None)
                first = SwarmNode(net.add_host(), CFG, TEST_PROFILE)

                async def bad_view(stream: Any) -> None:
                    await stream.send_all(encode_frame(packb({"records": [1, [2]], "bw": "x", "alive": [[]], "dead": None}),
                                                       max_frame=1 << 20))
                    await stream.send_eof()

                evil.set_stream_handler(VIEW, bad_view)
                node = SwarmNode(host, CFG, TEST_PROFILE)
                async with trio.open_nursery() as nursery:
                    await nursery.start(boot.run, [])
                    await nursery.start(first.run, [boot_host.listen_addrs()[0]])
                    await nursery.start(node.run, [evil.listen_addrs()[0], boot_host.listen_addrs()[0]])
                    await converge([first, node], bandwidth=False, timeout=10)
                    nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_handler_ending_on_a_peers_fault_does_not_end_the_memory_network() -> None:
    """Like the libp2p adapter: PeerUnavailable or RemoteProtocolError from a stream handler ends that
    stream only (before, it ended the in-memory network, and with it an embedded swarm)."""
    async def main() -> None:
        with trio.fail_after(10):
            async with memory_network() as net:
                a, b = net.add_host(), net.add_host()
                served = []

                async def handler(stream: Any) -> None:
                    data = await stream.receive_some()
                    if data == b"bad":
                        raise RemoteProtocolError("a bad request")
                    if data == b"gone":
                        raise PeerUnavailable(stream.remote_peer, "went away")
                    served.append(data)
                    await stream.send_all(b"ok")

                b.set_stream_handler("/t/1", handler)
                for msg in (b"bad", b"gone"):
                    assert await _send_raw(a, b.peer_id, "/t/1", msg) == b""
                assert await _send_raw(a, b.peer_id, "/t/1", b"good") == b"ok"
                assert served == [b"good"]

    trio.run(main)
