"""Workload estimator (ALGORITHMS.md §1.4): compute, memory and link times, as scalars and as arrays.

Scalar helpers state the formulas; :class:`CostModel` precomputes prefix sums over the unit order
so that the cost of any contiguous range ``[i, j)`` is O(1) (that is what keeps OP-Fence fast):

* compute of a unit on device d: ``(fwd_flops + bwd_flops) / (flops_fp32[d] * efficiency(kind))
  + act_bytes / act_rate`` seconds per micro-batch. The second term is the element-wise work (norms,
  activations, softmax, residuals: the FLOP counter counts none of it) at the rate the nodes measured
  (``DeviceProfile.act_rate``); for a small transformer on a CPU thread it is more than half of the
  step (measured: GPT-2 4 x 64, micro-batch 8: 7.1 ms predicted from FLOPs alone, 16 ms measured).
  So that a range's cost stays one prefix sum, the term is folded into FLOP-equivalents with one
  factor per snapshot, ``act_flops`` = the median of ``flops_fp32 / act_rate`` over the members that
  measured it (0 when none did: FLOPs alone, as before);
* memory of a range: ``param_memory_factor * params + k * act_bytes`` (plus
  ``replica_memory_factor * params`` when the stage is replicated, for CO2's anchor and momentum),
  with ``k`` the micro-batches the stage holds at once (``config.in_flight_limit``: ``M`` under GPipe,
  ``min(S - stage, M)`` under 1F1B); with ``recompute`` (activation recomputation) ``act_bytes +
  k * (cut[i] + cut[j])`` instead of the activations term, and one more forward in its compute;
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
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from fusionp2p.plan.config import PlannerConfig, in_flight_limit
from fusionp2p.plan.plan import deal_by_speed
from fusionp2p.plan.snapshot import Link, Snapshot
from fusionp2p.plan.wirebytes import bytes_per_element, wire_bytes
from fusionp2p.types import DeviceProfile, Unit, WorkloadGraph

F64 = npt.NDArray[np.float64]
T = TypeVar("T", float, F64)
# a streaming CO2 round predicted to take more than this share of a step's compute is applied two steps
# after its snapshot, not one (CostModel.averaging_lag): a prediction that close to a whole step leaves
# no room for the jitter of a shaped link or a busy CPU, and every late round holds the step
LAG_HEADROOM = 0.5

# CPU seconds the bf16 wire of a CO2 round (CO2.wire "bf16") costs per element it sends: the differences
# from the kept base and their rounding, the decoding of the peers' parts, the base's copy; net of the
# AEAD and socket work on the bytes it saves. benchmarks.averaging --allreduce-only on the development VM
# (bf16 minus fp32 CPU a round over the elements sent): 1.8 ns at 25M fp32 x 4 replicas, 1.6 ns at 5.3M;
# doubled, as that work runs on the event loop's thread, in the round's critical path, where the AEAD
# work it saves ran on the channels' threads (loopback: bf16 rounds' median 1.4x the fp32 ones').
BF16_WIRE_CPU_S = 4e-9


def bf16_pays(bandwidth_bps: float) -> bool:
    """Whether the bf16 wire pays on a link of *bandwidth_bps* bytes/s: the 2 bytes an element saves take
    longer to send than the CPU the bf16 wire spends on it (below about 500 MB/s: WAN links, not loopback
    or a LAN's 10 Gbit/s)."""
    return 2.0 / bandwidth_bps > BF16_WIRE_CPU_S


def compute_rate(profile: DeviceProfile, config: PlannerConfig) -> float:
    """The matmul FLOP/s a job's stages get on *profile*: its bf16 rate under mixed precision (where
    measured), else its fp32 rate."""
    if config.half_precision and profile.flops_bf16 > 0:
        return profile.flops_bf16
    return profile.flops_fp32


def unit_compute_time(unit: Unit, profile: DeviceProfile, config: PlannerConfig) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of *unit* on *profile*; the element-wise part
    (``act_bytes / act_rate``, where measured) split a third forward, two thirds backward."""
    rate = compute_rate(profile, config) * config.efficiency_of(unit.kind)
    act = unit.act_bytes / profile.act_rate if profile.act_rate > 0 else 0.0
    return unit.fwd_flops / rate + act / 3.0, unit.bwd_flops / rate + 2.0 * act / 3.0


def act_flops(profiles: Sequence[DeviceProfile], config: PlannerConfig | None = None) -> float:
    """FLOP-equivalents of one activation byte for a set of devices: the median of
    ``flops / act_rate`` (:func:`compute_rate`, fp32 without *config*) over those that measured
    ``act_rate`` (0.0 when none did)."""
    ratios = sorted((p.flops_fp32 if config is None else compute_rate(p, config)) / p.act_rate
                    for p in profiles if p.act_rate > 0)
    if not ratios:
        return 0.0
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else 0.5 * (ratios[mid - 1] + ratios[mid])


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
        profs = list(snapshot.members.values())
        self.act_flops = act_flops(profs, config)
        work = np.array([(u.fwd_flops + u.bwd_flops) / config.efficiency_of(u.kind) + self.act_flops * u.act_bytes
                         for u in units], dtype=np.float64)
        if config.recompute:   # one more forward: its FLOPs and its share of the element-wise work
            work += np.array([u.fwd_flops / config.efficiency_of(u.kind) + self.act_flops * u.act_bytes
                              * (u.fwd_flops / (u.fwd_flops + u.bwd_flops) if u.fwd_flops + u.bwd_flops else 1 / 3)
                              for u in units], dtype=np.float64)
        params = np.array([u.param_bytes for u in units], dtype=np.float64)
        acts = np.array([u.act_bytes for u in units], dtype=np.float64)
        self.work: F64 = np.concatenate(([0.0], np.cumsum(work)))
        self.params: F64 = np.concatenate(([0.0], np.cumsum(params)))
        diff = np.zeros(self.n_units + 2, dtype=np.float64)
        for e in workload.edges:
            diff[e.src + 1] += e.nbytes
            diff[e.dst + 1] -= e.nbytes
        self.cut: F64 = np.cumsum(diff)[: self.n_units + 1]
        self.cut[0] = 0.0
        self.acts: F64 = np.concatenate(([0.0], np.cumsum(acts)))
        # a range's largest trainable tensor (range_largest): a sparse table of maxima over 2^k units. Priced
        # when a step has more than one micro-batch: from the second on, autograd holds each parameter's new
        # gradient whole before adding it into .grad (measured: +1x the embedding, 94 MiB, at a node's peak)
        largest = np.array([u.max_param_bytes for u in units], dtype=np.float64)
        if config.micro_batches <= 1:
            largest[:] = 0.0
        self._largest: list[F64] = [largest]
        while 2 ** len(self._largest) <= len(largest):
            prev, h = self._largest[-1], 2 ** (len(self._largest) - 1)
            self._largest.append(np.maximum(prev[:-h], prev[h:]))
        # each fence's bytes in the program's dtype (``cut`` below is what crosses the wire): what a stage that
        # recomputes keeps per micro-batch in flight (range_memory)
        self.fence_bytes: F64 = self.cut.copy()
        self._mem: dict[tuple[int, bool], F64] = {}
        # every micro-batch in flight: GPipe's stash, the bound of any schedule (mem_prefix)
        self.mem: F64 = self.mem_prefix(config.micro_batches)
        if config.half_precision:
            self.cut *= 0.5   # activations and gradients travel in the compute dtype
        self.flops: F64 = np.array([compute_rate(p, config) for p in profs], dtype=np.float64)
        self.mem_cap: F64 = np.array([p.memory_bytes * config.memory_headroom for p in profs], dtype=np.float64)
        # the host a CPU device says it shares with others ("" for none or not a CPU), its threads and the
        # host's CPUs: plan/predict.py host_shares
        self.hosts: tuple[str, ...] = tuple(p.host if p.kind == "cpu" else "" for p in profs)
        self.threads: tuple[int, ...] = tuple(p.threads for p in profs)
        self.host_cpus: tuple[int, ...] = tuple(p.host_cpus for p in profs)
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

    def range_largest(self, i: npt.ArrayLike, j: npt.ArrayLike) -> F64:
        """The largest trainable tensor of units ``[i, j)`` (0 for an empty range, and for every range when a
        step has one micro-batch); vectorised over arrays of range bounds."""
        i_a, j_a = np.asarray(i, dtype=np.intp), np.asarray(j, dtype=np.intp)
        n = np.maximum(j_a - i_a, 1)
        k = np.floor(np.log2(n)).astype(np.intp)
        out = np.zeros(np.broadcast(i_a, j_a).shape, dtype=np.float64)
        for level in np.unique(k):
            tab, m = self._largest[int(level)], (k == level) & (j_a > i_a)
            if m.any():
                ii, jj = np.broadcast_to(i_a, out.shape)[m], np.broadcast_to(j_a, out.shape)[m]
                out[m] = np.maximum(tab[ii], tab[jj - 2 ** int(level)])
        return out

    def in_flight(self, stage: int, stages: int) -> int:
        """Micro-batches *stage* of a *stages*-stage pipeline holds at once under the job's schedule."""
        return in_flight_limit(self.config.schedule, stages, stage, self.config.micro_batches)

    def mem_prefix(self, in_flight: int, recompute: bool | None = None) -> F64:
        """Prefix sums of the memory of each unit with *in_flight* micro-batches held at once (the search's
        figure, ``opfence._Search``). With recomputation (*recompute*, default the config's) each unit is
        charged one micro-batch's activations and its two fences per micro-batch in flight: a range is then
        charged its own two fences and the inner ones twice, an upper bound of :meth:`range_memory` that
        stays a prefix sum."""
        rc = self.config.recompute if recompute is None else recompute
        got = self._mem.get((in_flight, rc))
        if got is None:
            params = np.diff(self.params)
            acts = np.diff(self.acts)
            per = acts + in_flight * (self.fence_bytes[:-1] + self.fence_bytes[1:]) if rc else acts * in_flight
            got = self._mem[(in_flight, rc)] = np.concatenate(([0.0], np.cumsum(params * self.config.param_memory_factor + per)))
        return got

    def range_memory(self, i: int, j: int, *, replicated: bool, in_flight: int | None = None,
                     recompute: bool | None = None, boundary: float | None = None) -> float:
        """Memory of one replica of a stage holding units ``[i, j)`` with *in_flight* micro-batches held at
        once (default all of them; :meth:`in_flight` gives a stage's): its parameters times the
        optimizer's factor (plus CO2's anchor and momentum when *replicated*), and the activations of the
        micro-batches in flight; with recomputation (*recompute*, default the config's) one micro-batch's
        activations and, per micro-batch in flight, only the tensors the stage receives and sends
        (*boundary* bytes, default its two fences); its largest tensor's new gradient
        (:meth:`range_largest`); and when *replicated*, the boundary tensors of
        ``replica_boundary_steps`` steps (:meth:`replica_boundary`)."""
        k = self.config.micro_batches if in_flight is None else in_flight
        factor = self.config.param_memory_factor + (self.config.replica_memory_factor if replicated else 0.0)
        acts = float(self.acts[j] - self.acts[i])
        if self.config.recompute if recompute is None else recompute:
            held = float(self.fence_bytes[i] + self.fence_bytes[j]) if boundary is None else boundary
            act_mem = acts + k * held
        else:
            act_mem = k * acts
        kept = float(self.replica_boundary(i, j)) if replicated or self.config.replicated_devices else 0.0
        return factor * self.range_params(i, j) + act_mem + float(self.range_largest(i, j)) + kept

    def range_extra(self, i: npt.ArrayLike, j: npt.ArrayLike, *, replicated: bool = False) -> F64:
        """What a range's memory adds to its prefix sums (``mem_prefix``): its largest tensor's new gradient and,
        when *replicated* (or every device of the search is a replica group: ``replicated_devices``), its
        kept boundary tensors; vectorised over arrays of range ends."""
        out = self.range_largest(i, j)
        if (replicated or self.config.replicated_devices) and self.config.replica_boundary_steps:
            out = out + self.replica_boundary(i, j)
        return out

    def replica_boundary(self, i: npt.ArrayLike, j: npt.ArrayLike) -> F64:
        """Bytes of the boundary tensors a replica of a stage of units ``[i, j)`` keeps beyond its step
        (``replica_boundary_steps`` steps of every micro-batch: what it received and sent through its two
        fences, and their gradients; the spot checks' transcripts); vectorised over arrays of range ends."""
        i_a, j_a = np.asarray(i, dtype=np.intp), np.asarray(j, dtype=np.intp)
        steps = self.config.replica_boundary_steps * self.config.micro_batches
        return np.asarray(2.0 * steps * (self.fence_bytes[i_a] + self.fence_bytes[j_a]), dtype=np.float64)

    # -- groups of replicas -----------------------------------------------------------------------
    def group_link(self, a: Sequence[int], b: Sequence[int]) -> Link:
        """The link between two replica groups, as ``min(|a|, |b|)`` paired streams.

        Replicas are paired greedily fastest pair first (each replica in at most one pair; pipeline
        ``p`` runs over pair ``p``, ``pipeline_order``). Every pipeline sends its step's ``M``
        micro-batches over its own pair and the pipelines run in lockstep (the averaging waits for the
        slowest), so the group link carries ``pairs x`` the *slowest* pair's bandwidth; the latency is
        the worst paired latency. Two sites each holding a full pipeline thus talk inside their site,
        not across the slow link.
        """
        if len(a) == 1 and len(b) == 1:
            bw, lat = float(self.bw[a[0], b[0]]), float(self.lat[a[0], b[0]])
            if not math.isfinite(bw):  # the same single device on both sides (not produced by planners)
                return Link(bandwidth_bps=1e30, latency_s=0.0)
            return Link(bandwidth_bps=bw, latency_s=lat)
        pairs = self.pairing(a, b)
        slowest = min(min(float(self.bw[x, y]), 1e30) for x, y in pairs)
        worst_lat = max(float(self.lat[x, y]) for x, y in pairs)
        return Link(bandwidth_bps=len(pairs) * slowest, latency_s=worst_lat)

    def pairing(self, a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int]]:
        """Replicas of two neighbouring stages matched into ``min(|a|, |b|)`` pairs whose slowest pair
        is as fast as possible (the pipelines run in lockstep, so the slowest pair sets the pace);
        the greedy fastest-first pairing where it reaches that bottleneck (deterministic). Otherwise a
        bottleneck matching: the largest bandwidth threshold that still admits a full matching
        (augmenting paths over the pairs at or above it, tried fastest first). Greedy alone used to
        strand the last replicas on a slow pair when a full matching over fast pairs existed."""
        ranked = sorted((-float(self.bw[x, y]), float(self.lat[x, y]), x, y) for x in a for y in b)
        need = min(len(a), len(b))
        levels = sorted({-nb for nb, _, _, _ in ranked}, reverse=True)
        lo, hi = 0, len(levels) - 1      # every pair is at or above the slowest level: a full matching
        while lo < hi:
            mid = (lo + hi) // 2
            if len(_match(ranked, levels[mid])) == need:
                hi = mid
            else:
                lo = mid + 1
        greedy = _greedy(ranked)
        if min(float(self.bw[x, y]) for x, y in greedy) >= levels[lo]:
            return greedy                 # fastest pairs first already reach the best bottleneck
        return sorted(_match(ranked, levels[lo]), key=lambda xy: (-float(self.bw[xy]), float(self.lat[xy]), xy))

    def group_speed(self, group: Sequence[int]) -> float:
        """FLOP/s a replica group delivers to its stage: ``r x`` its slowest member's. The replicas run
        in lockstep (every pipeline runs the step's ``M`` micro-batches and the average waits for the
        slowest), so a slow replica holds the fast ones back; speeds do not add up."""
        return len(group) * float(self.flops[list(group)].min())

    def split_micro(self, group: Sequence[int]) -> tuple[tuple[int, ...], int] | None:
        """Micro-batches per replica of *group* (in its order) per period of steps, and the period (in
        lowest terms, at most ``micro_period``), in proportion to speed: the ``M x r x P`` of ``P`` steps
        given one at a time to the replica that would finish it first (earliest finish: the shortest
        makespan for equal jobs on devices of different speeds), each replica at least one a step and at
        most ``MAX_MICRO_RATIO`` x the fewest (:func:`plan.deal_by_speed`). None when that is ``M`` a step
        each (lockstep)."""
        r, m = len(group), self.config.micro_batches
        if r < 2:
            return None
        micro, period = deal_by_speed([float(self.flops[d]) for d in group], m, self.config.micro_period)
        return None if period == 1 and all(c == m for c in micro) else (micro, period)

    def stage_time(self, i: int, j: int, group: Sequence[int], micro: Sequence[int] | None = None) -> float:
        """Seconds per micro-batch of stage [i, j) served by *group* (throughput-equivalent: the group's
        ``r`` replicas together finish one micro-batch in this time).

        Compute is ``work / group_speed`` (``r x`` the slowest replica: lockstep); a replicated stage
        is charged ``replica_overhead`` on top and can never be faster than its CO2 averaging round
        (an all-reduce of the stage's parameters, ``2 (r-1)/r * bytes / bandwidth + 2 alpha``, :meth:`round_times`)
        amortised over the ``tau * M * r`` micro-batches the group computes between two rounds: each replica's
        ``tau * M`` micro-batches must take at least one round (streaming CO2, a fragment's round every
        step: its latency ``2 alpha`` every step, its bytes amortised as before). A round that blocks the step
        (``overlap_averaging=False``: the per-step gradient all-reduce, synchronous CO2) adds to it.

        With *micro* (micro-batches per replica, :meth:`split_micro`) the replicas are not in lockstep:
        replica ``k`` runs ``micro[k]`` of the step's ``sum(micro)`` micro-batches, and the step lasts as
        long as the slowest of them, ``max_k micro[k] / speed_k``.
        """
        return float(self.replicated_time(self.range_work(i, j), self.range_params(i, j), group, micro))

    def round_times(self, params: T, group: Sequence[int]) -> tuple[T, float]:
        """(bytes term, latency term) in seconds of a CO2 round of *params* bytes among *group*: the
        averager's butterfly (average/allreduce.py: a reduce-scatter, then an all-gather, each an all-to-all
        of shards) moves ``2 (r-1)/r`` of the bytes over the slowest link between them, as a ring would, but
        in one hop of the longest latency per phase, not ``r-1`` (charging a ring's ``2 (r-1)`` hops, a
        probe's RTT inflated by a loaded uplink kept a fourth replica out of benchmarks.wan's ``slow``).
        Without CO2 (``gradient_exchange``) every replica sends its whole gradient to every other: ``r-1``
        times the bytes, in one hop."""
        r = len(group)
        sub = np.ix_(group, group)
        bw, lat = float(self.bw[sub].min()), float(self.lat[sub].max())
        if self.config.gradient_exchange:
            return (r - 1) * params * self.config.averaging_wire / bw, lat
        # a link where the bf16 wire does not pay carries fp32 (jobs/build.averaging_bf16)
        wire = self.config.averaging_wire if bf16_pays(bw) else 1.0
        return 2.0 * (r - 1) / r * params * wire / bw, 2.0 * lat

    def replicated_time(self, work: T, params: T, group: Sequence[int], micro: Sequence[int] | None = None) -> T:
        """:meth:`stage_time` from a stage's *work* and *params* (floats, or arrays of them for the
        vectorised searches in opfence.py)."""
        if micro:
            t = work * max(m / float(self.flops[d]) for m, d in zip(micro, group, strict=True)) / sum(micro)
        else:
            t = work / self.group_speed(group)
        r = len(group)
        if r == 1:
            return t
        round_bytes, round_lat = self.round_times(params, group)
        tau = self.config.co2_tau
        # streaming CO2 sends 1/tau of the vector every step, in a round of its own: the bytes of one whole
        # round per tau steps, but a round's latency every step
        per_step = round_bytes / tau + (round_lat if self.config.stream_averaging else round_lat / tau)
        floor = per_step / (self.config.micro_batches * r)
        t = t * (1.0 + self.config.replica_overhead)
        return np.maximum(t, floor) if self.config.overlap_averaging else t + floor

    def averaging_lag(self, i: int, j: int, group: Sequence[int], micro: Sequence[int] | None = None) -> int:
        """The lag of stage [i, j)'s streaming CO2 rounds on *group* (``OuterConfig.lag``): 2 when a
        fragment's round (its bytes over the slowest link between the replicas, plus a hop of latency
        per phase) is predicted to take more than ``LAG_HEADROOM`` of a step's compute on the
        fastest replica, else 1. The fastest replica starts its next round soonest after the last one, so
        it is the one that would wait. One replica, fewer than 2 fragments or no streaming: 1."""
        r, tau = len(group), self.config.co2_tau
        if r == 1 or tau < 2 or not (self.config.overlap_averaging and self.config.stream_averaging):
            return 1
        round_bytes, round_lat = self.round_times(self.range_params(i, j), group)
        round_s = round_bytes / tau + round_lat
        counts = micro if micro else [self.config.micro_batches] * r
        per_step = self.config.micro_batches * r / sum(counts)     # micro counts a period of steps (micro_period)
        step_s = self.range_work(i, j) * min(m * per_step / float(self.flops[d]) for m, d in zip(counts, group, strict=True))
        return 2 if round_s > LAG_HEADROOM * step_s else 1


def _greedy(ranked: Sequence[tuple[float, float, int, int]]) -> list[tuple[int, int]]:
    """Pairs taken fastest first, each replica in at most one pair."""
    free_a, free_b = {x for _, _, x, _ in ranked}, {y for _, _, _, y in ranked}
    out: list[tuple[int, int]] = []
    for _, _, x, y in ranked:
        if x in free_a and y in free_b:
            free_a.discard(x)
            free_b.discard(y)
            out.append((x, y))
    return out


def _match(ranked: Sequence[tuple[float, float, int, int]], threshold: float) -> list[tuple[int, int]]:
    """A maximum matching over the pairs of *ranked* (``(-bandwidth, latency, x, y)``, fastest first)
    with bandwidth >= *threshold*: augmenting paths (Kuhn), each replica of the first stage tried in
    order of its fastest pair, its candidates fastest first."""
    adj: dict[int, list[int]] = {}
    for nb, _, x, y in ranked:
        if -nb >= threshold:
            adj.setdefault(x, []).append(y)
    owner: dict[int, int] = {}

    def augment(x: int, seen: set[int]) -> bool:
        for y in adj[x]:
            if y in seen:
                continue
            seen.add(y)
            if y not in owner or augment(owner[y], seen):
                owner[y] = x
                return True
        return False

    for x in adj:
        augment(x, set())
    return [(x, y) for y, x in owner.items()]
