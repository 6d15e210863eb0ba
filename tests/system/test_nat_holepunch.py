"""Hole punching (DCUtR) upgrades the relayed connection of two NATed nodes to a direct one (issue 21).

``specs/nat2lan_punch.json``: ``specs/nat2lan.json`` (two LANs behind two MASQUERADE routers, a
public bootstrap) with routers that drop unsolicited connection attempts, as most home routers'
firewalls do, and nodes started with ``--hole-punch``. The nodes of different LANs first connect
through the bootstrap's relay; DCUtR then has both ends dial each other's predicted public address
(router address, listen port) at once, and each router forwards the other's SYN as the reply to its
own. The job's links between the two LANs then run on a direct libp2p connection (path ``libp2p``),
not through the relay. With routers that answer such attempts with a reset (the testbed's default,
``specs/nat2lan.json``) the same attempt fails: both SYNs reach the other router before it has sent
its own, and the reset tears the mapping down (docs/networking.md "Hole punching").
Needs root, iproute2 and iptables (``make iptables``); skipped, saying why, without.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusionp2p.testbed.emulator import fusionp2p_command, up
from fusionp2p.testbed.spec import load_spec
from fusionp2p.testing.wait import wait_until
from tests.system.nat_support import SPECS, every_node_job, need_nat_testbed, start_swarm

pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(600)]

SPEC = SPECS / "nat2lan_punch.json"
PUNCHED = "Successfully established direct connection with"   # py-libp2p's dcutr logger, INFO, in libp2p.log



def test_relayed_connections_are_hole_punched(tmp_path: Path) -> None:
    need_nat_testbed()
    with up(load_spec(SPEC)) as tb:
        addr, _nodes, peer_of = start_swarm(tb)
        office_log = tb.workdir / "office" / "home" / "libp2p.log"

        def punched() -> bool:   # a log written by another process: polled, with a deadline
            text = office_log.read_text() if office_log.exists() else ""
            return sum(f"{PUNCHED} {peer_of[h]}" in text for h in ("home1", "home2")) == 2

        wait_until(punched, timeout=120, interval=1.0,
                   what=f"a hole punch between office and both home nodes (see {office_log})")
        boot = tb.host("boot")
        cli = [*fusionp2p_command()]
        out_dir = tmp_path / "job"
        rc, out = tb.run(boot, ["env", "OMP_NUM_THREADS=1", *cli, "job", "--log-level", "warning", "submit",
                                str(every_node_job(tmp_path / "job.py", 6)), "--bootstrap", addr, "--out", str(out_dir)],
                         timeout=480.0)
        assert rc == 0, out[-4000:]
        assert "on 4 nodes" in out, out[-4000:]
        assert "job done" in out, out[-4000:]
        (found,) = list(out_dir.rglob("metrics.jsonl"))
        metrics = [json.loads(line) for line in found.read_text().splitlines()]
        host_of = {p: h for h, p in peer_of.items()}
        paths = {}
        for m in metrics:
            if m.get("type") == "links":
                for x in m["links"]:
                    other, path = x.split("=")
                    paths[frozenset((host_of[m["peer"]], host_of[other]))] = path
        print("links:", {"-".join(sorted(k)): v for k, v in paths.items()})
        across = {frozenset(("home1", "office")), frozenset(("home2", "office"))}
        assert across & set(paths), paths
        for pair in across & set(paths):
            assert paths[pair] == "libp2p", paths     # the hole-punched connection, not the relay
