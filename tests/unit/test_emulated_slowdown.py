"""A testbed host's ``slowdown`` reaches its node: the device profile it publishes and the compute of its
stage workers are that many times slower (``fusionp2p node --emulate-slowdown``), the way a slower
accelerator is, without taking the host's CPU from the node's networking."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from fusionp2p.cli.main import _cpu_share, _slowdown, build_parser
from fusionp2p.errors import ConfigError
from fusionp2p.jobs.host import NodeJobConfig
from fusionp2p.swarm import device as device_mod
from fusionp2p.swarm.daemon import DaemonConfig
from fusionp2p.testbed.emulator import TestbedHost
from fusionp2p.testbed.spec import HostSpec
from fusionp2p.train.worker import StageWorker
from fusionp2p.types import DeviceProfile

BOOT = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWKhVbxF9jfy1hsM9rhciLjbwjbBUKmZeaosq6Qtv7DZpS"


def _profile() -> DeviceProfile:
    return DeviceProfile(device="cpu", kind="cpu", name="x", flops_fp32=4e9, flops_bf16=2e9, memory_bytes=1 << 30,
                         act_rate=1e9)


def test_a_slowed_profile_divides_every_rate_and_keeps_the_rest() -> None:
    p = _profile()
    assert p.slowed(1.0) is p
    s = p.slowed(2.0)
    assert (s.flops_fp32, s.flops_bf16, s.act_rate) == (2e9, 1e9, 5e8)
    assert (s.memory_bytes, s.name, s.device) == (p.memory_bytes, p.name, p.device)


@pytest.mark.parametrize(("cpus", "sleep"), [(None, 0.5), (0.5, 0.95)])
def test_the_slowed_compute_sleeps_the_extra_in_its_own_thread(cpus: float | None, sleep: float,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that took 0.25 s of wall time and 0.2 s of CPU lasts 3x its time at the host's share:
    with no share known, 3 x 0.25 s (a sleep of 0.5 s); at half a core its 0.2 s of CPU stand for 0.4 s
    (it ran unthrottled, as a short op that sleeps after itself does under a quota), so 3 x 0.4 s (a
    sleep of 0.95 s). At factor 1 the function itself runs, unwrapped."""
    wall, cpu = iter([10.0, 10.25]), iter([1.0, 1.2])
    slept: list[float] = []
    monkeypatch.setattr(device_mod.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(device_mod.time, "thread_time", lambda: next(cpu))
    monkeypatch.setattr(device_mod.time, "sleep", slept.append)

    def forward(micro: int, inputs: dict[str, int]) -> str:
        return f"out {micro} {inputs}"

    ctx = SimpleNamespace(compute_slowdown=3.0, compute_cpus=cpus)
    slow = StageWorker._slowed(SimpleNamespace(ctx=ctx), forward)  # type: ignore[arg-type]
    assert slow(1, {"x": 2}) == "out 1 {'x': 2}"
    assert slept == [pytest.approx(sleep)]
    ctx1 = SimpleNamespace(compute_slowdown=1.0, compute_cpus=cpus)
    assert StageWorker._slowed(SimpleNamespace(ctx=ctx1), forward) is forward  # type: ignore[arg-type]


def test_the_node_takes_the_factor_from_its_flag_or_the_testbed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    ap = build_parser()
    monkeypatch.delenv("FUSIONP2P_COMPUTE_SLOWDOWN", raising=False)
    assert _slowdown(ap.parse_args(["node", "--bootstrap", BOOT])) == 1.0
    monkeypatch.setenv("FUSIONP2P_COMPUTE_SLOWDOWN", "2.0")
    assert _slowdown(ap.parse_args(["node", "--bootstrap", BOOT])) == 2.0
    assert _slowdown(ap.parse_args(["node", "--bootstrap", BOOT, "--emulate-slowdown", "3"])) == 3.0
    monkeypatch.setenv("FUSIONP2P_COMPUTE_SLOWDOWN", "fast")
    with pytest.raises(ConfigError, match="FUSIONP2P_COMPUTE_SLOWDOWN"):
        _slowdown(argparse.Namespace(emulate_slowdown=None))
    # what the testbed sets in a host with a slowdown
    host = TestbedHost(spec=HostSpec(name="dsl1", cpus=0.5, slowdown=2.0), namespace="ns", address="10.0.0.2")
    env = host.env()
    assert env["FUSIONP2P_COMPUTE_SLOWDOWN"] == "2.0" and env["FUSIONP2P_TESTBED_CPUS"] == "0.5"
    monkeypatch.setenv("FUSIONP2P_TESTBED_CPUS", env["FUSIONP2P_TESTBED_CPUS"])
    assert _cpu_share() == 0.5
    monkeypatch.setenv("FUSIONP2P_TESTBED_CPUS", "half")
    with pytest.raises(ConfigError, match="FUSIONP2P_TESTBED_CPUS"):
        _cpu_share()


@pytest.mark.parametrize("factor", [0.5, 0.0, 1001.0, float("nan")])
def test_a_factor_outside_1_to_1000_is_a_user_error(factor: float, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--emulate-slowdown"):
        NodeJobConfig(compute_slowdown=factor)
    with pytest.raises(ConfigError, match="CPU share"):
        NodeJobConfig(compute_slowdown=2.0, compute_cpus=factor - 1.0 if factor < 1 else 2000.0)
    with pytest.raises(ConfigError, match="--emulate-slowdown"):
        DaemonConfig(role="node", home=tmp_path, listen=("/ip4/127.0.0.1/tcp/0",), compute_slowdown=factor)
