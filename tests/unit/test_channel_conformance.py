"""One conformance suite for every TensorChannel: the in-memory pair, the encrypted TCP channel
(over loopback, keyed through the in-memory Transport) and the reconnecting channel on top of it
(told that a killed peer is gone, as a node's membership view tells it). STYLE.md 14."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import trio
import trio.testing

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.bulk import open_data_plane
from fusionp2p.net.channel import TensorChannel, TensorMessage
from fusionp2p.net.memory import memory_network
from fusionp2p.net.resilient import ResilientConfig, open_resilient_acceptor, open_resilient_channel
from fusionp2p.testing.channels import memory_channel_pair

WINDOW = 4


@dataclass
class Pair:
    a: TensorChannel
    b: TensorChannel
    a_peer: str
    b_peer: str
    kill_b: Callable[[], None]


@asynccontextmanager
async def memory_pair() -> AsyncIterator[Pair]:
    a, b = memory_channel_pair("peer-a", "peer-b", window=WINDOW)
    yield Pair(a, b, "peer-a", "peer-b", b.kill)


@asynccontextmanager
async def bulk_pair(**cfg: Any) -> AsyncIterator[Pair]:
    cfg = {"window": WINDOW, "chunk_size": 64 * 1024, "lanes": 1, **cfg}
    async with memory_network() as net, trio.open_nursery() as nursery:
        ta, tb = net.add_host(), net.add_host()
        scope_b = trio.CancelScope()
        ready: list[Any] = []
        got_b = trio.Event()

        async def run_b() -> None:
            with scope_b:
                async with open_data_plane(tb, **cfg) as db:
                    ready.append(db)
                    got_b.set()
                    await trio.sleep_forever()

        nursery.start_soon(run_b)
        await got_b.wait()
        async with open_data_plane(ta, **cfg) as da:
            a = await da.connect(tb.peer_id)
            b = await ready[0].incoming.receive()
            assert a.lanes == b.lanes == cfg["lanes"]
            assert a.path == b.path == ("libp2p" if cfg.get("advertise_port") else "direct")
            yield Pair(a, b, ta.peer_id, tb.peer_id, scope_b.cancel)
            await a.aclose()
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def resilient_pair() -> AsyncIterator[Pair]:
    # A dead peer is reported as a node does it: its membership view says so (here: kill_b) and the
    # channel stops waiting for the peer at once. Not a short reconnect_timeout: that bounded the first
    # dial too, and a dial took longer than 0.5 s under load (2 of 1500 runs at load 8 failed so).
    cfg = ResilientConfig(window=WINDOW)
    dead = trio.Event()
    async with memory_network() as net, trio.open_nursery() as nursery:
        ta, tb = net.add_host(), net.add_host()
        scope_b = trio.CancelScope()

        def kill_b() -> None:
            dead.set()
            scope_b.cancel()

        async def run_b(task_status: Any) -> None:
            with scope_b:
                # b's channels wait for nobody once b is dead (a killed process does not wait either)
                async with open_resilient_acceptor(config=cfg, peer_gone=lambda _: dead.is_set()) as acc, \
                        open_data_plane(tb, window=WINDOW, chunk_size=64 * 1024) as db:
                    task_status.started(acc)   # links wait in db.incoming until serve takes them
                    await acc.serve(db.incoming)

        acc = await nursery.start(run_b)
        async with open_data_plane(ta, window=WINDOW, chunk_size=64 * 1024) as da, \
                open_resilient_channel(da, tb.peer_id, name="conformance", config=cfg,
                                       peer_gone=lambda p: p == tb.peer_id and dead.is_set()) as a:
            b = await acc.incoming.receive()
            yield Pair(a, b, ta.peer_id, tb.peer_id, kill_b)
        nursery.cancel_scope.cancel()


def _closed_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def libp2p_pair() -> Any:
    """The fallback path: the listener announces a data-plane port that refuses connections, so the
    dialer carries the tensors over a stream of the transport (``net/stream_channel.py``)."""
    return bulk_pair(advertise_port=_closed_port(), lanes=1)


def striped_pair() -> Any:
    """The encrypted channel over 3 lanes, every message striped over them (a small one is one slot, on
    the lane after the last message's first slot)."""
    return bulk_pair(lanes=3, chunk_size=16 * 1024, stripe_min=0)


FACTORIES = {"memory": memory_pair, "bulk": bulk_pair, "striped": striped_pair, "resilient": resilient_pair,
             "libp2p": libp2p_pair}


def run(factory: str, body: Callable[[Pair], Any], timeout: float = 10.0) -> None:
    async def main() -> None:
        with trio.fail_after(timeout):
            async with FACTORIES[factory]() as pair:
                await body(pair)

    trio.run(main)


def _msg(i: int, n: int = 100) -> TensorMessage:
    g = torch.Generator().manual_seed(i)
    return TensorMessage(job="j", kind="act", step=i, micro=i % 3, name=f"e{i}", meta={"i": i, "codec": "id"},
                         tensors=(torch.randn(n, generator=g), torch.arange(i, dtype=torch.int64)))


def _check(m: TensorMessage, i: int, n: int = 100) -> None:
    ref = _msg(i, n)
    assert m.key == ref.key
    assert m.meta == ref.meta
    assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(m.tensors, ref.tensors))


pytestmark = pytest.mark.parametrize("factory", list(FACTORIES))


def test_in_order_both_directions(factory: str) -> None:
    async def body(p: Pair) -> None:
        assert p.a.remote_peer == p.b_peer
        assert p.b.remote_peer == p.a_peer

        async def pump(src: TensorChannel, count: int) -> None:
            for i in range(count):
                await src.send(_msg(i))

        async with trio.open_nursery() as n:
            n.start_soon(pump, p.a, 20)
            n.start_soon(pump, p.b, 10)
            for i in range(20):
                _check(await p.b.receive(), i)
            for i in range(10):
                _check(await p.a.receive(), i)

    run(factory, body)


def test_large_message_spanning_records(factory: str) -> None:
    async def body(p: Pair) -> None:
        async with trio.open_nursery() as n:
            n.start_soon(p.a.send, _msg(5, 300_000))  # 1.2 MB: many 64 KiB records on the bulk channel
            _check(await p.b.receive(), 5, 300_000)

    run(factory, body)


def test_window_backpressure(factory: str) -> None:
    async def body(p: Pair) -> None:
        sent = 0

        async def sender() -> None:
            nonlocal sent
            for i in range(WINDOW + 3):
                await p.a.send(_msg(i))
                sent += 1

        async with trio.open_nursery() as n:
            n.start_soon(sender)
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert sent == WINDOW  # the receiver took nothing: exactly a window in flight
            _check(await p.b.receive(), 0)
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert sent == WINDOW + 1
            for i in range(1, WINDOW + 3):
                _check(await p.b.receive(), i)

    run(factory, body)


def test_clean_close_ends_the_stream(factory: str) -> None:
    async def body(p: Pair) -> None:
        await p.a.send(_msg(0))
        await p.a.send(_msg(1))
        await p.a.aclose()
        _check(await p.b.receive(), 0)
        _check(await p.b.receive(), 1)
        with pytest.raises(trio.EndOfChannel):
            await p.b.receive()
        with pytest.raises(trio.ClosedResourceError):
            await p.a.send(_msg(2))

    run(factory, body)


def test_dead_peer_reported_within_a_second(factory: str) -> None:
    async def body(p: Pair) -> None:
        await p.a.send(_msg(0))
        t0 = trio.current_time()
        p.kill_b()
        with pytest.raises(PeerUnavailable):
            await p.a.receive()
        assert trio.current_time() - t0 < 1.5

        async def send_past_the_window() -> None:
            for i in range(WINDOW + 2):  # the window must not hide the failure
                await p.a.send(_msg(i))

        with pytest.raises(PeerUnavailable):
            await send_past_the_window()

    run(factory, body)
