"""Planner benchmark: planning time, optimality against brute force, predicted speedup over baselines.

Three parts:

1. planning time of :func:`make_plan` for (200, 1000, 5000) units x (8, 64, 256) devices on a
   random heterogeneous swarm (clustered bandwidths, three device speeds), against the target of
   1000 x 64 in under 1 s;
2. plan quality on small random DAGs (<= 8 units, <= 4 devices): the planner's bottleneck over the
   brute-force optimum (1.0 = optimal), for the exhaustive search and for the cluster-order DP;
3. predicted step time of OP-Fence (+ AdaTopK) against the even-layers (GPipe) and even-FLOPs
   baselines on heterogeneous scenarios, with a GPT-2-small-like workload. The headline is the
   geometric-mean speedup over the stronger baseline (even-FLOPs) across the heterogeneous
   scenarios; the speedups over even-layers are in the table and the JSON.

``python -m benchmarks.planner [--quick]``
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks._common import headline, parser, write
from fusionp2p.plan import (
    InfeasiblePlanError,
    Link,
    Plan,
    PlannerConfig,
    Snapshot,
    make_plan,
    plan_even_flops,
    plan_even_layers,
)
from fusionp2p.plan.estimator import CostModel
from fusionp2p.types import DeviceProfile, Edge, Unit, WorkloadGraph

NAME = "planner"
GB = 1 << 30
MBIT = 1e6 / 8          # bytes/s in one Mbit/s
GBIT = 1e9 / 8


def device(flops: float, mem: int = 16 * GB) -> DeviceProfile:
    return DeviceProfile(device="cuda:0", kind="cuda", name="sim", flops_fp32=flops, flops_bf16=0.0, memory_bytes=mem)


def swarm(n: int, bw: Callable[[int, int], float], flops: Callable[[int], float], *,
          lat: Callable[[int, int], float] = lambda a, b: 5e-3, mem: Callable[[int], int] = lambda i: 16 * GB) -> Snapshot:
    peers = [f"peer{i:04d}" for i in range(n)]
    links = {(peers[a], peers[b]): Link(bandwidth_bps=bw(a, b), latency_s=lat(a, b)) for a in range(n) for b in range(a + 1, n)}
    return Snapshot(job="bench", epoch=0, members={p: device(flops(i), mem(i)) for i, p in enumerate(peers)}, links=links)


def gpt_like(layers: int = 12, hidden: int = 768, seq: int = 1024, batch: int = 4, vocab: int = 50257) -> WorkloadGraph:
    """Embedding, transformer blocks, LM head: FLOPs 2*params*tokens (+ attention), fp32 activations."""
    tokens = batch * seq
    act = tokens * hidden * 4
    block_params = 12 * hidden * hidden
    block_fwd = 2 * block_params * tokens + 4 * batch * seq * seq * hidden
    units = [Unit(name="embed", kind="embedding", fwd_flops=2.0 * tokens * hidden, bwd_flops=4.0 * tokens * hidden,
                  param_bytes=4 * vocab * hidden, act_bytes=act)]
    units += [Unit(name=f"block{i}", kind="block", fwd_flops=float(block_fwd), bwd_flops=2.0 * block_fwd,
                   param_bytes=4 * block_params, act_bytes=8 * act) for i in range(layers)]
    units.append(Unit(name="head", kind="linear", fwd_flops=2.0 * tokens * hidden * vocab,
                      bwd_flops=4.0 * tokens * hidden * vocab, param_bytes=4 * vocab * hidden, act_bytes=tokens * vocab * 4))
    edges = [Edge(src=i, dst=i + 1, nbytes=act) for i in range(len(units) - 1)]
    return WorkloadGraph(units=tuple(units), edges=tuple(edges))


def random_chain(n: int, rng: np.random.Generator) -> WorkloadGraph:
    """n units with random costs, a chain plus skip edges spanning 2-4 units (ResNet/U-Net-like)."""
    fl = rng.uniform(1e9, 1e11, n)
    units = tuple(Unit(name=f"u{i}", kind="block", fwd_flops=float(fl[i]), bwd_flops=float(2 * fl[i]),
                       param_bytes=int(rng.integers(1e5, 1e7)), act_bytes=int(rng.integers(1e5, 1e7))) for i in range(n))
    edges = [Edge(src=i, dst=i + 1, nbytes=int(rng.integers(1e5, 1e7))) for i in range(n - 1)]
    edges += [Edge(src=i, dst=i + int(rng.integers(2, 5)), nbytes=int(rng.integers(1e5, 1e6)))
              for i in range(0, n - 4, 7)]
    return WorkloadGraph(units=units, edges=tuple(edges))


def random_swarm(d: int, rng: np.random.Generator) -> Snapshot:
    """d devices in ~sqrt(d) sites: 10 Gbit/s inside a site, 50-500 Mbit/s between; three GPU speeds."""
    sites = rng.integers(0, max(1, int(math.sqrt(d))), d)
    speed = rng.choice([1e13, 2e13, 4e13], d)
    inter = rng.uniform(50, 500, (d, d))
    return swarm(d, lambda a, b: 10 * GBIT if sites[a] == sites[b] else float(inter[min(a, b), max(a, b)]) * MBIT,
                 lambda i: float(speed[i]), mem=lambda i: 80 * GB)


# -- part 1 ---------------------------------------------------------------------------------------
def planning_time(quick: bool) -> list[dict[str, Any]]:
    sizes = [(200, 8), (200, 64), (1000, 8), (1000, 64)] if quick else [(u, d) for u in (200, 1000, 5000) for d in (8, 64, 256)]
    rows = []
    for units, devs in sizes:
        rng = np.random.default_rng(units * 1000 + devs)
        w, snap = random_chain(units, rng), random_swarm(devs, rng)
        reps = 3 if units * devs <= 64_000 else 1
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            plan = make_plan(w, snap, seed=0)
            best = min(best, time.perf_counter() - t0)
        rows.append({"units": units, "devices": devs, "seconds": best, "stages": len(plan.stages),
                     "devices_used": len(plan.peers), "bottleneck_s": plan.bottleneck_s})
        print(f"  plan {units:5d} units x {devs:3d} devices: {best * 1e3:9.1f} ms  ({len(plan.stages)} stages, {len(plan.peers)} devices used)")
    return rows


# -- part 2 ---------------------------------------------------------------------------------------
def brute(w: WorkloadGraph, snap: Snapshot, cfg: PlannerConfig, order: list[int] | None) -> float | None:
    import itertools

    cm = CostModel(w, snap, cfg)
    n, d = cm.n_units, cm.n_devices
    best: float | None = None
    for k in range(1, min(n, d) + 1):
        assigns = itertools.permutations(range(d), k) if order is None else (tuple(order[x] for x in c) for c in itertools.combinations(range(d), k))
        assigns = list(assigns)
        for cuts in itertools.combinations(range(1, n), k - 1):
            b = [0, *cuts, n]
            for devs in assigns:
                worst = 0.0
                for s in range(k):
                    if cm.range_memory(b[s], b[s + 1], replicated=False) > cm.mem_cap[devs[s]]:
                        worst = math.inf
                        break
                    worst = max(worst, cm.range_work(b[s], b[s + 1]) / cm.flops[devs[s]])
                    if s + 1 < k:
                        a, c = devs[s], devs[s + 1]
                        worst = max(worst, cfg.directions * (cm.lat[a, c] + cm.cut[b[s + 1]] / cm.bw[a, c]))
                if worst < math.inf and (best is None or worst < best):
                    best = worst
    return best


def quality(quick: bool) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    cases = 20 if quick else 100
    out: dict[str, list[float]] = {"exhaustive": [], "cluster_order": []}
    for _ in range(cases):
        n, d = int(rng.integers(2, 9)), int(rng.integers(2, 5))
        w = random_chain(n, rng)
        bws = rng.uniform(10, 1000, (d, d))
        speed = rng.choice([1e12, 2e12, 4e12], d)
        snap = swarm(d, lambda a, b, m=bws: float(m[min(a, b), max(a, b)]) * MBIT, lambda i, f=speed: float(f[i]))
        for mode, exact in (("exhaustive", 5), ("cluster_order", 0)):
            cfg = PlannerConfig(compression=False, replicas=False, exact_search_devices=exact)
            opt = brute(w, snap, cfg, None)
            if opt is None:
                continue
            out[mode].append(make_plan(w, snap, cfg).bottleneck_s / opt)
    res = {m: {"cases": len(v), "mean_ratio": float(np.mean(v)), "max_ratio": float(np.max(v)),
               "optimal_share": float(np.mean(np.array(v) <= 1 + 1e-6))} for m, v in out.items()}
    for m, r in res.items():
        print(f"  {m:14s}: bottleneck / brute-force optimum mean {r['mean_ratio']:.4f}, max {r['max_ratio']:.4f}, "
              f"optimal in {100 * r['optimal_share']:.0f}% of {r['cases']} cases")
    return res


# -- part 3 ---------------------------------------------------------------------------------------
def scenarios() -> dict[str, tuple[Snapshot, bool]]:
    """name -> (snapshot, heterogeneous?)."""
    access = [1000, 1000, 100, 100, 10, 10]  # Mbit/s: a pair's link is its slower end
    geo = [0] * 4 + [1] * 4 + [2] * 4
    return {
        "2x1gbit+2x100mbit+2x10mbit": (swarm(6, lambda a, b: min(access[a], access[b]) * MBIT, lambda i: 2e13,
                                             lat=lambda a, b: 0.01), True),
        "3 sites x 4 GPUs, 10gbit in / 100mbit between": (swarm(12, lambda a, b: 10 * GBIT if geo[a] == geo[b] else 100 * MBIT,
                                                                lambda i: 2e13, lat=lambda a, b: 1e-3 if geo[a] == geo[b] else 0.02), True),
        "4 fast + 4 slow GPUs, 1gbit": (swarm(8, lambda a, b: GBIT, lambda i: 4e13 if i % 2 else 1e13), True),
        "8 equal GPUs, 10gbit (homogeneous)": (swarm(8, lambda a, b: 10 * GBIT, lambda i: 2e13, lat=lambda a, b: 1e-4), False),
    }


def speedups() -> tuple[list[dict[str, Any]], float]:
    w = gpt_like()
    rows = []
    het = []
    for name, (snap, heterogeneous) in scenarios().items():
        plans: dict[str, Plan | None] = {}
        for label, fn, cfg in (("op-fence+adatopk", make_plan, PlannerConfig()),
                               ("op-fence dense", make_plan, PlannerConfig(compression=False)),
                               ("even-flops", plan_even_flops, PlannerConfig()),
                               ("even-layers", plan_even_layers, PlannerConfig())):
            try:
                plans[label] = fn(w, snap, cfg, 0)
            except InfeasiblePlanError:
                plans[label] = None
        ours = plans["op-fence+adatopk"]
        assert ours is not None
        row: dict[str, Any] = {"scenario": name, "step_s": {k: (p.step_time_s if p else None) for k, p in plans.items()},
                               "stages": [[s.start, s.end, len(s.replicas)] for s in ours.stages],
                               "rho": [f.rho for f in ours.fences]}
        for base in ("even-layers", "even-flops"):
            p = plans[base]
            row[f"speedup_vs_{base}"] = p.step_time_s / ours.step_time_s if p else None
        if heterogeneous and plans["even-flops"] is not None:
            het.append(row["speedup_vs_even-flops"])
        rows.append(row)
        st = row["step_s"]
        fmt = lambda v: f"{v:9.3f}" if v is not None else "      n/a"  # noqa: E731
        print(f"  {name:48s} step s: ours {fmt(st['op-fence+adatopk'])} dense {fmt(st['op-fence dense'])} "
              f"even-flops {fmt(st['even-flops'])} even-layers {fmt(st['even-layers'])}  "
              f"x{row['speedup_vs_even-layers']:.2f} / x{row['speedup_vs_even-flops']:.2f}")
    geo = float(np.exp(np.mean(np.log(het)))) if het else 0.0
    return rows, geo


def main() -> None:
    args = parser(NAME, __doc__).parse_args()
    print("planning time:")
    times = planning_time(args.quick)
    print("quality against brute force:")
    qual = quality(args.quick)
    print("predicted step time (GPT-2-small-like, 4 x 1024 tokens per micro-batch, M=8):")
    rows, geo = speedups()
    t1000 = next(r["seconds"] for r in times if r["units"] == 1000 and r["devices"] == 64)
    print(f"  1000 units x 64 devices planned in {t1000:.3f} s (target < 1 s)")
    write(NAME, args.out, {"planning_time": times, "quality": qual, "scenarios": rows,
                           "plan_1000x64_s": t1000, "geomean_speedup_vs_even_flops": geo},
          headline("predicted step-time speedup of OP-Fence+AdaTopK over the even-FLOPs split, geomean of 3 heterogeneous scenarios",
                   geo, "x", 1.45, "higher", "even-FLOPs split (compute-balanced, bandwidth-blind), same run"), quick=args.quick)


if __name__ == "__main__":
    main()
