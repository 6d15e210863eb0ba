"""Network-namespace plumbing for the emulated-WAN testbed: rates, the layout plan, and ``ip``/``tc``.

Theory of operation. A testbed run is named ``fp2p-<6 hex>``; it owns one *bridge* namespace
``<run>-br`` holding a Linux bridge ``br0``, and one namespace per host ``<run>-h<i>``. Each host is
joined to the bridge by a veth pair created *inside the bridge namespace* (``p<i>``) whose peer is
moved straight into the host namespace as ``eth0``: nothing is ever created in, routed through or
addressed from the root namespace, so testbed traffic cannot leave the namespaces we made. Hosts get
``10.77.<octet>.<10+i>/24`` where ``octet`` is chosen per run; the /24 exists only on those veths.

Shaping. A host's *uplink* is the egress of its ``eth0``; its *downlink* is the egress of the bridge
side ``p<i>``. Both get ``tc qdisc replace ... root tbf rate R burst B latency L``. This kernel has no
``sch_netem``, so only rates are emulated (no propagation delay, no loss). See :func:`tbf_params` for
how ``burst`` and ``latency`` are chosen.

CPU caps. A host with ``cpus`` in its spec gets a cgroup named like its namespace with a CFS quota;
its processes join it through :func:`in_cgroup_argv` before ``ip netns exec``.

Processes. :func:`spawn_process` starts a command in its own session (so its process group is
exactly what it started) and returns a :class:`Proc`, whose stdout can be read line by line with a
deadline. Whatever escapes a process group is still inside one of our namespaces, and
:func:`delete_namespace` SIGKILLs everything there before deleting it.

Everything that decides *what* to run is pure (:func:`plan_commands`, :func:`parse_rate`,
:func:`tbf_params`) and unit-tested; only the few functions at the bottom touch the system.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fusionp2p.errors import ConfigError, FusionError

log = logging.getLogger(__name__)

PREFIX = "fp2p-"
_RUN_RE = re.compile(r"^fp2p-[0-9a-f]{6}$")
_NS_RE = re.compile(r"^(fp2p-[0-9a-f]{6})-(br|h[0-9]{1,3}|r[0-9]{1,2})$")
NETNS_DIR = Path("/run/netns")   # where `ip netns add` bind-mounts named namespaces
MAX_ROUTERS = 40  # NAT groups per run: router WAN addresses .250 down to .211, LANs 192.168.100-139.0/24
MAX_HOSTS = 200  # addresses .10 .. .209 of the run's /24
NEEDS = "testbed needs root and iproute2 (ip netns, tc)"

# tc's unit suffixes for bit rates. Byte-rate suffixes ("mbps" is *megabytes* to tc) are refused
# on purpose: a spec that says "100mbps" almost always means megabits, and tc would read it as 8x.
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*$")
MIN_RATE_BPS = 64_000
MAX_RATE_BPS = 100 * 10**9


class TestbedError(FusionError):
    """A testbed command failed on a machine that otherwise has what the testbed needs."""

    __test__ = False  # not a pytest test class, despite the name


def parse_rate(text: str) -> int:
    """Parse a tc-style bit rate ("10mbit", "1gbit", "500kbit", "8000000bit") into bits per second.

    Raises ConfigError for byte units, unknown units, and rates outside [64 kbit/s, 100 gbit/s].
    """
    m = _RATE_RE.match(text.lower())
    if m is None:
        raise ConfigError(f"rate {text!r}: expected a number and a unit such as '10mbit' or '1gbit'")
    unit = m.group(2) or "bit"
    if unit not in _RATE_UNITS:
        hint = " (tc reads 'bps' as bytes per second; write e.g. '100mbit')" if unit.endswith("bps") else ""
        raise ConfigError(f"rate {text!r}: unknown unit {unit!r}; use bit, kbit, mbit, gbit{hint}")
    bps = round(float(m.group(1)) * _RATE_UNITS[unit])
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise ConfigError(f"rate {text!r}: must be between 64kbit and 100gbit")
    return bps


def format_rate(bps: int) -> str:
    """Human form of a bit rate: 1000000000 -> '1gbit', 20000000 -> '20mbit', 1500 -> '1500bit'."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bps % _RATE_UNITS[unit] == 0:
            return f"{bps // _RATE_UNITS[unit]}{unit}"
    return f"{bps}bit"


@dataclass(frozen=True, kw_only=True, slots=True)
class TbfParams:
    """The arguments of one ``tc ... tbf`` qdisc."""

    rate_bps: int
    burst_bytes: int
    latency_ms: int

    def argv(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(self.burst_bytes), "latency", f"{self.latency_ms}ms"]


# A token bucket can only pass one packet per refill if ``burst`` is smaller than what the rate
# earns between two timer wake-ups, so at high rates it undershoots. veth hands tbf GSO super-packets
# of up to 64 KiB (segmented if bigger than burst, which costs CPU), hence the 64 KiB floor; above
# that, ``burst`` is the bytes the rate earns in 2 ms, which measured within a few % of the shaped
# rate from 10 mbit to 10 gbit on this kernel (docs/testbed.md). ``latency`` bounds the queue:
# 50 ms of data at the rate, like a modest home-router buffer.
_BURST_FLOOR = 64 * 1024
_BURST_WINDOW_S = 0.002
_LATENCY_MS = 50


def tbf_params(rate_bps: int) -> TbfParams:
    """The tbf parameters used for a link of ``rate_bps`` (see the comment above for why)."""
    burst = max(_BURST_FLOOR, round(rate_bps / 8 * _BURST_WINDOW_S))
    return TbfParams(rate_bps=rate_bps, burst_bytes=burst, latency_ms=_LATENCY_MS)


@dataclass(frozen=True, kw_only=True, slots=True)
class HostLink:
    """One host's place in the layout: its namespace, address and (optional) shaped rates; a host behind
    a NAT router has the router's namespace and LAN gateway (its address is then a private one)."""

    index: int
    namespace: str
    address: str
    up_bps: int | None
    down_bps: int | None
    router: str = ""      # the NAT router's namespace ("": on the public bridge)
    gateway: str = ""     # the router's LAN address (the host's default route)


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterLink:
    """A NAT router: one namespace with a WAN leg on the public bridge and a LAN bridge for its hosts,
    forwarding LAN -> WAN with iptables MASQUERADE (nothing is forwarded in: no port is open)."""

    index: int
    group: str
    namespace: str
    wan_address: str      # on the public /24
    lan_prefix: str       # "192.168.<100 + index>"
    drop_inbound: bool = False   # unsolicited TCP SYNs from the WAN are dropped, not answered with a reset


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Names and addresses of one run. Build it with :func:`make_layout`."""

    run: str
    bridge_ns: str
    octet: int
    hosts: tuple[HostLink, ...]
    routers: tuple[RouterLink, ...] = ()

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Host namespaces first, then routers, bridge last: the order teardown uses (processes live in hosts)."""
        return (*(h.namespace for h in self.hosts), *(r.namespace for r in self.routers), self.bridge_ns)


def check_run_name(run: str) -> str:
    if not _RUN_RE.match(run):
        raise ConfigError(f"testbed name {run!r}: expected 'fp2p-' and 6 hex digits, e.g. fp2p-1a2b3c")
    return run


def make_layout(run: str, octet: int, rates: Sequence[tuple[int | None, int | None]],
                nats: Sequence[str] | None = None, *, drop_inbound: bool = False) -> Layout:
    """Lay out ``len(rates)`` hosts for run ``run`` on ``10.77.<octet>.0/24``; rates are (up, down).
    ``nats[i]`` names the NAT group of host i ("" for a public host): each group gets a router and a
    private LAN ``192.168.<100 + k>.0/24`` where the host keeps its index as ``.<10 + i>``."""
    check_run_name(run)
    if not 0 <= octet <= 255:
        raise ConfigError("subnet octet must be in 0..255")
    if not 1 <= len(rates) <= MAX_HOSTS:
        raise ConfigError(f"a testbed has 1..{MAX_HOSTS} hosts, got {len(rates)}")
    groups = list(dict.fromkeys(g for g in (nats or ()) if g))
    if len(groups) > MAX_ROUTERS:
        raise ConfigError(f"a testbed has at most {MAX_ROUTERS} NAT groups, got {len(groups)}")
    routers = tuple(RouterLink(index=k, group=g, namespace=f"{run}-r{k}", wan_address=f"10.77.{octet}.{250 - k}",
                               lan_prefix=f"192.168.{100 + k}", drop_inbound=drop_inbound)
                    for k, g in enumerate(groups))
    by_group = {r.group: r for r in routers}
    hosts = []
    for i, (up, down) in enumerate(rates):
        r = by_group.get((nats or [""] * len(rates))[i] or "\0")
        hosts.append(HostLink(index=i, namespace=f"{run}-h{i}", up_bps=up, down_bps=down,
                              address=f"{r.lan_prefix}.{10 + i}" if r else f"10.77.{octet}.{10 + i}",
                              router=r.namespace if r else "", gateway=f"{r.lan_prefix}.1" if r else ""))
    return Layout(run=run, bridge_ns=f"{run}-br", octet=octet, hosts=tuple(hosts), routers=routers)


def plan_commands(layout: Layout) -> list[list[str]]:
    """Every ``ip``/``tc`` command (argv) that builds ``layout``, in order. Pure."""
    br = layout.bridge_ns
    cmds: list[list[str]] = [["ip", "netns", "add", br]]
    cmds += [["ip", "netns", "add", h.namespace] for h in layout.hosts]
    cmds += [["ip", "netns", "add", r.namespace] for r in layout.routers]
    cmds += [
        ["ip", "-n", br, "link", "set", "lo", "up"],
        ["ip", "-n", br, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", br, "link", "set", "br0", "up"],
    ]
    for r in layout.routers:
        rn, lan = r.namespace, f"{r.lan_prefix}.0/24"
        cmds += [
            # WAN leg on the public bridge, a LAN bridge for the group's hosts, and address translation
            ["ip", "-n", br, "link", "add", f"r{r.index}", "type", "veth", "peer", "name", "wan0", "netns", rn],
            ["ip", "-n", br, "link", "set", f"r{r.index}", "master", "br0"],
            ["ip", "-n", br, "link", "set", f"r{r.index}", "up"],
            ["ip", "-n", rn, "link", "set", "lo", "up"],
            ["ip", "-n", rn, "addr", "add", f"{r.wan_address}/24", "dev", "wan0"],
            ["ip", "-n", rn, "link", "set", "wan0", "up"],
            ["ip", "-n", rn, "link", "add", "lan0", "type", "bridge"],
            ["ip", "-n", rn, "addr", "add", f"{r.lan_prefix}.1/24", "dev", "lan0"],
            ["ip", "-n", rn, "link", "set", "lan0", "up"],
            ["ip", "netns", "exec", rn, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
            ["ip", "netns", "exec", rn, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", lan, "-o", "wan0",
             "-j", "MASQUERADE"],
            # Like a home router's firewall: a packet conntrack calls INVALID (e.g. out of its TCP window
            # tracking under a shaped queue) is dropped, not handed to the router's own stack, which would
            # answer it with a reset; and window tracking is liberal (after the rule above: it loads
            # conntrack into the namespace).
            ["ip", "netns", "exec", rn, "iptables", "-A", "INPUT", "-m", "conntrack", "--ctstate", "INVALID",
             "-j", "DROP"],
            ["ip", "netns", "exec", rn, "iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID",
             "-j", "DROP"],
            ["ip", "netns", "exec", rn, "sysctl", "-q", "-w", "net.netfilter.nf_conntrack_tcp_be_liberal=1"],
        ]
        if r.drop_inbound:
            # a connection attempt from outside that no mapping forwards is dropped, not reset (a new SYN
            # that matches a mapping is forwarded before INPUT: TCP hole punching gets through)
            cmds += [["ip", "netns", "exec", rn, "iptables", "-A", "INPUT", "-i", "wan0", "-p", "tcp", "--syn",
                      "-j", "DROP"]]
    for h in layout.hosts:
        port, ns = f"p{h.index}", h.namespace
        up_ns, master = (h.router, "lan0") if h.router else (br, "br0")   # where the host's port lives
        cmds += [
            # Created inside the bridge (or router) namespace, peer moved directly into the host namespace.
            ["ip", "-n", up_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns],
            ["ip", "-n", up_ns, "link", "set", port, "master", master],
            ["ip", "-n", up_ns, "link", "set", port, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{h.address}/24", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
        ]
        if h.gateway:
            cmds.append(["ip", "-n", ns, "route", "add", "default", "via", h.gateway])
        if h.up_bps is not None:
            cmds.append(["tc", "-n", ns, "qdisc", "replace", "dev", "eth0", "root", *tbf_params(h.up_bps).argv()])
        if h.down_bps is not None:
            cmds.append(["tc", "-n", up_ns, "qdisc", "replace", "dev", port, "root", *tbf_params(h.down_bps).argv()])
    return cmds


def exec_argv(namespace: str, argv: Sequence[str]) -> list[str]:
    """The argv that runs ``argv`` inside ``namespace`` (``ip netns exec``)."""
    if not argv:
        raise ConfigError("empty command")
    return ["ip", "netns", "exec", namespace, *argv]


def run_of(namespace: str) -> str | None:
    """The run a namespace belongs to, or None if it is not one of ours."""
    m = _NS_RE.match(namespace)
    return m.group(1) if m else None


# ---------------------------------------------------------------- the few functions with effects


def check_environment() -> None:
    """Raise ConfigError (one line) unless we are root and ``ip netns`` and ``tc`` work."""
    if os.geteuid() != 0:
        raise ConfigError(f"{NEEDS}: not running as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ConfigError(f"{NEEDS}: '{tool}' not found on PATH (apt-get install iproute2)")
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise ConfigError(f"{NEEDS}: 'ip netns list' failed: {res.stderr.strip()}")


def run_cmd(argv: Sequence[str]) -> str:
    """Run one ip/tc command; raise TestbedError with its stderr if it fails."""
    log.debug("testbed: %s", " ".join(argv))
    res = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise TestbedError(f"'{' '.join(argv)}' failed: {res.stderr.strip() or res.returncode}")
    return res.stdout


def list_namespaces() -> list[str]:
    """Names of all named network namespaces: the entries of /run/netns, where ``ip netns add`` mounts
    them. Not ``ip netns list``: it also asks the kernel for every namespace's id over rtnetlink (two
    round trips per namespace on the machine), which waits behind the kernel's teardown of namespaces
    that were just deleted (``cleanup_net`` holds the rtnl lock while it dismantles their devices) and
    costs seconds on a busy machine with many namespaces: issue 15's slow testbed teardown."""
    try:
        return sorted(e.name for e in os.scandir(NETNS_DIR))
    except FileNotFoundError:
        return []


def namespace_pids(namespace: str) -> list[int]:
    """PIDs of the processes living in ``namespace`` (empty if it is gone)."""
    return pids_by_namespace([namespace])[namespace]


def pids_by_namespace(namespaces: Sequence[str]) -> dict[str, list[int]]:
    """The processes living in each of ``namespaces``, from one scan of /proc: a process is in a named
    namespace when its ``/proc/PID/ns/net`` is the same nsfs inode as ``/run/netns/NAME`` (what
    ``ip netns pids`` checks, one subprocess and one scan per namespace)."""
    out: dict[str, list[int]] = {ns: [] for ns in namespaces}
    want: dict[tuple[int, int], str] = {}
    for ns in namespaces:
        try:
            st = os.stat(NETNS_DIR / ns)
        except OSError:
            continue
        want[(st.st_dev, st.st_ino)] = ns
    if not want:
        return out
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:   # gone meanwhile, a kernel thread, or not ours to see
            continue
        found = want.get((st.st_dev, st.st_ino))
        if found is not None:
            out[found].append(int(entry.name))
    return out


def delete_namespace(namespace: str, *, timeout: float = 10.0) -> None:
    """SIGKILL whatever still runs in ``namespace`` (only ever ours), wait until it is gone, and
    delete the namespace; idempotent. See :func:`delete_namespaces`."""
    delete_namespaces([namespace], timeout=timeout)


def delete_namespaces(namespaces: Sequence[str], *, timeout: float = 10.0) -> None:
    """SIGKILL whatever still runs in ``namespaces`` (only ever ours), wait until all of it is gone
    (one deadline for all), and delete the namespaces; idempotent.

    All at once: one scan of /proc finds every process (:func:`pids_by_namespace`), every one is
    killed before any is waited for, and the wait uses pidfds (readable once the process has exited),
    so it needs no polling and works for processes that are not our children (e.g. left behind by a
    testbed whose creator was killed). Deleting a namespace destroys the veth ends in it, and a
    veth's peer goes with it.
    """
    for ns in namespaces:
        if run_of(ns) is None:
            raise ConfigError(f"refusing to delete namespace {ns!r}: not a testbed namespace")
    fds: list[int] = []
    try:
        for pids in pids_by_namespace(namespaces).values():
            for pid in pids:
                try:
                    fd = os.pidfd_open(pid)  # pins this process: no pid-reuse race before the kill
                except ProcessLookupError:
                    continue
                fds.append(fd)
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
        _wait_exited(fds, timeout)
    finally:
        for fd in fds:
            os.close(fd)
    errors = []
    for ns in namespaces:
        res = subprocess.run(["ip", "netns", "delete", ns], capture_output=True, text=True, check=False)
        if res.returncode != 0 and (NETNS_DIR / ns).exists():
            errors.append(f"could not delete namespace {ns}: {res.stderr.strip()}")
    if errors:
        raise TestbedError("; ".join(errors))


def _wait_exited(pidfds: Sequence[int], timeout: float) -> None:
    """Wait until every pidfd reports its process exited; TestbedError after ``timeout`` seconds."""
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    pending = set(pidfds)
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TestbedError(f"{len(pending)} killed testbed processes did not exit within {timeout:g} s")
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            pending.discard(fd)


# ---------------------------------------------------------------- CPU caps (heterogeneous compute)

# A host's ``cpus`` becomes a CFS quota on a cgroup named like its namespace. cgroup v1 (a ``cpu``
# hierarchy, as on this machine) and v2 (``cpu`` enabled in the root's subtree_control) both work.
_CG_V1 = Path("/sys/fs/cgroup/cpu")
_CG_V2 = Path("/sys/fs/cgroup")
_CFS_PERIOD_US = 100_000


def cpu_cgroup_root() -> tuple[Path, int] | None:
    """Where CPU-capped cgroups can be made, and the cgroup version; None if nowhere."""
    if (_CG_V1 / "cpu.cfs_quota_us").exists() and os.access(_CG_V1, os.W_OK):
        return _CG_V1, 1
    ctl = _CG_V2 / "cgroup.subtree_control"
    if ctl.exists() and "cpu" in ctl.read_text().split() and os.access(_CG_V2, os.W_OK):
        return _CG_V2, 2
    return None


def cfs_quota_us(cpus: float) -> int:
    """The CFS quota per 100 ms period that allows ``cpus`` cores (at least 1 ms, the kernel minimum)."""
    return max(1000, round(cpus * _CFS_PERIOD_US))


def make_cpu_cgroup(namespace: str, cpus: float) -> Path:
    """Create the cgroup for ``namespace`` capped at ``cpus`` cores; return its ``cgroup.procs``."""
    if run_of(namespace) is None:
        raise ConfigError(f"not a testbed namespace: {namespace!r}")
    found = cpu_cgroup_root()
    if found is None:
        raise ConfigError("a host's 'cpus' needs a writable cgroup cpu controller (/sys/fs/cgroup); remove 'cpus' or run on the host")
    root, version = found
    path = root / namespace
    path.mkdir(exist_ok=True)
    quota = cfs_quota_us(cpus)
    if version == 1:
        (path / "cpu.cfs_period_us").write_text(str(_CFS_PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (path / "cpu.max").write_text(f"{quota} {_CFS_PERIOD_US}")
    return path / "cgroup.procs"


def in_cgroup_argv(procs: Path, argv: Sequence[str]) -> list[str]:
    """argv that joins the cgroup whose ``cgroup.procs`` is ``procs``, then execs ``argv`` (same PID)."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *argv]


def remove_cpu_cgroups(run: str) -> None:
    """Remove the (empty, once the run's processes are dead) cgroups of ``run``; idempotent."""
    found = cpu_cgroup_root()
    if found is None:
        return
    for d in found[0].glob(f"{run}-h*"):
        if run_of(d.name) == run and d.is_dir():
            try:
                d.rmdir()
            except OSError as e:
                log.warning("testbed: could not remove cgroup %s: %s", d, e)


# ---------------------------------------------------------------- processes started in the testbed

_HISTORY = 10_000  # stdout lines kept per process for drain_stdout()


class Proc:
    """A process the testbed started: stdout by line with deadlines, stop by process group.

    With ``pipe_stdout`` a reader thread copies stdout to ``<label>.out`` and a queue (the pipe never
    fills up); otherwise stdout goes straight to the file, so the process can outlive us, and
    :meth:`read_line` follows the file. stderr always goes to ``<label>.err``.
    """

    def __init__(self, popen: subprocess.Popen[bytes], *, label: str, out_path: Path, err_path: Path) -> None:
        self.popen = popen
        self.label = label
        self.out_path = out_path
        self.err_path = err_path
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._history: deque[str] = deque(maxlen=_HISTORY)
        self._offset = 0  # file-following position when stdout is not piped
        self._reader: threading.Thread | None = None
        if popen.stdout is not None:
            self._reader = threading.Thread(target=self._pump, name=f"testbed-{label}", daemon=True)
            self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        with self.popen.stdout as src, open(self.out_path, "ab") as copy:
            for raw in src:
                copy.write(raw)
                copy.flush()
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                self._history.append(line)
                self._lines.put(line)
        self._lines.put(None)

    def _next_line(self, remaining: float) -> str | None:
        """The next stdout line; None at EOF; raises queue.Empty when ``remaining`` runs out."""
        if self._reader is not None:
            return self._lines.get(timeout=max(remaining, 0.0))
        # Detached output: follow the file. Polling is the only option once the pipe is not ours.
        deadline = time.monotonic() + remaining
        while True:
            with open(self.out_path, "rb") as f:
                f.seek(self._offset)
                raw = f.readline()
            if raw.endswith(b"\n"):
                self._offset += len(raw)
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                self._history.append(line)
                return line
            if self.popen.poll() is not None:
                return None
            if time.monotonic() >= deadline:
                raise queue.Empty
            time.sleep(0.05)

    def read_line(self, timeout: float, match: Callable[[str], bool] | None = None) -> str:
        """Return the next stdout line (that satisfies ``match``) within ``timeout`` seconds.

        Raises TestbedError if the process ends first or the deadline passes; the message names the
        stderr log, which is where the reason usually is.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._next_line(deadline - time.monotonic())
            except queue.Empty:
                raise TestbedError(f"{self.label}: no output line within {timeout:g} s (stderr: {self.err_path})") from None
            if line is None:
                rc = self.popen.wait()
                raise TestbedError(f"{self.label} exited with status {rc} before printing it (stderr: {self.err_path})")
            if match is None or match(line):
                return line

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit; raises TestbedError after ``timeout`` seconds."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TestbedError(f"{self.label} still running after {timeout:g} s") from None

    def drain_stdout(self) -> str:
        """All stdout lines seen so far (after the process ended: all of them), newline-joined."""
        if self._reader is not None and self.popen.poll() is not None:
            self._reader.join(timeout=5.0)
        return "\n".join(self._history)

    def signal_group(self, sig: int) -> None:
        # poll() is None means the child is not yet reaped, so its pid (= pgid) is still ours.
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, grace: float = 5.0) -> int:
        """SIGTERM the process group, SIGKILL it after ``grace`` s; return the exit status."""
        stop_all([self], grace=grace)
        return self.popen.wait()


def spawn_process(argv: Sequence[str], *, label: str, env: Mapping[str, str], logdir: Path, pipe_stdout: bool) -> Proc:
    """Start ``argv`` in a new session with stdout/stderr logged under ``logdir``."""
    logdir.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
    out_path, err_path = logdir / f"{safe}.out", logdir / f"{safe}.err"
    with open(err_path, "ab") as err, open(out_path, "ab") as out:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipe_stdout else out,
            stderr=err,
            env=dict(env),
            start_new_session=True,
        )
    log.debug("testbed: started %s (pid %d): %s", label, popen.pid, " ".join(argv))
    return Proc(popen, label=label, out_path=out_path, err_path=err_path)


def stop_all(procs: Sequence[Proc], *, grace: float) -> None:
    """SIGTERM every process group at once, wait up to ``grace`` s in total, SIGKILL the rest.

    Signalling all first means N nodes leave in parallel rather than in N x grace seconds.
    """
    for p in procs:
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.popen.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            log.warning("testbed: %s did not stop within %g s; killing it", p.label, grace)
            p.signal_group(signal.SIGKILL)
            p.popen.wait()
    # Children a leader left behind are not signalled by pgid once the leader is reaped (its number
    # could name someone else's group by then); they are still in our namespace, and
    # delete_namespace() kills everything there.
