"""A newcomer's mistakes through the real CLI: each ends with one line on stderr that names the likely
cause and what to do, a documented exit status, and no traceback (issue #44).

One bootstrap process on loopback serves every test here; the mistakes are made against it."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

CLI = [sys.executable, "-m", "fusionp2p.cli"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The full multiaddr a real bootstrap process printed."""
    home = tmp_path_factory.mktemp("boot")
    with open(home / "err", "wb") as err:
        p = subprocess.Popen([*CLI, "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--home", str(home)],
                             stdout=subprocess.PIPE, stderr=err, env=ENV)
        try:
            assert p.stdout is not None
            deadline = time.monotonic() + 90
            line = b""
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                assert left > 0 and select.select([p.stdout], [], [], left)[0], "the bootstrap printed no address"
                chunk = os.read(p.stdout.fileno(), 4096)
                assert chunk, (home / "err").read_text()
                line += chunk
            addr = line.decode().splitlines()[0].strip()
            assert "/p2p/" in addr
            yield addr
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def typo(addr: str) -> str:
    """*addr* with the last character of its peer id changed to another valid base58 character."""
    return addr[:-1] + ("T" if addr[-1] != "T" else "S")


def run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


def error_line(r: subprocess.CompletedProcess[str]) -> str:
    """The one error line; fails when stderr holds a traceback or more than that line (log lines aside)."""
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("fusionp2p: error: ")]
    assert len(errors) == 1, r.stderr
    assert r.stderr.rstrip().endswith(errors[0]), r.stderr
    return errors[0]


def test_node_with_a_typod_peer_id_says_the_id_differs_and_gives_up_at_once(bootstrap: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = run("node", "--bootstrap", typo(bootstrap), "--listen", "/ip4/127.0.0.1/tcp/0", "--home", str(tmp_path))
    took = time.monotonic() - t0
    line = error_line(r)
    assert r.returncode == 3
    assert "the port answered but the peer id differs" in line
    assert f"it is {bootstrap.rsplit('/p2p/', 1)[1]}" in line      # the id to copy
    attempts = [ln for ln in r.stderr.splitlines() if "attempt " in ln]
    assert len(attempts) == 1 and "attempt 1/5" in attempts[0]      # retrying cannot fix a wrong id
    assert took < 60, took


def test_status_and_job_submit_with_a_typod_peer_id_say_the_same(bootstrap: str, tmp_path: Path) -> None:
    for args in (["status", "--timeout", "5"],
                 ["job", "submit", "--builtin", "gpt2-tiny", "--home", str(tmp_path), "--out", str(tmp_path / "o")]):
        r = run(*args, "--bootstrap", typo(bootstrap))
        line = error_line(r)
        assert r.returncode == 3, r.stderr
        assert "the port answered but the peer id differs" in line and "copy the full /p2p/ address" in line
        assert line.count("unavailable") == 1, line


def test_status_against_a_closed_port_says_nothing_listens(bootstrap: str) -> None:
    closed = "/ip4/127.0.0.1/tcp/9/p2p/" + bootstrap.rsplit("/p2p/", 1)[1]
    r = run("status", "--bootstrap", closed, "--timeout", "5")
    assert r.returncode == 3
    assert "connection refused at /ip4/127.0.0.1/tcp/9: nothing listens there" in error_line(r)


def test_missing_job_file_is_one_line_exit_2(bootstrap: str, tmp_path: Path) -> None:
    r = run("job", "submit", str(tmp_path / "my_job.py"), "--bootstrap", bootstrap, "--home", str(tmp_path))
    assert r.returncode == 2
    line = error_line(r)
    assert "my_job.py not found" in line and "make_job()" in line and "--builtin gpt2-tiny" in line


def test_malformed_bootstrap_address_shows_an_example_with_p2p(tmp_path: Path) -> None:
    r = run("node", "--bootstrap", "/ip4/127.0.0.1/tcp/4001/p2/xyz", "--home", str(tmp_path))
    assert r.returncode == 2
    line = error_line(r)
    assert "malformed multiaddr" in line and "/p2p/12D3KooW" in line
