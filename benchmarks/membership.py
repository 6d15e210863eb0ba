"""Time for N node processes to converge on a full membership view and a full bandwidth matrix.

Starts a bootstrap and N ``fusionp2p node`` processes on loopback (real processes, real libp2p), then
watches the bootstrap's view (the VIEW protocol, every record verified) until it lists all N nodes
alive and every pair has a direct bandwidth measurement. Two clocks are reported: from spawning the
processes (includes Python + torch start-up and the device benchmark of every node on 2 shared cores)
and from the moment the last node printed its listen address (the protocol's own convergence time).
A node now listens and joins before it imports torch and runs its device benchmark (issue 40: its
record carries no profile until then), so "after listen" overlaps them (20 processes on 2 cores: some 60
CPU-seconds); the protocol's own convergence is timed from the moment the bootstrap's view first holds
all N nodes.
`--start` times only one node's start to listening (5 in turn, with the CPU-seconds it spent until then:
imports, identity, libp2p host), issue 40's 2 s target on an idle machine.
Headline (issue 40's wording): the time from the last node's listen address until every pair the planner
needs measured has a direct measurement, for the last size run (20 by default), target 15 s. Those pairs:
a node measures its links to the ``probe.peers`` (24) members it chose (``membership.probes_of``), and the
planner estimates the other pairs from the nodes' announced capacities; so the pairs it needs measured are
those some node chose, which at most ``probe.peers`` + 1 = 25 nodes is every pair (at 20 the headline is
the old "every pair measured" one). The table also shows the time until the members are all in view,
until every pair has a figure (measured or estimated), until every pair is measured, and the time after
all members joined (the headline before 2026-11-29); beside each, the CPU-seconds the processes spent
from the last listen until then, a steadier figure than the times on a shared machine.
`--preload` (a variant for a small machine's sake, written beside the default as ``membership_preload.json``, never
instead of it): every node process forked from one forkserver that imported torch and the node's modules once
(``cli/forked.py``, as ``LocalCluster(preload=True)``, ``make demo`` and ``benchmarks.churn --preload`` do), so
20 emulated machines on 2 cores do not pay 20 torch imports on the same 2 cores; the forkserver's own CPU is
counted in the processes' (the nodes are its children, not ours: their CPU is read from ``/proc`` at the end).
`--probe-cost` times one probe session between two libp2p hosts in this process (both sides' CPU: open
and pings, a first probe on the stream, one on a raw socket to the data plane), the unit cost of the
matrix.
"""

from __future__ import annotations

import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from benchmarks._common import RESULTS, headline, parser, write
from fusionp2p.cli.forked import Forked
from fusionp2p.cli.forked import server_pid as forked_server_pid
from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport
from fusionp2p.swarm.membership import BandwidthTable, probes_of
from fusionp2p.swarm.node import fetch_view
from fusionp2p.swarm.probe import ProbeConfig
from fusionp2p.wire.records import BandwidthReport, NodeRecord

CLI = [sys.executable, "-m", "fusionp2p.cli"]
POLL = 0.5   # seconds between two looks at the bootstrap's view: the times below are that coarse


def proc_cpu(pid: int) -> float:
    """CPU-seconds (user + system) process *pid* has spent so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:   # utime, stime: fields 14 and 15, after the name
            st = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")


def needed_pairs(nodes: list[str], k: int) -> list[tuple[str, str]]:
    """The pairs of *nodes* that some node measures (``membership.probes_of`` with *k* = ``probe.peers``):
    those the planner needs measured; it estimates the others from capacities. Every pair while
    ``len(nodes) <= k + 1``."""
    return [(a, b) for a in nodes for b in probes_of(a, nodes, k)]


async def watch(addr: str, n: int, timeout: float, cpu: Callable[[], float] = lambda: 0.0
                ) -> tuple[dict[str, float], dict[str, float]]:
    """Poll the bootstrap's view until every pair is measured or *timeout*: the moments reached (trio time
    since the start) and the processes' CPU-seconds (*cpu*) at each of them and at the start (``listen``).

    Moments: ``members`` (all *n* nodes alive), ``profiles`` (all of them announce a device profile: their
    start-up done, which waits for their first probes, a job request or ``--defer-startup``), ``needed`` (every pair some node measures has a direct
    measurement: :func:`needed_pairs`), ``estimated`` (every pair has a figure, measured or estimated from
    the nodes' capacities), ``measured`` (every pair measured directly). A moment not reached is absent.
    The CPU dict also holds ``needed_measured`` and ``needed_pairs``: how many of those pairs the last look
    found measured (a run that timed out: how far it got).
    """
    t0 = trio.current_time()
    cpus = {"listen": cpu()}
    times: dict[str, float] = {}
    k = ProbeConfig().peers
    progress = [0, 0]   # needed pairs measured at the last look, and of how many

    def reached(moment: str) -> None:
        if moment not in times:
            times[moment], cpus[moment] = trio.current_time() - t0, cpu()

    async with open_libp2p_transport(Identity.generate(), Libp2pConfig()) as t:
        with trio.move_on_after(timeout):
            while True:   # a bootstrap starved by 20 starting processes can miss one dial's deadline (10 s)
                try:
                    peer = await t.connect(addr)
                    break
                except PeerUnavailable:
                    await trio.sleep(0.5)
            while "measured" not in times:
                try:
                    v = await fetch_view(t, peer, timeout=10)
                except Exception:
                    await trio.sleep(0.2)
                    continue
                alive = set(v["alive"])
                nodes = sorted(r.peer for r in v["records"] if isinstance(r, NodeRecord) and r.role == "node" and r.peer in alive)
                if len(nodes) == n:
                    reached("members")
                    # every node's deferred start-up done (torch, job service, device benchmark: swarm/startup.py)
                    if all(r.profile is not None for r in v["records"] if isinstance(r, NodeRecord) and r.peer in nodes):
                        reached("profiles")
                    table = BandwidthTable()
                    for r in v["bw"]:
                        if isinstance(r, BandwidthReport):
                            table.on_report(r)
                    pairs = needed_pairs(nodes, k)
                    done = sum(table.direct(a, b) is not None for a, b in pairs)
                    # how far a run that times out got (on a shared machine at load 50 the 20-node run did)
                    progress[:] = [done, len(pairs)]
                    if done == len(pairs):
                        reached("needed")
                    if len(table.matrix(nodes)) == n * (n - 1):
                        reached("estimated")
                    if table.complete(nodes):
                        reached("measured")
                # polling another process's state; each poll is a new stream and a whole view for the bootstrap
                # to encode (at 0.2 s: 6% of its profile while 10 nodes formed, 2026-11-29), so not too often
                await trio.sleep(POLL)
    cpus["needed_measured"], cpus["needed_pairs"] = progress
    return times, cpus


def read_line(fd: int, timeout: float = 120.0) -> str:
    """One line from a forked node's stdout pipe (unbuffered reads: its listen address)."""
    buf, deadline = b"", time.monotonic() + timeout
    while b"\n" not in buf and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 4096) if ready else b""
        if ready and not chunk:
            break
        buf += chunk
    return buf.split(b"\n", 1)[0].decode()


def run_one(n: int, timeout: float, log_dir: str | None = None, preload: bool = False) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[str] | Forked] = []
    logs: list[Any] = []
    level = "debug" if log_dir else "warning"
    # our debug log in the log dir; py-libp2p's (in each node's temporary home, deleted at the end) at INFO: at
    # DEBUG it was ~20% of a node's event-loop samples while the swarm probed (py-spy, 2026-11-30)
    quiet = ["--libp2p-log-level", "info"]

    def err(name: str) -> Any:
        if not log_dir:
            return subprocess.DEVNULL
        os.makedirs(log_dir, exist_ok=True)
        logs.append(open(os.path.join(log_dir, f"n{n}-{name}.log"), "w"))  # noqa: SIM115
        return logs[-1]

    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            t_spawn = time.monotonic()
            boot = subprocess.Popen([*CLI, "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--home", f"{tmp}/boot",
                                     "--log-level", level, *quiet],
                                    stdout=subprocess.PIPE, stderr=err("boot"), text=True, env=env)
            procs.append(boot)
            assert boot.stdout is not None
            addr = boot.stdout.readline().strip()
            for i in range(n):
                argv = ["node", "--bootstrap", addr, "--listen", "/ip4/127.0.0.1/tcp/0", "--home", f"{tmp}/n{i}",
                        "--torch-threads", "1", "--log-level", level, *quiet]
                if preload:   # forked from the pre-imported forkserver (started by the first Forked)
                    log = os.path.join(log_dir, f"n{n}-node{i}.log") if log_dir else os.devnull
                    procs.append(Forked(argv, {"OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": env.get("MALLOC_ARENA_MAX", "1")},
                                        Path(log)))
                else:
                    procs.append(subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=err(f"node{i}"),
                                                  text=True, env=env))
            for p in procs[1:]:
                if isinstance(p, Forked):
                    read_line(p.stdout.fileno())
                else:
                    assert p.stdout is not None
                    p.stdout.readline()
            t_listen = time.monotonic()

            def cpu_now() -> float:
                server = forked_server_pid() if preload else None
                return sum(proc_cpu(p.pid) for p in procs) + (proc_cpu(server) if server else 0.0)
            times, cpus = trio.run(watch, addr, n, timeout, cpu_now)
            forked_cpu = sum(proc_cpu(p.pid) for p in procs if isinstance(p, Forked))   # not our children
            server = forked_server_pid() if preload else None
            forked_cpu += proc_cpu(server) if server else 0.0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
            for f in logs:
                f.close()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    # the CPU the bootstrap and the nodes spent, start-up included: on a shared machine a steadier figure
    # than the wall times, which stretch with everyone else's load
    cpu = ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime + (forked_cpu if preload else 0.0)
    t_members, t_matrix = times.get("members"), times.get("measured")
    needed_measured, needed_of = int(cpus.pop("needed_measured")), int(cpus.pop("needed_pairs"))
    return {"n": n, "preload": preload, "processes_cpu_s": cpu, "spawn_to_listen_s": t_listen - t_spawn, "members_after_listen_s": t_members,
            "needed_after_listen_s": times.get("needed"), "needed_measured": needed_measured, "needed_pairs": needed_of,
            "profiles_after_listen_s": times.get("profiles"),
            "matrix_after_members_s": None if t_matrix is None or t_members is None else t_matrix - t_members,
            "estimated_matrix_after_listen_s": times.get("estimated"),
            "matrix_after_listen_s": t_matrix, "members_after_spawn_s": None if t_members is None else t_members + t_listen - t_spawn,
            "matrix_after_spawn_s": None if t_matrix is None else t_matrix + t_listen - t_spawn,
            # the processes' CPU-seconds from the last listen until each moment (the work the convergence
            # cost; on a shared machine a steadier figure than the times)
            **{f"cpu_listen_to_{k}_s": v - cpus["listen"] for k, v in cpus.items() if k != "listen"}}


def start_times(runs: int) -> list[dict[str, float]]:
    """One ``fusionp2p node`` at a time against a bootstrap: seconds from spawning it to its listen address,
    and the CPU-seconds it spent until then (imports, identity, libp2p host; issue 40's target: 2 s idle)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        boot = subprocess.Popen([*CLI, "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--home", f"{tmp}/boot"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        try:
            assert boot.stdout is not None
            addr = boot.stdout.readline().strip()
            for i in range(runs):
                t0 = time.monotonic()
                p = subprocess.Popen([*CLI, "node", "--bootstrap", addr, "--listen", "/ip4/127.0.0.1/tcp/0", "--home",
                                      f"{tmp}/n{i}", "--torch-threads", "1", "--log-level", "warning"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
                assert p.stdout is not None
                p.stdout.readline()
                wall = time.monotonic() - t0
                cpu = proc_cpu(p.pid)
                out.append({"start_to_listen_s": wall, "cpu_s": cpu, "load": os.getloadavg()[0]})
                print(f"node {i}: listening {wall:.2f} s after its start, {cpu:.2f} CPU-s (load {out[-1]['load']:.1f})")
                p.terminate()
                p.wait(timeout=20)
        finally:
            boot.terminate()
            boot.wait(timeout=20)
    return out


async def probe_cost(runs: int) -> list[dict[str, Any]]:
    """CPU-seconds (both sides: one process) and wall seconds of one probe session between two libp2p hosts
    on loopback, median of *runs*: open and pings only; a first probe on the stream (a pilot of
    ``probe.bytes`` and its sized follow-up, as before a node's data plane listens); the same on a raw
    socket to the data plane's port (both directions timed)."""
    from fusionp2p.net.bulk import open_data_plane
    from fusionp2p.swarm.probe import ProbeServer, open_probe
    from fusionp2p.wire.protocols import PROBE

    pilot = ProbeConfig().bytes
    out = []
    async with open_libp2p_transport(Identity.generate(), Libp2pConfig()) as a, \
            open_libp2p_transport(Identity.generate(), Libp2pConfig()) as b, \
            open_data_plane(a, listen_host="127.0.0.1") as da, open_data_plane(b, listen_host="127.0.0.1") as db:
        server = ProbeServer()
        server.raw = db
        b.set_stream_handler(PROBE, server)
        await a.connect(b.listen_addrs()[0])
        for case, raw in (("open + pings", None), ("first probe, stream", None), ("first probe, raw socket", da),
                          ("open + 1 ping", None), ("raw socket, 1 ping", da)):
            cpu, wall, sent = [], [], 0
            for _ in range(runs):
                c0, t0 = time.process_time(), time.perf_counter()
                with trio.fail_after(30):
                    session = await open_probe(a, b.peer_id, pings=1 if "1 ping" in case else 3)
                    try:
                        if not case.startswith("open + "):
                            sent = (await session.measure(pilot, raw=raw)).sent
                    finally:
                        await session.aclose()
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - t0)
                await trio.sleep(0.05)   # the server's side of the stream ends before the next
            out.append({"case": case, "cpu_ms": 1e3 * sorted(cpu)[runs // 2], "wall_ms": 1e3 * sorted(wall)[runs // 2],
                        "bytes": sent, "load": os.getloadavg()[0]})
            print(f"{case:>24}: {out[-1]['cpu_ms']:6.1f} CPU-ms (both sides), {out[-1]['wall_ms']:6.1f} ms, "
                  f"{sent} bytes (load {out[-1]['load']:.1f})")
    return out


def main() -> None:
    ap = parser("membership", __doc__)
    ap.add_argument("--sizes", default=None, help="comma-separated N (default 4,8,16,20; --quick: 4,8)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for convergence per size")
    ap.add_argument("--log-dir", default=None, help="keep every process's debug log (stderr) in this directory")
    ap.add_argument("--start", action="store_true", help="only time one node's start to listening, 5 times in turn")
    ap.add_argument("--preload", action="store_true",
                    help="fork every node from one pre-imported forkserver (a variant, written beside the default)")
    ap.add_argument("--probe-cost", action="store_true", help="only time one probe session's CPU (median of 21)")
    args = ap.parse_args()
    if args.probe_cost:
        rows = trio.run(probe_cost, 21)
        write("membership_probe", args.out.with_name("membership_probe.json"), rows,
              # the target: a tenth of the 30 CPU-seconds two cores give in the 15 s of the main headline
              headline("CPU-seconds of a 20-node matrix's 190 first probes (190 x one first probe on the stream, "
                       "both sides)", 190 * rows[1]["cpu_ms"] / 1e3, "CPU-s", 3.0, "lower",
                       f"per probe: open + pings {rows[0]['cpu_ms']:.1f} CPU-ms, first probe on the stream "
                       f"{rows[1]['cpu_ms']:.1f}, on a raw socket {rows[2]['cpu_ms']:.1f} (with one ping, as the "
                       f"prober opens when it has a raw socket: {rows[4]['cpu_ms']:.1f}; open + 1 ping "
                       f"{rows[3]['cpu_ms']:.1f})"),
              quick=args.quick)
        return
    if args.start:
        rows = start_times(5)
        med = sorted(r["start_to_listen_s"] for r in rows)[len(rows) // 2]
        write("membership_start", args.out.with_name("membership_start.json"), rows,
              headline("a node's start to listening (median of 5)", med, "s", 2.0, "lower",
                       f"CPU-s until listening: median {sorted(r['cpu_s'] for r in rows)[len(rows) // 2]:.2f}"),
              quick=args.quick)
        return
    if args.preload and args.out.parent == RESULTS and args.out.stem.startswith("membership"):
        args.out = args.out.with_name(args.out.stem + "_preload.json")   # beside the default figure, never over it
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else ([4, 8] if args.quick else [4, 8, 16, 20])
    rows = []

    def f(x: float | None) -> str:
        return "timeout" if x is None else f"{x:.1f}"

    print("after the last listen, seconds (CPU-seconds of all the processes until then):")
    print(f"{'N':>4} {'spawn->listen':>14} {'members':>16} {'needed measured':>16} {'all estimated':>16} "
          f"{'all measured':>16} {'after members':>14}")
    for n in sizes:
        r = run_one(n, timeout=args.timeout, log_dir=args.log_dir, preload=args.preload)
        rows.append(r)
        cells = [f"{f(r[t])} ({f(r.get(c))})".rjust(16) for t, c in (
            ("members_after_listen_s", "cpu_listen_to_members_s"), ("needed_after_listen_s", "cpu_listen_to_needed_s"),
            ("estimated_matrix_after_listen_s", "cpu_listen_to_estimated_s"),
            ("matrix_after_listen_s", "cpu_listen_to_measured_s"))]
        print(f"{n:>4} {r['spawn_to_listen_s']:>14.1f} {' '.join(cells)} {f(r['matrix_after_members_s']):>14}"
              f"   (all processes, start to end: {r['processes_cpu_s']:.0f} CPU-s)")
    big = rows[-1]
    # not converged: report the deadline itself (JSON has no infinity), flagged in the results
    value = big["needed_after_listen_s"] if big["needed_after_listen_s"] is not None else args.timeout
    write("membership", args.out, rows,
          headline(f"{big['n']} processes: every pair the planner needs measured (those some node probes; every pair "
                   f"up to {ProbeConfig().peers + 1} nodes), seconds after the last one listened"
                   + (" (nodes forked from one pre-imported forkserver)" if args.preload else ""),
                   value, "s", 15.0, "lower",
                   "absolute time; after listen overlaps each node's torch import and device benchmark; the same run "
                   "reports all pairs measured, the time after all members joined (the headline before 2026-11-29) "
                   "and the processes' CPU-seconds until each moment"), quick=args.quick)


if __name__ == "__main__":
    main()
