"""A node's heavy start-up waits until it is needed (issue 40, swarm/startup.py): torch's import, the job
service and the device benchmark run when a job request arrives (the request answered after the profile
is measured), when the node's first probe round is done, or after a bounded delay, not in the first
seconds of a forming swarm. Real libp2p on loopback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport
from fusionp2p.swarm import device
from fusionp2p.swarm.daemon import DaemonConfig, run_daemon
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.startup import Startup, StartupConfig
from fusionp2p.testing.swarm import TEST_PROFILE

# A process of its own: the test session has imported torch long before. One node joins a bootstrap
# alone (no peer to probe: only a job request or the 600 s delay can start its start-up); after it has
# beaten twice more torch must still be out of sys.modules; then a JOB request starts the start-up (the
# real torch import and device benchmark), and its answer comes from the job service, which starts
# only once the profile is measured.
ON_DEMAND = """
import sys, tempfile
from pathlib import Path
import trio
from fusionp2p.jobs import proto
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport
from fusionp2p.swarm.daemon import DaemonConfig, run_daemon
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.startup import Startup, StartupConfig
from fusionp2p.wire.protocols import JOB


def prepare():
    import torch  # noqa: F401  (the CLI's prepare imports torch and the job service)


async def main(home):
    startup = Startup(StartupConfig(defer=600))

    def services(swarm, nursery):
        async def handle(peer, req):
            return {"ok": True, "profile": swarm.profile is not None and swarm.profile.flops_fp32 > 0,
                    "torch": "torch" in sys.modules}
        startup.serve(handle)

    with trio.fail_after(90):
        async with open_libp2p_transport(Identity.generate(), Libp2pConfig()) as bt:
            boot = SwarmNode(bt, SwarmConfig(role="bootstrap", heartbeat=0.3, dead_timeout=5.0), None)
            async with trio.open_nursery() as nursery:
                await nursery.start(boot.run, [])
                cfg = DaemonConfig(role="node", home=home, listen=("/ip4/127.0.0.1/tcp/0",),
                                   bootstrap=(bt.listen_addrs()[0],),
                                   swarm=SwarmConfig(heartbeat=0.3, dead_timeout=5.0, watch=0))
                early = [(JOB, proto.serve(startup.early_job, timeout=60))]   # as the CLI installs it
                nursery.start_soon(lambda: run_daemon(cfg, on_ready=lambda a: None, extra_services=services,
                                                      prepare=prepare, startup=startup, early_handlers=early))
                await boot.wait_until(lambda: len(boot.members()) == 1, 30)
                peer = boot.members()[0]
                seq = boot.view.records[peer].seq
                await boot.wait_until(lambda: boot.view.records[peer].seq >= seq + 2, 30)
                print("joined", "torch" in sys.modules, boot.view.records[peer].profile is None, startup.wanted.is_set())
                reply = await proto.request(bt, peer, {"op": "status", "job": "j"}, timeout=60)
                print("answered", reply["ok"], reply["profile"], reply["torch"], startup.on_demand)
                await boot.wait_until(lambda: boot.view.records[peer].profile is not None, 30)
                print("announced")
                nursery.cancel_scope.cancel()

with tempfile.TemporaryDirectory() as d:
    trio.run(main, Path(d))
"""


def test_a_node_imports_torch_only_when_a_job_request_comes_and_measures_before_it_answers() -> None:
    out = subprocess.run([sys.executable, "-c", ON_DEMAND], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split("\n")[:3] == ["joined False True False", "answered True True True True", "announced"], \
        out.stdout + out.stderr


def _daemons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int, swarm: SwarmConfig,
             defer: float, prepare: Callable[[], None] = lambda: None) -> list[Startup]:
    """*n* daemons (the device benchmark stubbed, *prepare* counted) against one bootstrap until each has
    announced its profile; their start-ups."""
    monkeypatch.setattr(device, "measure_profile", lambda dev: TEST_PROFILE)
    startups = [Startup(StartupConfig(defer=defer)) for _ in range(n)]

    async def main() -> None:
        with trio.fail_after(60):
            async with open_libp2p_transport(Identity.generate(), Libp2pConfig()) as bt:
                boot = SwarmNode(bt, SwarmConfig(role="bootstrap", heartbeat=0.3, dead_timeout=5.0), None)
                async with trio.open_nursery() as nursery:
                    await nursery.start(boot.run, [])
                    for i, s in enumerate(startups):
                        dcfg = DaemonConfig(role="node", home=tmp_path / f"n{i}", listen=("/ip4/127.0.0.1/tcp/0",),
                                            bootstrap=(bt.listen_addrs()[0],), swarm=swarm)
                        nursery.start_soon(lambda d=dcfg, s=s: run_daemon(d, on_ready=lambda a: None,
                                                                        prepare=prepare, startup=s))
                    await boot.wait_until(lambda: len(boot.members()) == n and all(
                        boot.view.records[p].profile == TEST_PROFILE for p in boot.members()), 45)
                    nursery.cancel_scope.cancel()

    trio.run(main)
    return startups


def test_the_first_probe_round_starts_the_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SwarmConfig(heartbeat=0.3, dead_timeout=5.0, watch=0)
    for s in _daemons(tmp_path, monkeypatch, 2, cfg, defer=600):
        assert s.reason == "the first probe round is done" and not s.on_demand, s.reason


def test_a_node_that_probes_nobody_starts_up_after_the_delay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SwarmConfig(heartbeat=0.3, dead_timeout=5.0, watch=0)
    (s,) = _daemons(tmp_path, monkeypatch, 1, cfg, defer=0.5)
    assert s.reason.startswith("0.5 s after joining"), s.reason


def test_the_start_up_config_is_checked() -> None:
    from fusionp2p.errors import ConfigError

    for bad in ({"defer": -1.0}, {"nice": 20}, {"on_demand_timeout": 0.0}, {"jitter": 2.0}):
        with pytest.raises(ConfigError):
            StartupConfig(**bad)  # type: ignore[arg-type]
