"""Choosing the AdaTopK keep ratio of a link, once from the plan and then online (ALGORITHMS.md §1.6).

For a link ``e`` carrying ``n`` elements per micro-batch with latency ``α`` (s) and bandwidth ``β``
(bytes/s), the time is ``T_e = α + V/β`` with ``V = n·b_dense``. The target is
``T* = max(T_comp, min_e T_e)``; links with ``T_e <= T*`` are not compressed, the others keep the
largest ratio whose sparse payload fits the byte budget ``B = (T* − α)·β``:

    ρ_e = clip(ρ_fit(B), ρ_min, (n−1)/n),   ρ_fit(B) = max(⌊B/(b_val + b_idx)⌋, ⌊(B − ⌈n/8⌉)/b_val⌋) / n

which is the inverse of the codec's wire size ``k·b_val + min(k·b_idx, ⌈n/8⌉)`` (``k = ⌈ρ·n⌉``; the
kept set travels as indices below ``ρ = 1/(8·b_idx)``, as a bitmap above). The link is sent dense
anyway when the codec would: sparse no smaller than ``n·b_dense`` (from ``ρ ≈ 31/32`` with fp32
values). Both directions of the byte model are ``fusionp2p.plan.wirebytes``, shared with the planner.
The receiver reads ``k`` from each message, so a ratio may change at any time without coordination.
Pure: the caller passes measurements in; no clock is read here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from fusionp2p.errors import ConfigError
from fusionp2p.plan.wirebytes import max_ratio, sends_dense, wire_bytes

K = TypeVar("K")


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkCost:
    """What the ratio choice needs to know about one link."""

    n: int                  # elements per micro-batch
    alpha: float            # latency, seconds
    beta: float             # bandwidth, bytes/second
    b_dense: int = 4        # bytes per element when dense (fp32)
    b_val: int = 4          # bytes per kept value
    b_idx: int = 4          # bytes per kept index (the codec's narrowest type: 4 for 2^15 < n <= 2^31)

    def __post_init__(self) -> None:
        if self.n < 0 or self.alpha < 0 or self.beta <= 0 or min(self.b_dense, self.b_val, self.b_idx) <= 0:
            raise ConfigError("LinkCost needs n >= 0, alpha >= 0, beta > 0 and positive byte sizes")

    def time(self, ratio: float = 1.0) -> float:
        """Predicted seconds per micro-batch at *ratio* (1.0 = dense; a ratio at which the codec
        falls back to dense costs the dense time)."""
        return self.alpha + self.wire_bytes(ratio) / self.beta

    def wire_bytes(self, ratio: float = 1.0) -> int:
        """Bytes per micro-batch on the wire at *ratio* (``plan.wirebytes.wire_bytes``)."""
        return wire_bytes(self.n, ratio, dense_bytes=self.b_dense, value_bytes=self.b_val, index_bytes=self.b_idx)

    def sends_dense(self, ratio: float) -> bool:
        """Whether the codec sends this link dense at *ratio* (sparse would save no bytes)."""
        return sends_dense(self.n, ratio, dense_bytes=self.b_dense, value_bytes=self.b_val, index_bytes=self.b_idx)


def choose_ratio(link: LinkCost, target_time: float, *, rho_min: float = 0.1) -> float:
    """The keep ratio that brings *link* down to *target_time* (1.0 = send dense)."""
    if not 0.0 < rho_min <= 1.0:
        raise ConfigError("rho_min must be in (0, 1]")
    if link.n == 0 or link.time(1.0) <= target_time:
        return 1.0
    fit = max_ratio(link.n, (target_time - link.alpha) * link.beta, value_bytes=link.b_val, index_bytes=link.b_idx)
    # at most n-1 of n kept: ratio 1.0 means dense, which misses the target here (all n fit sparse
    # only when b_val < b_dense, e.g. fp16 values of an fp32 tensor)
    rho = max(rho_min, min(fit, (link.n - 1) / link.n))
    return 1.0 if link.sends_dense(rho) else rho


def plan_ratios(links: Mapping[K, LinkCost], t_comp: float, *, rho_min: float = 0.1) -> dict[K, float]:
    """Ratios of every inter-stage link given the compute bottleneck ``T_comp = max_s C_s``."""
    if not links:
        return {}
    t_star = max(t_comp, min(link.time(1.0) for link in links.values()))
    return {e: choose_ratio(link, t_star, rho_min=rho_min) for e, link in links.items()}


class RatioEstimator:
    """Online re-estimation for one link: an EMA of measured bandwidth, re-solved every *every* samples.

    ``observe(nbytes, seconds)`` after each transfer; ``ratio`` is the current choice. ``t_comp`` (the
    compute bottleneck) may be updated with :meth:`set_compute_time`.
    """

    def __init__(self, *, n: int, t_comp: float, beta0: float, alpha: float = 0.0, ema: float = 0.2,
                 every: int = 8, rho_min: float = 0.1, b_val: int = 4, b_idx: int = 4, b_dense: int = 4) -> None:
        if not 0.0 < ema <= 1.0 or every < 1 or beta0 <= 0:
            raise ConfigError("RatioEstimator needs 0 < ema <= 1, every >= 1 and beta0 > 0")
        self._link = LinkCost(n=n, alpha=alpha, beta=beta0, b_dense=b_dense, b_val=b_val, b_idx=b_idx)
        self._t_comp = t_comp
        self._ema = ema
        self._every = every
        self._rho_min = rho_min
        self._count = 0
        self.beta = beta0
        self.ratio = choose_ratio(self._link, max(t_comp, 0.0), rho_min=rho_min)

    def set_compute_time(self, t_comp: float) -> None:
        self._t_comp = t_comp

    def observe(self, nbytes: int, seconds: float) -> float:
        """Fold one measured transfer into the bandwidth EMA; returns the (possibly updated) ratio."""
        if nbytes <= 0 or seconds <= 0:
            return self.ratio
        sample = nbytes / max(seconds - self._link.alpha, 1e-9)
        self.beta = (1.0 - self._ema) * self.beta + self._ema * sample
        self._count += 1
        if self._count % self._every == 0:
            link = LinkCost(n=self._link.n, alpha=self._link.alpha, beta=self.beta, b_dense=self._link.b_dense,
                            b_val=self._link.b_val, b_idx=self._link.b_idx)
            self.ratio = choose_ratio(link, self._t_comp, rho_min=self._rho_min)
        return self.ratio
