"""Geo-distributed benchmark (issue 8): five systems side by side on the emulated-WAN testbed.

``python -m benchmarks.wan --scenario mixed [--quick]`` builds the scenario's testbed (network
namespaces, ``tc tbf`` shaping; ``fusionp2p/testbed/specs/wan_<scenario>.json``), plans the five
systems from the shaped rates and a measured compute rate (``benchmarks/wan_setup.py``), starts one
worker process per host inside its namespace (``benchmarks/wan_worker.py``), runs the systems one
after the other with a barrier in between, collects per-step losses, timings and bytes per link
(``benchmarks/wan_report.py``), tears everything down (also on failure and Ctrl-C), prints a table
and writes ``benchmarks/results/wan.json`` plus ``benchmarks/results/wan_<scenario>.png``.

Systems: A = even split by layers, B = even split by FLOPs (both dense, GPipe, synchronous gradient
all-reduce between the replicas of a stage), OPF = OP-Fence, OPF+TopK = OP-Fence + AdaTopK, and
OPF+TopK+CO2 = the same with CO2 instead of the per-step all-reduce. Headline: samples/s of
OPF+TopK+CO2 over A in the same run.

Without root or ``ip netns`` it says so and runs the loopback variant: the same workers on
127.0.0.1, planned for the scenario's rates but without shaping (so the network gains disappear).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import RESULTS, headline, parser, write
from benchmarks.wan_report import collect, links_table, plot, table
from benchmarks.wan_setup import SCENARIOS, RunConfig, default_cpu_share, load_scenario, prepare
from fusionp2p.errors import ConfigError
from fusionp2p.testbed import netns
from fusionp2p.testbed.netns import Proc, spawn_process, stop_all

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"lan": 1.5, "mixed": 1.5, "slow": 9.4}   # the targets (mixed: none given, lan's used)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _worker_argv(job_path: Path, host: str, cpu: int | None) -> list[str]:
    argv = [sys.executable, "-m", "benchmarks.wan_worker", "--job", str(job_path), "--host", host]
    return [*argv, "--cpu", str(cpu)] if cpu is not None else argv


def _barrier(procs: list[Proc], want: str, timeout: float) -> None:
    for p in procs:
        line = p.read_line(timeout, match=lambda line: line.strip() in (want, f"failed {want[5:]}"))
        if line.startswith("failed"):
            raise RuntimeError(f"{p.label} failed (see {p.err_path})")


def run(scenario: str, cfg: RunConfig, *, loopback: bool, pin: bool, system_timeout: float) -> dict[str, Any]:
    """Run the five systems once on *scenario*; return the summary (raises on failure, cleans up always)."""
    spec = load_scenario(scenario)
    n = len(spec.hosts)
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    cpus = os.cpu_count() or 1
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix=f"wan-{scenario}-"))
        procs: list[Proc] = []
        stack.callback(lambda: stop_all(procs, grace=3.0))
        tb = None
        if not loopback:
            from fusionp2p.testbed.emulator import up
            tb = up(spec, workdir=workdir)   # logs stay in our workdir
            stack.callback(tb.close)
            addrs, ports = [h.address for h in tb.hosts], [4400] * n
        else:
            addrs, ports = ["127.0.0.1"] * n, _free_ports(n)
        t = time.perf_counter()
        caps = [h.cpus for h in spec.hosts]
        # Each emulated device computes at its cgroup cap (testbed) or its even share of the cores
        # (loopback), whether or not the other hosts are busy: that is what the planner is told.
        share = min(c for c in caps if c is not None) if tb is not None and None not in caps else default_cpu_share(n)
        job = prepare(spec, cfg, workdir, addrs=addrs, ports=ports, cpu_share=min(1.0, share))
        log.info("planned in %.1fs (1-thread compute %.1f GFLOP/s)", time.perf_counter() - t, job["flops_1thread"] / 1e9)
        for i, h in enumerate(spec.hosts):
            argv = _worker_argv(workdir / "job.json", h.name, i % cpus if pin else None)
            if tb is not None:
                procs.append(tb.spawn(h.name, argv, label=f"wan-{h.name}", env=env))
            else:
                procs.append(spawn_process(argv, label=f"wan-{h.name}", env={**os.environ, **env},
                                           logdir=workdir / "logs", pipe_stdout=True))
        _barrier(procs, "up", 180.0)
        for k, sysd in enumerate(job["systems"]):
            t = time.perf_counter()
            (workdir / f"go-{k}").touch()
            _barrier(procs, f"done {k}", system_timeout)
            print(f"  {sysd['name']:<13} finished in {time.perf_counter() - t:5.1f} s", flush=True)
        (workdir / f"go-{len(job['systems'])}").touch()   # everyone is done: workers may close and exit
        for p in procs:
            p.wait(60.0)
        summary = collect(job, workdir)
        log.info("logs and results in %s", workdir)
        return {"scenario": scenario, "loopback": loopback, "spec": spec.description, "job": {
            k: job[k] for k in ("run", "steps", "replicas", "flops_1thread", "cpu_share", "flops_planned", "units")},
            "hosts": [{k: h[k] for k in ("name", "slowdown", "up_bps", "down_bps")} for h in job["hosts"]],
            "systems": summary}


def main(argv: list[str] | None = None) -> int:
    p = parser("wan", __doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--scenario", choices=SCENARIOS, default="mixed")
    p.add_argument("--loopback", action="store_true", help="skip the testbed: 127.0.0.1, no shaping")
    p.add_argument("--samples", type=int, default=None, help="sequences per system (default 768 quick, 6400 full)")
    p.add_argument("--no-pin", action="store_true", help="do not pin workers to CPUs (sched_setaffinity)")
    p.add_argument("--system-timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    loopback = a.loopback
    if not loopback:
        try:
            netns.check_environment()
        except ConfigError as exc:
            print(f"no emulated WAN: {exc}; running the loopback variant without shaping", flush=True)
            loopback = True
    cfg = RunConfig(samples=a.samples or (768 if a.quick else 6400))
    print(f"scenario {a.scenario} ({'loopback, unshaped' if loopback else 'testbed, tc tbf'}), "
          f"{cfg.samples} sequences per system, {cfg.steps} steps of 2 pipelines", flush=True)
    res = run(a.scenario, cfg, loopback=loopback, pin=not a.no_pin, system_timeout=a.system_timeout)
    summary = res["systems"]
    print(table(summary))
    print(links_table(summary))
    png = plot(summary, RESULTS / f"wan_{a.scenario}.png",
               f"wan {a.scenario}{' (loopback)' if loopback else ''}: {cfg.samples} sequences per system")
    res["plot"] = str(png.relative_to(ROOT)) if png.is_relative_to(ROOT) else str(png)
    five = summary[-1]
    head = headline(f"samples/s of OPF+TopK+CO2 over baseline A ({a.scenario}{', loopback' if loopback else ''})",
                    five["speedup_vs_A"], "x", TARGETS[a.scenario], "higher", "baseline A (even layers, sync all-reduce)")
    write("wan", a.out, res, head, quick=a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
