"""A node under a CPU quota (container or testbed cgroup) reports the capped compute rate."""

from __future__ import annotations

import pytest

from fusionp2p.swarm import device
from fusionp2p.swarm.device import cpu_quota


def _reader(files: dict[str, str]):  # type: ignore[no-untyped-def]
    return lambda p: files.get(str(p))


def test_no_quota() -> None:
    assert cpu_quota("0::/\n", _reader({"/sys/fs/cgroup/cpu.max": "max 100000\n"})) is None
    assert cpu_quota("1:cpu:/\n", _reader({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
                                           "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"})) is None
    assert cpu_quota("", _reader({})) is None


def test_v2_quota_and_the_tightest_ancestor() -> None:
    files = {"/sys/fs/cgroup/a/b/cpu.max": "50000 100000\n", "/sys/fs/cgroup/a/cpu.max": "25000 100000\n"}
    assert cpu_quota("0::/a/b\n", _reader(files)) == (0.25, 0.1)
    assert cpu_quota("0::/a/b\n", _reader({"/sys/fs/cgroup/a/b/cpu.max": "150000 100000"})) == (1.5, 0.1)


def test_v1_quota() -> None:
    files = {"/sys/fs/cgroup/cpu/fp2p-abc-h1/cpu.cfs_quota_us": "33000\n",
             "/sys/fs/cgroup/cpu/fp2p-abc-h1/cpu.cfs_period_us": "100000\n"}
    text = "4:memory:/x\n1:cpu:/fp2p-abc-h1\n0::/\n"
    assert cpu_quota(text, _reader(files)) == (0.33, 0.1)


def test_garbage_is_ignored() -> None:
    files = {"/sys/fs/cgroup/a/cpu.max": "lots of\n", "/sys/fs/cgroup/cpu/a/cpu.cfs_quota_us": "x",
             "/sys/fs/cgroup/cpu/a/cpu.cfs_period_us": "100000"}
    assert cpu_quota("0::/a\n1:cpu:/a\nnonsense\n", _reader(files)) is None


def test_a_quota_lengthens_the_cpu_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float] = []

    def fake_rate(dev: object, dtype: object, seconds: float, n: int, *, stalled_seconds: float = 0.0, **kw: object) -> float:
        seen.append(seconds)
        return 1e9

    acts: list[float] = []

    def fake_act(dev: object, seconds: float, *, stalled_seconds: float = 0.0, **kw: object) -> float:
        acts.append(seconds)
        return 1e8

    monkeypatch.setattr(device, "_matmul_rate", fake_rate)
    monkeypatch.setattr(device, "_act_rate", fake_act)
    monkeypatch.setattr(device, "own_cpu_quota", lambda: (0.25, 0.1))
    # the rates as measured (the CPU clock's cap by the quota: test_demo_prediction.py)
    monkeypatch.setattr(device, "cgroups_visible", lambda: False)
    prof = device.measure_profile("cpu")
    assert seen[0] == pytest.approx(device.QUOTA_PERIODS * 0.1)
    assert acts[0] == pytest.approx(device.QUOTA_PERIODS * 0.1)    # the element-wise benchmark too
    assert prof.act_rate == 1e8
    seen.clear()
    acts.clear()
    monkeypatch.setattr(device, "own_cpu_quota", lambda: None)
    device.measure_profile("cpu")
    assert seen[0] == pytest.approx(0.2) and acts[0] == pytest.approx(0.2)


def test_element_wise_rate_is_a_few_gb_per_second_at_most_on_a_cpu_thread() -> None:
    """The element-wise benchmark runs at a small fraction of the matmul rate in FLOP-equivalents
    (that is why the planner needs it): one CPU thread moves at most tens of GB/s of outputs, and
    a real run takes the seconds it was given."""
    import time

    import torch

    t0 = time.perf_counter()
    rate = device._act_rate(torch.device("cpu"), 0.05)
    assert time.perf_counter() - t0 >= 0.05
    assert 1e6 < rate < 1e11


class _Clocks:
    """A fake ``time`` for device._rate: each call of the work takes 6 ms of wall time and 1 ms of this
    thread's CPU (a crowded machine: the thread gets a sixth of a core)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.calls = 0

    def perf_counter(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return self.cpu

    def work(self) -> None:
        self.calls += 1
        self.wall += 0.006
        self.cpu += 0.001


def test_a_cpu_clock_rate_costs_its_seconds_of_cpu_on_a_crowded_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    # the rate per CPU-second reads the same over any wall time: it stops at `seconds` of CPU, where the
    # old loop ran to stalled_seconds of wall (1 s: ~167 calls, 0.17 CPU-s of a 0.05 s benchmark)
    import torch

    clocks = _Clocks()
    monkeypatch.setattr(device, "time", clocks)
    rate = device._rate(clocks.work, 2.0, torch.device("cpu"), 0.05, 1.0, cpu_clock=True)
    assert clocks.calls <= 52 and clocks.cpu == pytest.approx(0.051, abs=0.002)
    assert rate == pytest.approx(2.0 / 0.001)
    # a wall-clock rate still runs longer where the thread is starved (a CPU quota hidden from it)
    clocks = _Clocks()
    monkeypatch.setattr(device, "time", clocks)
    rate = device._rate(clocks.work, 2.0, torch.device("cpu"), 0.05, 1.0)
    assert clocks.wall >= 1.0 and rate == pytest.approx(2.0 / 0.006, rel=0.01)


def test_a_quota_does_not_lengthen_a_cpu_clock_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    seen: list[tuple[float, bool]] = []

    def fake_rate(dev: object, dtype: object, seconds: float, n: int, *, cpu_clock: bool = False, **kw: object) -> float:
        seen.append((seconds, cpu_clock))
        return 1e9

    monkeypatch.setattr(device, "_matmul_rate", fake_rate)
    monkeypatch.setattr(device, "_act_rate", lambda dev, seconds, **kw: 1e8)
    monkeypatch.setattr(device, "own_cpu_quota", lambda: (0.25, 0.1))
    monkeypatch.setattr(device, "cgroups_visible", lambda: True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    prof = device.measure_profile("cpu")
    assert seen[0] == (pytest.approx(device.CPU_SECONDS), True)   # 0.1 s of CPU, not ten 0.1 s periods of it
    assert prof.flops_fp32 == pytest.approx(0.25e9)   # capped by the quota
