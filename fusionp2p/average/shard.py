"""Sharded outer state: the ZeRO idea applied to CO2 (pure).

The flat parameter vector of ``n_elems`` floats is cut into ``replicas`` contiguous shards whose
sizes differ by at most one (the first ``n_elems % replicas`` shards get the extra element).
Replica ``r`` owns the anchor, previous anchor and momentum of shard ``r`` only, so the outer
state costs ``3·n_elems/replicas`` floats per replica instead of ``3·n_elems``.

One round is: reduce-scatter (weighted mean) of the snapshots, the outer step on each owned
shard, all-gather of the new anchor shards. :class:`ShardedOuter` runs that round for n simulated
replicas in one process; it is the reference the networked averager must match and the proof
(tests/unit/test_average_shard.py) that sharding does not change the update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fusionp2p.average.outer import OuterConfig, OuterOptimizer
from fusionp2p.errors import ConfigError


def shard_bounds(n_elems: int, replicas: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of every shard, in rank order; they tile ``[0, n_elems)`` exactly."""
    if replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {replicas}")
    if n_elems < 0:
        raise ConfigError(f"n_elems must be >= 0, got {n_elems}")
    base, extra = divmod(n_elems, replicas)
    bounds = []
    lo = 0
    for r in range(replicas):
        hi = lo + base + (1 if r < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def all_finite(t: torch.Tensor) -> bool:
    """Whether *t* holds no NaN and no infinity.

    A sum first: one pass, no temporaries (``torch.isfinite(t).all()`` makes four passes and three
    tensors, and cost more than the AEAD on a 25M-float round). A NaN or an infinity makes the sum
    non-finite; finite values whose sum overflows fall back to the exact test, so it never errs."""
    if math.isfinite(float(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ w_i·x_i / Σ w_i`` in fp32, summed in the given order (deterministic), written into *out* when
    given (a flat fp32 vector of the parts' size, e.g. a recycled one; it must not overlap a part).

    With equal weights this is ``Σ x_i / n``, which is what every test reference computes.
    """
    if not parts or len(parts) != len(weights):
        raise ValueError("weighted_mean needs one weight per part and at least one part")
    if not all(w > 0 and math.isfinite(w) for w in weights):
        raise ValueError("weights must be positive and finite")
    # relative to the largest weight, so that no factor overflows fp32 (a weight of 1e39 is a finite
    # double but not a float: add_(alpha=1e39) raised); the mean is the same
    top = max(weights)
    rel = [w / top for w in weights]
    total = math.fsum(rel)
    uniform = all(w == weights[0] for w in weights)
    # the first term as it would be added to zeros (x, or w·x rounded once), without the pass over zeros;
    # equal weights: x_0 + x_1 in one pass (no copy of x_0 first: the same float)
    first = parts[0].to(torch.float32)
    rest = list(zip(parts[1:], rel[1:]))
    if out is None:
        out = torch.empty(first.shape, dtype=torch.float32)
    if uniform and rest:
        acc = torch.add(first, rest.pop(0)[0].to(torch.float32), out=out)
    elif uniform:
        acc = out.copy_(first)
    else:
        acc = torch.mul(first, rel[0], out=out)
    for x, w in rest:
        if uniform:
            acc.add_(x.to(torch.float32))
        else:
            acc.add_(x.to(torch.float32), alpha=w)
    return acc.div_(len(parts) if uniform else total)


class ShardedOuter:
    """n owners, each with the outer state of its shard; one call = one averaging round."""

    def __init__(self, config: OuterConfig, initial: torch.Tensor, replicas: int) -> None:
        flat = initial.detach().reshape(-1).to(torch.float32)
        self.config = config
        self.bounds = shard_bounds(flat.numel(), replicas)
        self.owners = [
            OuterOptimizer(config, flat[lo:hi], lo=lo, sharded=replicas > 1) for lo, hi in self.bounds
        ]

    def step(self, snapshots: Sequence[torch.Tensor], *, lr: float | None = None, weights: Sequence[float] | None = None) -> torch.Tensor:
        """Reduce-scatter *snapshots*, step every owner, all-gather: the new full anchor."""
        w = list(weights) if weights is not None else [1.0] * len(snapshots)
        shards = []
        gap_sq = 0.0
        for opt, (lo, hi) in zip(self.owners, self.bounds):
            avg = weighted_mean([s.reshape(-1)[lo:hi] for s in snapshots], w)
            res = opt.step(avg, lr=lr)
            shards.append(res.anchor)
            gap_sq += res.gap_sq_part
        for opt in self.owners:  # what the all-gather tells every owner
            opt.gap_sq = gap_sq
        return torch.cat(shards)

    def hold(self, *, lr: float | None = None) -> torch.Tensor:
        for opt in self.owners:
            opt.hold(lr=lr)
        return self.anchor

    @property
    def anchor(self) -> torch.Tensor:
        return torch.cat([o.anchor for o in self.owners])

    @property
    def momentum(self) -> torch.Tensor:
        return torch.cat([o.momentum for o in self.owners])

    def state_floats_per_replica(self) -> list[int]:
        """Outer-state floats each owner holds (anchor, previous anchor, momentum)."""
        return [3 * o.anchor.numel() for o in self.owners]


def stream_fragments(n_elems: int, tau: int, segments: Sequence[tuple[int, int]] | None = None
                     ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The streaming fragments of a flat vector of *n_elems*: ``F = min(tau, n_elems)`` (at least 1)
    fragments, each a tuple of flat ``(lo, hi)`` ranges. Every segment (a contiguous range; *segments*
    must cut ``[0, n_elems)`` in order, default one segment) is cut into F balanced contiguous pieces
    (``shard_bounds``) and fragment ``f`` takes piece ``f`` of each: with one segment, F contiguous
    balanced slices. An element's fragment thus depends only on its segment: a tied parameter given
    as a segment of its own falls in the same fragments on every stage that holds a copy."""
    segs = [(0, n_elems)] if segments is None else [(int(lo), int(hi)) for lo, hi in segments]
    pos = 0
    for lo, hi in segs:
        if lo != pos or hi < lo:
            raise ConfigError(f"averaging segments must cut [0, {n_elems}) in order, got {segs[:8]}")
        pos = hi
    if pos != n_elems:
        raise ConfigError(f"averaging segments cover {pos} of {n_elems} elements")
    n_frag = max(1, min(tau, n_elems))
    frags: list[list[tuple[int, int]]] = [[] for _ in range(n_frag)]
    for lo, hi in segs:
        for f, (a, b) in enumerate(shard_bounds(hi - lo, n_frag)):
            if b <= a:
                continue
            if frags[f] and frags[f][-1][1] == lo + a:   # adjacent pieces: one range
                frags[f][-1] = (frags[f][-1][0], lo + b)
            else:
                frags[f].append((lo + a, lo + b))
    return tuple(tuple(fr) for fr in frags)
