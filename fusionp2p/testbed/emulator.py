"""The emulated-WAN testbed: shaped network namespaces, the processes in them, and their teardown.

Use::

    spec = load_spec("fusionp2p/testbed/specs/wan6.json")
    with up(spec) as tb:                       # namespaces, bridge, veths, tbf shaping
        boot, addr = tb.start_bootstrap()      # `fusionp2p bootstrap` in the spec's bootstrap host
        nodes = tb.start_nodes(addr)           # `fusionp2p node` in every host
        tb.run(tb.hosts[0], ["python", "-c", "..."], timeout=10)
    # every process the testbed started is stopped, every namespace deleted

The layout and the shaping are described in :mod:`fusionp2p.testbed.netns`. Teardown is idempotent
and happens on leaving the ``with`` block (also on an exception or Ctrl-C), at interpreter exit
(atexit) for testbeds still open, and on demand with :func:`down` / :func:`down_all`, which need no
state from the process that created the testbed: they find our namespaces by name and kill what
runs inside them. :func:`cli_up` / :func:`cli_down` are what ``fusionp2p testbed up|down`` calls.

Only the namespaces created here are ever addressed: hosts live on ``10.77.<octet>.0/24``, which
exists only on the testbed's veths.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from fusionp2p.errors import ConfigError
from fusionp2p.testbed import netns
from fusionp2p.testbed.netns import (
    Layout,
    Proc,
    TestbedError,
    format_rate,
    spawn_process,
    stop_all,
)
from fusionp2p.testbed.spec import HostSpec, TestbedSpec, load_spec, spec_from_dict

log = logging.getLogger(__name__)

__all__ = [
    "HostSpec",
    "Proc",
    "Testbed",
    "TestbedError",
    "TestbedHost",
    "TestbedSpec",
    "cli_down",
    "cli_up",
    "down",
    "down_all",
    "fusionp2p_command",
    "describe",
    "load_spec",
    "running",
    "spec_from_dict",
    "up",
]

@dataclass(frozen=True, kw_only=True, slots=True)
class TestbedHost:
    """A host of a running testbed: its spec, namespace and address."""

    __test__ = False

    spec: HostSpec
    namespace: str
    address: str
    cgroup_procs: Path | None = None  # set when the host has a CPU cap (spec ``cpus``)

    @property
    def name(self) -> str:
        return self.spec.name

    def env(self) -> dict[str, str]:
        """Environment added to processes started in this host (heterogeneous compute).

        ``FUSIONP2P_TORCH_THREADS`` / ``OMP_NUM_THREADS`` cap torch's threads;
        ``FUSIONP2P_COMPUTE_SLOWDOWN`` asks the node to run its compute that many times slower than it
        runs at ``FUSIONP2P_TESTBED_CPUS`` cores (the host's ``cpus``, when it has a cap);
        ``FUSIONP2P_TESTBED_HOST`` / ``FUSIONP2P_TESTBED_ADDR`` are the host's name and address.
        """
        env = {
            "FUSIONP2P_COMPUTE_SLOWDOWN": repr(self.spec.slowdown),
            "FUSIONP2P_TESTBED_HOST": self.name,
            "FUSIONP2P_TESTBED_ADDR": self.address,
        }
        if self.spec.cpus is not None:
            env["FUSIONP2P_TESTBED_CPUS"] = repr(self.spec.cpus)   # the cgroup is out of sight in the namespace
        if self.spec.torch_threads is not None:
            n = str(self.spec.torch_threads)
            env |= {"FUSIONP2P_TORCH_THREADS": n, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}
        return env


def fusionp2p_command() -> list[str]:
    """argv prefix that runs the ``fusionp2p`` CLI of *this* interpreter's installation."""
    script = Path(sys.executable).parent / "fusionp2p"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-c", "import sys; from fusionp2p.cli import main; sys.exit(main())"]


# Testbeds still open in this process, torn down at interpreter exit. A registry is the only way an
# atexit hook can find them; it holds nothing else.
_LIVE: dict[str, Testbed] = {}
_LIVE_LOCK = threading.Lock()


def _close_live_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE.values())
    for tb in live:
        tb.close()


atexit.register(_close_live_at_exit)


@dataclass(kw_only=True, eq=False)
class Testbed:
    """A running testbed. Create it with :func:`up`; :meth:`close` (or ``with``) tears it down."""

    __test__ = False

    spec: TestbedSpec
    layout: Layout
    workdir: Path
    hosts: tuple[TestbedHost, ...]
    owns_workdir: bool = True
    procs: list[Proc] = field(default_factory=list)
    closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def name(self) -> str:
        return self.layout.run

    def host(self, name: str) -> TestbedHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ConfigError(f"no host {name!r} in testbed {self.name}; hosts: {[h.name for h in self.hosts]}")

    def _resolve(self, host: TestbedHost | str) -> TestbedHost:
        return self.host(host) if isinstance(host, str) else host

    def argv(self, host: TestbedHost | str, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` inside ``host``'s namespace."""
        return netns.exec_argv(self._resolve(host).namespace, argv)

    def spawn(
        self,
        host: TestbedHost | str,
        argv: Sequence[str],
        *,
        label: str = "",
        env: Mapping[str, str] | None = None,
        detached_output: bool = False,
    ) -> Proc:
        """Start ``argv`` inside ``host`` and track it, so that teardown stops exactly this process.

        stdout is readable line by line with :meth:`Proc.read_line` (and copied to the workdir);
        with ``detached_output`` it goes only to a file, so the process outlives this Python process.
        """
        if self.closed:
            raise TestbedError(f"testbed {self.name} is closed")
        h = self._resolve(host)
        full_env = {**os.environ, **h.env(), **(env or {})}
        tag = label or f"{h.name}-{len(self.procs)}"
        full = self.argv(h, argv)
        if h.cgroup_procs is not None:
            full = netns.in_cgroup_argv(h.cgroup_procs, full)
        proc = spawn_process(full, label=tag, env=full_env, logdir=self.workdir / "logs", pipe_stdout=not detached_output)
        with self._lock:
            self.procs.append(proc)
        return proc

    def run(self, host: TestbedHost | str, argv: Sequence[str], *, timeout: float) -> tuple[int, str]:
        """Run ``argv`` inside ``host`` to completion; return (exit status, stdout). Stops it on timeout."""
        proc = self.spawn(host, argv)
        try:
            rc = proc.wait(timeout)
        finally:
            proc.stop(grace=1.0)
        return rc, proc.drain_stdout()

    def start_bootstrap(
        self, argv: Sequence[str] | None = None, *, ready_timeout: float = 60.0, detached_output: bool = False
    ) -> tuple[Proc, str]:
        """Start the bootstrap in the spec's bootstrap host; return it and its first multiaddr line.

        ``argv`` defaults to ``fusionp2p bootstrap --listen /ip4/IP/tcp/PORT --home DIR``. The address
        is the first stdout line starting with ``/``, read with a deadline of ``ready_timeout``.
        """
        h = self.host(self.spec.bootstrap)
        if argv is None:
            home = self.workdir / h.name / "bootstrap-home"
            home.mkdir(parents=True, exist_ok=True)
            listen = f"/ip4/{h.address}/tcp/{self.spec.bootstrap_port}"
            argv = [*fusionp2p_command(), "bootstrap", "--listen", listen, "--home", str(home)]
        proc = self.spawn(h, argv, label=f"{h.name}-bootstrap", detached_output=detached_output)
        addr = proc.read_line(ready_timeout, match=lambda line: line.startswith("/"))
        log.info("testbed %s: bootstrap at %s", self.name, addr)
        return proc, addr

    def node_home(self, host: TestbedHost | str) -> Path:
        """The ``--home`` of ``host``'s node in :meth:`node_argv` (created)."""
        home = self.workdir / self._resolve(host).name / "home"
        home.mkdir(parents=True, exist_ok=True)
        return home

    def node_argv(self, host: TestbedHost | str, bootstrap_addr: str) -> list[str]:
        """The default node command for ``host``: ``fusionp2p node --bootstrap … --listen … --home …``."""
        h = self._resolve(host)
        home = self.node_home(h)
        return [
            *fusionp2p_command(),
            "node",
            "--bootstrap",
            bootstrap_addr,
            "--listen",
            f"/ip4/{h.address}/tcp/0",
            "--home",
            str(home),
            *(["--torch-threads", str(h.spec.torch_threads)] if h.spec.torch_threads is not None else []),
            *h.spec.node_args,
        ]

    def start_nodes(
        self,
        bootstrap_addr: str,
        argv_for: Callable[[TestbedHost, str], Sequence[str]] | None = None,
        *,
        ready_timeout: float | None = None,
        detached_output: bool = False,
    ) -> list[Proc]:
        """Start one node per host (``argv_for(host, bootstrap_addr)``, default :meth:`node_argv`).

        With ``ready_timeout``, also wait (that long in all) until every node has printed a first
        stdout line, which is how a node says it is up.
        """
        make = argv_for or self.node_argv
        procs = [
            self.spawn(h, make(h, bootstrap_addr), label=f"{h.name}-node", detached_output=detached_output)
            for h in self.hosts
        ]
        if ready_timeout is not None:
            deadline = time.monotonic() + ready_timeout
            for p in procs:
                p.read_line(max(deadline - time.monotonic(), 0.0))
        return procs

    def stop_processes(self, grace: float = 5.0) -> None:
        """SIGTERM every tracked process group, wait up to ``grace`` s in total, then SIGKILL."""
        with self._lock:
            procs = list(self.procs)
        stop_all(procs, grace=grace)

    def close(self, *, grace: float = 5.0, keep_workdir: bool = False) -> None:
        """Stop the processes, delete the namespaces and (if we made it) the workdir. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            stop_all(list(self.procs), grace=grace)
        finally:
            _delete_run(self.name)
            with _LIVE_LOCK:
                _LIVE.pop(self.name, None)
            if self.owns_workdir and not keep_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
            elif keep_workdir:
                log.warning("testbed %s: logs kept in %s", self.name, self.workdir)

    def detach(self) -> None:
        """Leave the testbed running after this process exits (``fusionp2p testbed down`` removes it)."""
        with _LIVE_LOCK:
            _LIVE.pop(self.name, None)
        self.closed = True

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        # On a failure, keep the logs: they are what explains it.
        self.close(keep_workdir=et is not None and not issubclass(et, KeyboardInterrupt))


def up(
    spec: TestbedSpec,
    *,
    name: str | None = None,
    workdir: str | os.PathLike[str] | None = None,
    rng: random.Random | None = None,
) -> Testbed:
    """Create the namespaces, bridge, veths and shaping of ``spec``; return the running Testbed.

    ``name`` (``fp2p-<6 hex>``) and the subnet octet are drawn from ``rng`` (default: the OS's
    entropy) so that parallel runs never collide. If any step fails, whatever was created is removed
    before the error propagates. Raises ConfigError without root or iproute2.
    """
    netns.check_environment()
    r = rng or random.SystemRandom()
    existing = {netns.run_of(ns) for ns in netns.list_namespaces()}
    if name is None:
        name = f"{netns.PREFIX}{r.getrandbits(24):06x}"
        while name in existing:
            name = f"{netns.PREFIX}{r.getrandbits(24):06x}"
    elif name in existing:
        raise ConfigError(f"testbed {name} already exists; run `fusionp2p testbed down {name}` first")
    if any(h.nat for h in spec.hosts) and shutil.which("iptables") is None:
        raise ConfigError("the spec has hosts behind a NAT: the routers need iptables (make iptables, or "
                          "apt-get install iptables)")
    layout = netns.make_layout(name, r.randrange(256), [(h.up_bps, h.down_bps) for h in spec.hosts],
                               [h.nat for h in spec.hosts], drop_inbound=spec.nat_inbound == "drop")
    owns = workdir is None
    wd = Path(tempfile.mkdtemp(prefix=f"{name}-")) if workdir is None else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    created: list[str] = []
    try:
        for cmd in netns.plan_commands(layout):
            netns.run_cmd(cmd)
            if cmd[:3] == ["ip", "netns", "add"]:
                created.append(cmd[3])
        hosts = tuple(
            TestbedHost(
                spec=s,
                namespace=h.namespace,
                address=h.address,
                cgroup_procs=None if s.cpus is None else netns.make_cpu_cgroup(h.namespace, s.cpus),
            )
            for s, h in zip(spec.hosts, layout.hosts)
        )
    except BaseException:
        # Remove only what this call created: should another run have taken the same name in the
        # meantime (1 in 16 million), its namespaces are not ours to delete.
        netns.delete_namespaces(list(reversed(created)))
        if created:
            netns.remove_cpu_cgroups(name)
        if owns:
            shutil.rmtree(wd, ignore_errors=True)
        raise
    tb = Testbed(spec=spec, layout=layout, workdir=wd, hosts=hosts, owns_workdir=owns)
    with _LIVE_LOCK:
        _LIVE[name] = tb
    log.info("testbed %s up: %d hosts on 10.77.%d.0/24, workdir %s", name, len(hosts), layout.octet, wd)
    return tb


def _delete_run(run: str) -> list[str]:
    """Delete every namespace of ``run`` (hosts first, then the bridge); return the names deleted."""
    mine = [ns for ns in netns.list_namespaces() if netns.run_of(ns) == run]
    mine.sort(key=lambda ns: ns.endswith("-br"))
    try:
        netns.delete_namespaces(mine)   # every process of the run killed at once, one wait
    finally:
        netns.remove_cpu_cgroups(run)  # after the namespaces: their processes are dead by now
    return mine


def down(name: str) -> list[str]:
    """Tear down testbed ``name`` (also one created by another process); return the namespaces removed.

    Idempotent: a testbed that is already gone removes nothing.
    """
    netns.check_run_name(name)
    netns.check_environment()
    with _LIVE_LOCK:
        live = _LIVE.get(name)
    if live is not None:
        live.close()
    return _delete_run(name)


def running() -> list[str]:
    """Names of the testbeds whose namespaces exist on this machine (created by any process)."""
    netns.check_environment()
    return sorted({r for ns in netns.list_namespaces() if (r := netns.run_of(ns)) is not None})


def down_all() -> list[str]:
    """Tear down every testbed on this machine (leftovers of crashed runs included)."""
    removed: list[str] = []
    for run in running():
        removed += down(run)
    return removed


# ---------------------------------------------------------------- what `fusionp2p testbed` calls


def describe(tb: Testbed) -> str:
    """A plain-text table of the hosts of ``tb``."""
    def rate(bps: int | None) -> str:
        return format_rate(bps) if bps is not None else "unshaped"

    rows = [f"testbed {tb.name}: {len(tb.hosts)} hosts on 10.77.{tb.layout.octet}.0/24 (workdir {tb.workdir})"]
    rows.append(f"  {'host':<12} {'namespace':<18} {'address':<15} {'up':>9} {'down':>9}  compute")
    for h in tb.hosts:
        comp = f"x{h.spec.slowdown:g} slower" if h.spec.slowdown != 1.0 else "full speed"
        if h.spec.cpus is not None:
            comp += f", {h.spec.cpus:g} cpus"
        if h.spec.torch_threads is not None:
            comp += f", {h.spec.torch_threads} threads"
        if h.spec.nat:
            comp += f", behind NAT {h.spec.nat!r}"
        rows.append(f"  {h.name:<12} {h.namespace:<18} {h.address:<15} {rate(h.spec.up_bps):>9} {rate(h.spec.down_bps):>9}  {comp}")
    rows += [f"  NAT {r.group!r}: router {r.namespace} at {r.wan_address}, LAN {r.lan_prefix}.0/24 (MASQUERADE)"
             for r in tb.layout.routers]
    return "\n".join(rows)

def _remove_tmp_workdirs(run: str) -> None:
    """Remove the auto-created workdirs of ``run`` (``mkdtemp(prefix=run + '-')``), e.g. of a detached run."""
    for d in Path(tempfile.gettempdir()).glob(f"{run}-*"):
        if d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)


class _Terminate(KeyboardInterrupt):
    """SIGTERM/SIGHUP turned into the same unwinding as Ctrl-C."""


def _raise_terminate(signum: int, frame: object) -> None:
    raise _Terminate(f"signal {signum}")


def cli_up(
    spec_path: str | os.PathLike[str],
    *,
    start_nodes: bool = True,
    detach: bool = False,
    ready_timeout: float = 60.0,
    wait_nodes: bool = False,
    bootstrap_argv: Sequence[str] | None = None,
    node_argv: Callable[[TestbedHost, str], Sequence[str]] | None = None,
) -> int:
    """``fusionp2p testbed up --spec FILE``: build the testbed, start a bootstrap and a node per host.

    In the foreground (default) it waits until Ctrl-C/SIGTERM, until the bootstrap exits, or until
    ``fusionp2p testbed down`` removed the testbed from another shell, then tears everything down. ``wait_nodes`` also waits for each node's first stdout line (within
    ``ready_timeout``), so that "up" means up. With ``detach`` it returns 0 and leaves the testbed running for
    ``fusionp2p testbed down``. Returns the exit status: 0 ok, 1 a process failed, 2 a bad spec or
    a machine without root/iproute2 (one line on stderr).
    """
    try:
        tb = up(load_spec(spec_path))
    except (ConfigError, TestbedError) as e:
        print(f"fusionp2p testbed: {e}", file=sys.stderr)
        return 2
    print(describe(tb), flush=True)
    main_thread = threading.current_thread() is threading.main_thread()
    # SIGINT too, explicitly: a process started with SIGINT ignored (a job a non-interactive shell put
    # in the background with `&`, and everything it starts: CI runners do this) inherits SIG_IGN, and
    # Python then installs no KeyboardInterrupt handler, so Ctrl-C/`kill -INT` did nothing at all.
    old = ({s: signal.signal(s, _raise_terminate) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
           if main_thread else {})
    ok = False
    try:
        boot: Proc | None = None
        if start_nodes:
            boot, addr = tb.start_bootstrap(bootstrap_argv, ready_timeout=ready_timeout, detached_output=detach)
            print(f"bootstrap: {addr}", flush=True)
            wait = ready_timeout if wait_nodes else None
            nodes = tb.start_nodes(addr, node_argv, ready_timeout=wait, detached_output=detach)
            state = "up" if wait_nodes else "started"
            print(f"{len(nodes)} nodes {state}; logs in {tb.workdir / 'logs'}", flush=True)
        if detach:
            tb.detach()
            print(f"testbed {tb.name} left running; remove it with: fusionp2p testbed down {tb.name}", flush=True)
            ok = True
            return 0
        # Without a bootstrap, a sentinel process stands in for it: `testbed down` from another
        # shell kills everything in our namespaces, so its exit tells us the testbed is gone.
        watched = boot if boot is not None else tb.spawn(tb.hosts[0], ["sleep", "infinity"], label="sentinel")
        print(f"testbed {tb.name} is up; Ctrl-C tears it down", flush=True)
        rc = watched.popen.wait()
        if rc == -signal.SIGKILL:  # we never SIGKILL it ourselves before this point: `testbed down` did
            print(f"testbed {tb.name} is being removed by `fusionp2p testbed down`", flush=True)
            ok = True
            return 0
        print(f"{watched.label} exited with status {rc} (stderr: {watched.err_path}); tearing down", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ntearing down testbed {tb.name}", flush=True)
        ok = True
        return 0
    except (ConfigError, TestbedError) as e:
        print(f"fusionp2p testbed: {e}", file=sys.stderr)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if not tb.closed:
            tb.close(keep_workdir=not ok)
            if ok:
                print(f"testbed {tb.name} removed", flush=True)


def cli_down(name: str | None = None) -> int:
    """``fusionp2p testbed down [--name NAME]``: remove testbed NAME, or every testbed of ours if None.

    Also removes the testbed's auto-created workdir (logs, node homes). Returns 0 when done (also
    when there was nothing to remove), 2 on a bad name or a machine without root/iproute2.
    """
    try:
        if name is not None:
            netns.check_run_name(name)
        targets = [name] if name is not None else running()
        if not targets:
            print("no testbed running", flush=True)
        for run in targets:
            removed = down(run)
            _remove_tmp_workdirs(run)
            print(f"testbed {run}: removed {len(removed)} namespaces" if removed else f"testbed {run}: nothing left to remove", flush=True)
        return 0
    except (ConfigError, TestbedError) as e:
        print(f"fusionp2p testbed: {e}", file=sys.stderr)
        return 2
