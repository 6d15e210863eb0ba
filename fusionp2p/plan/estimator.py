"""Workload estimator (ALGORITHMS.md §1.4): compute, memory and link times, as scalars and as arrays.

Scalar helpers state the formulas; :class:`CostModel` precomputes prefix sums over the unit order
so that the cost of any contiguous range ``[i, j)`` is O(1) (that is what keeps OP-Fence fast):

* compute of a unit on device d: ``(fwd_flops + bwd_flops) / (flops_fp32[d] * efficiency(kind))``
  seconds per micro-batch;
* memory of a range: ``param_memory_factor * params + micro_batches * act_bytes`` (plus
  ``replica_memory_factor * params`` when the stage is replicated, for CO2's anchor and momentum);
* a fence's traffic ``cut[f]``: bytes per micro-batch of every edge ``src < f <= dst`` (skip edges
  are relayed through the stages in between, so they count on every fence they cross);
* a link: ``directions * (latency + bytes / bandwidth)``, with the AdaTopK payload of the codec's
  wire format (``plan.wirebytes``): ``k * value_bytes + min(k * index_bytes, ceil(n / 8))`` for
  ``k = ceil(rho * n)`` kept of ``n = ceil(bytes / value_bytes)`` elements (indices or a bitmap,
  whichever is smaller), and the dense bytes when that saves nothing (from ``rho`` ~ 31/32).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from fusionp2p.plan.config import PlannerConfig
from fusionp2p.plan.snapshot import Link, Snapshot
from fusionp2p.plan.wirebytes import bytes_per_element, wire_bytes
from fusionp2p.types import DeviceProfile, Unit, WorkloadGraph

F64 = npt.NDArray[np.float64]


def unit_compute_time(unit: Unit, profile: DeviceProfile, config: PlannerConfig) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of *unit* on *profile*."""
    rate = profile.flops_fp32 * config.efficiency_of(unit.kind)
    return unit.fwd_flops / rate, unit.bwd_flops / rate


def unit_memory(unit: Unit, config: PlannerConfig, *, replicated: bool = False) -> float:
    """Bytes one device needs to hold *unit* for training (parameters, optimizer, activations)."""
    factor = config.param_memory_factor + (config.replica_memory_factor if replicated else 0.0)
    return unit.param_bytes * factor + unit.act_bytes * config.micro_batches


def compressed_bytes(nbytes: float, rho: float, config: PlannerConfig) -> float:
    """Bytes on the wire for a dense tensor of *nbytes* sent with kept fraction *rho* (1.0 = dense):
    :func:`~fusionp2p.plan.wirebytes.wire_bytes` of its ``ceil(nbytes / value_bytes)`` elements."""
    if rho >= 1.0 or nbytes <= 0:
        return float(nbytes)
    n = math.ceil(nbytes / config.value_bytes)
    got = wire_bytes(n, rho, dense_bytes=config.value_bytes, value_bytes=config.value_bytes,
                     index_bytes=config.index_bytes)
    return float(nbytes) if got >= n * config.value_bytes else float(got)


def link_time(link: Link, nbytes: float, rho: float, config: PlannerConfig) -> float:
    """Seconds per micro-batch a fence of *nbytes* costs on *link* (activations and gradients)."""
    return config.directions * link.time(compressed_bytes(nbytes, rho, config))


class CostModel:
    """Arrays of one (workload, snapshot, config): device i is ``peers[i]`` (sorted peer ids)."""

    def __init__(self, workload: WorkloadGraph, snapshot: Snapshot, config: PlannerConfig) -> None:
        self.config = config
        self.peers: tuple[str, ...] = snapshot.peers
        self.index = {p: i for i, p in enumerate(self.peers)}
        units = workload.units
        self.n_units = len(units)
        work = np.array([(u.fwd_flops + u.bwd_flops) / config.efficiency_of(u.kind) for u in units], dtype=np.float64)
        params = np.array([u.param_bytes for u in units], dtype=np.float64)
        acts = np.array([u.act_bytes for u in units], dtype=np.float64)
        self.work: F64 = np.concatenate(([0.0], np.cumsum(work)))
        self.params: F64 = np.concatenate(([0.0], np.cumsum(params)))
        self.mem: F64 = np.concatenate(([0.0], np.cumsum(params * config.param_memory_factor + acts * config.micro_batches)))
        diff = np.zeros(self.n_units + 2, dtype=np.float64)
        for e in workload.edges:
            diff[e.src + 1] += e.nbytes
            diff[e.dst + 1] -= e.nbytes
        self.cut: F64 = np.cumsum(diff)[: self.n_units + 1]
        self.cut[0] = 0.0
        profs = list(snapshot.members.values())
        self.flops: F64 = np.array([p.flops_fp32 for p in profs], dtype=np.float64)
        self.mem_cap: F64 = np.array([p.memory_bytes * config.memory_headroom for p in profs], dtype=np.float64)
        d = len(self.peers)
        self.bw: F64 = np.full((d, d), config.missing_link.bandwidth_bps, dtype=np.float64)
        self.lat: F64 = np.full((d, d), config.missing_link.latency_s, dtype=np.float64)
        for (a, b), lk in snapshot.links.items():
            i, j = self.index[a], self.index[b]
            self.bw[i, j] = self.bw[j, i] = lk.bandwidth_bps
            self.lat[i, j] = self.lat[j, i] = lk.latency_s
        np.fill_diagonal(self.bw, np.inf)
        np.fill_diagonal(self.lat, 0.0)
        # Fraction of dense bytes left at the AdaTopK floor: what the DP may assume a link can reach
        # (large-n bytes per element, a lower bound of compressed_bytes at rho_min for every n).
        floor = bytes_per_element(config.rho_min, value_bytes=config.value_bytes,
                                  index_bytes=config.index_bytes) / config.value_bytes
        self.min_byte_factor = min(1.0, floor) if config.compression else 1.0

    @property
    def n_devices(self) -> int:
        return len(self.peers)

    # -- ranges -----------------------------------------------------------------------------------
    def range_work(self, i: int, j: int) -> float:
        return float(self.work[j] - self.work[i])

    def range_params(self, i: int, j: int) -> float:
        return float(self.params[j] - self.params[i])

    def range_memory(self, i: int, j: int, *, replicated: bool) -> float:
        extra = self.config.replica_memory_factor * self.range_params(i, j) if replicated else 0.0
        return float(self.mem[j] - self.mem[i]) + extra

    # -- groups of replicas -----------------------------------------------------------------------
    def group_link(self, a: Sequence[int], b: Sequence[int]) -> Link:
        """The link between two replica groups, as ``min(|a|, |b|)`` paired streams.

        Replicas are paired greedily fastest pair first (each replica in at most one pair), and
        micro-batches are routed over the pairs in proportion to their bandwidth (SWARM-style), so
        the pairs' bandwidths add up; the latency is the worst paired latency. Two sites each
        holding a full pipeline thus talk inside their site, not across the slow link.
        """
        if len(a) == 1 and len(b) == 1:
            bw, lat = float(self.bw[a[0], b[0]]), float(self.lat[a[0], b[0]])
            if not math.isfinite(bw):  # the same single device on both sides (not produced by planners)
                return Link(bandwidth_bps=1e30, latency_s=0.0)
            return Link(bandwidth_bps=bw, latency_s=lat)
        total, worst_lat = 0.0, 0.0
        for x, y in self.pairing(a, b):
            total += min(float(self.bw[x, y]), 1e30)
            worst_lat = max(worst_lat, float(self.lat[x, y]))
        return Link(bandwidth_bps=total, latency_s=worst_lat)

    def pairing(self, a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int]]:
        """Greedy matching of replicas of two neighbouring stages, fastest pair first (deterministic)."""
        pairs = sorted((-float(self.bw[x, y]), float(self.lat[x, y]), x, y) for x in a for y in b)
        free_a, free_b = set(a), set(b)
        out: list[tuple[int, int]] = []
        for _, _, x, y in pairs:
            if x in free_a and y in free_b:
                free_a.discard(x)
                free_b.discard(y)
                out.append((x, y))
        return out

    def stage_time(self, i: int, j: int, group: Sequence[int]) -> float:
        """Seconds per micro-batch of stage [i, j) served by *group* (throughput-equivalent).

        Replicas share the micro-batches in proportion to their speed, so compute is
        ``work / sum(flops)``; a replicated stage is charged ``replica_overhead`` on top and can
        never be faster than its CO2 averaging round amortised over ``tau * M`` micro-batches
        (a ring all-reduce of the stage's parameters, ``2 (r-1)/r * bytes / bandwidth``).
        """
        work = self.range_work(i, j)
        t = work / float(self.flops[list(group)].sum())
        r = len(group)
        if r > 1:
            t *= 1.0 + self.config.replica_overhead
            sub_bw = self.bw[np.ix_(group, group)]
            sub_lat = self.lat[np.ix_(group, group)]
            ring = 2.0 * (r - 1) / r * self.range_params(i, j) / float(sub_bw.min()) + 2.0 * (r - 1) * float(sub_lat.max())
            t = max(t, ring / (self.config.co2_tau * self.config.micro_batches))
        return t
