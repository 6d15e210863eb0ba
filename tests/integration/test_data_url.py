"""A dataset the nodes read themselves from a URL (data/url.py), against a local HTTP server in the test.

The server (127.0.0.1, a thread of this process; nothing leaves the machine) serves a token file with
range requests, or lies (other bytes), or stalls. The publisher hashes the file once into the manifest;
a reading stage's feed reads its shards by range and checks each: a lying or stalled URL is refused,
counted against (asked no more after three strikes), and the shard comes from a holder instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio

from fusionp2p.data import TokenURL, make_shards
from fusionp2p.data.stream import StreamConfig, StreamOrder
from fusionp2p.errors import ConfigError
from fusionp2p.jobs.build import build_job
from fusionp2p.jobs.content import ContentConfig, ContentService, ContentStore
from fusionp2p.jobs.data_shards import URL_STRIKES, FeedConfig, ShardFeed
from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.net.memory import memory_network
from fusionp2p.sdk import Swarm
from fusionp2p.train.config import TrainConfig

T, B, M, PER = 8, 2, 2, 4


def _tokens(n: int = 12 * (PER * T + 1)) -> np.ndarray:
    return np.random.default_rng(9).integers(0, 300, size=n).astype("<u2")


@contextmanager
def _server(body: bytes, mode: str = "ok") -> Iterator[tuple[str, list[str]]]:
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            rng = self.headers.get("Range")
            asked.append(rng or "")
            if mode == "stall" and rng:
                time.sleep(3.0)
                return
            if rng:
                a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
                data = body[a:b + 1]
                if mode == "lie":
                    data = bytes(x ^ 0x55 for x in data)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {a}-{b}/{len(body)}")
            else:
                data = body
                self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/tokens.bin", asked
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_publisher_hashes_the_url_once_into_the_same_shards() -> None:
    toks = _tokens()
    with _server(toks.tobytes()) as (url, asked):
        src = TokenURL(url, seq_len=T, vocab_size=300, shard_tokens=PER * T + 1)
        man = src.manifest()
        assert asked == [""]                                    # one plain read, no range
    ref, _ = make_shards(toks, vocab_size=300, shard_tokens=PER * T + 1)
    assert man == ref and np.array_equal(src.tokens(), toks[:PER * T + 1])
    for bad in ("file:///etc/passwd", "ftp://x/y", "http://x/" + "a" * 300):
        with pytest.raises(ConfigError, match="http"):
            TokenURL(bad, seq_len=T, vocab_size=300)


def _feed(svc: ContentService, man: Any, url: str, peers: list[str]) -> ShardFeed:
    order = StreamOrder(man, StreamConfig(seq_len=T, micro_batch=B, micro_batches=M, seed=1), ((0, M),))
    return ShardFeed(svc, order, ("x", "y"), replica=0, replicas=1, peers=peers, url=url,
                     config=FeedConfig(late_after=1.0, deadline=30.0))


async def _read(feed: ShardFeed, toks: np.ndarray, steps: int) -> None:
    done = trio.Event()
    async with trio.open_nursery() as n:
        await n.start(feed.serve, done)
        for step in range(steps):
            for mu in range(M):
                await feed.ready(step, mu)
                starts = feed.order.starts(feed._windows(step, mu))
                want = np.stack([toks[s:s + T] for s in starts.tolist()]).astype(np.int64)
                assert np.array_equal(feed(step, mu)["x"].numpy(), want)
        done.set()


@pytest.mark.parametrize("mode", ["ok", "lie", "stall"])
def test_a_feed_reads_its_shards_by_range_and_refuses_a_url_that_lies_or_stalls(mode: str, tmp_path: Path) -> None:
    toks = _tokens()
    man, blobs = make_shards(toks, vocab_size=300, shard_tokens=PER * T + 1)

    async def main(url: str) -> ShardFeed:
        with trio.fail_after(60):
            async with memory_network() as net:
                pub = ContentService(net.add_host(), ContentStore())     # a holder of every shard
                me = ContentService(net.add_host(), ContentStore(tmp_path / mode), ContentConfig(fetch_timeout=1.0))
                for svc in (pub, me):
                    svc.install()
                for blob in blobs.values():
                    pub.store.put(blob)
                await me.transport.connect(pub.transport.listen_addrs()[0])
                feed = _feed(me, man, url, [pub.transport.peer_id])   # the URL first, the publisher after it
                await _read(feed, toks.astype(np.int64), 6)
                return feed

    with _server(toks.tobytes(), mode) as (url, asked):
        feed = trio.run(main, url)
    if mode == "ok":
        assert feed.stats.url_bytes == feed.stats.received_bytes > 0 and not feed.stats.peers
        assert all(a.startswith("bytes=") for a in asked)
    else:      # refused, counted, and asked no more after URL_STRIKES; the shards came from the holder
        assert feed.url_strikes == URL_STRIKES == len(asked) and feed.stats.url_bytes == 0
        assert feed.stats.received_bytes > 0 and feed.stats.refused == URL_STRIKES


@pytest.mark.slow
def test_a_job_trains_on_a_url_dataset_and_only_its_readers_read_the_url(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    seq = 16
    toks = np.random.default_rng(2).integers(0, 256, size=16 * (5 * seq + 1)).astype("<u1")
    cfg = TrainConfig(steps=4, micro_batch=2, micro_batches=2, lr=1e-3, replicas=1, averaging="none",
                      compression="none", planner="even_layers", seed=1)
    with _server(toks.tobytes()) as (url, asked), Swarm.local(n_nodes=3, home=tmp_path) as sw:
        torch.manual_seed(0)
        src = TokenURL(url, seq_len=seq, dtype="uint8", vocab_size=256, shard_tokens=5 * seq + 1)
        built = build_job(GPT2(GPT2Config.tiny(block_size=seq, n_layer=3)), None, src, cfg, publisher=sw.publisher_id,
                          sign=sw.sign, now=1.0, nonce=b"u" * 16)
        assert set(built.blobs) >= {built.spec.dataset.content_hash} and built.spec.dataset.kind == "url"
        assert not set(src.manifest().shards) & set(built.blobs)     # the publisher serves no shard
        job = sw.publish_built(built)
        job.wait(timeout=180)
        assert job.state is JobState.DONE
        assert sw.embedded is not None
        runs = {n.peer_id: n.jobs.jobs[built.spec.job_id] for n in sw.embedded.nodes}
        plan = next(r.plan for r in runs.values() if r.plan is not None)
        assert plan is not None and len(plan.stages) == 3
        stats = [runs[st.replicas[0]].data for st in plan.stages]
        assert stats[0].received_bytes > 0 and stats[2].received_bytes > 0     # the readers: from the URL
        assert stats[0].url_bytes + stats[2].url_bytes > 0
        assert stats[1].received_bytes == stats[1].consumed_bytes == 0           # the middle stage: nothing
        assert len(asked) > 1
