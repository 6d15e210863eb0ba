"""Bandwidth clustering and cluster ordering (ALGORITHMS.md §1.5 steps 1-2).

Theory of operation. Devices are merged agglomeratively with *average linkage on log-bandwidth*
(the similarity of two clusters is the mean of ``log B[i, j]`` over their cross pairs, i.e. the
log of the geometric-mean bandwidth). Two clusters may merge only while their linkage bandwidth is
at least ``theta`` times the internal (geometric-mean) bandwidth of each of them (a single
device's reference is its fastest link), so a cluster never swallows a much slower neighbour; a block-structured matrix (fast inside groups, slow
between) is therefore recovered exactly for any ``theta`` above the block contrast.

The clusters are then ordered as a max-bottleneck Hamiltonian path over the linkage bandwidths
(data crosses every consecutive boundary once): exhaustive for up to 8 clusters, otherwise a
greedy path from a few starting clusters (chosen with the seeded RNG), best one kept. Devices are
listed cluster by cluster, fastest first inside a cluster, which is the order OP-Fence places
stages in.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
EXHAUSTIVE_CLUSTERS = 8


def cluster_devices(bw: F64, theta: float) -> list[list[int]]:
    """Partition device indices 0..D-1 into clusters of mutually fast links (each list sorted).

    *bw* is the symmetric bandwidth matrix (bytes/s; the diagonal is ignored). Clusters are
    returned sorted by their smallest device index, so the result is a pure function of *bw*.
    """
    d = bw.shape[0]
    if d == 1:
        return [[0]]
    logb = np.log(np.where(np.eye(d, dtype=bool), 1.0, bw))
    sim = logb.copy()                         # cluster-to-cluster mean log bandwidth
    np.fill_diagonal(sim, -np.inf)
    size = np.ones(d, dtype=np.float64)
    # Reference speed of a singleton: its fastest link (a device whose links are all equally slow
    # may pair up; one with a fast partner will not be merged into a slow group).
    intra = sim.max(axis=1)
    members: list[list[int]] = [[i] for i in range(d)]
    active = np.ones(d, dtype=bool)
    log_theta = math.log(theta)
    while active.sum() > 1:
        floor = np.maximum(intra[:, None], intra[None, :]) + log_theta
        ok = (sim >= floor) & active[:, None] & active[None, :]
        cand = np.where(ok, sim, -np.inf)
        flat = int(np.argmax(cand))
        a, b = divmod(flat, d)
        if not math.isfinite(cand[a, b]):
            break
        if a > b:
            a, b = b, a
        # New internal mean log-bandwidth: pairs inside a, inside b, and across.
        na, nb = size[a], size[b]
        pa, pb, pab = na * (na - 1) / 2, nb * (nb - 1) / 2, na * nb
        ia = intra[a] if pa > 0 else 0.0
        ib = intra[b] if pb > 0 else 0.0
        intra[a] = (ia * pa + ib * pb + sim[a, b] * pab) / (pa + pb + pab)
        row = (sim[a] * na + sim[b] * nb) / (na + nb)
        sim[a, :] = row
        sim[:, a] = row
        sim[a, a] = -np.inf
        sim[b, :] = -np.inf
        sim[:, b] = -np.inf
        size[a] = na + nb
        active[b] = False
        members[a] = sorted(members[a] + members[b])
        members[b] = []
    return sorted((m for m in members if m), key=lambda m: m[0])


def cluster_link_matrix(bw: F64, clusters: list[list[int]]) -> F64:
    """Mean log-bandwidth between every pair of clusters (the diagonal is +inf)."""
    m = len(clusters)
    out = np.full((m, m), np.inf)
    logb = np.log(np.where(np.eye(bw.shape[0], dtype=bool), 1.0, bw))
    for x in range(m):
        for y in range(x + 1, m):
            v = float(logb[np.ix_(clusters[x], clusters[y])].mean())
            out[x, y] = out[y, x] = v
    return out


def _score(order: tuple[int, ...], link: F64) -> tuple[float, float]:
    steps = [float(link[a, b]) for a, b in itertools.pairwise(order)]
    return (min(steps), sum(steps)) if steps else (math.inf, 0.0)


def order_clusters(link: F64, seed: int, *, tries: int = 8) -> list[int]:
    """A max-bottleneck Hamiltonian path over clusters (ties: larger sum, then lexicographic)."""
    m = link.shape[0]
    if m <= 2:
        return list(range(m))
    if m <= EXHAUSTIVE_CLUSTERS:
        # All m! paths at once (40320 x 8 for m = 8); permutations come in lexicographic order, so
        # the stable sort keeps the lexicographically first of equally good paths.
        perms = np.array(list(itertools.permutations(range(m))), dtype=np.intp)
        steps = link[perms[:, :-1], perms[:, 1:]]
        first = np.lexsort((np.arange(len(perms)), -steps.sum(axis=1), -steps.min(axis=1)))[0]
        return [int(x) for x in perms[first]]
    rng = np.random.default_rng(seed)
    starts = [0, *(int(s) for s in rng.choice(m, size=min(tries, m) - 1, replace=False) if s != 0)]
    best_order: tuple[int, ...] = ()
    best_key: tuple[float, float] = (-math.inf, -math.inf)
    for s in starts:
        order = [s]
        left = np.ones(m, dtype=bool)
        left[s] = False
        while left.any():
            row = np.where(left, link[order[-1]], -np.inf)
            nxt = int(np.argmax(row))
            order.append(nxt)
            left[nxt] = False
        key = _score(tuple(order), link)
        if key > best_key:
            best_key, best_order = key, tuple(order)
    return list(best_order)


def device_order(bw: F64, flops: F64, theta: float, seed: int) -> tuple[list[list[int]], list[int]]:
    """(clusters, devices listed cluster by cluster in path order, fastest device first inside)."""
    clusters = cluster_devices(bw, theta)
    order = order_clusters(cluster_link_matrix(bw, clusters), seed)
    devices: list[int] = []
    for c in order:
        devices.extend(sorted(clusters[c], key=lambda i: (-float(flops[i]), i)))
    return [clusters[c] for c in order], devices
