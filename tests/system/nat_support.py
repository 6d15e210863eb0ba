"""What the NAT system tests share: the skip when the testbed or iptables is missing, the specs, and a
swarm started in the testbed (a bootstrap, one node per host, each node's peer id by host name)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fusionp2p.errors import ConfigError
from fusionp2p.testbed import netns
from fusionp2p.testbed.emulator import Testbed
from fusionp2p.testbed.netns import Proc

SPECS = Path(__file__).resolve().parents[2] / "fusionp2p" / "testbed" / "specs"


def need_nat_testbed() -> None:
    """Skip, saying why, without root, iproute2 or iptables."""
    try:
        netns.check_environment()
    except ConfigError as exc:
        pytest.skip(str(exc))
    if shutil.which("iptables") is None:
        pytest.skip("the NAT routers need iptables: run `make iptables` (Debian's package)")


def start_swarm(tb: Testbed) -> tuple[str, list[Proc], dict[str, str]]:
    """The bootstrap's address, the node processes, and each host's peer id (a node's first stdout line is
    its own multiaddr)."""
    _, addr = tb.start_bootstrap(ready_timeout=120.0)
    nodes = tb.start_nodes(addr, ready_timeout=180.0)
    peer_of = {h.name: n.drain_stdout().splitlines()[0].rsplit("/p2p/", 1)[1] for h, n in zip(tb.hosts, nodes)}
    return addr, nodes, peer_of


def every_node_job(path: Path, steps: int, replicas: int = 2) -> Path:
    """A job file (``fusionp2p job submit FILE``): the builtin tiny GPT-2 planned by the network-blind
    even-layers baseline (dense fences: no AdaTopK), *replicas* per stage, so that every node has a role (on
    4 nodes: 2 stages x 2 replicas, in peer-id order). The builtin job's OP-Fence plan is the planner's choice: on a loaded
    machine it ran 1 stage x 2 replicas on 2 of 4 nodes (2026-11-29), and a test that needs a link across
    the NATs could not count on one."""
    path.write_text(
        "import dataclasses\n"
        "from fusionp2p.cli.demo import SEQ_LEN, demo_config, demo_model\n"
        "from fusionp2p.data import BuiltinCorpus\n\n\n"
        "def make_job():\n"
        f"    config = dataclasses.replace(demo_config({steps}, 4), planner='even_layers', replicas={replicas},\n"
        "                                 compression=None)\n"
        "    return {'model': demo_model(), 'dataset': BuiltinCorpus(seq_len=SEQ_LEN), 'config': config}\n")
    return path
