"""A reading stage's data feed (jobs/data_shards.py) on the in-memory transport, under trio's mock clock.

The feed fetches the shards its replica reads a window ahead, from the DHT's holders before the
publisher (token windows or examples); refuses a holder's wrong bytes (counted against it) and a stalled holder (one timeout) and
asks the next; slows a step with a notice when no shard comes, and fails with the reason at its
deadline; keeps what it read on disk, announced, so that the publisher may go away after a first pass.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pytest
import trio
import trio.testing

from fusionp2p.data import Examples, make_shards
from fusionp2p.data.stream import ExampleOrder, OrderConfig, StreamConfig, StreamOrder, held_out_indices
from fusionp2p.errors import JobError
from fusionp2p.jobs.content import ContentConfig, ContentService, ContentStore
from fusionp2p.jobs.data_shards import ExampleFeed, FeedConfig, ShardFeed
from fusionp2p.net.memory import memory_network
from fusionp2p.wire.protocols import CONTENT

T, B, M = 8, 2, 2
PER = 4                                  # windows a shard
NAMES = ("x", "y")


def _data() -> tuple[np.ndarray, Any, dict[str, bytes]]:
    toks = np.random.default_rng(5).integers(0, 256, size=12 * (PER * T + 1)).astype(np.int64)
    man, blobs = make_shards(toks, vocab_size=256, shard_tokens=PER * T + 1)
    return toks, man, blobs


class _LyingStore(ContentStore):
    """Holds every blob it is given, and serves each with its first byte flipped (the content service
    serves through ``reader``, a part at a time; ``get`` lies the same way)."""

    def get(self, h: str) -> bytes:
        blob = bytearray(super().get(h))
        blob[0] ^= 0xFF
        return bytes(blob)

    @contextlib.contextmanager
    def reader(self, h: str) -> Iterator[BinaryIO]:
        yield io.BytesIO(self.get(h))


def _feed(svc: ContentService, man: Any, peers: list[str], **cfg: Any) -> ShardFeed:
    order = StreamOrder(man, StreamConfig(seq_len=T, micro_batch=B, micro_batches=M, seed=3), ((0, M),))
    return ShardFeed(svc, order, NAMES, replica=0, replicas=1, peers=peers,
                     config=FeedConfig(ahead_steps=2, max_shards=6, late_after=1.0, deadline=20.0, **cfg))


def _expected(feed: ShardFeed, toks: np.ndarray, sstep: int, micro: int) -> np.ndarray:
    starts = feed.order.starts(feed._windows(sstep, micro))
    return np.stack([toks[s:s + T] for s in starts.tolist()])


async def _read(feed: ShardFeed, toks: np.ndarray, steps: int) -> None:
    for step in range(steps):
        for mu in range(M):
            await feed.ready(step, mu)
            got = feed(step, mu)
            assert np.array_equal(got["x"].numpy(), _expected(feed, toks, step, mu))
            assert len(feed._held) <= feed.max_shards


def test_a_liar_and_a_staller_are_refused_and_the_data_comes_from_the_next_holder(tmp_path: Path) -> None:
    toks, man, blobs = _data()

    async def main() -> None:
        with trio.fail_after(60):
            async with memory_network() as net:
                pub = ContentService(net.add_host(), ContentStore())
                liar = ContentService(net.add_host(), _LyingStore())
                stall = net.add_host()
                me = ContentService(net.add_host(), ContentStore(tmp_path / "me"), ContentConfig(fetch_timeout=2.0))
                for svc in (pub, liar, me):
                    svc.install()

                asked: list[int] = []

                async def hang(stream: Any) -> None:
                    asked.append(1)
                    await trio.sleep_forever()
                stall.set_stream_handler(CONTENT, hang)
                for h, blob in blobs.items():
                    pub.store.put(blob)
                    liar.store.put(blob)
                    await pub.transport.provide(h)
                    await liar.transport.provide(h)
                    await stall.provide(h)
                for p in (pub, liar):
                    await me.transport.connect(p.transport.listen_addrs()[0])
                await me.transport.connect(stall.listen_addrs()[0])
                feed = _feed(me, man, [pub.transport.peer_id])
                done = trio.Event()
                async with trio.open_nursery() as n:
                    await n.start(feed.serve, done)
                    await _read(feed, toks, 6)
                    done.set()
                assert feed.stats.refused >= 1
                assert me.refusals.score(liar.transport.peer_id, now=trio.current_time()) > 0
                assert feed.stats.peers.keys() <= {pub.transport.peer_id}   # nothing taken from the liar
                assert asked and me.refusals.score(stall.peer_id, now=trio.current_time()) > 0   # stalled: counted

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_shard_nobody_serves_slows_the_step_with_a_notice_then_fails_it_with_the_reason() -> None:
    _toks, man, _blobs = _data()
    late: list[tuple[int, int, float]] = []

    async def on_late(step: int, shard: int, waited: float) -> None:
        late.append((step, shard, waited))

    async def main() -> None:
        with trio.fail_after(120):
            async with memory_network() as net:
                me = ContentService(net.add_host(), ContentStore())
                gone = net.add_host()
                feed = _feed(me, man, [gone.peer_id])
                feed.on_late = on_late
                net.kill(gone.peer_id)
                done = trio.Event()
                async with trio.open_nursery() as n:
                    await n.start(feed.serve, done)
                    t0 = trio.current_time()
                    with pytest.raises(JobError, match=r"shard \d+ of the dataset could not be fetched in 20 s"):
                        await feed.ready(0, 0)
                    assert trio.current_time() - t0 == pytest.approx(20.0, abs=0.5)
                    done.set()
        assert len(late) == 1 and late[0][0] == 0 and late[0][2] >= 1.0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_publisher_may_leave_after_a_first_pass_holders_serve_the_rest(tmp_path: Path) -> None:
    toks, man, blobs = _data()

    async def main() -> None:
        with trio.fail_after(60):
            async with memory_network() as net:
                pub = ContentService(net.add_host(), ContentStore())
                first = ContentService(net.add_host(), ContentStore(tmp_path / "first"))
                second = ContentService(net.add_host(), ContentStore(tmp_path / "second"))
                for svc in (pub, first, second):
                    svc.install()
                for h, blob in blobs.items():
                    pub.store.put(blob)
                    await pub.transport.provide(h)
                for a, b in ((first, pub), (second, pub), (second, first)):
                    await a.transport.connect(b.transport.listen_addrs()[0])
                steps = 12   # one epoch: 12 shards x 4 windows, 4 a step
                a = _feed(first, man, [pub.transport.peer_id])
                done = trio.Event()
                async with trio.open_nursery() as n:
                    await n.start(a.serve, done)
                    await _read(a, toks, steps)
                    done.set()
                assert a.stats.received_bytes == sum(len(b) for b in blobs.values())   # each shard once
                assert a.stats.received_bytes <= 1.1 * a.stats.consumed_bytes
                net.kill(pub.transport.peer_id)
                b = _feed(second, man, [pub.transport.peer_id])
                done = trio.Event()
                async with trio.open_nursery() as n:
                    await n.start(b.serve, done)
                    await _read(b, toks, steps)
                    done.set()
                assert set(b.stats.peers) == {first.transport.peer_id}
                # the first reader's store keeps what it read (on disk, cache: pinned by nobody)
                assert first.store.stats()["pinned_bytes"] == 0 and all(first.store.has(h) for h in man.shards)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_example_feed_reads_its_examples_and_the_held_out_ones_and_refuses_a_liar(tmp_path: Path) -> None:
    """The same feed for :class:`Examples`: every training example of an epoch once, by field name, from the
    honest holder; the held-out shards pinned for the evaluation; a window of shards in memory."""
    rng = np.random.default_rng(8)
    data = Examples({"x": rng.integers(0, 99, (53, 3)), "y": np.arange(53)}, holdout=5, seed=4, shard_bytes=4 * 32)
    man, blobs = data.shards()
    assert (man.num_train, man.shard_examples, len(man.shards)) == (48, 4, 14)

    async def main() -> None:
        with trio.fail_after(60):
            async with memory_network() as net:
                pub = ContentService(net.add_host(), ContentStore())
                liar = ContentService(net.add_host(), _LyingStore())
                me = ContentService(net.add_host(), ContentStore(tmp_path / "me"))
                for svc in (pub, liar, me):
                    svc.install()
                for h, blob in blobs.items():
                    pub.store.put(blob)
                    liar.store.put(blob)
                    await liar.transport.provide(h)
                for p in (pub, liar):
                    await me.transport.connect(p.transport.listen_addrs()[0])
                order = ExampleOrder(man, OrderConfig(micro_batch=B, micro_batches=M, seed=3), ((0, M),))
                feed = ExampleFeed(me, order, ("y", "x"), replica=0, replicas=1, peers=[pub.transport.peer_id],
                                   last_step=12, config=FeedConfig(ahead_steps=2, max_shards=4))
                assert feed.pinned == (12,) and feed.eval_data is not None     # the first 4 held-out examples
                seen: list[int] = []
                done = trio.Event()
                async with trio.open_nursery() as n:
                    await n.start(feed.serve, done)
                    for step in range(12):    # one epoch: 48 examples, 4 a step
                        for mu in range(M):
                            await feed.ready(step, mu)
                            got = feed(step, mu)
                            want = data.batch(order.indices(step, mu))
                            assert set(got) == {"x", "y"} and np.array_equal(got["x"].numpy(), want["x"])
                            seen.extend(got["y"].tolist())
                            assert len(feed._held) <= feed.max_shards and 12 in feed._held
                    for mu in range(M):
                        held = feed.eval_data(12, mu)
                        assert np.array_equal(held["y"].numpy(), data.batch(held_out_indices(man, B, mu))["y"])
                    done.set()
                train = set(data.batch(np.arange(48))["y"].tolist())
                assert sorted(seen) == sorted(train)              # each training example once, no held-out one
                assert feed.stats.refused >= 1 and feed.stats.peers.keys() <= {pub.transport.peer_id}
                # each shard read once: 12 to train, the held-out one of the evaluation (not the last, unread)
                assert feed.stats.received_bytes == man.total_bytes - man.shard_bytes(13)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
