"""benchmarks.convergence --reference: the dense references of an earlier run, and nothing else, carried."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.convergence import CARRIED, carry_reference


def _old(tmp_path: Path, **over: Any) -> Path:
    entry = {"heldout_loss": 1.35, "steps": 3, "replicas": 2, "samples": 192}
    results = {"model": "mlp", "steps": 3, "replicas": 2,
               "systems": {"allreduce": entry, "co2-async": {**entry, "heldout_loss": 1.2}},
               "curves": {"allreduce": [3.0, 2.0, 1.5], "co2-async": [3.0, 2.1, 1.4]}}
    results.update(over)
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"results": results, "time": "2026-11-28T08:50:33"}))
    return path


def test_only_the_dense_references_are_carried_and_say_where_from(tmp_path: Path) -> None:
    assert "allreduce" in CARRIED and "co2-async" not in CARRIED
    path = _old(tmp_path)
    results: dict[str, Any] = {"model": "mlp", "steps": 3, "replicas": 2, "systems": {"opfence": {"heldout_loss": 1.4}}}
    curves: dict[str, dict[int, float]] = {"opfence": {0: 3.0, 1: 2.0, 2: 1.6}}
    per_step: dict[str, int] = {"opfence": 64}
    carry_reference(path, results, curves, per_step)
    assert sorted(results["systems"]) == ["allreduce", "opfence"]      # co2-async ran on other code: not carried
    assert results["systems"]["allreduce"]["from"] == f"{path} (2026-11-28T08:50:33)"
    assert curves["allreduce"] == {0: 3.0, 1: 2.0, 2: 1.5} and per_step["allreduce"] == 64


def test_a_reference_of_another_run_shape_is_refused(tmp_path: Path) -> None:
    results: dict[str, Any] = {"model": "mlp", "steps": 2000, "replicas": 2, "systems": {}}
    with pytest.raises(SystemExit, match="another model"):
        carry_reference(_old(tmp_path), results, {}, {})
