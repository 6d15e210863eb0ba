"""Real processes through the CLI on loopback: bootstrap + 4 nodes, status, SIGKILL, restart with the same home."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusionp2p.testing.wait import wait_until

pytestmark = pytest.mark.system

CLI = [sys.executable, "-m", "fusionp2p.cli"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


class Procs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: str, name: str) -> subprocess.Popen[str]:
        err = open(self.tmp / f"{name}.err", "a")  # noqa: SIM115 - kept open for the process' lifetime
        p = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=err, text=True, env=ENV)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.stop_all()


def status(addr: str) -> dict | None:  # type: ignore[type-arg]
    r = subprocess.run([*CLI, "status", "--bootstrap", addr, "--json", "--timeout", "10"], capture_output=True, text=True,
                       env=ENV, timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else None


def alive_nodes(addr: str) -> set[str]:
    s = status(addr)
    return {m["peer"] for m in s["members"] if m["role"] == "node" and m["alive"]} if s else set()


@pytest.mark.timeout(300)
def test_bootstrap_nodes_status_kill_restart(procs: Procs, tmp_path: Path) -> None:
    boot = procs.start("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--home", str(tmp_path / "boot"), name="boot")
    assert boot.stdout is not None
    addr = boot.stdout.readline().strip()  # printed as soon as it listens
    assert "/p2p/12D3KooW" in addr
    common = ["--bootstrap", addr, "--listen", "/ip4/127.0.0.1/tcp/0", "--heartbeat", "0.5", "--dead-timeout", "3"]
    nodes = [procs.start("node", *common, "--home", str(tmp_path / f"n{i}"), name=f"n{i}") for i in range(4)]
    ids = []
    for n in nodes:
        assert n.stdout is not None
        ids.append(n.stdout.readline().strip().rsplit("/p2p/", 1)[1])
    wait_until(lambda: alive_nodes(addr) == set(ids), timeout=90, interval=1.0, what="status to list all 4 nodes")

    # SIGKILL one node: the others mark it dead within the heartbeat timeout (plus one status round trip)
    nodes[3].send_signal(signal.SIGKILL)
    nodes[3].wait(timeout=10)
    wait_until(lambda: ids[3] not in alive_nodes(addr) and alive_nodes(addr) == set(ids[:3]), timeout=30, interval=0.5,
               what="the killed node to be marked dead")
    s = status(addr)
    assert s is not None and ids[3] in s["dead"]

    # restart with the same home: same peer id, and it rejoins
    again = procs.start("node", *common, "--home", str(tmp_path / "n3"), name="n3b")
    assert again.stdout is not None
    assert again.stdout.readline().strip().rsplit("/p2p/", 1)[1] == ids[3]
    wait_until(lambda: alive_nodes(addr) == set(ids), timeout=60, interval=1.0, what="the restarted node to rejoin")

    # clean exit on SIGTERM
    nodes[0].send_signal(signal.SIGTERM)
    assert nodes[0].wait(timeout=20) == 0


def test_bad_bootstrap_address_is_one_line_exit_2(tmp_path: Path) -> None:
    r = subprocess.run([*CLI, "node", "--bootstrap", "/ip4/nope", "--home", str(tmp_path)], capture_output=True, text=True,
                       env=ENV, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "malformed multiaddr" in r.stderr


def test_corrupt_identity_is_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "identity.key").write_bytes(b"not a key")
    r = subprocess.run([*CLI, "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--home", str(tmp_path)], capture_output=True,
                       text=True, env=ENV, timeout=60)
    assert r.returncode == 2
    assert "not a fusionp2p identity key" in r.stderr and "Traceback" not in r.stderr


def test_unreachable_bootstrap_gives_clear_error(tmp_path: Path) -> None:
    from fusionp2p.net.identity import Identity

    ghost = Identity.generate().peer_id
    r = subprocess.run([*CLI, "status", "--bootstrap", f"/ip4/127.0.0.1/tcp/9/p2p/{ghost}", "--timeout", "3"],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 3
    assert "unavailable" in r.stderr and "Traceback" not in r.stderr
