"""Nodes behind a NAT take part in training (issue 21), with real processes in the testbed.

``specs/nat4.json``: a public network with the bootstrap and two nodes, and a home LAN of two nodes
behind a router doing address translation (iptables MASQUERADE, nothing forwarded in: the home nodes
can dial out, nobody can dial them). A job submitted with ``fusionp2p job submit`` from the public side
must train to DONE on all four nodes: the home nodes learn they are not dialable (the bootstrap's
dial-back), dial the public nodes themselves, the publisher reaches them by connection reversal through
the bootstrap, and tensors to them go over the libp2p connection (the fallback path), which the job's
progress says. Needs root, iproute2 and iptables (``make iptables``); skipped, saying why, without.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fusionp2p.errors import ConfigError
from fusionp2p.testbed import netns
from fusionp2p.testbed.emulator import fusionp2p_command, up
from fusionp2p.testbed.spec import load_spec

pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(600)]

SPEC = Path(__file__).resolve().parents[2] / "fusionp2p" / "testbed" / "specs" / "nat4.json"


def _need_testbed() -> None:
    try:
        netns.check_environment()
    except ConfigError as exc:
        pytest.skip(str(exc))
    if shutil.which("iptables") is None:
        pytest.skip("the NAT routers need iptables: run `make iptables` (Debian's package)")


def test_nodes_behind_a_nat_train_with_the_public_ones(tmp_path: Path) -> None:
    _need_testbed()
    with up(load_spec(SPEC)) as tb:
        _, addr = tb.start_bootstrap(ready_timeout=120.0)
        nodes = tb.start_nodes(addr, ready_timeout=180.0)
        home = {h.name for h in tb.hosts if h.spec.nat}
        # a node's first stdout line is its own multiaddr
        peer_of = {h.name: n.drain_stdout().splitlines()[0].rsplit("/p2p/", 1)[1] for h, n in zip(tb.hosts, nodes)}
        pub = tb.host("pub")
        cli = [*fusionp2p_command()]
        # every node's reachability is known and announced: the home nodes are not dialable
        status: dict[str, object] = {}
        for _ in range(20):
            rc, out = tb.run(pub, [*cli, "status", "--bootstrap", addr, "--json"], timeout=60.0)
            assert rc == 0, out
            status = json.loads(out)
            reach = {m["peer"]: m["reach"] for m in status["members"] if m["role"] == "node" and m["alive"]}  # type: ignore[index]
            if len(reach) == 4 and all(reach[peer_of[h]] == ("private" if h in home else "public") for h in peer_of):
                break
        else:
            pytest.fail(f"reachability not learned: {status}")
        out_dir = tmp_path / "job"
        env_cmd = ["env", "OMP_NUM_THREADS=1", *cli]
        rc, out = tb.run(pub, [*env_cmd, "job", "--log-level", "warning", "submit", "--builtin", "gpt2-tiny",
                               "--bootstrap", addr, "--steps", "6", "--out", str(out_dir)], timeout=480.0)
        assert rc == 0, out[-4000:]
        assert "on 4 nodes" in out, out[-4000:]           # every node is in the plan, the home ones too
        assert "job done" in out, out[-4000:]
        assert "libp2p connection" in out, out[-4000:]    # the links to the home nodes took the fallback path
        assert (out_dir / "model.safetensors").is_file()
        (found,) = list(out_dir.rglob("metrics.jsonl"))
        metrics = [json.loads(line) for line in found.read_text().splitlines()]
        links = [m for m in metrics if m.get("type") == "links"]
        paths = {(m["peer"], x.split("=")[0]): x.split("=")[1] for m in links for x in m["links"]}
        home_peers = {peer_of[h] for h in home}
        for (a, b), path in paths.items():
            if a in home_peers and b in home_peers:
                assert path == "direct", (a, b)       # the home LAN reaches itself directly
        assert "libp2p" in paths.values()
