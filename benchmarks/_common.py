"""Shared benchmark plumbing: argument parsing, the machine description, and the JSON result file.

Every benchmark writes ``benchmarks/results/NAME.json`` with ``machine``, ``results`` (the full
figures) and ``headline``: ``{"metric", "value", "unit", "target", "better", "baseline"}`` where
``value`` is measured in the same run as its baseline (ARCHITECTURE.md, Benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc)
    p.add_argument("--quick", action="store_true", help="a short run (under about two minutes)")
    p.add_argument("--out", type=Path, default=RESULTS / f"{name}.json", help="where to write the JSON")
    return p


def _loadavg() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


# every benchmark imports this module before it starts: the load then is the load at its start (machine()
# runs when the result is written, after the run)
_LOAD_AT_START = _loadavg()


def machine() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": [round(x, 2) for x in _LOAD_AT_START],
        "loadavg_at_end": [round(x, 2) for x in _loadavg()],
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def headline(metric: str, value: float, unit: str, target: float, better: str, baseline: str) -> dict[str, Any]:
    if better not in ("higher", "lower"):
        raise ValueError("better must be 'higher' or 'lower'")
    return {"metric": metric, "value": float(value), "unit": unit, "target": float(target), "better": better, "baseline": baseline}


def _scalar(o: Any) -> Any:
    """A numpy or torch scalar as its Python number (a run of many minutes lost its result to an np.int64)."""
    item = getattr(o, "item", None)
    if callable(item) and getattr(o, "ndim", getattr(o, "dim", lambda: 1)) in (0, ()):
        return item()
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def write(name: str, out: Path, results: Any, head: dict[str, Any], *, quick: bool) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "quick": quick, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), "results": results, "headline": head}
    out.write_text(json.dumps(doc, indent=2, sort_keys=True, default=_scalar) + "\n")
    ok = head["value"] >= head["target"] if head["better"] == "higher" else head["value"] <= head["target"]
    print(f"headline: {head['metric']} = {head['value']:.4g} {head['unit']} (target {head['better']} than {head['target']}: {'met' if ok else 'NOT met'}) -> {out}")
