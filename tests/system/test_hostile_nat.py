"""A live hostile peer against the relay, hole punching and the reachability checks (issue 43), with real
CLI processes in the namespace testbed.

``specs/hostile_nat.json``: a public bootstrap host (bootstrap, relay and dial-back service, and a node),
two LANs behind two NAT routers with one node each (``home``, ``office``; ``--hole-punch``), and a public
host ``evil`` running ``python -m tests.system.net_attacker``: one member identity and ten
throwaway ones on one IP. From before the NAT'd nodes join until the honest job is done it

* holds the dial-back service with checks of ports that drop SYNs (an iptables rule here);
* reserves relay slots with every identity, and opens, holds and drops circuits to a NAT'd node (the
  *victim*) with all of them at once, again and again;
* over its own circuit to the victim, sends hole-punching sessions listing 300+ addresses: junk, 16
  ports it counts, 300 closed ports this test counts (an iptables rule);
* announces 16 counting addresses in its signed record and says it is public.

What must hold: the NAT'd nodes still learn they are private and reserve their relay slots; a job
submitted through the CLI trains to DONE on all three nodes, its home-office link through the relay
(the honest circuit outlives every attacker circuit to the same node); every process stays up and
exits cleanly; and the attacker got no more than the limits: per-IP reservation and circuit slots
(``RelayLimits``), a few addresses per hole-punching session (``HolePunchLimits.addrs``) and none of
the closed ports, at most ``per_ip`` checks served at once (``ReachConfig``), and a few of its record's
addresses dialled (``net/addrs.peer_dial_addrs``, ``Libp2pTransport._trim_addrs``). Each attack must also have reached its target (the
victim answered sessions, the relay granted circuits, the service refused checks by IP), so that the
test fails if an attack stops being made.

Three to seven minutes on the loaded 2-core machine: ``slow``, run by ``.ci/run`` on its own (``make test-hostile``).
Needs root, iproute2 and iptables (``make iptables``); skipped, saying why, without.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fusionp2p.net.addrs import DIAL_LIMIT
from fusionp2p.net.holepunch import HolePunchLimits
from fusionp2p.net.relay import RelayLimits
from fusionp2p.testbed.emulator import Testbed, fusionp2p_command, up
from fusionp2p.testbed.spec import load_spec
from tests.system.nat_support import SPECS, every_node_job, need_nat_testbed
from tests.system.net_attacker import CLOSED_PORTS, DROP_PORTS

pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(600)]

SPEC = SPECS / "hostile_nat.json"
SYBILS = 10
ATTACK_S = 600     # the attacker's --duration: the test's own timeout, so that it attacks until the test stops it
# for the NAT'd nodes' reach and relay slots (at once on joining) and the relayed pair's first probe: seen by the
# status calls 4.0 and 14.6 s, 15.9 and 33.1 s after the processes were up (two runs at load 52-57, 2026-11-30;
# a status call took 4-16 s there); the code before issue 40's fix 31.2 and 48.3 s in a run between them
DEADLINE_S = 90.0


def _syn_counter(tb: Testbed, host: str) -> int:
    """Packets counted by the ACCEPT rule of *host*'s namespace (the closed ports' SYNs)."""
    rc, out = tb.run(host, ["iptables", "-L", "INPUT", "-v", "-n", "-x"], timeout=30.0)
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines() if "dpts:" in line and "ACCEPT" in line]
    return int(rows[0][0])


def test_a_hostile_peer_cannot_break_relayed_nodes_or_make_them_dial_for_it(tmp_path: Path) -> None:
    need_nat_testbed()
    t0 = time.monotonic()
    phases: dict[str, float] = {}     # seconds each phase took (printed: what the deadlines below are sized by)
    with up(load_spec(SPEC)) as tb:
        evil = tb.host("evil")
        closed = f"{CLOSED_PORTS.start}:{CLOSED_PORTS.stop - 1}"
        dropped = f"{DROP_PORTS.start}:{DROP_PORTS.stop - 1}"
        for rule in (["-A", "INPUT", "-p", "tcp", "--syn", "--dport", closed, "-j", "ACCEPT"],   # counted (no listener: RST)
                     ["-A", "INPUT", "-p", "tcp", "--dport", dropped, "-j", "DROP"]):            # the hog's dials hang
            rc, out = tb.run(evil, ["iptables", *rule], timeout=30.0)
            assert rc == 0, out
        _, addr = tb.start_bootstrap(ready_timeout=120.0)
        cli = fusionp2p_command()
        peer_of: dict[str, str] = {}

        def start_node(name: str) -> None:
            proc = tb.spawn(name, tb.node_argv(name, addr), label=f"{name}-node")
            peer_of[name] = proc.read_line(180.0).rsplit("/p2p/", 1)[1]

        start_node("boot")
        report = tmp_path / "attack.json"
        root = str(Path(__file__).resolve().parents[2])     # `tests` importable whatever the cwd
        attacker = tb.spawn(evil, [sys.executable, "-m", "tests.system.net_attacker", "--bootstrap", addr,
                                   "--ip", evil.address, "--sybils", str(SYBILS), "--duration", str(ATTACK_S),
                                   "--report", str(report)], label="evil-attacker",
                            env={"PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))})
        start_node("home")      # both join while the dial-back service is under the attacker's checks
        start_node("office")
        phases["processes up"] = time.monotonic() - t0
        status: dict[str, Any] = {}
        # a NAT'd node learns its reach and reserves its relay slot on joining (swarm/self_reach.py), whatever its
        # deferred start-up; then the relayed pair is probed. Before, the reach check waited for the start-up
        # (--defer-startup 15 s + jitter up to 7.5 s + up to 45 s of patience) and this wait was 150 s. The public
        # node is "public" only once its data plane listens (after its start-up): checked after the job
        up_at = time.monotonic()
        deadline = up_at + DEADLINE_S
        first: dict[str, float] = {}      # when each condition first held (printed: what DEADLINE_S is sized by)
        while time.monotonic() < deadline:
            rc, out = tb.run("boot", [*cli, "status", "--bootstrap", addr, "--json"], timeout=60.0)
            assert rc == 0, out
            status = json.loads(out)
            members = {m["peer"]: m for m in status["members"] if m["role"] == "node" and m["alive"]}
            pairs = {frozenset((b["src"], b["dst"])) for b in status["bandwidth"] if b["measured"]}
            nodes = [members.get(peer_of[h], {}) for h in ("boot", "home", "office")]
            held = {"public node dialable": all(nodes) and nodes[0]["reach"] in ("p2p", "public"),
                    "NAT'd nodes private, relayed": all(nodes) and all(
                        m["reach"] == "private" and any("/p2p-circuit" in a for a in m["addrs"]) for m in nodes[1:]),
                    "relayed pair measured": frozenset((peer_of["home"], peer_of["office"])) in pairs}
            first |= {k: round(time.monotonic() - up_at, 1) for k, v in held.items() if v and k not in first}
            if all(held.values()):
                print("first held (s after the processes were up):", first)
                break
        else:
            pytest.fail(f"the NAT'd nodes did not learn their reach or connect through the relay: "
                        f"{json.dumps(status)[:4000]}")
        phases["reach, relay and the relayed pair learned"] = time.monotonic() - t0 - sum(phases.values())
        line = attacker.read_line(60.0, match=lambda s: s.startswith("attacking"))
        victim = line.split()[1]
        assert victim in (peer_of["home"], peer_of["office"]), (line, peer_of)

        out_dir = tmp_path / "job"
        rc, out = tb.run("boot", ["env", "OMP_NUM_THREADS=1", *cli, "job", "--log-level", "warning", "submit",
                                  str(every_node_job(tmp_path / "job.py", 6, replicas=3)), "--bootstrap", addr,
                                  "--out", str(out_dir)], timeout=420.0)
        phases["job submitted to done"] = time.monotonic() - t0 - sum(phases.values())
        print("phases:", {k: round(v, 1) for k, v in phases.items()})
        assert rc == 0, out[-4000:]
        assert "on 3 nodes" in out and "job done" in out, out[-4000:]
        (found,) = list(out_dir.rglob("metrics.jsonl"))
        host_of = {p: h for h, p in peer_of.items()}
        paths = {}
        for m in map(json.loads, found.read_text().splitlines()):
            if m.get("type") == "links":
                for x in m["links"]:
                    other, path = x.split("=")
                    paths[frozenset((host_of[m["peer"]], host_of[other]))] = path
        print("links:", {"-".join(sorted(k)): v for k, v in paths.items()})
        assert paths.get(frozenset(("home", "office"))) == "relay", paths
        rc, out = tb.run("boot", [*cli, "status", "--bootstrap", addr, "--json"], timeout=60.0)
        assert rc == 0, out
        reach = {host_of[m["peer"]]: m["reach"] for m in json.loads(out)["members"] if m["peer"] in host_of}
        assert reach == {"boot": "public", "home": "private", "office": "private"}, reach   # data planes checked too

        attacker.signal_group(signal.SIGTERM)
        assert attacker.wait(60.0) == 0, attacker.err_path.read_text()[-3000:]
        honest = {p.label: p.popen.poll() for p in tb.procs if p.label.endswith(("-node", "-bootstrap"))}
        assert len(honest) == 4 and set(honest.values()) == {None}, honest      # every process is still up
        closed_syns = _syn_counter(tb, "evil")
        codes = {p.label: p.stop(grace=30.0) for p in tb.procs if p.label in honest}
        assert set(codes.values()) == {0}, codes

    got = json.loads(report.read_text())
    did = got["did"]
    print("attacker:", json.dumps(got, sort_keys=True), "closed-port SYNs:", closed_syns)
    relay, punch = RelayLimits(), HolePunchLimits()
    # hole punching: sessions were taken (the attacker is a member with a relayed connection), and each
    # dialled a few of the listed addresses at the attacker's IP, within the shared budget; never the
    # 300 closed ports listed after them, nor the junk
    assert did.get("dcutr_sessions_answered", 0) >= 1, did
    assert got["dcutr_listeners"]["ports_hit"] <= punch.addrs, got
    windows = math.ceil(ATTACK_S / punch.window) + 1
    assert got["dcutr_listeners"]["connects"] <= punch.dials * windows, got
    assert closed_syns == 0, closed_syns
    # relay: one IP's identities hold at most per_ip slots and circuits_per_ip circuits, however many ask
    assert did.get("reserve_ok", 0) + did.get("reserve_refused", 0) == SYBILS, did
    assert 1 <= did.get("reserve_ok", 0) <= relay.per_ip, did
    assert did.get("circuit_ok", 0) >= 1 and 1 <= got["circuits_held_max"] <= relay.circuits_per_ip, got
    # reachability: the service served some of the attacker's checks and refused the rest by its IP
    # (ReachConfig.per_ip at a time; the honest nodes learned their reach meanwhile, above)
    assert did.get("check_refused_per_ip", 0) >= 1 and did.get("check_served", 0) >= 1, did
    # addresses: of the 16 in its record the nodes dial a few per attempt (the swarm's dialer the first
    # DIAL_LIMIT of the record, a reversal DIAL_LIMIT of the ports the bootstrap knows, py-libp2p's own dials
    # the first DIAL_LIMIT in one canonical order), and back off between failed attempts. Before: 9, 11 and
    # 9 of the 16 dialled, 510, 2,047 and 2,979 connects in three runs (every NAT'd node, every heartbeat);
    # after: 10 and 535 (2026-11-29, load 20-30). The bound on connects is empirical: it catches dials at
    # every heartbeat again, not a few more retries
    assert got["record_listeners"]["ports_hit"] <= 3 * DIAL_LIMIT, got
    assert got["record_listeners"]["connects"] < 1500, got
