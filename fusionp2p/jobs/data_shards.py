"""A reading stage's data feed: the shards its replica is about to read, fetched a bounded window ahead.

Theory of operation. A token dataset or a dataset of examples travels as content-addressed shards
(``data/shards.py``, ``data/examples.py``) and is read in the order of ``data/stream.py``: each replica
reads a contiguous run of shards of its own. Only a stage whose program reads a data input (the first
for the tokens or inputs, the last for the targets or labels, wherever the DAG puts them) builds a feed
(:class:`ShardFeed` for token windows, :class:`ExampleFeed` for examples, both a :class:`StreamFeed`);
every other stage fetches nothing.

* **Window.** The worker asks :meth:`ShardFeed.ready` before it reads a micro-batch; that moves the
  feed's cursor to the step. A background task (:meth:`ShardFeed.serve`) fetches, in the order they
  will be read, the shards of the next ``ahead_steps`` steps of this replica (its micro-batches by the
  plan's deal), holding at most ``max_shards`` in memory; a shard no step from the cursor on reads
  leaves memory at once. An example feed also *pins* the shards of the held-out examples the
  evaluations read (fetched with the first step's, kept to the end).
* **Where from.** The node's content store first (``--disk``: shards read before, kept as cache, oldest
  evicted first when room is needed; never pinned, so a dataset larger than the disk streams through
  it), then the shard's holders on the DHT, the publisher last, so that the publisher may go offline
  once the first pass has spread the shards. Every shard is checked against the manifest (size, hash,
  token ids); a holder that serves other bytes is refused and counted against (``Refusals``), and the
  next one is asked. A node that keeps a shard on disk announces it on the DHT.
* **Late and lost.** A step whose shard is not in after ``late_after`` seconds waits, and says so
  (``on_late``, a log line); after ``deadline`` seconds it fails the job with the reason (which
  shard, who was asked). Every fetch has the content service's timeout, so a stalled holder costs
  one timeout, never a hang.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import trio

from fusionp2p.data.examples import ExampleManifest, ShardedExamples, decode_example_shard, read_rows
from fusionp2p.data.shards import STORAGE_DTYPES, ShardedTokens, ShardManifest, decode_shard
from fusionp2p.data.stream import (
    ExampleOrder,
    History,
    OrderConfig,
    ShardOrder,
    StreamConfig,
    StreamOrder,
    held_out_indices,
    next_history,
)
from fusionp2p.data.url import read_range
from fusionp2p.errors import ConfigError, JobError, PeerUnavailable, RemoteProtocolError
from fusionp2p.graph.program import DATA, StageProgram
from fusionp2p.jobs.accepted import AcceptedJob
from fusionp2p.jobs.content import ContentService
from fusionp2p.jobs.events import DataLate
from fusionp2p.jobs.store import StoreFull
from fusionp2p.plan import Plan
from fusionp2p.train.deal import Deal
from fusionp2p.types import short_peer

log = logging.getLogger(__name__)

STREAMED_KINDS = ("text", "npy", "bin", "url")   # dataset kinds read as streamed token shards
ANNOUNCE_GRACE = 2.0                     # seconds an ending feed leaves its pending announcements
URL = "url"                              # the dataset's URL among the candidates of a shard
URL_STRIKES = 3                          # wrong answers or stalls after which a feed asks the URL no more
URL_TIMEOUT = 60.0                       # seconds for one range request


@dataclass(frozen=True, kw_only=True, slots=True)
class FeedConfig:
    """Tunables of a stage's data feed (docs/models.md "Bringing data")."""

    ahead_steps: int = 2          # prefetch the shards of this many steps ahead of the cursor
    max_shards: int = 32          # shards held in memory at once (raised to one step's need)
    late_after: float = 2.0       # a step that waits this long for a shard says so
    deadline: float = 300.0       # ... and fails the job after this long
    retry: float = 0.5            # seconds between rounds over the holders (doubling, at most 8 s)
    announce_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.ahead_steps < 1 or self.max_shards < 1 or not 0 < self.late_after <= self.deadline or self.retry <= 0:
            raise ConfigError("a data feed needs ahead_steps >= 1, max_shards >= 1, 0 < late_after <= deadline, retry > 0")


@dataclass(slots=True)
class FeedStats:
    """What a feed fetched and read (the tests and benchmarks/data_plane.py read it)."""

    received_bytes: int = 0       # shard bytes from peers
    disk_bytes: int = 0           # shard bytes read back from the node's store
    url_bytes: int = 0            # shard bytes read from the dataset's URL (also in received_bytes)
    consumed_bytes: int = 0       # bytes of the samples the stage read (seq_len tokens a sample)
    shards: int = 0               # shards fetched from peers
    refused: int = 0              # shards refused (wrong bytes) from a peer
    late: int = 0                 # reads that waited past late_after
    waited_s: float = 0.0         # seconds reads waited for shards
    first_wait_s: float | None = None
    peers: dict[str, int] = field(default_factory=dict)   # bytes received from each holder


def reads_data(prog: StageProgram) -> bool:
    return any(r.src == DATA for r in prog.recv)


class StreamFeed:
    """Data of one reading stage replica (see the module docstring); callable as the worker's ``DataFn``.
    What a shard is (its size, how it is checked and read) is its subclass's: :class:`ShardFeed` for token
    windows, :class:`ExampleFeed` for examples."""

    order: ShardOrder
    eval_data: Callable[[int, int], dict[str, torch.Tensor]] | None = None   # the held-out micro-batches, if any

    def __init__(self, content: ContentService, order: ShardOrder, names: Sequence[str], *, replica: int,
                 replicas: int, micro: Sequence[int] = (), micro_period: int = 1, peers: Sequence[str] = (),
                 config: FeedConfig | None = None, last_step: int | None = None, url: str | None = None,
                 on_late: Callable[[int, int, float], Awaitable[None]] | None = None, pinned: Sequence[int] = ()) -> None:
        self.content, self.order, self.names = content, order, tuple(names)
        self.url = url               # a URL dataset (data/url.py): asked after the holders, before the peers
        self.url_strikes = 0         # its wrong answers and stalls; at URL_STRIKES it is asked no more
        self.last_step = last_step   # the job's steps: the final evaluation reads that step's, none later
        self.config = config or FeedConfig()
        self.replicas, self.peers, self.on_late = replicas, tuple(peers), on_late
        m = order.config.micro_batches
        self.deal = Deal(micro, micro_period, replica=replica, replicas=replicas, micro_batches=m)
        self.pinned = tuple(dict.fromkeys(pinned))   # shards held from the start to the end (the held-out examples')
        self.max_shards = max(self.config.max_shards, self.deal.most * order.config.micro_batch + 1) + len(self.pinned)
        self.stats = FeedStats()
        self._held: dict[int, Any] = {}
        self._cursor = -1
        self._changed = trio.Event()
        self._arrived = trio.Event()
        self._errors: dict[int, str] = {}
        self._need_cache: tuple[int, list[int]] = (-1, [])
        self._urgent: list[int] = []     # shards a waiting read needs now

    # ------------------------------------------------------------------ what a shard is (the subclass's)
    def _size(self, i: int) -> int:
        """Shard *i*'s exact size in bytes (a fetch is bounded by it)."""
        raise NotImplementedError

    def _decode(self, i: int, blob: bytes) -> Any:
        """Shard *i* checked against the manifest (RemoteProtocolError: wrong bytes) and made readable."""
        raise NotImplementedError

    def _url_start(self, i: int) -> int:
        raise NotImplementedError

    # ------------------------------------------------------------------ what is read when
    def _split(self, sstep: int, micro: int) -> tuple[int, int]:
        """The worker's (sampler step, micro) -> (step, slot of the step)."""
        return sstep // self.replicas, (sstep % self.replicas) * self.order.config.micro_batches + micro

    def _windows(self, sstep: int, micro: int) -> np.ndarray:
        step, k = self._split(sstep, micro)
        return self.order.windows(self.order.samples(step, k, 1))

    def _needed(self) -> list[int]:
        """Shards of the steps [cursor, cursor + ahead) of this replica, in the order they are read."""
        if self._need_cache[0] == self._cursor:
            return self._need_cache[1]
        out: dict[int, None] = {}
        end = self._cursor + self.config.ahead_steps
        for step in range(self._cursor, end if self.last_step is None else min(end, self.last_step + 1)):
            count, first = self.deal.at(step)
            wids = self.order.windows(self.order.samples(step, first, count))
            out.update(dict.fromkeys(self.order.shard_of(wids).tolist()))
        out.update(dict.fromkeys(self.pinned))   # after the next step's: fetched early, never dropped
        self._need_cache = (self._cursor, list(out))
        return self._need_cache[1]

    def _move(self, step: int) -> None:
        if step <= self._cursor:
            return
        self._cursor = step
        keep = set(self._needed())
        for i in [i for i in self._held if i not in keep]:
            del self._held[i]       # read: its memory goes (a copy stays on disk, if the node keeps one)
        self._changed.set()
        self._changed = trio.Event()

    # ------------------------------------------------------------------ the worker's side
    async def ready(self, sstep: int, micro: int) -> None:
        """Wait until micro-batch (sstep, micro)'s shards are held: slowed with a notice after
        ``late_after`` seconds, JobError with the reason after ``deadline``."""
        step, _ = self._split(sstep, micro)
        self._move(step)
        # the pinned (held-out) shards as well: an evaluation reads them without waiting
        shards = list(dict.fromkeys([*self.order.shard_of(self._windows(sstep, micro)).tolist(), *self.pinned]))
        # the micro-batch's own shards come first, even if a re-deal put them outside the window or it is full
        self._urgent = [i for i in shards if i not in self._held]
        t0 = trio.current_time()
        told = False
        while any(i not in self._held for i in shards):
            self._changed.set()
            self._changed = trio.Event()
            waited = trio.current_time() - t0
            if waited >= self.config.deadline:
                missing = [i for i in shards if i not in self._held]
                raise JobError(f"shard {missing[0]} of the dataset could not be fetched in {self.config.deadline:.0f} s "
                               f"({self._errors.get(missing[0], 'no holder answered')})")
            if not told and waited >= self.config.late_after:
                told = True
                self.stats.late += 1
                log.warning("step %d waits for data shard(s) %s (%.1f s so far)", step,
                            [i for i in shards if i not in self._held][:4], waited)
                if self.on_late is not None:
                    await self.on_late(step, next(i for i in shards if i not in self._held), waited)
            limit = self.config.late_after if not told else self.config.deadline
            with trio.move_on_after(max(0.0, limit - waited)):
                await self._arrived.wait()
        waited = trio.current_time() - t0
        self.stats.waited_s += waited
        if self.stats.first_wait_s is None:
            self.stats.first_wait_s = waited

    def __call__(self, sstep: int, micro: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ the fetching side
    async def serve(self, until: trio.Event, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Fetch ahead of the cursor until *until* is set (the epoch's channels closed) or cancelled."""
        async with trio.open_nursery() as announces:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._prefetch, announces)
                task_status.started()
                await until.wait()
                nursery.cancel_scope.cancel()
            # the last shards' announcements get a moment to finish (a DHT provide can take seconds)
            announces.cancel_scope.deadline = trio.current_time() + ANNOUNCE_GRACE

    async def _prefetch(self, announces: trio.Nursery) -> None:
        while True:
            urgent = next((i for i in self._urgent if i not in self._held), None)
            nxt = urgent if urgent is not None else next((i for i in self._needed() if i not in self._held), None)
            if nxt is None or (urgent is None and len(self._held) >= self.max_shards) or self._cursor < 0:
                await self._changed.wait()
                continue
            blob, kept = await self._fetch(nxt)
            if nxt == urgent or nxt in self._needed():   # the cursor may have moved past it meanwhile
                self._held[nxt] = self._decode(nxt, blob)
                self._arrived.set()
                self._arrived = trio.Event()
            if kept:
                announces.start_soon(self._announce, self.order.manifest.shards[nxt])

    async def _from_url(self, i: int, size: int, errors: list[str]) -> bytes | None:
        """Shard *i* read from the dataset's URL with a range request, verified; None (counted against
        the URL) when it serves other bytes, fails or stalls."""
        assert self.url is not None
        try:
            blob = await _read_url(self.url, self._url_start(i), size, min(self.content.config.fetch_timeout, URL_TIMEOUT))
            self._decode(i, blob)
        except (RemoteProtocolError, trio.TooSlowError) as exc:
            self.url_strikes += 1
            self.stats.refused += 1
            log.warning("data shard %d from %s: %s (strike %d of %d)", i, self.url[:80], exc, self.url_strikes, URL_STRIKES)
            errors.append(f"url: {type(exc).__name__}")
            return None
        return blob

    async def _announce(self, h: str) -> None:
        with trio.move_on_after(self.config.announce_timeout):
            try:
                await self.content.transport.provide(h)
            except (PeerUnavailable, RemoteProtocolError, OSError) as exc:
                log.info("announcing data shard %s…: %s", h[:12], exc)

    async def _fetch(self, i: int) -> tuple[bytes, bool]:
        """Shard *i*'s verified bytes, and whether the node's store keeps them (announce then)."""
        store = self.content.store
        h = self.order.manifest.shards[i]
        size = self._size(i)
        with store.unpinned():
            if store.has(h):
                try:
                    blob = store.get(h)
                    self._decode(i, blob)
                    self.stats.disk_bytes += len(blob)
                    return blob, False
                except (KeyError, RemoteProtocolError) as exc:
                    log.warning("data shard %d on disk: %s", i, exc)
        delay = self.config.retry
        got = await self._from_holders(i, h, size)
        while got is None:   # no holder delivered: again after a pause (the reader's deadline ends it)
            await trio.sleep(delay)
            delay = min(2 * delay, 8.0)
            got = await self._from_holders(i, h, size)
        blob = got
        if not store.on_disk:
            return blob, False    # a store in memory only (a test's) would keep every shard: memory is the window's
        with store.unpinned():
            try:
                store.put(blob)
                return blob, True
            except StoreFull as exc:
                log.info("data shard %d not kept on disk: %s", i, exc)
                return blob, False

    async def _from_holders(self, i: int, h: str, size: int) -> bytes | None:
        me, now = self.content.transport.peer_id, trio.current_time()
        try:
            with trio.fail_after(self.content.config.fetch_timeout):
                found = await self.content.transport.find_providers(h)
        except (PeerUnavailable, RemoteProtocolError, trio.TooSlowError, OSError) as exc:
            found = []
            log.info("holders of data shard %d: %s", i, exc)
        # holders first, the publisher (and the other given peers) last: it may have gone offline
        holders = [p for p in sorted(set(found) - set(self.peers)) if p != me]
        url = [URL] if self.url is not None and self.url_strikes < URL_STRIKES else []
        candidates = [p for p in dict.fromkeys([*holders, *url, *self.peers])
                      if p != me and not self.content.refusals.banned(p, now=now)]
        errors: list[str] = []
        for peer in candidates:
            if peer == URL:
                blob = await self._from_url(i, size, errors)
                if blob is None:
                    continue
                self.stats.url_bytes += len(blob)
                self.stats.received_bytes += len(blob)
                self.stats.shards += 1
                self._errors.pop(i, None)
                return blob
            try:
                blob = await self.content.fetch_from(peer, h, max_size=size)
                self._decode(i, blob)
            except RemoteProtocolError as exc:   # wrong bytes (IntegrityError) or a broken exchange
                self.stats.refused += 1
                self.content.refusals.refuse(peer, "data/shard", now=trio.current_time(), detail=str(exc)[:200])
                errors.append(f"{short_peer(peer)}: {type(exc).__name__}")
                continue
            except trio.TooSlowError:   # a holder that stalls costs one timeout, and counts against it
                self.content.refusals.refuse(peer, "data/stall", now=trio.current_time())
                errors.append(f"{short_peer(peer)}: stalled")
                continue
            except PeerUnavailable as exc:
                errors.append(f"{short_peer(peer)}: {type(exc).__name__}")
                continue
            self.stats.received_bytes += len(blob)
            self.stats.shards += 1
            self.stats.peers[peer] = self.stats.peers.get(peer, 0) + len(blob)
            self._errors.pop(i, None)
            return blob
        self._errors[i] = "; ".join(errors) or "no holder found"
        return None


class ShardFeed(StreamFeed):
    """A token dataset's feed: windows of ``seq_len`` tokens and their next-token targets."""

    order: StreamOrder

    def __init__(self, content: ContentService, order: StreamOrder, names: Sequence[str], **kw: Any) -> None:
        super().__init__(content, order, names, **kw)
        self._itemsize = STORAGE_DTYPES[order.manifest.dtype].itemsize

    def _size(self, i: int) -> int:
        lo, hi = self.order.manifest.shard_range(i)
        return (hi - lo) * self._itemsize

    def _decode(self, i: int, blob: bytes) -> np.ndarray:
        return decode_shard(self.order.manifest, i, blob)

    def _url_start(self, i: int) -> int:
        return self.order.manifest.shard_range(i)[0] * self._itemsize

    def __call__(self, sstep: int, micro: int) -> dict[str, torch.Tensor]:
        """The micro-batch's inputs (``names[0]``) and next-token targets (``names[1]``), int64."""
        wids = self._windows(sstep, micro)
        shard, starts = self.order.shard_of(wids), self.order.starts(wids)
        t = self.order.config.seq_len
        x = np.empty((len(wids), t + 1), dtype=np.int64)
        for b, (i, s) in enumerate(zip(shard.tolist(), starts.tolist(), strict=True)):
            lo = s - i * self.order.manifest.shard_tokens
            x[b] = self._held[i][lo:lo + t + 1]
        self.stats.consumed_bytes += len(wids) * t * self._itemsize
        return {self.names[0]: torch.from_numpy(x[:, :-1].copy()), self.names[1]: torch.from_numpy(x[:, 1:].copy())}


class ExampleFeed(StreamFeed):
    """An :class:`~fusionp2p.data.examples.Examples` dataset's feed: the fields the stage reads, by name. The
    held-out examples of the evaluation (``held_out_indices``: a contiguous run of them) are pinned: fetched
    once, kept to the end, read by :attr:`eval_data`."""

    order: ExampleOrder

    def __init__(self, content: ContentService, order: ExampleOrder, names: Sequence[str], **kw: Any) -> None:
        man, b = order.manifest, order.config.micro_batch
        held = ([held_out_indices(man, b, mu) for mu in range(order.config.micro_batches)]
                if man.num_holdout else [])
        pinned = sorted({int(i) // man.shard_examples for idx in held for i in idx.tolist()})
        super().__init__(content, order, names, pinned=pinned, **kw)
        self._held_out = held
        if held:
            self.eval_data = self._eval
            if self.last_step is not None:   # the evaluations read the held-out examples: no read of step `steps`
                self.last_step -= 1

    def _size(self, i: int) -> int:
        return self.order.manifest.shard_bytes(i)

    def _decode(self, i: int, blob: bytes) -> dict[str, np.ndarray]:
        return decode_example_shard(self.order.manifest, i, blob)

    def _rows(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        rows = read_rows(self.order.manifest, self._held, idx)
        self.stats.consumed_bytes += len(idx) * self.order.manifest.example_bytes
        return {k: torch.from_numpy(rows[k]) for k in self.names}

    def __call__(self, sstep: int, micro: int) -> dict[str, torch.Tensor]:
        """The micro-batch's examples: the fields the stage reads, by name."""
        return self._rows(self._windows(sstep, micro))

    def _eval(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        """The evaluation's micro-batch *micro* of held-out examples (the same at every evaluation)."""
        return self._rows(self._held_out[micro])


async def _read_url(url: str, start: int, size: int, timeout: float) -> bytes:
    with trio.fail_after(timeout + 1.0):   # urllib's own timeout is per read; this bounds the whole range
        # trio-typing's stubs predate abandon_on_cancel (as in swarm/probe.py)
        return await trio.to_thread.run_sync(lambda: read_range(url, start, size, timeout=timeout),  # type: ignore[no-any-return]
                                             abandon_on_cancel=True)  # type: ignore[call-arg]


def stage_feed(content: ContentService, accepted: AcceptedJob, plan: Plan, stage: int, replica: int, history: History,
               prog: StageProgram, *, peers: Sequence[str] = (), stats: FeedStats | None = None,
               config: FeedConfig | None = None,
               gossip: Callable[[DataLate], Awaitable[None]] | None = None) -> StreamFeed | None:
    """The feed of replica *replica* of *stage* in *plan*, when the job's data is streamed (a token dataset
    or examples) and the stage's program reads it; None otherwise (such a stage fetches no data). A late
    shard is announced with *gossip* (a :class:`DataLate` event)."""
    tokens, cfg, names = accepted.tokens, accepted.spec.config, accepted.dag.data_inputs
    if not isinstance(tokens, ShardedTokens | ShardedExamples) or not reads_data(prog):
        return None

    async def on_late(step: int, shard: int, waited: float) -> None:
        if gossip is not None:
            await gossip(DataLate(job=accepted.spec.job_id, step=step, stage=stage, peer=content.transport.peer_id,
                                  shard=shard, waited_s=waited, at=time.time()))

    kw: dict[str, Any] = {"replica": replica, "replicas": len(plan.stages[stage].replicas), "micro": plan.micro,
                          "micro_period": plan.micro_period, "peers": peers, "config": config,
                          "last_step": cfg.steps, "on_late": on_late}
    feed: StreamFeed
    if isinstance(tokens, ShardedExamples):
        eorder = ExampleOrder(tokens.manifest, OrderConfig(micro_batch=cfg.micro_batch, micro_batches=cfg.micro_batches,
                                                           seed=cfg.seed), history)
        feed = ExampleFeed(content, eorder, names, **kw)
    else:
        if len(names) != 2:
            raise ConfigError(f"the model takes data inputs {list(names)}; a token job feeds exactly (tokens, targets)")
        order = StreamOrder(tokens.manifest, StreamConfig(seq_len=accepted.spec.dataset.seq_len, micro_batch=cfg.micro_batch,
                                                          micro_batches=cfg.micro_batches, seed=cfg.seed), history)
        feed = ShardFeed(content, order, names, url=accepted.spec.dataset.name if accepted.spec.dataset.kind == "url" else None,
                         **kw)
    if stats is not None:
        feed.stats = stats     # the job's totals over its epochs
    return feed


def plan_history(previous: Sequence[tuple[int, int]], step: int, plan: Plan, micro_batches: int) -> History:
    """The data history of an epoch of *plan* that resumes at *step* (``data/stream.py``)."""
    return next_history(previous, step, len(plan.stages[0].replicas) * micro_batches)


def window_bytes(manifest: ShardManifest | ExampleManifest, *, micro_batch: int, micro_batches: int,
                 config: FeedConfig | None = None) -> int:
    """Memory a reading stage's feed holds at most: what a node must have besides its stage."""
    cfg = config or FeedConfig()
    n = max(cfg.max_shards, micro_batch * micro_batches + 1)
    if isinstance(manifest, ExampleManifest):
        largest = max(manifest.shard_bytes(0), manifest.shard_bytes(len(manifest.shards) - 1))
        held_out = -(-micro_batch * micro_batches // manifest.shard_examples) + 1 if manifest.num_holdout else 0
        return min(n + held_out, len(manifest.shards)) * largest
    shard = manifest.shard_tokens * STORAGE_DTYPES[manifest.dtype].itemsize
    return n * min(shard, manifest.num_tokens * STORAGE_DTYPES[manifest.dtype].itemsize)


__all__ = ["ANNOUNCE_GRACE", "STREAMED_KINDS", "ExampleFeed", "FeedConfig", "FeedStats", "ShardFeed", "StreamFeed", "plan_history",
           "reads_data", "stage_feed", "window_bytes"]
