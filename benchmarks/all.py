"""Run every benchmark one after the other (``make bench``), each in its own process.

``python -m benchmarks.all [--quick] [--only a,b]``. Each benchmark writes
``benchmarks/results/NAME.json`` with its headline; this prints a summary table of the headlines.
A benchmark that fails is reported and the others still run; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from benchmarks._common import RESULTS

BENCHMARKS = ["membership", "swarm_scale", "executor", "planner", "stream", "paths", "averaging", "schedule",
              "tensor_parallel", "e2e", "data_plane", "soak", "gpu_check", "testbed", "wan"]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.all", description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated subset")
    args = ap.parse_args()
    names = [n for n in BENCHMARKS if not args.only or n in args.only.split(",")]
    failed = []
    rows = []
    for name in names:
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *(["--quick"] if args.quick else [])]
        print(f"== {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.call(cmd)
        dt = time.monotonic() - t0
        if rc != 0:
            failed.append(name)
            rows.append((name, f"FAILED (exit {rc})", dt))
            continue
        try:
            head = json.loads((RESULTS / f"{name}.json").read_text())["headline"]
            rows.append((name, f"{head['metric']}: {head['value']:.4g} {head['unit']} (target {head['target']}, {head['better']} is better)", dt))
        except (OSError, KeyError, ValueError):
            rows.append((name, "no headline written", dt))
    print("\nsummary")
    for name, text, dt in rows:
        print(f"  {name:<16} {dt:7.1f}s  {text}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
