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
