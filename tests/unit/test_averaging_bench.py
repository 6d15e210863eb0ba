"""benchmarks.averaging's all-reduce measurements: ours in one process and in one process per replica
(benchmarks/allreduce_procs.py), and the hivemind anchor's runner (benchmarks/anchors/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from benchmarks import anchors
from benchmarks.allreduce_procs import run_procs
from benchmarks.averaging import REPLICAS, allreduce_throughput, tcp_mesh


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_allreduce_throughput_over_encrypted_tcp_checks_every_mean(wire: str) -> None:
    async def main() -> dict[str, object]:
        with trio.fail_after(60):
            async with tcp_mesh([f"r{i}" for i in range(REPLICAS)]) as mesh:
                return await allreduce_throughput(mesh, 10_000, 3, 30, wire=wire)

    res = trio.run(main)
    assert res["wire"] == wire and len(res["t_allreduce_all_s"]) == 3  # type: ignore[arg-type]
    assert 0 < res["t_allreduce_s"] <= res["t_allreduce_median_s"]  # type: ignore[operator]
    assert 0 < res["loop_cpu_per_round_s"] <= res["cpu_per_round_s"]  # type: ignore[operator]


def test_steady_bf16_rounds_fault_in_no_fresh_pages() -> None:
    """The bf16 wire's conversions (the vector to bf16, each received part back to fp32) come from the
    round's pool: with the data plane's heap settings (net/heap.py: every block of 1 MiB or more mapped
    afresh) they faulted in 31k pages a round at 2.4M floats, 49k at 5.3M (+41% of the round's CPU)."""
    async def main() -> dict[str, object]:
        with trio.fail_after(60):
            async with tcp_mesh([f"r{i}" for i in range(REPLICAS)]) as mesh:
                return await allreduce_throughput(mesh, 2_400_000, 6, 30, wire="bf16")

    faults = trio.run(main)["minflt_all"]   # a round's page faults, every replica: its pools fill in the first ones
    vector_pages = 2_400_000 * 4 // 4096
    assert max(faults[-2:]) < vector_pages // 4, faults   # type: ignore[index]


@pytest.mark.slow
def test_allreduce_in_one_process_per_replica() -> None:
    res = run_procs(10_000, replicas=3, rounds=3, timeout=120)
    assert res["processes"] == 3 and len(res["t_allreduce_all_s"]) == 3
    assert 0 < res["t_allreduce_s"] <= res["t_allreduce_median_s"]


def test_the_hivemind_anchor_says_which_make_target_installs_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(anchors, "HIVEMIND_PYTHON", tmp_path / ".venv-hivemind" / "bin" / "python")
    monkeypatch.setattr(anchors, "ROOT", tmp_path)
    with pytest.raises(anchors.AnchorUnavailable, match="make hivemind-venv"):
        anchors.run_hivemind(1000)
