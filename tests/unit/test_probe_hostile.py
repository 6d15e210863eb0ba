"""Probe poisoning (issue 15, item 7): a liar spoils only its own pair, and nobody holds a probe server."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.identity import verify
from fusionp2p.net.memory import memory_network
from fusionp2p.net.transport import Stream
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.probe import MEASURE_BYTES, ProbeBusy, ProbeServer, probe
from fusionp2p.swarm.prober import _Link
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.msg import packb, unpackb
from fusionp2p.wire.protocols import PROBE
from fusionp2p.wire.records import BandwidthReport, decode_signed, encode_signed


def _liar(rate: object):  # type: ignore[no-untyped-def]
    """A probe server that answers every transfer with *rate* as its measurement."""

    async def serve(stream: Stream) -> None:
        dec = FrameDecoder(max_frame=1 << 20)
        got = 0
        want = None
        while True:
            data = await stream.receive_some()
            if not data:
                return
            for fr in dec.feed(data):
                if want is None:
                    m = unpackb(fr)
                    if m["op"] == "ping":
                        await stream.send_all(encode_frame(packb({"op": "pong", "i": m["i"]}), max_frame=4096))
                    else:
                        want, got = m["n"], 0
                        await stream.send_all(encode_frame(packb({"op": "go"}), max_frame=4096))
                    continue
                got += len(fr)
                if got >= want:
                    ack = {"op": "ack", "n": want, "timed": 1.0, "rate": rate}
                    await stream.send_all(encode_frame(packb(ack), max_frame=4096))
                    want = None
    return serve


@pytest.mark.parametrize("rate", [1e300, math.inf, math.nan, -5.0, 1e13, "fast", True])
def test_a_lying_rate_fails_that_pair_only(rate: object) -> None:
    async def main() -> None:
        with trio.fail_after(10):
            async with memory_network() as net:
                a, honest, liar = net.add_host(), net.add_host(), net.add_host()
                honest.set_stream_handler(PROBE, ProbeServer())
                liar.set_stream_handler(PROBE, _liar(rate))
                with pytest.raises(PeerUnavailable, match="claims a rate"):
                    await probe(a, liar.peer_id, nbytes=MEASURE_BYTES)
                res = await probe(a, honest.peer_id, nbytes=MEASURE_BYTES)
                assert 0 < res.bandwidth < 1e13

    trio.run(main)


def test_our_signed_report_stays_acceptable_whatever_the_figures() -> None:
    """Defence in depth: a figure out of the range peers accept (from wherever) is clamped, so the
    prober's report with all its other measurements still verifies everywhere."""

    async def main() -> None:
        async with memory_network() as net:
            t = net.add_host()
            node = SwarmNode(t, SwarmConfig(), TEST_PROFILE)
            node.prober.links = {"p-inf": _Link(bandwidth=math.inf, rtt=1e9, samples=1),
                           "p-nan": _Link(bandwidth=math.nan, rtt=math.nan, samples=1),
                           "p-ok": _Link(bandwidth=1.25e8, rtt=0.01, samples=3)}
            node.prober.server.record_inbound("x", 1e300)
            rep = node._report()
            assert rep is not None
            back = decode_signed(encode_signed(rep, t.sign), verify)
            assert isinstance(back, BandwidthReport)
            figures = {m.dst: m.bandwidth for m in back.measurements}
            assert figures["p-ok"] == 1.25e8 and figures["p-nan"] == 0.0 and 0 < figures["p-inf"] < 1e13
            assert 0 < back.downlink < 1e13

    trio.run(main)


def test_one_stream_cannot_keep_the_probe_server_reserved() -> None:
    """An attacker reserves the server (one small transfer), then pings every 9 s to keep its stream
    alive, and reserves again whenever it can, for 10 simulated minutes. An honest peer probes every
    30 s (a busy answer is retried 3 times, as the swarm's prober does). Before: 20 of 20 busy."""

    async def main() -> None:
        async with memory_network() as net:
            victim, attacker, honest = net.add_host(), net.add_host(), net.add_host()
            server = ProbeServer()
            victim.set_stream_handler(PROBE, server)
            end = trio.current_time() + 600
            held = [0.0]
            holding = trio.Event()   # the attacker holds the server's reservation

            async def attack() -> None:
                while trio.current_time() < end:
                    s = await attacker.open_stream(victim.peer_id, PROBE)
                    dec = FrameDecoder(max_frame=4096)
                    try:
                        while trio.current_time() < end:
                            await s.send_all(encode_frame(packb({"op": "bulk", "n": 10, "mark": 2}), max_frame=4096))
                            data = await s.receive_some()
                            if not data:
                                break
                            if unpackb(dec.feed(data)[0])["op"] == "go":
                                await s.send_all(encode_frame(b"x" * 10, max_frame=4096))
                                await s.receive_some()   # ack
                                holding.set()
                            while trio.current_time() < end:
                                await trio.sleep(9)
                                await s.send_all(encode_frame(packb({"op": "ping", "i": 0}), max_frame=4096))
                                if not await s.receive_some():
                                    break
                            break
                    except (PeerUnavailable, trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    finally:
                        await s.aclose()

            async def watch() -> None:
                while trio.current_time() < end:
                    await trio.sleep(0.5)
                    if server.holds(attacker.peer_id, trio.current_time()):
                        held[0] += 0.5

            ok = busy = 0
            async with trio.open_nursery() as n:
                n.start_soon(attack)
                n.start_soon(watch)
                await holding.wait()
                for _ in range(20):
                    for _attempt in range(4):
                        try:
                            await probe(honest, victim.peer_id, nbytes=4096, max_bytes=4096, timeout=10)
                            ok += 1
                            break
                        except ProbeBusy:
                            await trio.sleep(0.3)
                    else:
                        busy += 1
                    await trio.sleep(30)
                n.cancel_scope.cancel()
            assert ok >= 16, (ok, busy)
            assert held[0] <= 0.15 * 600   # the attacker's share of the server: at most ~SERVER_SHARE

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_links_latency_is_the_smallest_of_its_recent_rtts() -> None:
    """A ping waits for both ends' event loops; on a host at its CPU quota that wait dominates (1-88 ms on
    links with no added delay). The link keeps the smallest of its last RTT_WINDOW RTTs."""
    from fusionp2p.swarm.probe import ProbeResult
    from fusionp2p.swarm.prober import RTT_WINDOW

    async def main() -> None:
        async with memory_network() as net:
            t, other = net.add_host(), net.add_host()
            node = SwarmNode(t, SwarmConfig(), TEST_PROFILE)
            node.view.is_alive = lambda peer: True  # type: ignore[method-assign]
            seen = []
            for rtt in (0.002, 0.088, 0.040, 0.001, 0.063, *([0.050] * RTT_WINDOW)):
                node.prober._apply_probe(other.peer_id, ProbeResult(peer=other.peer_id, rtt=rtt, bandwidth=1e6, nbytes=1 << 20,
                                                             elapsed=1.0))
                seen.append(node.prober.links[other.peer_id].rtt)
            assert seen[:5] == [0.002, 0.002, 0.002, 0.001, 0.001]
            assert seen[-1] == 0.050                    # the fast ones have left the window

    trio.run(main)
