"""A bootstrap and N ``fusionp2p node`` processes on loopback, for the demo, tests and benchmarks.

``with LocalCluster(nodes=4, home=dir) as cluster:`` starts ``python -m fusionp2p.cli bootstrap``,
reads its multiaddr from its stdout, starts the nodes pointing at it, and on exit sends SIGTERM to
every process it started (by PID, nodes first), waits for them, and SIGKILLs any that hang. The
exit codes are kept in ``cluster.exit_codes`` (a clean node leaves with 0). Each process writes its
stderr to ``<home>/<name>.log``. With ``http=True`` every process also serves its dashboard on a free
loopback port (``--http 127.0.0.1:0``); :meth:`LocalCluster.http_urls` reads the URLs they print.

With ``preload=True`` (the demo's and the e2e benchmark's) the nodes are forked from one multiprocessing
forkserver that imported torch, ``torch._dynamo`` and the node's modules once (``cli/forked.py``) instead of each
paying them: they run the same ``main(argv)``, each with its own PID, session, stdout pipe and log. The program
that holds such a cluster must guard its entry point (``if __name__ == "__main__":``), as multiprocessing asks:
the forkserver imports a script's main module. :meth:`LocalCluster.cpu_seconds` reads each process's CPU time.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

from fusionp2p.cli.forked import Forked, start_forkserver
from fusionp2p.cli.forked import server_pid as forked_server_pid
from fusionp2p.errors import PeerUnavailable

log = logging.getLogger(__name__)


class LocalCluster:
    """Processes of a loopback swarm (see the module docstring)."""

    def __init__(self, nodes: int, home: Path, *, torch_threads: int = 1, heartbeat: float = 1.0,
                 dead_timeout: float = 10.0, probe_interval: float = 30.0, start_timeout: float = 60.0,
                 log_level: str = "info", http: bool = False, progress_interval: float | None = None,
                 preload: bool = False) -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.n = nodes
        self.home = home
        self.torch_threads = torch_threads
        self.node_args = ["--heartbeat", str(heartbeat), "--dead-timeout", str(dead_timeout),
                          "--probe-interval", str(probe_interval),
                          *(["--progress-interval", str(progress_interval)] if progress_interval is not None else [])]
        self.start_timeout = start_timeout
        self.preload = preload   # fork the processes from one pre-imported forkserver (cli/forked.py)
        self.log_level = log_level
        self.http = ["--http", "127.0.0.1:0"] if http else []
        self._urls: dict[str, str] = {}
        self._out: dict[str, bytes] = {}    # stdout read but not consumed yet, per process
        self.procs: dict[str, subprocess.Popen[bytes] | Forked] = {}
        self._logs: list[IO[bytes]] = []
        self.bootstrap = ""
        self.exit_codes: dict[str, int | None] = {}
        self._peers: dict[str, str] = {}
        self._old_term: Any = None         # the SIGTERM handler to restore on exit

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes] | Forked:
        d = self.home / name
        d.mkdir(parents=True, exist_ok=True)
        argv = [*args, "--home", str(d), "--log-level", self.log_level]
        if self.preload and name != "bootstrap":
            f = Forked(argv, self._fork_env(), self.home / f"{name}.log")
            self.procs[name] = f
            return f
        err = open(self.home / f"{name}.log", "wb")   # noqa: SIM115 - closed in stop()
        self._logs.append(err)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.torch_threads),
               "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "1")}   # from the first malloc (net/heap.py)
        p = subprocess.Popen([sys.executable, "-m", "fusionp2p.cli", *argv],
                             stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True)
        self.procs[name] = p
        return p

    def _fork_env(self) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(self.torch_threads), "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "1")}

    def start(self) -> LocalCluster:
        """Start the bootstrap (wait for its address) and the nodes. PeerUnavailable if it fails."""
        self.home.mkdir(parents=True, exist_ok=True)
        if self.preload:
            # the forkserver imports while the bootstrap, which trains nothing and needs no torch, starts as its own
            # command beside it: the nodes, forked after both, wait for the longer of the two, not their sum
            start_forkserver(self._fork_env())
        self._spawn("bootstrap", ["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", *self.http])
        addr = self._read_line("bootstrap", b"/", time.monotonic() + self.start_timeout)
        if addr is None or "/p2p/" not in addr:
            self.stop()
            raise PeerUnavailable("bootstrap", f"did not print its address; see {self.home / 'bootstrap.log'}")
        self.bootstrap = addr
        for i in range(self.n):
            self.add_node(f"node{i}")
        return self

    def add_node(self, name: str) -> subprocess.Popen[bytes] | Forked:
        """Start one more node process (a joiner), or restart *name* with its home (same identity)."""
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            raise ValueError(f"{name} is still running")
        self._out.pop(name, None)
        self._peers.pop(name, None)
        return self._spawn(name, ["node", "--bootstrap", self.bootstrap, "--listen", "/ip4/127.0.0.1/tcp/0",
                                  "--torch-threads", str(self.torch_threads), *self.node_args, *self.http])

    def peer_id(self, name: str, timeout: float = 60.0) -> str:
        """The peer id a process printed with its multiaddr (PeerUnavailable if it did not)."""
        if name not in self._peers:
            addr = self._read_line(name, b"/", time.monotonic() + timeout)
            if addr is None or "/p2p/" not in addr:
                raise PeerUnavailable(name, f"printed no address; see {self.home / (name + '.log')}")
            self._peers[name] = addr.rsplit("/p2p/", 1)[1]
        return self._peers[name]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send *sig* to one process we started (by its PID) and wait for it; its exit code."""
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(sig)
        code = p.wait(timeout=60)
        self.exit_codes[name] = code
        return code

    def http_urls(self, timeout: float = 90.0) -> dict[str, str]:
        """The dashboard URL of every process (``http=True``), read from their stdout; PeerUnavailable
        naming the process when one has not printed it within *timeout* seconds."""
        deadline = time.monotonic() + timeout
        for name in self.procs:
            if name not in self._urls:
                url = self._read_line(name, b"http://", deadline)
                if url is None:
                    raise PeerUnavailable(name, f"printed no dashboard URL; see {self.home / (name + '.log')}")
                self._urls[name] = url
        return dict(self._urls)

    def _read_line(self, name: str, prefix: bytes, deadline: float) -> str | None:
        """The next line of *name*'s stdout that starts with *prefix* (earlier lines are skipped), or
        None at the deadline or when the process ends. Unbuffered reads: no line is lost in a buffer."""
        p = self.procs[name]
        assert p.stdout is not None
        fd = p.stdout.fileno()
        while True:
            buf = self._out.get(name, b"")
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self._out[name] = buf
                if line.startswith(prefix):
                    return line.decode().strip()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    return None   # the process closed its stdout (it ended)
                self._out[name] = buf + chunk

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, seconds) of every process still running, from ``/proc`` (Linux; empty
        elsewhere), and of the forkserver they were forked from (``preload=True``): load-independent, unlike
        their wall times."""
        pids = {n: p.pid for n, p in self.procs.items() if p.poll() is None}
        server = forked_server_pid() if self.preload else None
        if server is not None:
            pids["forkserver"] = server
        out: dict[str, float] = {}
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        for name, pid in pids.items():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()   # after the command name, which may hold spaces
            out[name] = (int(fields[11]) + int(fields[12])) / tick   # utime, stime (fields 14 and 15)
        return out

    def alive(self) -> list[str]:
        """Names of the processes still running."""
        return [n for n, p in self.procs.items() if p.poll() is None]

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        """SIGTERM every process (nodes first), wait up to *timeout*, SIGKILL the rest; exit codes."""
        order = [n for n in self.procs if n != "bootstrap"] + [n for n in self.procs if n == "bootstrap"]
        for name in order:
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name in order:
            p = self.procs[name]
            try:
                self.exit_codes[name] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM; killing it", name, p.pid)
                p.kill()
                p.wait()
                self.exit_codes[name] = None
        for f in self._logs:
            f.close()
        self._logs.clear()
        for p in self.procs.values():
            if p.stdout is not None:
                p.stdout.close()
        return self.exit_codes

    def __enter__(self) -> LocalCluster:
        # The processes run in their own sessions, so a SIGTERM to this process (a CI timeout, `kill PID`) would
        # leave them running: turn it into SystemExit so the ``with`` block stops them on the way out.
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._old_term = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            return self.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.stop()
        finally:
            if self._old_term is not None:
                signal.signal(signal.SIGTERM, self._old_term)
                self._old_term = None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


T = TypeVar("T")


def wait_until(probe: Callable[[], T | None], *, timeout: float, interval: float = 0.2, what: str = "condition") -> T:
    """Call *probe* until it returns a truthy value; AssertionError naming *what* after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


__all__ = ["LocalCluster", "wait_until"]
