"""The probe protocol on the in-memory transport: a measurement, a busy server, and server deadlines."""

import pytest
import trio
import trio.testing

from fusionp2p.errors import PeerUnavailable
from fusionp2p.runtime import probe as probe_mod
from fusionp2p.runtime.probe import ProbeBusy, ProbeServer, next_probe_size, probe
from fusionp2p.testing.memory import memory_network
from fusionp2p.wire.framing import encode_frame
from fusionp2p.wire.msg import packb
from fusionp2p.wire.protocols import PROBE


def test_probe_measures_and_a_busy_server_says_so() -> None:
    async def main() -> None:
        with trio.fail_after(10):
            async with memory_network() as net:
                a, b, c = net.add_host(), net.add_host(), net.add_host()
                server = ProbeServer()
                b.set_stream_handler(PROBE, server)
                res = await probe(a, b.peer_id, nbytes=256 * 1024)
                assert res.nbytes == 256 * 1024 and res.bandwidth > 0 and res.rtt >= 0
                server._busy = True          # as while another peer's transfer runs
                with pytest.raises(ProbeBusy):
                    await probe(c, b.peer_id, nbytes=1024)
                server._busy = False
                assert (await probe(c, b.peer_id, nbytes=1024)).nbytes == 1024

    trio.run(main)


def test_stalled_client_frees_the_server_at_its_deadline() -> None:
    """A client that announces a transfer and then goes silent must not keep the server busy forever."""

    async def main() -> None:
        async with memory_network() as net:
            a, b = net.add_host(), net.add_host()
            server = ProbeServer()
            b.set_stream_handler(PROBE, server)
            s = await a.open_stream(b.peer_id, PROBE)
            await s.send_all(encode_frame(packb({"op": "bulk", "n": 1000}), max_frame=4096))
            await s.receive_some()           # "go"
            assert server._busy
            await trio.sleep(probe_mod.SERVER_BULK + 1)   # the stalled sender (mock clock)
            assert not server._busy
            with pytest.raises(PeerUnavailable):
                await probe(a, "12D3KooWNoSuchPeer", nbytes=1024, timeout=1)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_next_probe_size_targets_a_duration() -> None:
    assert next_probe_size(1 << 20, 0.03) == 8 << 20        # grows, at most 8x per step
    assert next_probe_size(1 << 20, 0.6) == 512 * 1024      # shrinks toward ~0.3 s
    assert next_probe_size(1 << 20, 100.0) == 256 * 1024    # floor


def test_server_times_inbound_transfers_for_a_downlink_figure() -> None:
    async def main() -> None:
        with trio.fail_after(10):
            async with memory_network() as net:
                a, b = net.add_host(), net.add_host()
                server = ProbeServer()
                b.set_stream_handler(PROBE, server)
                assert server.best_inbound() == 0.0
                await probe(a, b.peer_id, nbytes=256 * 1024)
                assert server.inbound[a.peer_id] > 0 and server.best_inbound() == server.inbound[a.peer_id]

    trio.run(main)


def test_a_peer_too_busy_to_answer_is_given_up_on_at_the_control_deadline() -> None:
    """A server that accepts the stream but never answers the pings costs the client ctrl_timeout, not timeout."""

    async def main() -> None:
        async with memory_network() as net:
            a, b = net.add_host(), net.add_host()

            async def mute(stream: object) -> None:
                await trio.sleep_forever()

            b.set_stream_handler(PROBE, mute)  # type: ignore[arg-type]
            t0 = trio.current_time()
            with pytest.raises(PeerUnavailable, match="ping"):
                await probe(a, b.peer_id, nbytes=1024, timeout=20.0, ctrl_timeout=2.0)
            assert trio.current_time() - t0 == pytest.approx(2.0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
