"""A node listens before it imports torch (issue 40): torch's import and the device benchmark were most of
the 4.5 s from ``fusionp2p node``'s start to its listening; they run after it (``swarm/daemon.py``)."""

from __future__ import annotations

import subprocess
import sys

# what ``fusionp2p node`` imports before it listens (cli/main.py _run_daemon, swarm/daemon.py run_daemon)
BEFORE_LISTEN = """
import sys
from fusionp2p.cli.main import build_parser
from fusionp2p.net.addrs import tcp_endpoint
from fusionp2p.net.relay import RelayLimits
from fusionp2p.swarm.daemon import DaemonConfig, run_daemon
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.probe import ProbeConfig
DaemonConfig(role="node", home=__import__("pathlib").Path("."), listen=("/ip4/127.0.0.1/tcp/0",))
print(sorted(m for m in ("torch", "safetensors", "fusionp2p.jobs.node") if m in sys.modules))
"""


def test_a_node_imports_no_torch_before_it_listens() -> None:
    out = subprocess.run([sys.executable, "-c", BEFORE_LISTEN], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
