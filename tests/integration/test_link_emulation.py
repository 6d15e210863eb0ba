"""Emulated link rates (net/shaping.py): the token bucket, the shaped in-memory transport and the
shaped data plane move at the emulated rate; unshaped pairs are untouched."""

from __future__ import annotations

import time

import pytest
import torch
import trio

from fusionp2p.errors import ConfigError
from fusionp2p.jobs.embedded import EmbeddedConfig, link_rate, sites
from fusionp2p.net.bulk import open_data_plane
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.memory import memory_network
from fusionp2p.net.shaping import LinkEmulator, TokenBucket


def test_token_bucket_paces_at_its_rate() -> None:
    b = TokenBucket(1000.0, burst=100.0)
    assert b.reserve(100, now=0.0) == 0.0            # the burst passes at once
    assert b.reserve(500, now=0.0) == pytest.approx(0.5)
    assert b.reserve(500, now=0.0) == pytest.approx(1.0)
    # an idle link refills only up to its burst
    assert b.reserve(100, now=100.0) == 0.0
    assert b.reserve(1000, now=100.0) == pytest.approx(1.0)
    with pytest.raises(ConfigError):
        TokenBucket(0.0)


def test_emulator_pairs_and_rates() -> None:
    emu = LinkEmulator()
    emu.set_rate("a", "b", 1e6)
    assert emu.rate("b", "a") == 1e6
    assert emu.bucket("a", "c") is None
    ab = emu.bucket("a", "b", "data")
    assert ab is not None and ab is emu.bucket("a", "b", "data")       # one bucket per direction and plane
    assert ab is not emu.bucket("b", "a", "data") and ab is not emu.bucket("a", "b", "control")
    with pytest.raises(ConfigError):
        emu.set_rate("a", "a", 1.0)


def test_rates_and_sites() -> None:
    assert link_rate("8mbit") == 1e6
    assert link_rate(5e5) == 5e5
    with pytest.raises(ConfigError):
        link_rate(-1)
    assert sites([2, 2], between="8mbit") == {(0, 2): 1e6, (0, 3): 1e6, (1, 2): 1e6, (1, 3): 1e6}
    assert sites([1, 2], between=1e6, inside=2e6) == {(0, 1): 1e6, (0, 2): 1e6, (1, 2): 2e6}
    assert EmbeddedConfig(links={(3, 1): "8mbit"}).links == {(1, 3): 1e6}
    with pytest.raises(ConfigError):
        EmbeddedConfig(links={(1, 1): 1e6})


def test_shaped_transport_and_data_plane_move_at_the_rate() -> None:
    rate = 2e6                                    # bytes/s
    payload = 1_000_000

    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net:
                ta, tb, tc = net.add_host(), net.add_host(), net.add_host()
                emu = net.emulator = LinkEmulator()
                emu.set_rate(ta.peer_id, tb.peer_id, rate)
                got = trio.Event()

                async def sink(stream: object) -> None:
                    n = 0
                    while n < payload:
                        data = await stream.receive_some()   # type: ignore[attr-defined]
                        if not data:
                            break
                        n += len(data)
                    got.set()

                tb.set_stream_handler("/sink", sink)
                tc.set_stream_handler("/sink", sink)
                # control plane: shaped a -> b, not a -> c
                for peer, slow in ((tb.peer_id, True), (tc.peer_id, False)):
                    got = trio.Event()
                    s = await ta.open_stream(peer, "/sink")
                    t0 = trio.current_time()
                    await s.send_all(b"x" * payload)
                    await got.wait()
                    took = trio.current_time() - t0
                    assert (took > 0.8 * payload / rate) == slow, (peer, took)
                # data plane: a tensor of 1 MB from a to b at 2 MB/s takes about 0.5 s
                async with open_data_plane(ta, emulator=emu) as da, open_data_plane(tb, emulator=emu) as db:
                    ch = await da.connect(tb.peer_id)
                    inc = await db.incoming.receive()
                    msg = TensorMessage(job="j", kind="act", step=0, tensors=(torch.zeros(payload // 4),))
                    t0 = time.monotonic()
                    await ch.send(msg)
                    back = await inc.receive()
                    took = time.monotonic() - t0
                    assert back.tensors[0].numel() == payload // 4
                    assert 0.8 * payload / rate < took < 5 * payload / rate, took
                    await ch.aclose()
                    await inc.aclose()

    trio.run(main)
