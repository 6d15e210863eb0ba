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
from typing import Any

import pytest

from fusionp2p.errors import ConfigError
from fusionp2p.net.identity import KEY_FILE, Identity
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


# The plan of `--builtin gpt2-tiny` on 4 nodes is 2 stages x 2 replicas over the sorted peer ids (stage 0 =
# the two smallest; a pipeline link goes from stage 0 replica r to stage 1 replica r, a replica link from
# replica 0 to replica 1; the first end dials). Identities are chosen so that the ids sort as below:
# then the public nodes must dial home2 (its data port is unreachable: the libp2p fallback) and home1
# dials out (direct).
ORDER = ("home1", "pub", "boot", "home2")
WANT = {("home1", "boot"): "direct", ("pub", "home2"): "libp2p",      # pipeline links
        ("home1", "pub"): "direct", ("boot", "home2"): "libp2p"}      # replica links


def _identities(tb: Any, tmp: Path) -> dict[str, str]:
    """Give each node the identity that puts it at its place in ORDER; host name -> peer id."""
    keys = [(Identity.load_or_create(tmp / f"k{i}"), tmp / f"k{i}" / KEY_FILE) for i in range(len(ORDER))]
    keys.sort(key=lambda k: k[0].peer_id)
    out = {}
    for name, (ident, path) in zip(ORDER, keys):
        home = tb.workdir / name / "home"
        home.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, home / KEY_FILE)
        out[name] = ident.peer_id
    return out


def test_nodes_behind_a_nat_train_with_the_public_ones(tmp_path: Path) -> None:
    _need_testbed()
    with up(load_spec(SPEC)) as tb:
        ids = _identities(tb, tmp_path)
        _, addr = tb.start_bootstrap(ready_timeout=120.0)
        nodes = tb.start_nodes(addr, ready_timeout=180.0)
        home = {h.name for h in tb.hosts if h.spec.nat}
        # a node's first stdout line is its own multiaddr
        peer_of = {h.name: n.drain_stdout().splitlines()[0].rsplit("/p2p/", 1)[1] for h, n in zip(tb.hosts, nodes)}
        assert peer_of == ids
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
        assert "libp2p connection" in out, out[-4000:]    # the links to home2 took the fallback path
        assert (out_dir / "model.safetensors").is_file()
        (found,) = list(out_dir.rglob("metrics.jsonl"))
        metrics = [json.loads(line) for line in found.read_text().splitlines()]
        links = [m for m in metrics if m.get("type") == "links"]
        paths = {(m["peer"], x.split("=")[0]): x.split("=")[1] for m in links for x in m["links"]}
        host_of = {p: h for h, p in peer_of.items()}
        seen = {}
        for (a, b), path in paths.items():
            pair = (host_of[a], host_of[b]) if (host_of[a], host_of[b]) in WANT else (host_of[b], host_of[a])
            seen[pair] = path
            assert path == WANT[pair], (pair, path)   # reported the same by both ends
        assert seen == WANT
