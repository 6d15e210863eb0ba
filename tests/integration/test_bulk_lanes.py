"""Bulk channels over several TCP connections ("lanes"): striped and plain messages interleave in order,
the lanes share the bytes, records out of place on an aux lane fail the channel, and a lost aux lane is
a lost peer. Both ends in one trio.run over loopback; every test has a deadline."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
import trio

from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.net.bulk import BulkChannel, open_data_plane
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.memory import memory_network
from fusionp2p.wire import tensor_frame as tf

LANES = {"lanes": 3, "chunk_size": 16 * 1024, "stripe_min": 40 * 1024, "window": 4}


def run(body: Callable[[BulkChannel, BulkChannel], Awaitable[None]], timeout: float = 15.0, **cfg: Any) -> None:
    async def main() -> None:
        with trio.fail_after(timeout):
            async with memory_network() as net:
                ta, tb = net.add_host(), net.add_host()
                async with open_data_plane(ta, **{**LANES, **cfg}) as da, open_data_plane(tb, **{**LANES, **cfg}) as db:
                    a = await da.connect(tb.peer_id)
                    b = await db.incoming.receive()
                    assert a.lanes == b.lanes == cfg.get("lanes", LANES["lanes"])
                    await body(a, b)

    trio.run(main)


def _msg(i: int) -> TensorMessage:
    """Sizes from 1 KB (one record on lane 0) to 400 KB (striped), odd tensor lengths (pads)."""
    g = torch.Generator().manual_seed(i)
    n = [250, 100_000, 3_001, 40_000, 17][i % 5]
    return TensorMessage(job="j", kind="act", step=i, meta={"i": i},
                         tensors=(torch.randn(n, generator=g), torch.arange(i % 7 + 1, dtype=torch.int8)))


def _same(got: TensorMessage, i: int) -> None:
    ref = _msg(i)
    assert (got.step, got.meta) == (ref.step, ref.meta)
    assert all(torch.equal(x, y) for x, y in zip(got.tensors, ref.tensors))


def test_striped_and_plain_messages_interleave_in_order_both_ways() -> None:
    async def body(a: BulkChannel, b: BulkChannel) -> None:
        async def pump(src: BulkChannel, count: int) -> None:
            for i in range(count):
                await src.send(_msg(i))

        async def drain(dst: BulkChannel, count: int) -> None:
            for i in range(count):
                _same(await dst.receive(), i)

        async with trio.open_nursery() as n:
            n.start_soon(pump, a, 30)
            n.start_soon(pump, b, 20)
            n.start_soon(drain, b, 30)
            n.start_soon(drain, a, 20)
        shares = [lane.bytes_sent for lane in a._lanes]
        assert min(shares) > 0.5 * max(shares), shares  # the slots spread over every lane

    run(body)


def test_a_clean_close_waits_for_the_slots_still_on_their_way() -> None:
    async def body(a: BulkChannel, b: BulkChannel) -> None:
        for _ in range(4):
            await a.send(_msg(1))  # striped
        await a.aclose()  # CLOSE on lane 0 may overtake the slots on the other lanes
        for _ in range(4):
            _same(await b.receive(), 1)
        with pytest.raises(trio.EndOfChannel):
            await b.receive()

    run(body)


def test_a_record_that_is_not_a_slot_on_an_aux_lane_fails_the_channel() -> None:
    async def body(a: BulkChannel, b: BulkChannel) -> None:
        a._send_raw_for_tests(bytes(a._lanes[1].sealer.seal(a._lanes[1].sealer.next_nonce(), tf.PING, [b""])), lane=1)
        with pytest.raises(RemoteProtocolError, match="only slots"):
            await b.receive()

    run(body)


def test_a_forged_slot_fails_the_channel() -> None:
    async def body(a: BulkChannel, b: BulkChannel) -> None:
        forged = tf.record_header(tf.SLOT, 16 * 1024 + tf.TAG_SIZE) + bytes(16 * 1024 + tf.TAG_SIZE)
        a._send_raw_for_tests(forged, lane=1)  # waits on b's lane 1 until a striped message is announced
        with contextlib.suppress(PeerUnavailable):  # b may hang up before a has sealed every slot
            await a.send(_msg(1))
        with pytest.raises(RemoteProtocolError, match="authentication"):
            await b.receive()
        with pytest.raises(PeerUnavailable):  # b hung up
            await a.receive()

    run(body)


def test_losing_an_aux_lane_is_losing_the_peer() -> None:
    async def body(a: BulkChannel, b: BulkChannel) -> None:
        await a.send(_msg(1))
        _same(await b.receive(), 1)
        a._lanes[2].sock.shutdown(socket.SHUT_RDWR)  # one TCP connection of three dies
        t0 = trio.current_time()

        async def send_past_the_window() -> None:
            for _ in range(LANES["window"] + 1):
                await a.send(_msg(1))

        async def receive_until_it_fails() -> None:
            while True:
                await b.receive()

        with pytest.raises(PeerUnavailable):
            await send_past_the_window()
        with pytest.raises(PeerUnavailable):
            await receive_until_it_fails()
        assert trio.current_time() - t0 < 2.0

    run(body)


def test_a_listener_grants_at_most_its_own_lanes() -> None:
    async def main() -> None:
        with trio.fail_after(10):
            async with memory_network() as net:
                ta, tb = net.add_host(), net.add_host()
                async with open_data_plane(ta, **LANES) as da, open_data_plane(tb, **{**LANES, "lanes": 1}) as db:
                    a = await da.connect(tb.peer_id)
                    b = await db.incoming.receive()
                    assert a.lanes == b.lanes == 1
                    await a.send(_msg(1))  # big enough to stripe, but there is one lane
                    _same(await b.receive(), 1)

    trio.run(main)


def test_a_message_that_crosses_our_close_is_read_not_answered_with_a_reset() -> None:
    """The job-end race seen on real nodes: A sends its last message and closes while B, which has not
    read that far, still sends (the ACK of an earlier message). A must read B's message to the end and
    drop it; before, A's reader failed on it ("channel ended") and closed the socket with its bytes
    unread, so B's kernel got a reset and dropped A's last message and CLOSE. The order is forced by
    holding B's lane-0 reader until A has read (or refused) B's message."""
    async def body(a: BulkChannel, b: BulkChannel) -> None:
        hold, go = threading.Event(), threading.Event()
        real = b._recv_exactly

        def gated(lane: Any, view: memoryview, *, at_boundary: bool) -> bool:
            if hold.is_set() and not lane.index:
                go.wait(10.0)
            return real(lane, view, at_boundary=at_boundary)

        b._recv_exactly = gated  # type: ignore[method-assign]
        await a.send(_msg(0))
        _same(await b.receive(), 0)
        hold.set()                       # B reads nothing more (its reader is inside the next recv) ...
        await a.send(_msg(2))            # ... so A's last message and its CLOSE wait in B's socket
        await a.aclose()
        read, over = [], trio.Event()   # A's reader finished B's message / A stopped (either ends the wait)
        on_event = a._on_event

        def seen(kind: int, message: Any, count: int) -> None:
            if kind == tf.MSG_END:
                read.append(message)
                over.set()
            on_event(kind, message, count)

        a._on_event = seen  # type: ignore[method-assign]
        await b.send(_msg(1))            # B has not seen the CLOSE: it still sends (400 KB)
        async with trio.open_nursery() as n:
            async def stopped() -> None:
                await a._finished.wait()
                over.set()
            n.start_soon(stopped)
            await over.wait()
            n.cancel_scope.cancel()
        assert read, "A stopped reading after its close (its reader refused B's message)"
        go.set()
        _same(await b.receive(), 2)
        with pytest.raises(trio.EndOfChannel):
            await b.receive()
        assert b._error is None and b.closed_by_peer
        with trio.fail_after(5):
            await a._finished.wait()     # B closed its side once it read the CLOSE: A's threads end

    run(body, lanes=1)
