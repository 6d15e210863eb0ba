"""Nodes behind two different NATs train together through a circuit relay (issue 21), real processes.

``specs/nat2lan.json``: a public bootstrap host (it runs a node too) and two LANs, each behind its own
router doing address translation (iptables MASQUERADE, nothing forwarded in): ``home1`` and ``home2``
in one, ``office`` in the other. A node in one LAN cannot open any connection to one in the other: the
bootstrap's dial-back finds them ``private``, each reserves a slot on the bootstrap's relay and
announces its circuit address, and the larger peer id of such a pair dials the other through the
relay. A job submitted from the public side must train to DONE on all four nodes (2 stages x 2
replicas: whatever the order, ``office`` has a pipeline or replica link to a home node, and that link
is reported as ``relay``).
Needs root, iproute2 and iptables (``make iptables``); skipped, saying why, without.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusionp2p.testbed.emulator import fusionp2p_command, up
from fusionp2p.testbed.spec import load_spec
from tests.system.nat_support import SPECS, every_node_job, need_nat_testbed, start_swarm

pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(600)]

SPEC = SPECS / "nat2lan.json"



def test_nodes_behind_two_nats_train_through_the_relay(tmp_path: Path) -> None:
    need_nat_testbed()
    with up(load_spec(SPEC)) as tb:
        addr, _nodes, peer_of = start_swarm(tb)
        boot = tb.host("boot")
        cli = [*fusionp2p_command()]
        # the home nodes are found private and announce circuit addresses through the bootstrap; they
        # connect to each other through it and measure that path
        status: dict[str, object] = {}
        for _ in range(40):
            rc, out = tb.run(boot, [*cli, "status", "--bootstrap", addr, "--json"], timeout=60.0)
            assert rc == 0, out
            status = json.loads(out)
            members = {m["peer"]: m for m in status["members"] if m["role"] == "node" and m["alive"]}  # type: ignore[index]
            pairs = {frozenset((b["src"], b["dst"])) for b in status["bandwidth"] if b["measured"]}  # type: ignore[index]
            nat = ("home1", "home2", "office")
            if (len(members) == 4 and all(members[peer_of[h]]["reach"] == "private" for h in nat)
                    and all(any("/p2p-circuit" in a for a in members[peer_of[h]]["addrs"]) for h in nat)
                    and all(frozenset((peer_of[h], peer_of["office"])) in pairs for h in ("home1", "home2"))):
                break
        else:
            pytest.fail(f"the home nodes did not connect through the relay: {json.dumps(status)[:4000]}")
        out_dir = tmp_path / "job"
        rc, out = tb.run(boot, ["env", "OMP_NUM_THREADS=1", *cli, "job", "--log-level", "warning", "submit",
                                str(every_node_job(tmp_path / "job.py", 6)), "--bootstrap", addr, "--out", str(out_dir)],
                         timeout=480.0)
        assert rc == 0, out[-4000:]
        assert "on 4 nodes" in out, out[-4000:]           # every node is in the plan, the NATed ones too
        assert "job done" in out, out[-4000:]
        assert (out_dir / "model.safetensors").is_file()
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
        relayed = {frozenset(("home1", "office")), frozenset(("home2", "office"))}
        assert relayed & set(paths), paths                  # office has a link to a home node
        for pair, path in paths.items():
            assert path == ("relay" if pair in relayed else path if path in ("direct", "libp2p") else "?"), (pair, path)
