"""A node that runs for weeks (issue 42): memory, open files, threads and store size across consecutive jobs.

A bootstrap and ``--nodes`` ``fusionp2p node`` processes on loopback (CLI, ``LocalCluster``, each with
``--disk``) run consecutive jobs, the operator's ``fusionp2p job submit --builtin gpt2-tiny --steps S``
(the demo's GPT-2, published with ``Swarm.connect`` over libp2p and downloaded when done), one after
another. Phase one: ``--jobs`` jobs on the same nodes. Phase two: ``--churn-jobs`` jobs in each of which
one member is SIGKILLed a third of the way in and a fresh node joins (the job re-plans around the loss
and takes the joiner in). After every job each live node's resident memory (VmRSS), open files, threads
and content-store bytes on disk are read from /proc and its home.

Headline: the RSS slope over the last half of phase one, in MB per job, the largest over the nodes that
lived through it (least squares; target at most 1, so a node's memory levels off); among the results
the store's largest disk use against ``--disk``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import headline, parser, write
from fusionp2p.cli.cluster import LocalCluster, wait_until
from fusionp2p.cli.demo import SEQ_LEN, demo_config, demo_model
from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.events import JobStateChanged, PlanChanged, StepProgress
from fusionp2p.sdk import Swarm
from fusionp2p.sizes import parse_size

MB = 1e6


def store_bytes(root: Path) -> int:
    """Bytes of the files under a node's content store (what ``--disk`` bounds)."""
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(FileNotFoundError):   # evicted while we walked
                total += os.stat(os.path.join(d, f)).st_size
    return total


def sample(pid: int, home: Path) -> dict[str, float]:
    """One node process's footprint, from /proc and its home."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = {k: v.split() for k, _, v in (line.partition(":") for line in status.splitlines())}
    return {"rss_mb": int(fields["VmRSS"][0]) * 1024 / MB, "threads": int(fields["Threads"][0]),
            "open_files": len(os.listdir(f"/proc/{pid}/fd")), "store_mb": store_bytes(home / "content") / MB}


def slope(ys: list[float]) -> float:
    """Least-squares slope of *ys* against 0, 1, 2, … (per job)."""
    n = len(ys)
    if n < 2:
        return float("nan")
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


def run_job(sw: Swarm, cluster: LocalCluster, steps: int, nodes: int, out: Path, *,
            churn: bool, fresh: list[int], names: dict[str, str]) -> dict[str, Any]:
    t0 = time.monotonic()
    job = sw.publish(model=demo_model(), dataset=BuiltinCorpus(seq_len=SEQ_LEN), config=demo_config(steps, nodes),
                     name="soak")
    plan: list[str] = []
    state, killed, joined = "", "", ""
    for ev in job.events(timeout=900):
        if isinstance(ev, PlanChanged):
            plan = list(ev.members)
        elif isinstance(ev, StepProgress) and churn and not killed and ev.step >= steps // 3 and plan:
            victim = names[sorted(plan)[0]]
            cluster.kill(victim)
            killed = victim
            joined = f"node{fresh[0]}"
            fresh[0] += 1
            cluster.add_node(joined)
            names[cluster.peer_id(joined)] = joined
        elif isinstance(ev, JobStateChanged):
            state = ev.state
    job.wait(timeout=60)
    path = job.download(out)
    return {"state": state, "wall_s": time.monotonic() - t0, "killed": killed, "joined": joined,
            "epochs": max((e.epoch for e in job.history if isinstance(e, PlanChanged)), default=0),
            "downloaded": path.is_file()}


def main() -> None:
    ap = parser("soak", __doc__)
    ap.add_argument("--jobs", type=int, default=None, help="phase one: consecutive jobs (default 30; --quick 4)")
    ap.add_argument("--churn-jobs", type=int, default=None, help="phase two: jobs with a kill and a joiner "
                                                                 "(default 4; --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per job (default 60; --quick 20)")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--disk", default="64M", help="each node's --disk (default 64M: small enough to evict)")
    args = ap.parse_args()
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    jobs = args.jobs if args.jobs is not None else (4 if args.quick else 30)
    churn_jobs = args.churn_jobs if args.churn_jobs is not None else (1 if args.quick else 4)
    steps = args.steps if args.steps is not None else (20 if args.quick else 60)
    disk = parse_size(args.disk, "--disk")
    root = Path(tempfile.mkdtemp(prefix="fusionp2p-bench-soak-"))
    cluster = LocalCluster(args.nodes, root, dead_timeout=3.0, probe_interval=60.0)
    cluster.node_args += ["--disk", str(disk)]
    rows: list[dict[str, Any]] = []
    with cluster, Swarm.connect([cluster.bootstrap], home=root / "client", listen="/ip4/127.0.0.1/tcp/0") as sw:
        wait_until(lambda: len(sw.members()) >= args.nodes, timeout=120, interval=0.5, what=f"{args.nodes} members")
        names = {cluster.peer_id(f"node{i}"): f"node{i}" for i in range(args.nodes)}
        fresh = [args.nodes]

        def measure(job: int, phase: str, info: dict[str, Any]) -> None:
            live = {n: p.pid for n, p in cluster.procs.items() if n != "bootstrap" and p.poll() is None}
            row = {"job": job, "phase": phase, **info, "load": os.getloadavg()[0],
                   "nodes": {n: sample(pid, root / n) for n, pid in sorted(live.items())}}
            rows.append(row)
            rss = " ".join(f"{n}={s['rss_mb']:.0f}" for n, s in row["nodes"].items())
            store = max((s["store_mb"] for s in row["nodes"].values()), default=0.0)
            print(f"{phase:<6}{job:>4} {info.get('state', '-'):<6}{info.get('wall_s', 0.0):>7.1f} s  RSS MB {rss}  "
                  f"store max {store:.1f} MB  load {row['load']:.1f}", flush=True)

        measure(0, "start", {})
        for j in range(1, jobs + 1):
            measure(j, "calm", run_job(sw, cluster, steps, args.nodes, root / "out" / str(j), churn=False,
                                       fresh=fresh, names=names))
        for j in range(1, churn_jobs + 1):
            measure(jobs + j, "churn", run_job(sw, cluster, steps, args.nodes, root / "out" / f"c{j}", churn=True,
                                               fresh=fresh, names=names))
    calm = [r for r in rows if r["phase"] == "calm"]
    half = calm[len(calm) // 2:]
    survivors = [n for n in rows[0]["nodes"] if all(n in r["nodes"] for r in calm)]
    slopes = {n: slope([r["nodes"][n]["rss_mb"] for r in half]) for n in survivors}
    store_max = max(s["store_mb"] for r in rows for s in r["nodes"].values()) * MB
    results = {
        "jobs": jobs, "churn_jobs": churn_jobs, "steps": steps, "nodes": args.nodes, "disk_bytes": disk,
        "rss_slope_mb_per_job_last_half": slopes,
        "rss_slope_mb_per_job_all": {n: slope([r["nodes"][n]["rss_mb"] for r in calm]) for n in survivors},
        "store_max_bytes": store_max, "store_max_over_disk": store_max / disk,
        "open_files": {n: [r["nodes"][n]["open_files"] for r in calm] for n in survivors},
        "threads": {n: [r["nodes"][n]["threads"] for r in calm] for n in survivors},
        "all_done": all(r["state"] == "done" and r["downloaded"] for r in rows[1:]),
        "rows": rows,
    }
    worst = max(slopes.values()) if slopes else float("nan")
    print(f"RSS slope over the last {len(half)} of {jobs} jobs: "
          + ", ".join(f"{n} {s:+.2f}" for n, s in slopes.items()) + " MB/job; "
          f"store at most {store_max / MB:.1f} of {disk / MB:.1f} MB (--disk); every job done and downloaded: "
          f"{results['all_done']}")
    write("soak", args.out, results,
          headline("node RSS slope over the last half of consecutive jobs (worst node)", worst, "MB/job", 1.0,
                   "lower", f"{jobs} gpt2-tiny jobs of {steps} steps on {args.nodes} CLI nodes, --disk {args.disk}"),
          quick=args.quick)


if __name__ == "__main__":
    main()
