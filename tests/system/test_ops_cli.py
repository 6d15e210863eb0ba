"""``--http`` and ``--listen`` mistakes end with one line and exit status 2, before the daemon starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

CLI = [sys.executable, "-m", "fusionp2p.cli"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def run(tmp: Path, http: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--home", str(tmp), "--http", http],
                          capture_output=True, text=True, env=ENV, timeout=60)


def test_http_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = run(tmp_path, str(s.getsockname()[1]))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--http: cannot listen on 127.0.0.1" in r.stderr


@pytest.mark.parametrize("addr", ["localhost:9100", "99999", "::1:80"])
def test_http_bad_address(tmp_path: Path, addr: str) -> None:
    r = run(tmp_path, addr)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("fusionp2p: error: --http")


def test_listen_port_in_use(tmp_path: Path) -> None:
    """py-libp2p logs a listener it could not start and runs on; the node must not join listening nowhere."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}"
        r = subprocess.run([*CLI, "bootstrap", "--listen", busy, "--home", str(tmp_path)],
                           capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith(f"fusionp2p: error: cannot listen on {busy}:")
