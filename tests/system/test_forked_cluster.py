"""``LocalCluster(preload=True)`` (the demo's): its nodes are forked from one pre-imported forkserver, and are
still real processes of their own: own PID and session, their address on stdout, their log, SIGTERM and SIGKILL
by PID, exit codes as ``subprocess`` reports them."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from fusionp2p.cli.cluster import LocalCluster
from fusionp2p.cli.forked import server_pid

pytestmark = pytest.mark.system


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_forked_processes_are_real_processes_of_their_own(tmp_path: Path) -> None:
    with LocalCluster(2, tmp_path, preload=True, start_timeout=120.0) as c:
        server = server_pid()
        assert server is not None
        for name in ("node0", "node1"):
            assert c.peer_id(name, timeout=120.0).startswith("12D3Koo")   # listening: its address on stdout
        for name, p in c.procs.items():
            assert p.pid not in (os.getpid(), server)
            assert os.getsid(p.pid) == p.pid, f"{name} is not in its own session"
            # the bootstrap (no torch) is a command of its own, started beside the forkserver's imports
            assert _ppid(p.pid) == (os.getpid() if name == "bootstrap" else server), f"{name}: wrong parent"
        cpu = c.cpu_seconds()
        assert set(cpu) == {"bootstrap", "node0", "node1", "forkserver"}
        # the imports were paid once, in the forkserver: a node's own CPU time is a fraction of them
        assert cpu["forkserver"] > cpu["node0"]
        assert c.kill("node1", signal.SIGKILL) == -signal.SIGKILL
        assert c.alive() == ["bootstrap", "node0"]
    # the exit codes come back as subprocess reports them: -9 for the SIGKILL; the others took the SIGTERM (their
    # code is theirs: py-libp2p may fail a stream opened during the stop)
    assert c.exit_codes["node1"] == -signal.SIGKILL
    assert None not in c.exit_codes.values()
    assert (tmp_path / "node0.log").stat().st_size > 0    # its stderr went to its log
