"""benchmarks/gpu_check.py --quick runs in the default suite (issue 39): on this machine, without CUDA, every
check runs on the CPU, passes, and the script says that CUDA was not checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine run the script itself")
def test_the_gpu_check_runs_on_the_cpu_and_says_cuda_was_not_checked(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--quick", "--threads", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("CUDA was not checked") and "(CUDA not checked)" in text
    doc = json.loads(out.read_text())
    checks = {c["check"] for c in doc["results"]["checks"]}
    assert {"profile", "gpt2 step", "gpt2 speed", "encode", "adatopk", "mask", "tied sum", "mean", "state",
            "gloo", "sync"} <= checks
    assert doc["results"]["cuda_checked"] is False and all(c["ok"] for c in doc["results"]["checks"])
    # one line per check
    assert sum(line.startswith(("ok ", "FAIL")) for line in text.splitlines()) == len(checks)
