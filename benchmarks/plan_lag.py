"""How long a job's plan keeps the node's event loop from serving, on the loop and off it (issue 40).

For each size N (members: 8, 32, 64; --quick: 8, 32): a 12-layer GPT-2 job (``build_job``, the real traced DAG),
N members of speeds drawn in 0.5-2x the local profile, every pair measured at a rate drawn log-uniformly in
1 MB/s - 1 GB/s. The member's plan of the snapshot (``plan_for_snapshot``) is made ``--reps`` times on the trio
loop (as before issue 40) and as often through ``jobs/plan_thread.planned`` (a worker thread, the collector
paused), alternating, while a probe task sleeps 10 ms in a loop and records how late it wakes: what a heartbeat,
a ping's or a probe's handler waits. Figures per size and way: the plan's CPU-s (median), its wall time, the
worst lag over the runs, and whether the thread's plan hash is the loop's. The process holds a node-sized heap
(a million small objects), on which a full collection of the cyclic collector takes tenths of a second.
``python -m benchmarks.plan_lag [--quick]``
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import statistics
import time
from typing import Any

import trio

from benchmarks._common import headline, parser, write
from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.build import BuiltJob, build_job, plan_for_snapshot
from fusionp2p.jobs.plan_thread import planned
from fusionp2p.models import GPT2, GPT2Config
from fusionp2p.net.identity import Identity
from fusionp2p.plan.snapshot import Link, Snapshot
from fusionp2p.sdk import LOCAL_PROFILE
from fusionp2p.train.config import TrainConfig
from fusionp2p.types import DeviceProfile

NAME = "plan_lag"


def job(layers: int = 12) -> BuiltJob:
    cfg = TrainConfig(steps=10, micro_batch=2, micro_batches=8, lr=1e-4, seed=1)
    me = Identity.generate()
    return build_job(GPT2(GPT2Config.tiny(n_layer=layers, block_size=32)), None, BuiltinCorpus(seq_len=32), cfg,
                     publisher=me.peer_id, sign=me.sign, now=1.0, nonce=b"t" * 16)


def swarm(n: int, seed: int) -> tuple[dict[str, DeviceProfile], dict[tuple[str, str], Link]]:
    """*n* members of different speeds, every pair measured at its own rate (1 MB/s - 1 GB/s)."""
    rng = random.Random(seed)
    peers = [f"m{i:03d}" for i in range(n)]
    members = {p: dataclasses.replace(LOCAL_PROFILE, flops_fp32=LOCAL_PROFILE.flops_fp32 * rng.uniform(0.5, 2.0))
               for p in peers}
    links = {(a, b): Link(bandwidth_bps=math.exp(rng.uniform(math.log(1e6), math.log(1e9))),
                          latency_s=rng.uniform(1e-3, 5e-2)) for i, a in enumerate(peers) for b in peers[i + 1:]}
    return members, links


async def lag_probe(lags: list[float], stop: trio.Event) -> None:
    """How late a 10 ms sleep wakes, until *stop*."""
    while not stop.is_set():
        t = trio.current_time()
        await trio.sleep(0.01)
        lags.append(trio.current_time() - t - 0.01)


async def one(built: BuiltJob, snap: Snapshot, threaded: bool) -> dict[str, Any]:
    lags: list[float] = []
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lag_probe, lags, stop)
        await trio.sleep(0.05)
        c0, w0 = time.process_time(), time.perf_counter()
        if threaded:
            plan = await planned(built.spec, built.dag, snap, trio.CapacityLimiter(1))
        else:
            plan = plan_for_snapshot(built.spec, built.dag, snap)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        await trio.sleep(0.03)
        stop.set()
    return {"cpu_s": cpu, "wall_s": wall, "lag_s": max(lags), "hash": plan.plan_hash()}


def main() -> None:
    p = parser(NAME, __doc__)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    built = job()
    heap: list[list[dict[str, int]]] = [[{} for _ in range(10)] for _ in range(100_000)]   # a node's heap, as the collector walks it
    rows: list[dict[str, Any]] = []

    async def run() -> None:
        for n in (8, 32) if args.quick else (8, 32, 64):
            members, links = swarm(n, seed=n)
            snap = Snapshot(job=built.spec.job_id, epoch=0, members=members, links=links)
            got: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            for _ in range(args.reps):
                for threaded in (False, True):
                    got[threaded].append(await one(built, snap, threaded))
            load = f"{os.getloadavg()[0]:.2f}"
            for threaded, rs in got.items():
                row = {"n": n, "way": "thread" if threaded else "loop", "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                       "wall_s_max": max(r["wall_s"] for r in rs), "lag_s_max": max(r["lag_s"] for r in rs),
                       "same_hash": all(r["hash"] == got[False][0]["hash"] for r in rs), "load": float(load)}
                rows.append(row)
                print(f"N={n:3d} {row['way']:6s}: plan {row['cpu_s']:.3f} CPU-s (wall up to {row['wall_s_max']:.2f} s), "
                      f"worst loop lag {row['lag_s_max']:.3f} s, same hash {row['same_hash']} (load {load})", flush=True)

    trio.run(run)
    del heap
    big = max(r["n"] for r in rows)
    loop, thread = (next(r for r in rows if r["n"] == big and r["way"] == w) for w in ("loop", "thread"))
    write(NAME, args.out, {"rows": rows}, headline(
        f"worst loop lag while {big} members are planned off the loop over on it", thread["lag_s_max"] / loop["lag_s_max"],
        "x", 0.1, "lower", "the plan made on the loop, same run"), quick=args.quick)


if __name__ == "__main__":
    main()
