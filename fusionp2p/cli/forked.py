"""Node processes forked from one pre-imported parent, for :class:`~fusionp2p.cli.cluster.LocalCluster`.

Why: every ``python -m fusionp2p.cli node`` pays its imports before it can answer an offer: the interpreter and
fusionp2p (~1.2 CPU-s), torch (~2.2 CPU-s) and, at the first optimizer it builds, ``torch._dynamo`` with sympy
and mpmath (~1.5 CPU-s: torch's ``Optimizer.add_param_group`` is wrapped in ``torch._disable_dynamo``, which
imports it on first call). On a machine of two cores the demo's five processes spent ~25 CPU-s on that, the same
work five times (issue 40). Here a multiprocessing *forkserver* imports it all once and forks each process from
that state: the pages are shared copy-on-write and a child starts with everything loaded.

The children stay real node processes: each has its own PID and session (``os.setsid``), its own TCP listener,
takes SIGTERM and SIGKILL by PID, writes its stdout to a pipe the cluster reads and its stderr to its log file,
and runs the same ``node``/``bootstrap`` command as the command line (``fusionp2p.cli.daemon_cmd.daemon_main``). Forking is safe because the forkserver
is a fresh single-threaded interpreter that has only imported modules (no torch thread pool, no trio loop, no
socket); ``MALLOC_ARENA_MAX`` reaches it through its environment before its first allocation, and each daemon
still calls ``mallopt`` first thing (``net/heap.py``).

:class:`Forked` has the part of :class:`subprocess.Popen`'s interface the cluster uses (``pid``, ``stdout``,
``poll``, ``wait``, ``send_signal``, ``kill``), with the same exit-code convention (``-N`` for signal N).
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

# What a node imports before it can train: the forkserver imports these once (a module that fails to import
# is skipped by multiprocessing, and the child then imports it itself)
PRELOAD = ("fusionp2p.cli.daemon_cmd", "torch", "torch._dynamo", "fusionp2p.swarm.node", "fusionp2p.jobs.node",
           "fusionp2p.jobs.run", "fusionp2p.train.worker")

# multiprocessing runs one forkserver per process: parallel/rendezvous.py's (its preload: torch, fusionp2p.parallel)
# is this same server, and whichever starts it first sets the preload (both still work: a child imports what the
# server did not). It lives until the process that started it ends (~310 MiB resident after PRELOAD).
_ctx: multiprocessing.context.ForkServerContext | None = None


def start_forkserver(env: Mapping[str, str]) -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its server started (importing :data:`PRELOAD`, without waiting for it) on first
    use with *env*'s ``MALLOC_ARENA_MAX`` and ``OMP_NUM_THREADS`` (read by glibc and OpenMP when it starts and
    imports torch, not later)."""
    global _ctx
    if _ctx is None:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        keys = ("MALLOC_ARENA_MAX", "OMP_NUM_THREADS")
        saved = {k: os.environ.get(k) for k in keys}
        os.environ.update({k: env[k] for k in keys if k in env})
        try:
            forkserver.ensure_running()   # it inherits this environment now
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _ctx = ctx
    return _ctx


def _child(argv: Sequence[str], env: Mapping[str, str], stdout: Connection, log_path: str) -> None:
    """Runs in the forked process: its own session, stdout to the cluster's pipe, stderr to its log."""
    os.setsid()
    os.environ.update(env)
    os.dup2(stdout.fileno(), 1)
    stdout.close()
    err = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    os.close(err)
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(write_through=True)   # what PYTHONUNBUFFERED gives a spawned one
    from fusionp2p.cli.daemon_cmd import daemon_main as main

    try:
        rc = main(list(argv))
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(rc)   # no interpreter teardown, as a daemon started from the command line (cli/base.py _exit_now)


def server_pid() -> int | None:
    """The forkserver's PID once it runs (its CPU time holds the imports every child was spared)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)   # no public accessor
    return pid if isinstance(pid, int) else None


class _Reader:
    """The read end of a child's stdout pipe, as ``Popen.stdout`` offers it to the cluster."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def fileno(self) -> int:
        return self._conn.fileno()

    def close(self) -> None:
        self._conn.close()


class Forked:
    """A node process forked from the pre-imported forkserver (see the module docstring)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> None:
        ctx = start_forkserver(env)
        reader, writer = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(list(argv), dict(env), writer, str(log_path)), daemon=False)
        try:
            self._proc.start()
        finally:
            writer.close()   # the child has its copy: the cluster sees EOF when the child ends
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid
        self.stdout = _Reader(reader)

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self._proc.kill()


__all__ = ["PRELOAD", "Forked", "server_pid", "start_forkserver"]
