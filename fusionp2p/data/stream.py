"""The sample order of a streamed dataset: exact per epoch, local per replica, stable across re-plans.

The same order serves token windows (:class:`StreamOrder`) and examples (:class:`ExampleOrder`): both are
items counted by shard (:class:`ShardOrder`); below, "window" is a token dataset's item, an example the other's.

Theory of operation. A streamed dataset is a :class:`ShardManifest` whose shards a node fetches only
when its replica is about to read them (``jobs/data_shards.py``). Two things must hold at once:

* **exact**: every window of an epoch is trained on once across all replicas, none twice, none skipped,
  whatever re-plans change the replica count and whatever steps a re-plan throws away; and
* **local**: a replica reads whole shards, and only its own, so that the bytes it receives are about
  the bytes it consumes (a global shuffle of windows would touch a new shard with almost every sample).

Windows never cross a shard: shard ``i`` of ``n_i`` tokens holds ``(n_i - 1) // T`` windows of
``T = seq_len`` inputs plus the shifted target (at most ``T`` tokens a shard go unused). The epoch
order ``S_e`` lists every window: the shards in a seeded permutation, each shard's windows shuffled (by
the shard's own seeded stream, computed when it is read: the order is held as O(shards) numbers, and what
earlier pieces consumed as runs of positions, :class:`_Runs`, never an array of every window).

Samples are numbered globally: ``G = base(step) + k * B + b`` for micro-batch slot ``k`` of a step
(``0 <= k < slots``, ``slots = replicas x micro_batches``: the worker's ``(step * R + k // M, k % M)``)
and sample ``b < B = micro_batch``. ``base(step)`` adds up ``slots x B`` over the steps before it, segment
by segment of the :data:`History` (``(from_step, slots)`` per re-plan), so a re-plan from R to R' replicas
continues exactly where the kept steps ended. Epoch ``e`` is ``G`` in ``[e W, (e + 1) W)``.

Where a segment meets an epoch (a *piece*), the windows left in ``S_e`` (those earlier pieces did not
consume, in ``S_e``'s order) are laid out **column-major** over the step's ``P = slots x B`` sample
offsets: offset ``o`` of every step reads the next window of its own column, a contiguous run of the
remaining order. Replica ``k`` runs a contiguous block of slots, so it reads a contiguous block of
columns, which is a contiguous run of shards: it alone fetches them (a shard at the edge of two blocks
is fetched by both). A re-plan ends the piece; the next piece lays out what is left the same way.

Pure: no I/O, no global RNG (``numpy.random.Generator(PCG64)`` seeded by ``(seed, epoch)``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fusionp2p.data.examples import ExampleManifest
from fusionp2p.data.sampler import check_batch_shape
from fusionp2p.data.shards import ShardManifest
from fusionp2p.errors import ConfigError

_SEED_DOMAIN = 0x46505354  # "FPST": apart from the in-memory sampler's streams of the same seed
_EXAMPLE_DOMAIN = 0x46505358   # "FPSX": examples' streams

# (first step, micro-batch slots a step) per plan since step 0, in order (see the module docstring)
History = tuple[tuple[int, int], ...]
MAX_HISTORY = 4096    # re-plans a job may have made (a Resume carries its history; bounded on the wire)

IntArray = npt.NDArray[np.int64]


def next_history(previous: Sequence[tuple[int, int]], step: int, slots: int) -> History:
    """The history of an epoch that resumes at *step* with *slots* slots a step, after *previous*: the
    segments of the kept steps (a checkpoint restore throws later ones away), then the new one."""
    if step < 0 or slots < 1:
        raise ConfigError(f"a data segment needs step >= 0 and slots >= 1, got ({step}, {slots})")
    kept = [(int(a), int(b)) for a, b in previous if a < step]
    if not kept and step > 0:   # no history known (an older leader): as if the job ran this plan from step 0
        return ((0, slots),)
    if kept and kept[-1][1] == slots:
        return tuple(kept)
    return (*kept, (step, slots))


def check_history(history: Sequence[tuple[int, int]]) -> History:
    """*history* if well formed (starts at step 0, strictly increasing steps, slots >= 1), else ValueError."""
    out = tuple((int(a), int(b)) for a, b in history)
    if not out or out[0][0] != 0 or len(out) > MAX_HISTORY or any(b < 1 for _, b in out) or any(
            out[i][0] >= out[i + 1][0] for i in range(len(out) - 1)):
        raise ValueError(f"a data history starts at step 0 with increasing steps and slots >= 1: {out[:4]}")
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class OrderConfig:
    """The batch shape and seed an order of items depends on (examples: no seq_len)."""

    micro_batch: int
    micro_batches: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_batch_shape(self, names=("micro_batch", "micro_batches"))


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamConfig(OrderConfig):
    seq_len: int

    def __post_init__(self) -> None:
        check_batch_shape(self)


@dataclass(frozen=True, slots=True)
class _Runs:
    """A subsequence of an epoch's order as sorted disjoint runs of its positions: O(re-plans x P), never
    one entry a window (a 2 GiB text file at seq_len 64 has 33 M windows: 256 MiB an array)."""

    starts: IntArray      # first position of each run
    cum: IntArray         # [runs + 1] the subsequence's index of each run's first element; cum[-1] = its length

    def __len__(self) -> int:
        return int(self.cum[-1])

    def at(self, k: IntArray) -> IntArray:
        """Positions in the epoch's order of the subsequence's elements *k*."""
        i = np.searchsorted(self.cum, k, side="right") - 1
        return self.starts[i] + (k - self.cum[i])

    def without(self, used: list[tuple[int, int]]) -> _Runs:
        """The subsequence less its elements in *used* (sorted disjoint ``[a, b)`` of its indices)."""
        keep, at = [], 0
        for a, b in used:
            if a > at:
                keep.append((at, a))
            at = max(at, b)
        if at < len(self):
            keep.append((at, len(self)))
        starts: list[int] = []
        lens: list[int] = []
        for a, b in keep:        # each kept index range, cut at the runs it spans
            i = int(np.searchsorted(self.cum, a, side="right")) - 1
            while a < b:
                run_end = int(self.cum[i + 1])
                q = int(self.starts[i]) + a - int(self.cum[i])
                n = min(b, run_end) - a
                if starts and starts[-1] + lens[-1] == q:
                    lens[-1] += n
                else:
                    starts.append(q)
                    lens.append(n)
                a += n
                i += 1
        return _Runs(starts=np.array(starts, dtype=np.int64),
                     cum=np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64))


@dataclass(frozen=True, slots=True)
class _Piece:
    lo: int               # first global sample number G of the piece
    hi: int               # one past its last (the epoch's end for the open segment)
    phase: int            # (lo - the segment's base) % P: the step offset of G = lo
    period: int           # P = slots x micro_batch
    left: _Runs           # what the piece lays out: the epoch's order less earlier pieces' (as runs of it)
    colstart: IntArray    # [P] first position of each column
    t0: IntArray          # [P] first row of each column (1 for the columns before the phase)

    def positions(self, g: IntArray) -> IntArray:
        v = g - self.lo + self.phase
        t, o = v // self.period, v % self.period
        return self.colstart[o] + t - self.t0[o]


class ShardOrder:
    """Which item each global sample number reads, for items counted by shard (*per_shard*), a config and a
    :data:`History`. Items are numbered shard by shard (``first[i]`` is shard ``i``'s first); *domain*
    keeps the seeded streams of one kind of dataset apart from another's."""

    manifest: ShardManifest | ExampleManifest

    def __init__(self, per_shard: IntArray, config: OrderConfig, history: Sequence[tuple[int, int]] = ((0, 1),), *,
                 domain: int = _SEED_DOMAIN) -> None:
        self.config, self._domain = config, domain
        self.history = check_history(history)
        self.per_shard: IntArray = np.asarray(per_shard, dtype=np.int64)
        self.first: IntArray = np.concatenate([[0], np.cumsum(self.per_shard)]).astype(np.int64)
        self.num_windows = int(self.first[-1])
        if self.num_windows < config.micro_batch:
            raise ConfigError(f"the dataset holds {self.num_windows} samples, fewer than micro_batch={config.micro_batch}")
        self._order = functools.lru_cache(maxsize=2)(self._epoch_order)
        self._shuffles = functools.lru_cache(maxsize=64)(self._shuffle)   # 64 shards' items, int64 each
        self._pieces = functools.lru_cache(maxsize=2)(self._epoch_pieces)
        bases, acc = [], 0
        for j, (a, s) in enumerate(self.history):
            bases.append(acc)
            if j + 1 < len(self.history):
                acc += (self.history[j + 1][0] - a) * s * config.micro_batch
        self._bases = bases

    # ------------------------------------------------------------------ global numbering
    def base(self, step: int) -> int:
        """Samples trained on before *step* (of the kept steps, over every segment)."""
        b = self.config.micro_batch
        j = max(i for i, (a, _) in enumerate(self.history) if a <= step)
        a, s = self.history[j]
        return self._bases[j] + (step - a) * s * b

    def slots(self, step: int) -> int:
        return next(s for a, s in reversed(self.history) if a <= step)

    def samples(self, step: int, first: int, count: int) -> IntArray:
        """Global sample numbers of slots ``[first, first + count)`` of *step*."""
        s = self.slots(step)
        if step < 0 or first < 0 or count < 0 or first + count > s:
            raise IndexError(f"slots [{first}, {first + count}) of step {step} outside [0, {s})")
        b = self.config.micro_batch
        g0 = self.base(step) + first * b
        return np.arange(g0, g0 + count * b, dtype=np.int64)

    # ------------------------------------------------------------------ order
    def _epoch_order(self, epoch: int) -> tuple[IntArray, IntArray]:
        """(the shards in the epoch's order, the order's position of each one's first window): O(shards)."""
        rng = np.random.Generator(np.random.PCG64([self._domain, self.config.seed, epoch]))
        ranked = rng.permutation(len(self.per_shard)).astype(np.int64)
        return ranked, np.concatenate([[0], np.cumsum(self.per_shard[ranked])]).astype(np.int64)

    def _shuffle(self, epoch: int, shard: int) -> IntArray:
        """The order of shard *shard*'s windows in *epoch* (its own seeded stream: computed for the shards read)."""
        rng = np.random.Generator(np.random.PCG64([self._domain, self.config.seed, epoch, shard]))
        return rng.permutation(int(self.per_shard[shard])).astype(np.int64)

    def _at(self, epoch: int, q: IntArray) -> IntArray:
        """The window at positions *q* of the epoch's order: the shards in a seeded permutation, each
        shard's windows shuffled."""
        ranked, cum = self._order(epoch)
        r = np.searchsorted(cum, q, side="right") - 1
        out = np.empty(len(q), dtype=np.int64)
        for rr in np.unique(r).tolist():
            m = r == rr
            shard = int(ranked[rr])
            out[m] = self.first[shard] + self._shuffles(epoch, shard)[q[m] - cum[rr]]
        return out

    def _segment_bounds(self) -> list[tuple[int, int, int]]:
        """(base G, end G or -1 for the open one, P) of every segment."""
        b = self.config.micro_batch
        out = []
        for j, (_, s) in enumerate(self.history):
            end = self._bases[j + 1] if j + 1 < len(self.history) else -1
            out.append((self._bases[j], end, s * b))
        return out

    def _epoch_pieces(self, epoch: int) -> tuple[_Piece, ...]:
        w = self.num_windows
        e_lo, e_hi = epoch * w, (epoch + 1) * w
        left = _Runs(starts=np.zeros(1, dtype=np.int64), cum=np.array([0, w], dtype=np.int64))
        pieces: list[_Piece] = []
        for base, end, p in self._segment_bounds():
            hi = e_hi if end < 0 else min(end, e_hi)
            lo = max(base, e_lo)
            if lo >= hi:
                continue
            phase = (lo - base) % p
            n = e_hi - lo                      # the piece is laid out as if it ran to the epoch's end
            assert n == len(left)
            v_end = phase + n
            o = np.arange(p, dtype=np.int64)
            t0 = (o < phase).astype(np.int64)
            t_end = np.where(o < v_end, -(-(v_end - o) // p), 0)
            cnt = np.maximum(t_end - t0, 0)
            colstart = np.concatenate([[0], np.cumsum(cnt)[:-1]]).astype(np.int64)
            piece = _Piece(lo=lo, hi=hi, phase=phase, period=p, left=left, colstart=colstart, t0=t0)
            pieces.append(piece)
            if hi < e_hi:                      # a re-plan ended it: what it consumed leaves the order,
                v_hi = phase + hi - lo         # a run at the head of each column
                rows = np.where(o < v_hi, -(-(v_hi - o) // p), 0) - t0
                left = left.without([(int(c), int(c + r)) for c, r in zip(colstart, rows, strict=True) if r > 0])
        return tuple(pieces)

    def windows(self, g: IntArray) -> IntArray:
        """The window id each global sample number reads."""
        w = self.num_windows
        out = np.empty(len(g), dtype=np.int64)
        for epoch in np.unique(g // w):
            sel = g // w == epoch
            gs = g[sel]
            res = np.empty(len(gs), dtype=np.int64)
            for piece in self._pieces(int(epoch)):
                m = (gs >= piece.lo) & (gs < piece.hi)
                if m.any():
                    res[m] = self._at(int(epoch), piece.left.at(piece.positions(gs[m])))
            out[sel] = res
        return out

    def shard_of(self, wids: IntArray) -> IntArray:
        return (np.searchsorted(self.first, wids, side="right") - 1).astype(np.int64)



class StreamOrder(ShardOrder):
    """The order of a token dataset's windows (``T = seq_len`` inputs and the shifted target, inside a shard)."""

    config: StreamConfig
    manifest: ShardManifest

    def __init__(self, manifest: ShardManifest, config: StreamConfig, history: Sequence[tuple[int, int]] = ((0, 1),)) -> None:
        self.manifest = manifest
        t = config.seq_len
        lens = np.array([b - a for a, b in (manifest.shard_range(i) for i in range(len(manifest.shards)))], dtype=np.int64)
        per_shard = np.maximum(lens - 1, 0) // t          # windows of each shard
        if int(per_shard.sum()) < config.micro_batch:
            raise ConfigError(f"the dataset's shards hold {int(per_shard.sum())} windows of seq_len {t}, fewer than "
                              f"micro_batch={config.micro_batch}: use larger shards or a shorter seq_len")
        super().__init__(per_shard, config, history)

    def starts(self, wids: IntArray) -> IntArray:
        """First token of each window (in the whole stream)."""
        shard = self.shard_of(wids)
        return shard * self.manifest.shard_tokens + (wids - self.first[shard]) * self.config.seq_len


class ExampleOrder(ShardOrder):
    """The order of an :class:`ExampleManifest`'s training examples (the held-out ones, last, are never in it):
    item ``i`` is example ``i`` of the sharded order (every shard before the last training one is full)."""

    manifest: ExampleManifest

    def __init__(self, manifest: ExampleManifest, config: OrderConfig, history: Sequence[tuple[int, int]] = ((0, 1),)) -> None:
        self.manifest = manifest
        lo = np.arange(len(manifest.shards), dtype=np.int64) * manifest.shard_examples
        per_shard = np.clip(np.minimum(lo + manifest.shard_examples, manifest.num_train) - lo, 0, None)
        super().__init__(per_shard, config, history, domain=_EXAMPLE_DOMAIN)

    def indices(self, step: int, micro: int, *, replicas: int = 1) -> IntArray:
        """The examples of the worker's micro-batch ``(step, micro)`` (its sampler step: ``step * R + r``)."""
        m = self.config.micro_batches
        return self.windows(self.samples(step // replicas, (step % replicas) * m + micro, 1))


def held_out_indices(manifest: ExampleManifest, micro_batch: int, micro: int) -> IntArray:
    """The held-out examples of the evaluation's micro-batch *micro*: ``[micro x B, (micro + 1) x B)`` of the
    held-out ones (wrapping), a contiguous run of their shards. The publisher put them in a seeded random
    order (``Examples.order``), so the first ones are a uniform sample of them."""
    h = manifest.num_holdout
    if h < 1:
        raise ConfigError("the dataset has no held-out examples")
    return manifest.num_train + (np.arange(micro * micro_batch, (micro + 1) * micro_batch, dtype=np.int64) % h)


__all__ = ["MAX_HISTORY", "ExampleOrder", "History", "OrderConfig", "ShardOrder", "StreamConfig", "StreamOrder",
           "check_history", "held_out_indices", "next_history"]
