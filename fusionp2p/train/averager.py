"""ReplicaAverager: CO2 averaging among the replicas of one stage, in the background (trio shell).

Theory of operation. The training loop calls :meth:`ReplicaAverager.round_boundary` every τ
local steps. That call copies the live parameters into a fresh snapshot buffer (the only thing
the averaging ever reads: live parameters keep training while it runs), then

* sync mode: runs the round (reduce-scatter → outer step on the owned shard → all-gather) and
  returns the new anchor x̃_{t+1};
* async mode (CO2): waits for the round launched at the PREVIOUS boundary, launches this
  boundary's round in the background, and returns the anchor the previous round produced. Since
  that round's outer step needs only state known at its launch (x̃_t, x̃_{t-1}, m and the average
  of snap_{t-1}), the whole round, all-gather included, overlaps with the next τ local steps.

* streaming mode (``OuterConfig(stream=True, sync=False)``, the product's default; Streaming DiLoCo,
  Douillard et al. 2025, with CO2's overlap): the vector is cut into F = τ balanced fragments
  (:func:`stream_fragments`: contiguous slices, or with *segments* piece ``f`` of every segment, so
  that a tied parameter given its own segment is cut the same way on every stage holding a copy),
  each with its own outer state (sharded over the replicas like the whole-vector state). The loop
  calls ``round_boundary`` after EVERY local step ``t``: it waits for the round launched ``L`` steps
  earlier (``OuterConfig.lag``, 1 by default: fragment ``f' = (t−L) mod τ``) and returns that
  fragment's new value as a jump that keeps the progress made since the snapshot,
  ``live_f' + (x̃_f' − snap_f')``; then it snapshots fragment ``t mod τ`` and launches its round
  (reduce-scatter → outer step on the fresh mean, the sync form → all-gather) in the background of
  the next steps. Rounds run one after the other, in launch order (a round starts when the one
  before it has finished), so with ``L = 2`` a round may take two steps' time, the next one queued
  behind it. Each fragment is averaged once every τ steps (the bytes of whole-vector CO2), but each
  average is applied ``L`` local steps after its snapshot instead of τ. ``finalize(params)`` replaces
  the last step's boundary: it applies the rounds in flight, then averages each fragment of the live
  vector once more (plain mean), one after the other, and returns the whole consensus vector.

The pure round logic is :class:`fusionp2p.average.allreduce.AllReduceRound`; this module only
moves messages. Every wait has a deadline (``round_timeout``): a peer that has not delivered when
it passes, or whose channel breaks, is declared lost; the round then completes over the survivors
or is skipped (``BoundaryResult.anchor is None``: keep the live parameters). After any loss or
skip the survivors form a new epoch (sorted survivor list) and the next round re-initialises the
outer state from the mean of their snapshots (momentum restarts at zero).

Wire: ``TensorMessage(kind="avg", job, stage, step=round id, name=phase,
meta={"epoch","lo","hi","w","s"}, tensors=(fp32 slice,))``; streaming rounds add ``"f"`` (the
fragment index; ``lo``/``hi`` are then within the fragment), which the round checks against its own
(``RemoteProtocolError`` otherwise). Round ids count launches over all fragments, so they are unique
per fragment too, and every replica launches the same sequence. Other kinds arriving on the same
channel are handed to ``on_other`` (e.g. the stage worker's activation router).

Plausible lies (``AveragerConfig.robust``): each shard owner reduces by CenteredClip (``average/robust.py``)
and counts whom it clipped; one clipped in ``strikes`` of ``window`` rounds is dropped like a peer whose part
was refused, and listed in ``dropped_outliers`` for the job's events.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
import trio

from fusionp2p.average.allreduce import PHASES, AllReduceRound, Finished, Reduced, RoundMsg, RoundResult, Send
from fusionp2p.average.outer import OuterConfig, OuterOptimizer
from fusionp2p.average.robust import ClipBook, RobustConfig, clipped_by_majority
from fusionp2p.average.shard import all_finite, shard_bounds
from fusionp2p.average.shard import stream_fragments as stream_fragments  # re-exported: the streaming API
from fusionp2p.errors import ConfigError, PeerUnavailable, RemoteProtocolError
from fusionp2p.net.channel import TensorChannel, TensorMessage
from fusionp2p.net.tensor_stream import BufferPool
from fusionp2p.train.averager_wire import KIND, _encode
from fusionp2p.train.averager_wire import from_message as from_message  # re-exported: the wire API
from fusionp2p.train.averager_wire import to_message as to_message
from fusionp2p.train.config import CO2_WIRES
from fusionp2p.train.flat import flatten as flatten  # re-exported: the flat-vector API
from fusionp2p.train.flat import load_anchor_ as load_anchor_
from fusionp2p.train.flat import load_flat_ as load_flat_
from fusionp2p.train.flat import load_slice_ as load_slice_
from fusionp2p.train.flat import read_ranges as read_ranges
from fusionp2p.train.flat import read_slice as read_slice
from fusionp2p.types import AveragingStats

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True, kw_only=True)
class AveragerConfig:
    """The averager of one stage's replica set."""

    outer: OuterConfig
    job: str
    stage: int = 0
    round_timeout: float = 60.0   # seconds a round may take from its launch, all phases included
    weight: float = 1.0           # this replica's weight in the mean (e.g. its samples per round)
    send_window: int = 8          # queued messages per peer before round tasks block
    max_weight_ratio: float = 4.0  # a peer's weight outside [w / ratio, w * ratio] is refused (w: ours)
    wire: str = "fp32"            # "bf16": parts as bf16 differences from the last average (CO2.wire)
    # wire "bf16": the peers whose links carry the differences (None: all). The job prices the bf16 wire
    # per link (plan/estimator.bf16_pays: its CPU against the bytes it saves, jobs/build.averaging_bf16),
    # the same on both ends of a link; other links carry fp32, and with none the rounds run as plain fp32
    # (no base kept, nothing rounded): on fast links the conversions cost more than the halved bytes save
    bf16_peers: frozenset[str] | None = None
    robust: RobustConfig | None = None   # CenteredClip at each shard owner (None: the plain mean)

    def __post_init__(self) -> None:
        if self.wire not in CO2_WIRES:
            raise ConfigError(f"AveragerConfig.wire must be one of {', '.join(CO2_WIRES)}, got {self.wire!r}")
        if not (self.round_timeout > 0 and math.isfinite(self.round_timeout)):
            raise ConfigError("round_timeout must be a positive number of seconds")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ConfigError("weight must be positive")
        if self.send_window < 1:
            raise ConfigError("send_window must be >= 1")
        if not self.max_weight_ratio >= 1:
            raise ConfigError("max_weight_ratio must be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryResult:
    """What a round boundary hands the training loop.

    ``anchor`` is the flat fp32 vector to load (``load_flat_``), or None: keep the live parameters.
    In streaming mode it is the new value of one fragment only, to load into the flat ranges
    ``ranges`` (``load_anchor_``; ``()`` means the whole vector); ``fragment`` names it.
    ``consumed_round`` is the round whose snapshots produced it (t−1 in async mode, t in sync mode,
    the previous step's in streaming mode).
    """

    boundary: int
    anchor: torch.Tensor | None
    consumed_round: int | None
    launched_round: int | None
    reason: str = ""
    ranges: tuple[tuple[int, int], ...] = ()
    fragment: int | None = None
    speeds: tuple[tuple[str, float], ...] = ()   # the consumed round's owners' speeds (RoundResult.speeds)
    arrivals: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()   # ... and arrivals (RoundResult.arrivals)


def round_buffer_pool(round_elems: int, replicas: int, *, bf16: bool) -> BufferPool:
    """The pool a :class:`ReplicaAverager` takes its round vectors from: the snapshot and gathered vector of
    a whole-vector round (the bf16 wire: its bases, differences and conversions too), the owned shard's
    mean and outer anchors. A fresh vector of 1 MiB or more faults in every page (``net/heap.py`` maps each
    one afresh: a bf16 round's conversions cost +41% of its CPU, measured); the pool hands one out again
    once nothing holds it (not the round, not a send, not the caller).

    Bounded by one round's working set, what a round holds at its peak anyway (so the pool adds nothing to
    a node's peak memory, it only keeps that set between rounds): 4 vectors of the round's size (snapshot,
    gathered vector, and in async mode the next snapshot and the anchor the caller still holds; 6 with the
    bf16 wire's base and difference) and 4 of its shard's (mean, new anchor, anchor, previous anchor); the
    bf16 wire's conversions add the snapshot's bf16 difference, the published shard's difference in fp32
    and bf16, and the received parts in fp32 (the other replicas' scatter parts, held until the mean, and
    one gather part at a time). *round_elems*: the largest round's vector (streaming: the largest fragment,
    about n/tau elements, so the set is that much smaller). Past the bound a vector is a plain tensor,
    freed as usual."""
    size = round_elems
    shard = -(-size // max(1, replicas))
    vectors = 6 if bf16 else 4
    n_bytes = 4 * (vectors * size + 4 * shard)
    if not bf16:
        return BufferPool(max_buffers=vectors + 4, max_bytes=n_bytes)
    conversions = 2 * size + (4 + 2 + 4 * replicas) * shard   # bytes: the conversions listed above
    return BufferPool(max_buffers=vectors + 4 + replicas + 3, max_bytes=n_bytes + conversions)


def epoch_id(peers: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(peers).encode()).hexdigest()[:16]




_Event = tuple[str, str, "RoundMsg | None"]  # ("msg" | "lost", peer, message)


class _Round:
    """One round in flight: its result is set once, by its task."""

    def __init__(self, round_id: int, boundary: int, *, fragment: int | None = None, snap: torch.Tensor | None = None,
                 mean_only: bool = False) -> None:
        self.round_id = round_id
        self.boundary = boundary
        self.fragment = fragment   # streaming: the fragment it averages (None: the whole vector)
        self.snap = snap           # streaming: this replica's snapshot of it (the jump subtracts it)
        self.mean_only = mean_only  # publish the plain mean, no outer step (streaming finalize)
        self.done = trio.Event()
        self.result: RoundResult | None = None
        self.launched_at = trio.current_time()   # when this replica's own part was ready (its step ended)


class ReplicaAverager:
    """CO2 averaging of this replica (``me``) with ``peers`` over ``channels`` (one per other peer).

    Construct through :func:`open_replica_averager`. ``initial`` is the shared starting point x̃_0
    (identical on every replica, e.g. same seed or checkpoint).
    """

    def __init__(
        self,
        config: AveragerConfig,
        *,
        peers: Sequence[str],
        me: str,
        channels: Mapping[str, TensorChannel],
        initial: torch.Tensor | Iterable[torch.Tensor],
        on_other: Callable[[str, TensorMessage], Awaitable[None]] | None = None,
        momentum: torch.Tensor | None = None,
        segments: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        missing = [p for p in peers if p != me and p not in channels]
        if me not in peers or missing:
            raise ConfigError(f"need {me} in peers and a channel to every other peer (missing: {missing})")
        self.config = config
        self.me = me
        self.alive: tuple[str, ...] = tuple(peers)
        # this replica's weight in the rounds it launches from now on, and its speed (seconds per
        # micro-batch, 0: not measured) in the shards it publishes: the worker updates both as it re-deals
        self.weight = config.weight
        self.speed = 0.0
        self.epoch = epoch_id(self.alive)
        self._channels = dict(channels)
        self._on_other = on_other
        flat = flatten(initial)
        self.n_elems = flat.numel()
        # streaming: tau fragments (fewer when the vector is shorter; see stream_fragments), each with
        # its own outer state (sync form: the fresh average of its own round), sharded over the replicas
        self.streaming = config.outer.streaming
        self.fragments = stream_fragments(self.n_elems, config.outer.tau, segments) if self.streaming else ()
        self._flen = [sum(hi - lo for lo, hi in fr) for fr in self.fragments]
        self._vectors = round_buffer_pool(max(self._flen) if self._flen else self.n_elems, len(self.alive),
                                          bf16=config.wire == "bf16")
        self._initial: torch.Tensor | None = flat
        self._opt = self._make_opt(flat)
        self._frag_outer = dataclasses.replace(config.outer, sync=True)
        self._fopts = [self._make_frag_opt(flat, f) for f in range(len(self.fragments))]
        self._freinit = [False] * len(self.fragments)
        if self.streaming:
            self._initial = None   # no warm-up hold: every fragment's outer state starts at x̃_0 above
        if momentum is not None:   # handed over at a re-plan (jobs/state.py): this replica's shard of it
            if momentum.shape != flat.shape:
                raise ConfigError(f"momentum of {momentum.numel()} elements for {flat.numel()} parameters")
            self._opt.momentum = momentum[self._opt.lo:self._opt.hi].to(torch.float32).clone()
            for f, fo in enumerate(self._fopts):
                fo.momentum = read_ranges(momentum, self.fragments[f])[fo.lo:fo.hi].clone()
        self._needs_reinit = False
        self._boundary = 0
        self._next_round = 0
        self._pending: _Round | None = None       # the whole-vector round in flight
        self._inflight: deque[_Round] = deque()   # streaming: the fragment rounds in flight, oldest first
        self._dead: set[str] = set()
        self._stash: dict[int, list[tuple[str, RoundMsg]]] = defaultdict(list)
        # re-dealing replicas: when each peer's scatter part of a round arrived (train/claims.py checks
        # the speeds by them); one entry per round and peer, dropped as the rounds before it start
        self._arrived: dict[int, dict[str, float]] = defaultdict(dict)
        self._events_send, self._events_recv = trio.open_memory_channel[_Event](1024)
        self._queues: dict[str, trio.MemorySendChannel[TensorMessage]] = {}
        self._nursery: trio.Nursery | None = None
        self.last: BoundaryResult | None = None   # the latest boundary's result (for status/metrics)
        self.stats = AveragingStats()               # finished rounds and their durations (for metrics)
        self.refused: dict[str, int] = {}         # parts refused per peer (NaN, weight out of range...)
        # robust reduction: clipped parts per peer in our shards; the peers dropped for it, in order
        self.clips = ClipBook(config.robust) if config.robust is not None else None
        self.dropped_outliers: list[str] = []
        self._outliers_told = 0                     # of those, the ones new_outliers returned already
        # wire "bf16": per fragment (None: the whole vector), the last complete round's vector, which every
        # replica that finished that round holds bit for bit, and the round's id as its tag
        self._bases: dict[int | None, tuple[int, torch.Tensor]] = {}
        # ... and the peers that named the same base as ours in that round: they hold the new one too (if
        # their round completed; one that did not names no base in its next part and leaves the set)
        self._shared: dict[int | None, frozenset[str]] = {}

    def _make_opt(self, flat: torch.Tensor) -> OuterOptimizer:
        lo, hi = shard_bounds(flat.numel(), len(self.alive))[self.alive.index(self.me)]
        return OuterOptimizer(self.config.outer, flat[lo:hi], lo=lo, sharded=len(self.alive) > 1, alloc=self._vector)

    def _make_frag_opt(self, flat: torch.Tensor, f: int) -> OuterOptimizer:
        """Fragment *f*'s outer state: this replica's shard of it (``lo`` relative to the fragment)."""
        lo, hi = shard_bounds(self._flen[f], len(self.alive))[self.alive.index(self.me)]
        return OuterOptimizer(self._frag_outer, read_ranges(flat, self.fragments[f])[lo:hi], lo=lo, sharded=len(self.alive) > 1,
                              alloc=self._vector)

    # ------------------------------------------------------------------ the training loop's API
    async def round_boundary(self, params: torch.Tensor | Iterable[torch.Tensor], *, lr: float | None = None) -> BoundaryResult:
        """Snapshot *params*, complete/launch averaging rounds, return what to load (see module doc).

        Streaming mode: call it after EVERY local step; it returns one fragment's new value to load
        into ``ranges`` (``load_anchor_``), or ``anchor=None``."""
        if self.streaming:
            return await self._stream_boundary(params, lr)
        b = self._boundary
        self._boundary += 1
        outer = self.config.outer
        if not outer.sync and self._pending is not None and not self._pending.done.is_set():
            age = b - self._pending.boundary
            if age < outer.max_staleness:  # bounded staleness: let the late round finish later
                return self._record(BoundaryResult(boundary=b, anchor=None, consumed_round=None, launched_round=None, reason="average late"))
        snap = flatten(params, self._vector(self.n_elems))  # the copy happens before any await: live params are never read again
        if outer.sync:
            rnd = self._launch(snap, b, lr)
            await rnd.done.wait()
            return self._record(self._consume(b, rnd, launched=None))
        prev, self._pending = self._pending, None
        if prev is not None:
            await prev.done.wait()
        elif self._initial is not None:  # async warm-up: x̃_1 = x̃_0, nothing to average yet
            self._opt.hold(lr=lr)
            anchor, self._initial = self._initial, None
            self._pending = self._launch(snap, b, lr)
            return self._record(BoundaryResult(boundary=b, anchor=anchor, consumed_round=None, launched_round=self._pending.round_id))
        self._pending = self._launch(snap, b, lr)
        if prev is None:
            return self._record(BoundaryResult(boundary=b, anchor=None, consumed_round=None, launched_round=self._pending.round_id, reason="no round in flight"))
        return self._record(self._consume(b, prev, launched=self._pending.round_id))

    async def finalize(self, params: torch.Tensor | Iterable[torch.Tensor] | None = None) -> BoundaryResult | None:
        """Wait for the round in flight (async mode) and return its anchor, if any.

        Streaming mode (*params*: the live parameters, required): call it INSTEAD of the last step's
        round boundary. It applies the round in flight, then averages every fragment of the live
        vector once more (plain mean, no outer step: the last partial round enters at weight 1), one
        fragment after the other, and returns the whole vector to load (``anchor``, ``ranges=()``): the
        same on every replica. A fragment whose final round failed keeps this replica's values."""
        if self.streaming:
            if params is None:
                raise ConfigError("streaming averaging: finalize needs the live parameters")
            return await self._stream_finalize(params)
        prev, self._pending = self._pending, None
        if prev is None:
            return None
        await prev.done.wait()
        return self._record(self._consume(self._boundary, prev, launched=None))

    def momentum_shard(self) -> tuple[int, torch.Tensor]:
        """``(lo, momentum)``: this replica's slice ``[lo, lo + len)`` of the outer momentum (for a hand-off)."""
        return self._opt.lo, self._opt.momentum.detach().clone()

    def momentum_shards(self) -> list[tuple[int, torch.Tensor]]:
        """Every ``(lo, momentum)`` slice of the outer momentum this replica holds (flat offsets): one
        per fragment in streaming mode, else the one shard."""
        if not self.streaming:
            return [self.momentum_shard()]
        out = []
        for f, fo in enumerate(self._fopts):   # the owned shard [fo.lo, fo.hi) of the fragment, in flat ranges
            off = 0
            for lo, hi in self.fragments[f]:
                a, b = max(fo.lo, off), min(fo.hi, off + hi - lo)
                if a < b:
                    out.append((lo + a - off, fo.momentum[a - fo.lo:b - fo.lo].detach().clone()))
                off += hi - lo
        return out

    # ------------------------------------------------------------------ streaming
    async def _stream_boundary(self, params: torch.Tensor | Iterable[torch.Tensor], lr: float | None) -> BoundaryResult:
        """After local step ``b``: apply the round of fragment ``(b-1) mod tau`` (launched one step ago)
        as a jump that keeps the progress made since its snapshot, then snapshot fragment ``b mod tau``
        and launch its round in the background."""
        b = self._boundary
        self._boundary += 1
        prev: _Round | None = None
        new: torch.Tensor | None = None
        res = BoundaryResult(boundary=b, anchor=None, consumed_round=None, launched_round=None, reason="no round in flight")
        # one round launched per boundary: the one launched lag boundaries ago is due now
        if self._inflight and b - self._inflight[0].boundary >= self.config.outer.lag:
            prev = self._inflight.popleft()
            await prev.done.wait()
            new, res = self._consume_fragment(b, prev, params)
        f = b % self.config.outer.tau
        if f < len(self.fragments) and self._flen[f]:
            if new is not None and prev is not None and prev.fragment == f:   # lag = tau: snapshot after the jump
                snap = new.clone()
            else:
                snap = read_ranges(params, self.fragments[f])   # copied before any await
            rnd = self._launch_fragment(f, snap, b, lr, after=self._inflight[-1] if self._inflight else None)
            self._inflight.append(rnd)
            res = dataclasses.replace(res, launched_round=rnd.round_id)
        return self._record(res)

    def _consume_fragment(self, b: int, rnd: _Round, params: torch.Tensor | Iterable[torch.Tensor]
                          ) -> tuple[torch.Tensor | None, BoundaryResult]:
        """The jump ``live_f + (anchor_f - snap_f)`` of a finished fragment round (None if skipped)."""
        r, f = rnd.result, rnd.fragment
        assert r is not None and f is not None and rnd.snap is not None
        ranges = self.fragments[f]
        if not r.complete or r.vector is None:
            return None, BoundaryResult(boundary=b, anchor=None, consumed_round=rnd.round_id, launched_round=None,
                                        reason=r.reason or "skipped", ranges=ranges, fragment=f)
        new = read_ranges(params, ranges).add_(r.vector - rnd.snap)
        if not all_finite(new):   # the round refuses non-finite parts; our own may not be
            log.warning("averaging: fragment %d's new value is not finite; not loaded", f)
            return None, BoundaryResult(boundary=b, anchor=None, consumed_round=rnd.round_id, launched_round=None,
                                        reason="not finite", ranges=ranges, fragment=f)
        return new, BoundaryResult(boundary=b, anchor=new, consumed_round=rnd.round_id, launched_round=None,
                                   ranges=ranges, fragment=f, speeds=r.speeds, arrivals=r.arrivals)

    def _launch_fragment(self, f: int, snap: torch.Tensor, boundary: int, lr: float | None, *, mean_only: bool = False,
                         after: _Round | None = None) -> _Round:
        """Launch fragment *f*'s round, which starts once the round *after* (the one launched before it,
        still in flight) has finished: one round at a time reads the events and the bases."""
        assert self._nursery is not None, "use open_replica_averager"
        rnd = _Round(self._next_round, boundary, fragment=f, snap=snap, mean_only=mean_only)
        self._next_round += 1
        self._nursery.start_soon(self._run_round_after, after, rnd, snap, lr)
        return rnd

    async def _run_round_after(self, before: _Round | None, rnd: _Round, snap: torch.Tensor, lr: float | None) -> None:
        if before is not None:
            await before.done.wait()
        await self._run_round(rnd, snap, lr)

    async def _stream_finalize(self, params: torch.Tensor | Iterable[torch.Tensor]) -> BoundaryResult:
        live = flatten(params)
        while self._inflight:   # the rounds in flight, applied in launch order
            prev = self._inflight.popleft()
            await prev.done.wait()
            new, _ = self._consume_fragment(self._boundary, prev, live)
            if new is not None:
                assert prev.fragment is not None
                load_anchor_(live, new, self.fragments[prev.fragment])
        reasons = []
        first: int | None = None
        for f, ranges in enumerate(self.fragments):   # one at a time: every replica in the same order
            if not self._flen[f]:
                continue
            rnd = self._launch_fragment(f, read_ranges(live, ranges), self._boundary, None, mean_only=True)
            first = rnd.round_id if first is None else first
            await rnd.done.wait()
            r = rnd.result
            assert r is not None
            if r.complete and r.vector is not None:
                load_anchor_(live, r.vector, ranges)
            else:
                reasons.append(f"fragment {f}: {r.reason or 'skipped'}")
        self._boundary += 1
        return self._record(BoundaryResult(boundary=self._boundary - 1, anchor=live, consumed_round=first,
                                           launched_round=None, reason="; ".join(reasons)))

    # ------------------------------------------------------------------ internals
    def _vector(self, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A flat vector of *n* elements (fp32, or the bf16 wire's conversions; contents undefined), recycled
        when one of that size is free."""
        if n * dtype.itemsize < self._vectors.min_size:
            return torch.empty(n, dtype=dtype)
        return torch.frombuffer(self._vectors.get(n * dtype.itemsize), dtype=dtype)

    def _record(self, res: BoundaryResult) -> BoundaryResult:
        self.last = res
        return res

    def _consume(self, b: int, rnd: _Round, *, launched: int | None) -> BoundaryResult:
        r = rnd.result
        assert r is not None
        if not r.complete or r.vector is None:
            return BoundaryResult(boundary=b, anchor=None, consumed_round=rnd.round_id, launched_round=launched, reason=r.reason or "skipped")
        return BoundaryResult(boundary=b, anchor=r.vector, consumed_round=rnd.round_id, launched_round=launched,
                              speeds=r.speeds)

    def _launch(self, snap: torch.Tensor, boundary: int, lr: float | None) -> _Round:
        assert self._nursery is not None, "use open_replica_averager"
        self._initial = None if self.config.outer.sync else self._initial
        rnd = _Round(self._next_round, boundary)
        self._next_round += 1
        self._nursery.start_soon(self._run_round, rnd, snap, lr)
        return rnd

    async def _run_round(self, rnd: _Round, snap: torch.Tensor, lr: float | None) -> None:
        f = rnd.fragment
        reinit = self._needs_reinit if f is None else self._freinit[f]
        started = trio.current_time()
        n_elems = self.n_elems if f is None else self._flen[f]
        bf16 = self._bf16_wire()
        base = self._bases.get(f) if bf16 else None
        sm = AllReduceRound(peers=self.alive, me=self.me, n_elems=n_elems, round_id=rnd.round_id, epoch=self.epoch,
                            weight=self.weight, max_weight_ratio=self.config.max_weight_ratio, fragment=f,
                            robust=self.config.robust, out=self._vector(n_elems), alloc=self._vector,
                            reference=None if base is None else base[1])
        result: RoundResult | None = None
        links = self.config.bf16_peers
        shared = self._shared.get(f, frozenset())  # the peers our scatter parts go to as differences
        tags: dict[str, int | None] = {}          # the base each peer's scatter part named (None: fp32)
        gather_q: list[torch.Tensor] = []         # our published shard as a bf16 difference from the base
        scatter_q: list[torch.Tensor] = []        # our snapshot as a bf16 difference from the base

        # NOT recursive on purpose: a closure that calls itself is a reference cycle, and the cycle
        # would keep this round's buffers (snapshot, parts, shards) alive until the cyclic GC runs.
        async def act(actions: list[Send | Reduced | Finished]) -> None:
            nonlocal result
            todo = list(actions)
            while todo:
                a = todo.pop(0)
                if isinstance(a, Send):
                    msg = _encode(a.msg, base, scatter_q[0] if scatter_q else None, gather_q[0] if gather_q else None,
                                  tags.get(a.peer), a.peer in shared, links is None or a.peer in links)
                    with contextlib.suppress(trio.ClosedResourceError):  # closing down
                        await self._queues[a.peer].send(to_message(self.config.job, self.config.stage, msg))
                elif isinstance(a, Reduced):
                    if reinit:  # new epoch: restart the outer state from the survivors' mean
                        sharded = len(self.alive) > 1
                        if f is None:
                            self._opt = OuterOptimizer(self.config.outer, a.mean, lo=a.lo, sharded=sharded, alloc=self._vector)
                        else:
                            self._fopts[f] = OuterOptimizer(self._frag_outer, a.mean, lo=a.lo, sharded=sharded,
                                                            alloc=self._vector)
                        shard, scalar = a.mean, 0.0
                    elif rnd.mean_only:
                        shard, scalar = a.mean, 0.0
                    else:
                        step = (self._opt if f is None else self._fopts[f]).step(a.mean, lr=lr)
                        shard, scalar = step.anchor, step.gap_sq_part
                    if base is not None:
                        # what every replica will compute from the bf16 difference, we load too: bit for bit
                        # (base + q, computed as q + base in the difference's own buffer: the same floats)
                        d = torch.sub(shard.to(torch.float32), base[1][a.lo:a.hi], out=self._vector(a.hi - a.lo))
                        gather_q.append(self._vector(a.hi - a.lo, torch.bfloat16).copy_(d))
                        shard = d.copy_(gather_q[0]).add_(base[1][a.lo:a.hi])
                    arrived = [(self.me, 0.0)] + [(p, t - rnd.launched_at) for p, t in self._arrived.pop(rnd.round_id, {}).items()
                               if p in a.contributors] if self.speed else []
                    todo.extend(sm.publish(shard, scalar, self.speed, a.clipped, arrived))
                else:
                    result = a.result

        if base is not None:
            # our part, rounded the way our peers will read it: the same mean whoever owns a shard (a tied
            # parameter's copies in two stages, whose shards fall to different owners, stay equal)
            d = torch.sub(snap, base[1], out=self._vector(n_elems))
            scatter_q.append(self._vector(n_elems, torch.bfloat16).copy_(d))
            snap = d.copy_(scatter_q[0]).add_(base[1])   # base + q, as above
        for old in [k for k in self._arrived if k < rnd.round_id]:
            del self._arrived[old]
        await act(sm.start(snap, self.weight))
        for peer in sorted(self._dead & set(self.alive)):
            await act(sm.peer_lost(peer))
        for peer, stashed in self._stash.pop(rnd.round_id, []):
            await act(self._decoded_receive(sm, peer, stashed, base, tags))
        # One deadline window per phase: at the end of a window whoever is still awaited is lost,
        # and the survivors get a fresh window for the next phase (so that one silent peer does not
        # make every replica also give up on the others, who are busy timing it out too).
        while result is None:
            with trio.move_on_after(self.config.round_timeout):
                while result is None:
                    kind, peer, msg = await self._events_recv.receive()
                    if kind == "lost":
                        await act(sm.peer_lost(peer))
                    elif msg is not None and msg.round_id == rnd.round_id:
                        await act(self._decoded_receive(sm, peer, msg, base, tags))
                    elif msg is not None and msg.round_id > rnd.round_id:
                        self._stash[msg.round_id].append((peer, msg))
            if result is None:
                waiting = sorted(sm.awaiting())
                log.warning("averaging round %d: deadline passed, giving up on %s", rnd.round_id, waiting)
                for peer in waiting:
                    self._dead.add(peer)
                    await act(sm.peer_lost(peer))
        if result.complete:
            self._count_clipped(result)
        self._after_round(result, f, mean_only=rnd.mean_only)
        if bf16 and result.complete and result.vector is not None:
            self._bases[f] = (rnd.round_id, self._vector(n_elems).copy_(result.vector))
            ours = base[0] if base is not None else None
            self._shared[f] = frozenset(p for p, t in tags.items() if t == ours)
        else:   # some replicas may have it and some not (or no bf16 link is left): fp32 until a round completes again
            self._bases.pop(f, None)
            self._shared.pop(f, None)
        took, st = trio.current_time() - started, self.stats
        self.stats = AveragingStats(rounds=st.rounds + int(result.complete), skipped=st.skipped + int(not result.complete),
                                    seconds=st.seconds + took, last_s=took)
        rnd.result = result
        rnd.done.set()

    def _count_clipped(self, result: RoundResult) -> None:
        """Count the peers a majority of owners clipped in a finished round; one clipped too often leaves
        the averaging (every replica that finished the round counts the same)."""
        if self.clips is None or not result.clipped:
            return
        hit = clipped_by_majority(result.clipped)
        for peer in self.clips.record([p for p, _ in result.clipped if p != self.me], sorted(hit)):
            log.warning("averaging: %s's parts were clipped in %d of the last %d rounds; averaging without it",
                        peer, self.clips.config.strikes, self.clips.config.window)
            self.dropped_outliers.append(peer)
            self._dead.add(peer)

    def peer_of(self, name: str) -> str:
        """The remote peer id of replica *name* (``r<k>``; itself when not a channel's)."""
        return self._channels[name].remote_peer if name in self._channels else name

    def new_outliers(self) -> tuple[str, ...]:
        """The replicas (remote peer ids) dropped as outliers since the last call (the worker's reports)."""
        new, self._outliers_told = self.dropped_outliers[self._outliers_told:], len(self.dropped_outliers)
        return tuple(self._channels[n].remote_peer if n in self._channels else n for n in new)

    def _bf16_wire(self) -> bool:
        """Whether this round runs the bf16 wire: configured, and some live peer's link carries it."""
        links = self.config.bf16_peers
        return self.config.wire == "bf16" and (links is None or any(p in links for p in self.alive if p != self.me))

    def _decoded_receive(self, sm: AllReduceRound, peer: str, msg: RoundMsg, base: tuple[int, torch.Tensor] | None,
                         tags: dict[str, int | None]) -> list[Send | Reduced | Finished]:
        """Hand *msg* to the round, a bf16 difference turned back into fp32 values against our base. A
        difference from a base we do not hold (another tag, or none) contributes nothing and skips the
        round (``unusable``); the peer stays live, and the next round of the fragment goes in fp32."""
        if msg.phase == "scatter":
            tags[peer] = msg.base
        if msg.data.dtype == torch.bfloat16:
            assert msg.base is not None   # from_message
            if base is None or base[0] != msg.base:
                log.info("averaging round %d: %s part from %s names base %d, ours is %s; skipped", msg.round_id,
                         msg.phase, peer, msg.base, "none" if base is None else base[0])
                return sm.unusable(peer, msg.phase) if msg.phase in PHASES else self._safe_receive(sm, peer, msg)
            d = msg.data
            if d.dim() != 1 or not 0 <= msg.lo <= msg.hi <= base[1].numel() or d.numel() != msg.hi - msg.lo:
                return self._safe_receive(sm, peer, dataclasses.replace(msg, data=d.to(torch.float32)))   # refused there
            msg = dataclasses.replace(msg, data=self._vector(d.numel()).copy_(d).add_(base[1][msg.lo:msg.hi]))   # base + d
        return self._safe_receive(sm, peer, msg)

    def _safe_receive(self, sm: AllReduceRound, peer: str, msg: RoundMsg) -> list[Send | Reduced | Finished]:
        try:
            return sm.receive(peer, msg)
        except RemoteProtocolError as exc:  # a peer's bad bytes are never our crash: treat it as lost
            log.warning("averaging: bad message from %s: %s", peer, exc)
            self.refused[peer] = self.refused.get(peer, 0) + 1
            self._dead.add(peer)
            return sm.peer_lost(peer)

    def _after_round(self, result: RoundResult, fragment: int | None = None, *, mean_only: bool = False) -> None:
        lost = (set(result.lost) | self._dead) & set(self.alive)
        if result.complete and not mean_only:
            if fragment is None:
                self._opt.gap_sq = result.scalar_sum
                self._needs_reinit = False
            else:
                self._fopts[fragment].gap_sq = result.scalar_sum
                self._freinit[fragment] = False
        if lost or not result.complete:
            if lost:
                self.alive = tuple(p for p in self.alive if p not in lost)
                self.epoch = epoch_id(self.alive)
                log.warning("averaging: replicas %s lost; continuing with %d in epoch %s", sorted(lost), len(self.alive), self.epoch)
            self._needs_reinit = True
            self._freinit = [True] * len(self._freinit)   # every fragment's shards moved with the epoch

    async def _receiver(self, peer: str, ch: TensorChannel) -> None:
        try:
            while True:
                tm = await ch.receive()
                if tm.kind != KIND:
                    if self._on_other is not None:
                        await self._on_other(peer, tm)
                    continue
                if tm.job != self.config.job or tm.stage != self.config.stage:
                    log.debug("averaging: dropping message for job %s stage %d", tm.job, tm.stage)
                    continue
                try:
                    msg = from_message(tm)
                except RemoteProtocolError as exc:
                    log.warning("averaging: malformed message from %s: %s", peer, exc)
                    break
                if msg.phase == "scatter" and abs(msg.round_id - self._next_round) <= 2 * self.config.outer.tau + 2:
                    self._arrived[msg.round_id].setdefault(peer, trio.current_time())
                await self._events_send.send(("msg", peer, msg))
        except (PeerUnavailable, trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError, RemoteProtocolError) as exc:
            log.info("averaging: channel to %s ended: %r", peer, exc)
        self._dead.add(peer)
        await self._events_send.send(("lost", peer, None))

    async def _sender(self, peer: str, ch: TensorChannel, queue: trio.MemoryReceiveChannel[TensorMessage]) -> None:
        async for tm in queue:
            if peer in self._dead:
                continue
            try:
                await ch.send(tm)
            except (PeerUnavailable, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                log.info("averaging: send to %s failed: %r", peer, exc)
                self._dead.add(peer)
                await self._events_send.send(("lost", peer, None))


@asynccontextmanager
async def open_replica_averager(
    config: AveragerConfig,
    *,
    peers: Sequence[str],
    me: str,
    channels: Mapping[str, TensorChannel],
    initial: torch.Tensor | Iterable[torch.Tensor],
    on_other: Callable[[str, TensorMessage], Awaitable[None]] | None = None,
    momentum: torch.Tensor | None = None,
    segments: Sequence[tuple[int, int]] | None = None,
    cls: type[ReplicaAverager] | None = None,
) -> AsyncIterator[ReplicaAverager]:
    """Run a :class:`ReplicaAverager` (its receivers, senders and rounds) for the block's duration.

    *momentum*: the whole outer momentum vector handed over at a re-plan (None: start at zero).
    *segments* (streaming only): contiguous ranges cutting the flat vector, each cut into the
    fragments on its own (:func:`stream_fragments`; the worker gives every tied parameter its own).
    *cls*: a subclass to run instead (``fusionp2p.testing.byzantine.LyingAverager``)."""
    avg = (cls or ReplicaAverager)(config, peers=peers, me=me, channels=channels, initial=initial, on_other=on_other,
                          momentum=momentum, segments=segments)
    async with trio.open_nursery() as senders:
        for peer in peers:
            if peer == me:
                continue
            send, recv = trio.open_memory_channel[TensorMessage](config.send_window)
            avg._queues[peer] = send
            senders.start_soon(avg._sender, peer, channels[peer], recv)
        async with trio.open_nursery() as nursery:
            avg._nursery = nursery
            for peer in peers:
                if peer != me:
                    nursery.start_soon(avg._receiver, peer, channels[peer])
            try:
                yield avg
            finally:
                nursery.cancel_scope.cancel()
        # Flush: parts this replica already queued (e.g. its last anchor shard) are still owed to
        # peers that may be waiting on them; deliver them, within one round deadline.
        for q in avg._queues.values():
            q.close()
        senders.cancel_scope.deadline = trio.current_time() + config.round_timeout
