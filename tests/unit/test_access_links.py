"""Access links of the in-memory transport (net/shaping.py ``LinkEmulator.set_access``): a stream moves at
the smaller of the sender's uplink and the receiver's downlink, the streams of one node share its link, and
bytes arrive the two nodes' latencies later. Under trio's autojump clock: simulated time, exact and fast."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from fusionp2p.errors import ConfigError
from fusionp2p.net.memory import MemoryStream, memory_network
from fusionp2p.net.shaping import Access, LinkEmulator

MB = 1_000_000


async def _drain(stream: MemoryStream, done: trio.MemorySendChannel[float]) -> None:
    """Read *stream* to its end, then say when."""
    while await stream.receive_some():
        pass
    await done.send(trio.current_time())


def _run(main: object) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))   # type: ignore[arg-type]


def test_access_validated_and_path_rate() -> None:
    with pytest.raises(ConfigError):
        Access(up=0.0, down=1.0)
    with pytest.raises(ConfigError):
        Access(up=1.0, down=1.0, latency=-1.0)
    emu = LinkEmulator()
    emu.set_access("a", Access(up=1e6, down=8e6, latency=0.01))
    emu.set_access("b", Access(up=2e6, down=4e6, latency=0.02))
    assert emu.path_rate("a", "b") == 1e6 and emu.path_rate("b", "a") == 2e6
    assert emu.latency("a", "b") == pytest.approx(0.03)
    assert emu.path_rate("a", "c") == 1e6 and emu.path_rate("c", "d") is None
    emu.set_rate("a", "b", 0.5e6)   # a pair's own rate narrows it further
    assert emu.path_rate("b", "a") == 0.5e6


@pytest.mark.parametrize(("up", "down"), [(2e6, 8e6), (8e6, 2e6), (50e6, 1.25e9)])
def test_stream_takes_size_over_rate_plus_latency(up: float, down: float) -> None:
    size, lat_a, lat_b = 4 * MB, 0.015, 0.005

    async def main() -> None:
        with trio.fail_after(60):
            async with memory_network() as net:
                a, b = net.add_host(), net.add_host()
                emu = net.emulator = LinkEmulator()
                emu.set_access(a.peer_id, Access(up=up, down=1e9, latency=lat_a))
                emu.set_access(b.peer_id, Access(up=1e9, down=down, latency=lat_b))
                done, ends = trio.open_memory_channel[float](4)
                b.set_stream_handler("/sink", lambda s: _drain(s, done))   # type: ignore[arg-type,return-value]
                t0 = trio.current_time()
                s = await a.open_stream(b.peer_id, "/sink")
                await s.send_all(b"x" * size)
                await s.send_eof()
                took = await ends.receive() - t0
                want = size / min(up, down) + lat_a + lat_b
                assert took == pytest.approx(want, rel=0.03, abs=0.003), (took, want)

    _run(main)


def test_streams_of_one_node_share_its_uplink() -> None:
    size, up = 2 * MB, 4e6

    async def main() -> None:
        with trio.fail_after(60):
            async with memory_network() as net:
                a, b, c = net.add_host(), net.add_host(), net.add_host()
                emu = net.emulator = LinkEmulator()
                emu.set_access(a.peer_id, Access(up=up, down=1e9))
                done, ends = trio.open_memory_channel[float](4)
                for h in (b, c):
                    h.set_stream_handler("/sink", lambda s: _drain(s, done))   # type: ignore[arg-type,return-value]
                t0 = trio.current_time()

                async def send(peer: str) -> None:
                    s = await a.open_stream(peer, "/sink")
                    await s.send_all(b"x" * size)
                    await s.send_eof()

                async with trio.open_nursery() as nursery:
                    for h in (b, c):
                        nursery.start_soon(send, h.peer_id)
                last = max([await ends.receive(), await ends.receive()])
                # both streams together move 2 * size through a's uplink
                assert last - t0 == pytest.approx(2 * size / up, rel=0.03)

    _run(main)


def test_round_trip_is_twice_the_latency() -> None:
    async def main() -> None:
        with trio.fail_after(10):
            async with memory_network() as net:
                a, b = net.add_host(), net.add_host()
                emu = net.emulator = LinkEmulator()
                emu.set_access(a.peer_id, Access(up=1e8, down=1e8, latency=0.02))
                emu.set_access(b.peer_id, Access(up=1e8, down=1e8, latency=0.03))

                async def echo(s: MemoryStream) -> None:
                    await s.send_all(await s.receive_some())

                b.set_stream_handler("/echo", echo)   # type: ignore[arg-type]
                s = await a.open_stream(b.peer_id, "/echo")
                t0 = trio.current_time()
                await s.send_all(b"ping")
                assert await s.receive_some() == b"ping"
                assert trio.current_time() - t0 == pytest.approx(0.1, abs=1e-3)

    _run(main)
