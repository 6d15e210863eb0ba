"""Anchors: other systems' figures measured beside ours, in the same run.

Each anchor runs in a virtual environment of its own (a make target installs it), never in the
product's: ``hivemind`` (``make hivemind-venv`` -> ``.venv-hivemind``) runs its DecentralizedAverager
(:mod:`benchmarks.anchors.hivemind_averager`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HIVEMIND_PYTHON = ROOT / ".venv-hivemind" / "bin" / "python"


class AnchorUnavailable(Exception):
    """The anchor's environment is missing; the message says which make target installs it."""


def run_hivemind(n_elems: int, *, peers: int = 4, rounds: int = 7, timeout: float = 300.0) -> dict[str, Any]:
    """hivemind's DecentralizedAverager on *n_elems* fp32 values among *peers* processes on loopback:
    ``{"times", "times_max", "t_best_s", "t_median_s", "cpu_per_round_s", ...}``, the first round left out of
    best and median (``cpu_per_round_s``: the median CPU of a round, all of hivemind's processes together)."""
    if not HIVEMIND_PYTHON.exists():
        raise AnchorUnavailable(f"no {HIVEMIND_PYTHON.relative_to(ROOT)}: run `make hivemind-venv` first")
    cmd = [str(HIVEMIND_PYTHON), str(Path(__file__).with_name("hivemind_averager.py")), "--n", str(n_elems),
           "--peers", str(peers), "--rounds", str(rounds), "--timeout", str(timeout)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * (rounds + 3), cwd=ROOT, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise RuntimeError(f"hivemind anchor failed (exit {proc.returncode}): {proc.stdout.strip()[-500:]}")
    res: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    timed = res["times"][1:] if len(res["times"]) > 1 else res["times"]
    cpu = res["cpu_s"][1:] if len(res["cpu_s"]) > 1 else res["cpu_s"]
    res.update(t_best_s=min(timed), t_median_s=statistics.median(timed), version="hivemind 1.1.12",
               cpu_per_round_s=statistics.median(cpu) if cpu else None)
    return res
