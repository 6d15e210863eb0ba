"""Robust reduction of one averaging shard: a replica that lies plausibly moves the mean by a bounded amount.

Theory of operation. A shard's owner holds every replica's part of its shard (the reduce-scatter,
``average/allreduce.py``); before this module it took their weighted mean, so one replica could move the
average anywhere (a finite part within the weight ratio entered the mean as is). :func:`robust_mean`
replaces that mean by CenteredClip (Karimireddy, He and Jaggi 2021, as in BTARD, Gorbunov et al. 2022):

1. with the last average ``ref`` of the vector (the ``base`` every replica holds on the bf16 wire; none
   on the fp32 wire or in a fragment's first round), a test of direction that no norm sees: each part's
   update ``u_i = x_i - ref`` against the weighted mean of the others' updates. Honest updates share a
   direction (the common gradient); where the others agree significantly (the median cosine of their pairs
   above ``agree / sqrt(d)``, ``d`` the shard's length: two random directions' cosine is about
   ``1/sqrt(d)``) a part whose cosine with them is under half that is left out of the reduction and counted
   as clipped (:func:`misaligned`, at most the worst ``(n - 1) // 2``). A sign-flipped update, a replayed
   older average (it points back) and noise at the honest norm fail it while staying inside ``rho`` of step
   3: on the GPT-2 reference each cost 2-4.5% of held-out loss with CenteredClip alone
   (benchmarks/byzantine.py);
2. a robust start: the coordinate-wise median ``c`` of the parts left (the mean of the middle two for an
   even count);
3. the clip radius from the honest spread: ``rho = radius * d_(k)``, where ``d_i = ||x_i - c||`` and
   ``d_(k)`` is the upper median of the ``d_i`` (``k = n//2``: with fewer than half the replicas lying it is
   at most an honest replica's distance). The lower median clipped honest replicas of the GPT-2 reference
   (their distances ranged up to 1.9x the lower median, benchmarks/byzantine.py);
4. if no part was left out and every part is within ``rho`` of the plain weighted mean, that mean is the
   answer, bit for bit the mean of :func:`~fusionp2p.average.shard.weighted_mean` (it is CenteredClip's
   fixed point: nothing is clipped there), so an honest round is unchanged;
5. otherwise ``iters`` CenteredClip steps from ``c``: ``v <- v + sum_i w_i clip(x_i - v, rho) / sum_i w_i``
   (``clip(u, rho) = u * min(1, rho/||u||)``), and the parts still farther than ``rho`` from ``v`` are the
   clipped ones, counted against their peers (:class:`ClipBook`) with those left out in step 1.

Bound. At CenteredClip's fixed point the clipped parts pull the result by ``rho`` each against the
others: a liar of weight ``w`` of ``W`` moves its shard at most about ``w/(W-w) * rho`` from where the
honest parts put it (``rho/3`` for one replica of four; tests/unit/test_average_robust.py), a multiple of
the honest replicas' own spread whatever it sends (scaled updates, sign flips, noise, a stale
average), instead of anything at all.

Limits (docs/security.md). The norm is per shard: each owner sees only the parts of its shard, so a
lie spread thinly over every shard (within ``rho`` of each) is not clipped; it is bounded per shard
all the same. With two replicas (or a lying majority) nothing tells honest from lying: the reduction
is the plain mean below three parts. A replica owns its shard's outer step: what it publishes for its
own shard in the gather phase is not checked here.

Cost on an honest round: the updates' Gram matrix, one median over the stacked parts and two norms per
part (a few passes over the shard; benchmarks/byzantine.py measures it against the step time).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fusionp2p.average.shard import weighted_mean
from fusionp2p.errors import ConfigError

MIN_PARTS = 3   # below this no majority exists: the plain mean


@dataclass(frozen=True, slots=True, kw_only=True)
class RobustConfig:
    """How a shard owner reduces its parts, and when it stops averaging with a replica it keeps clipping.

    ``radius``: the clip radius in lower-median distances to the coordinate-wise median (2: an honest part
    twice as far from the centre as the typical one is still taken whole). ``iters``: CenteredClip steps
    when someone is clipped. ``agree``: the test of direction (module docstring, step 1). ``strikes`` of the last ``window`` rounds this replica reduced with a peer's
    part clipped drop that peer from the averaging (``ClipBook``)."""

    radius: float = 2.0
    iters: int = 3
    strikes: int = 4
    window: int = 8
    agree: float = 4.0   # the others' agreement the test of direction needs, in 1/sqrt(d); 0: no test

    def __post_init__(self) -> None:
        if not (self.radius >= 1.0 and math.isfinite(self.radius)):
            raise ConfigError(f"RobustConfig.radius must be finite and >= 1, got {self.radius}")
        if not 1 <= self.iters <= 100:
            raise ConfigError(f"RobustConfig.iters must be in [1, 100], got {self.iters}")
        if not (self.agree >= 0.0 and math.isfinite(self.agree)):
            raise ConfigError(f"RobustConfig.agree must be finite and >= 0, got {self.agree}")
        if not 1 <= self.strikes <= self.window <= 1024:
            raise ConfigError(f"RobustConfig needs 1 <= strikes <= window <= 1024, got {self.strikes}, {self.window}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RobustMean:
    """The reduced shard, the indices of the parts clipped (empty: the exact weighted mean), and ``rho``."""

    mean: torch.Tensor
    clipped: tuple[int, ...] = ()
    radius: float = math.inf


def coordinate_median(stacked: torch.Tensor) -> torch.Tensor:
    """The median of each column of *stacked* (n, d); the mean of the middle two for an even n."""
    n = stacked.shape[0]
    if n in (3, 4):   # the middle one or two are what the extremes leave: 3 reductions, no sort (25x faster at 4)
        return (stacked.sum(dim=0) - stacked.amax(dim=0) - stacked.amin(dim=0)).div_(n - 2)
    if n % 2:
        return stacked.median(dim=0).values
    mid = stacked.sort(dim=0).values[n // 2 - 1:n // 2 + 1]
    return mid.mean(dim=0)


def misaligned(x: torch.Tensor, reference: torch.Tensor, w: torch.Tensor, agree: float) -> list[int]:
    """The rows of *x* (n, d) whose update from *reference* does not point the way the others agree on
    (module docstring, step 1; *w*: the weights), worst first, at most ``(n - 1) // 2``: the others agree
    (the median cosine of their updates' pairs is above ``floor = agree / sqrt(d)``) and its cosine with their
    weighted mean update is at most ``floor / 2``. An honest part's is about 1.7 times the pairs' (a mean of
    the others points more along the common direction than one of them), far above it; a random direction's
    is within ``floor / 2`` (two standard deviations at ``agree`` 4) in 98% of rounds."""
    n, d = x.shape
    u = x - reference
    gram = (u @ u.T).double()                       # every dot product of two updates: one pass over the parts
    norm = gram.diagonal().clamp_min(1e-300).sqrt()
    cosine = gram / norm[:, None] / norm[None, :]
    floor = agree / math.sqrt(d)
    wd = w.double()
    bad: list[tuple[float, int]] = []
    for i in range(n):
        o = [j for j in range(n) if j != i]
        if statistics.median(float(cosine[j, k]) for a, j in enumerate(o) for k in o[a + 1:]) <= floor:
            continue
        wo = wd[o]
        dot = float(wo @ gram[i, o])                 # u_i . (the others' weighted sum)
        m2 = float(wo @ gram[o][:, o] @ wo)
        if m2 > 0 and dot / math.sqrt(m2) / float(norm[i]) <= floor / 2:
            bad.append((dot / math.sqrt(m2) / float(norm[i]), i))
    return [i for _, i in sorted(bad)[:(n - 1) // 2]]


def robust_mean(parts: Sequence[torch.Tensor], weights: Sequence[float], config: RobustConfig,
                reference: torch.Tensor | None = None) -> RobustMean:
    """CenteredClip of *parts* (flat fp32, equal sizes) with *weights*, and with *reference* (the last
    average of the same shard) the test of direction (module docstring)."""
    exact = weighted_mean(parts, weights)
    n = len(parts)
    if n < MIN_PARTS or exact.numel() == 0:
        return RobustMean(mean=exact)
    x = torch.stack([p.to(torch.float32) for p in parts])
    w = torch.tensor([float(v) for v in weights], dtype=torch.float32)
    w = w / w.sum()
    out = misaligned(x, reference.to(torch.float32), w, config.agree) if reference is not None and config.agree > 0 else []
    keep = [i for i in range(n) if i not in out]
    x, w = x[keep], w[keep] / w[keep].sum()
    centre = coordinate_median(x)
    dist = torch.linalg.vector_norm(x - centre, dim=1)
    rho = config.radius * float(dist.sort().values[len(keep) // 2])
    if not out and bool((torch.linalg.vector_norm(x - exact, dim=1) <= rho).all()):
        return RobustMean(mean=exact, radius=rho)
    v = centre
    for _ in range(config.iters):
        diff = x - v
        d = torch.linalg.vector_norm(diff, dim=1)
        scale = torch.where(d > rho, rho / d.clamp_min(1e-30), torch.ones_like(d))
        v = v + (w * scale) @ diff
    far = [keep[int(i)] for i in torch.nonzero(torch.linalg.vector_norm(x - v, dim=1) > rho).flatten()]
    return RobustMean(mean=v, clipped=tuple(sorted(far + out)), radius=rho)


def clipped_by_majority(clipped: Sequence[tuple[str, Sequence[str]]]) -> set[str]:
    """The peers more than half of the OTHER owners clipped in a round (*clipped*: per owner, whom it
    clipped; ``RoundResult.clipped``). Every replica that finished the round computes the same set, so they
    count the same strikes and drop a liar at the same round; one lying owner cannot frame an honest peer."""
    owners = [o for o, _ in clipped]
    out = set()
    for p in owners:
        votes = sum(1 for o, c in clipped if o != p and p in c)
        if 2 * votes > len(owners) - 1:
            out.add(p)
    return out


@dataclass(slots=True)
class ClipBook:
    """Per peer, whether a majority of the other owners clipped its part, in each of the last ``window``
    rounds it took part in (:func:`clipped_by_majority`).

    ``record`` returns the peers that reached ``strikes`` clipped rounds for the first time: the shell
    stops averaging with them (as with a refused part) and the job reports them."""

    config: RobustConfig
    history: dict[str, deque[bool]] = field(default_factory=dict)
    clipped: dict[str, int] = field(default_factory=dict)    # clipped rounds per peer, ever
    dropped: set[str] = field(default_factory=set)

    def record(self, contributors: Sequence[str], clipped: Sequence[str]) -> list[str]:
        out = []
        for peer in contributors:
            h = self.history.setdefault(peer, deque(maxlen=self.config.window))
            hit = peer in clipped
            h.append(hit)
            if hit:
                self.clipped[peer] = self.clipped.get(peer, 0) + 1
            if peer not in self.dropped and sum(h) >= self.config.strikes:
                self.dropped.add(peer)
                out.append(peer)
        return out


__all__ = ["ClipBook", "RobustConfig", "RobustMean", "clipped_by_majority", "coordinate_median", "misaligned",
           "robust_mean"]
