"""The ``fusionp2p`` command: bootstrap, node, status, testbed, demo, job.

User mistakes end with one line on stderr and exit status 2; nothing here prints a traceback for
them. Logging handlers are configured here and only here (STYLE.md 17): our own loggers go to
stderr, py-libp2p's (noisy at ERROR for routine events) to ``<home>/libp2p.log``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fusionp2p.errors import ConfigError, FusionError, PeerUnavailable, leaf_errors

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger("fusionp2p.cli")


def _data_home() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "fusionp2p"


def setup_logging(level: str, libp2p_log: Path | None) -> None:
    # --log-level applies to our loggers; third-party ones (multiaddr logs every parse at DEBUG) stay at WARNING
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("fusionp2p").setLevel(getattr(logging, level.upper(), logging.INFO))
    lp = logging.getLogger("libp2p")
    for h in list(lp.handlers):
        lp.removeHandler(h)
    lp.propagate = False
    if libp2p_log is not None:
        libp2p_log.parent.mkdir(parents=True, exist_ok=True)
        h = logging.FileHandler(libp2p_log)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        lp.addHandler(h)
        lp.setLevel(logging.DEBUG if level == "debug" else logging.INFO)   # --log-level debug: py-libp2p's too
    else:
        lp.setLevel(logging.CRITICAL)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


_HTTP_HELP = ("serve a live dashboard, /api/... JSON and Prometheus /metrics, read-only, at ADDR: PORT (loopback) "
              "or HOST:PORT, e.g. 9100 or 0.0.0.0:9100 (port 0: any free port; the URL is printed). Off by default")

_GOSSIP_RATE_HELP = ("swarm-wide heartbeat messages per second: a node's heartbeat period stretches to "
                     "members / rate when that is longer than --heartbeat (default 5)")


_RELAY_RATE_HELP = "MB/s that relayed circuits may move together at most (default 10; other limits: docs/security.md)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fusionp2p", description="Peer-to-peer decentralized training node.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("bootstrap", help="run a bootstrap node (DHT server, no training)")
    b.add_argument("--listen", action="append", default=None, help="multiaddr to listen on (default /ip4/0.0.0.0/tcp/4001)")
    b.add_argument("--announce-addr", action="append", default=[], help="public multiaddr to announce")
    b.add_argument("--bootstrap", action="append", default=[], help="other bootstrap nodes to peer with")
    b.add_argument("--home", default=None, help="directory for the identity key and logs")
    b.add_argument("--gossip-rate", type=float, default=5.0, help=_GOSSIP_RATE_HELP)
    b.add_argument("--http", default=None, metavar="ADDR", help=_HTTP_HELP)
    b.add_argument("--no-relay", action="store_true",
                   help="do not relay connections of nodes that cannot be dialled (circuit relay v2; docs/networking.md)")
    b.add_argument("--relay-rate", type=float, default=10.0, metavar="MB_PER_S", help=_RELAY_RATE_HELP)
    _common(b)

    n = sub.add_parser("node", help="run a training node that joins a swarm")
    n.add_argument("--bootstrap", action="append", required=True, help="full multiaddr of a bootstrap (repeatable)")
    n.add_argument("--listen", action="append", default=None, help="multiaddr to listen on (default /ip4/0.0.0.0/tcp/0)")
    n.add_argument("--announce-addr", action="append", default=[], help="public multiaddr to announce")
    n.add_argument("--data-listen", default=None, metavar="MULTIADDR",
                   help="TCP address of the data plane (tensors), e.g. /ip4/0.0.0.0/tcp/4002 "
                        "(default: any free port where --listen listens)")
    n.add_argument("--data-announce", default=None, metavar="MULTIADDR",
                   help="data-plane address peers should dial, e.g. /ip4/PUBLIC_IP/tcp/4002 "
                        "(behind NAT or in a container: the forwarded or published port; docs/networking.md)")
    n.add_argument("--home", default=None, help="directory for the identity key, checkpoints and logs")
    n.add_argument("--device", default="cpu", help="where this node's stages train: cpu or cuda:N (docs/gpu.md)")
    n.add_argument("--memory", default=None, metavar="SIZE",
                   help="memory this node's process may use in all, e.g. 3GiB: a stage gets what its own footprint "
                        "and a reserve for a job's data leave, and the planner keeps the stage within that (default: "
                        "what it measures as available, less 10%% and at least 512 MiB)")
    n.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat period, seconds")
    n.add_argument("--dead-timeout", type=float, default=5.0, help="seconds without heartbeat before a peer is dead")
    n.add_argument("--gossip-rate", type=float, default=5.0, help=_GOSSIP_RATE_HELP)
    n.add_argument("--probe-interval", type=float, default=10.0, help="seconds between bandwidth probe rounds")
    n.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    n.add_argument("--defer-startup", type=float, default=15.0, metavar="SECONDS",
                   help="the node imports torch, starts its job service and measures its device once its first "
                        "bandwidth probes are done, when a job request comes, or at the latest this long after "
                        "joining (default 15; the swarm forms first)")
    n.add_argument("--startup-nice", type=int, default=5, metavar="N",
                   help="that start-up's imports run N steps nicer than the node (0-19, default 5; a job request "
                        "that starts it runs them at the node's own priority)")
    n.add_argument("--emulate-slowdown", type=float, default=None, metavar="FACTOR",
                   help="testbeds: run every forward, backward and optimizer step FACTOR times slower than at this "
                        "host's CPU share (a sleep after each, as a slower accelerator would; default: "
                        "$FUSIONP2P_COMPUTE_SLOWDOWN, else 1)")
    n.add_argument("--progress-interval", type=float, default=1.0, metavar="SECONDS",
                   help="gossip a job's training progress at most this often, the steps between in one message "
                        "(0: every step; default 1)")
    n.add_argument("--disk", default="20G", metavar="SIZE",
                   help="the most the node's content store keeps on disk: the data, weights, stage states and "
                        "checkpoints of its jobs; what running jobs use is kept, the rest goes oldest first "
                        "(e.g. 500M, 20G; default 20G; docs/operations.md)")
    n.add_argument("--http", default=None, metavar="ADDR", help=_HTTP_HELP)
    n.add_argument("--relay", action="store_true",
                   help="also relay connections of nodes that cannot be dialled (needs a public address; docs/networking.md)")
    n.add_argument("--relay-rate", type=float, default=10.0, metavar="MB_PER_S", help=_RELAY_RATE_HELP)
    n.add_argument("--hole-punch", action="store_true",
                   help="try DCUtR hole punching on relayed connections (experimental; docs/networking.md)")
    _common(n)

    s = sub.add_parser("status", help="print the swarm's members and bandwidth matrix")
    s.add_argument("--bootstrap", action="append", required=True, help="full multiaddr of any swarm member")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--timeout", type=float, default=15.0)
    s.add_argument("--watch", action="store_true", help="a live view (members, bandwidth, jobs), refreshed until Ctrl-C")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes of --watch")
    s.add_argument("--refreshes", type=int, default=0, help="with --watch: stop after this many refreshes (0: never)")
    _common(s)

    t = sub.add_parser("testbed", help="emulated-WAN testbed in network namespaces (root)")
    tsub = t.add_subparsers(dest="testbed_cmd", required=True)
    tu = tsub.add_parser("up", help="create namespaces, shape links, start a bootstrap and nodes")
    tu.add_argument("--spec", required=True, help="testbed spec file (JSON, or TOML on Python 3.11+)")
    tu.add_argument("--no-nodes", action="store_true", help="only create and shape the network")
    tu.add_argument("--detach", action="store_true", help="leave the testbed running and return (tear down with `testbed down`)")
    tu.add_argument("--wait-nodes", action="store_true", help="wait until every node has joined before reporting ready")
    td = tsub.add_parser("down", help="tear a testbed down")
    td.add_argument("--name", default=None, help="testbed name (default: all of ours)")
    _common(t)

    d = sub.add_parser("demo", help="train the GPT-2 reference on an embedded local swarm")
    d.add_argument("--nodes", type=int, default=4)
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--out", default="out/demo", help="where the trained model is saved")
    d.add_argument("--wan", default=None, metavar="RATE",
                   help="emulate two sites joined by links of RATE (e.g. 16mbit) on an embedded swarm: the plan "
                        "keeps pipelines inside the sites or compresses the fence that crosses them "
                        "(with --nodes 2 it must cross)")
    _common(d)

    j = sub.add_parser("job", help="submit, list, follow, download and cancel training jobs")
    jsub = j.add_subparsers(dest="job_cmd", required=True)
    key_help = ("the publisher's identity key (default: the client home's identity.key, created on first use); "
                "jobs are listed, attached, downloaded and cancelled with the key that submitted them")

    def job_common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--bootstrap", action="append", required=True, help="a bootstrap multiaddr (repeatable)")
        q.add_argument("--key", default=None, help=key_help)
        q.add_argument("--home", default=None, help="client home (default: ~/.local/share/fusionp2p/client)")
        q.add_argument("--log-level", default=argparse.SUPPRESS, choices=["debug", "info", "warning", "error"],
                       help="also accepted before the subcommand")

    js = jsub.add_parser("submit", help="publish a job and follow it (Ctrl-C detaches; the job goes on)")
    js.add_argument("file", nargs="?", help="a Python file defining make_job() (see docs/jobs.md)")
    js.add_argument("--builtin", choices=["gpt2-tiny"], default=None)
    js.add_argument("--steps", type=int, default=100)
    js.add_argument("--out", default="out/job", help="where the trained model is saved")
    js.add_argument("--detach", action="store_true", help="return once the job runs (follow it later with attach)")
    job_common(js)
    jl = jsub.add_parser("list", help="the jobs this key submitted, with their state")
    jl.add_argument("--json", action="store_true")
    job_common(jl)
    for name, help_ in (("status", "a job's state, plan, progress and checkpoints"),
                        ("attach", "follow a running job to its end and download the model"),
                        ("download", "download a finished job's trained model"),
                        ("cancel", "stop a job on every node")):
        q = jsub.add_parser(name, help=help_)
        q.add_argument("job", help="the job id")
        if name == "status":
            q.add_argument("--json", action="store_true")
        if name in ("attach", "download"):
            q.add_argument("--out", default="out/job", help="where the trained model is saved")
        job_common(q)
    _common(j)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = _dispatch(args)
        if argv is None and args.cmd in ("node", "bootstrap"):
            _exit_now(rc)
        return rc
    except FusionError as exc:
        return _fail(exc)
    except BaseExceptionGroup as group:
        # trio wraps an error raised inside a nursery (the daemon's join) in a group: report the error itself
        ours = [e for e in leaf_errors(group) if isinstance(e, FusionError)]
        if not ours:
            raise
        return _fail(ours[0])
    except KeyboardInterrupt:
        return 130


def _exit_now(rc: int) -> None:
    """End a daemon that left cleanly without the interpreter's teardown: freeing torch's and libp2p's
    modules cost about 1 CPU-second a process, and seconds of a swarm's stop under load (issue 40).
    Its logs and output are flushed first; it holds no other file open by then."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _fail(exc: FusionError) -> int:
    """One line on stderr; exit status 2 for a user mistake, 3 for an unreachable peer, 1 otherwise."""
    print(f"fusionp2p: error: {exc}", file=sys.stderr)
    if isinstance(exc, ConfigError):
        return 2
    return 3 if isinstance(exc, PeerUnavailable) else 1


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.cmd
    if cmd in ("node", "bootstrap"):
        return _run_daemon(args)
    if cmd == "status":
        return _status(args)
    if cmd == "testbed":
        return _testbed(args)
    if cmd == "demo":
        from fusionp2p.cli.demo import run_demo

        # the demo prints its own progress; with --wan its nodes run in this process, and their INFO lines
        # (joins, accepted jobs, links) would bury it: shown with an explicit --log-level info or debug
        setup_logging(args.log_level if any(a.startswith("--log-level") for a in sys.argv) else "warning", None)
        return run_demo(nodes=args.nodes, steps=args.steps, out=Path(args.out), wan=args.wan)
    if cmd == "job":
        from fusionp2p.cli.job import cli_job

        setup_logging(args.log_level, None)
        if args.home is None:
            args.home = str(_data_home() / "client")
        return cli_job(args)
    raise ConfigError(f"unknown command {cmd}")


def _run_daemon(args: argparse.Namespace) -> int:
    from fusionp2p.net.heap import one_arena

    one_arena()   # before any thread allocates: a node's memory is what its stage was priced at (net/heap.py)
    import trio

    from fusionp2p.swarm.daemon import DaemonConfig, check_home, run_daemon
    from fusionp2p.swarm.node import SwarmConfig, SwarmNode
    from fusionp2p.swarm.probe import ProbeConfig
    from fusionp2p.swarm.startup import Startup, StartupConfig

    role = args.cmd
    home = check_home(args.home, _data_home() / role)
    listen = tuple(args.listen or (["/ip4/0.0.0.0/tcp/4001"] if role == "bootstrap" else ["/ip4/0.0.0.0/tcp/0"]))
    if role == "node":
        swarm = SwarmConfig(role="node", heartbeat=args.heartbeat, dead_timeout=args.dead_timeout,
                            gossip_rate=args.gossip_rate, probe=ProbeConfig(interval=args.probe_interval))
    else:
        swarm = SwarmConfig(role="bootstrap", gossip_rate=args.gossip_rate)
    relay = None
    if (role == "bootstrap" and not args.no_relay) or (role == "node" and args.relay):
        from fusionp2p.net.relay import RelayLimits

        if not args.relay_rate > 0:
            raise ConfigError("--relay-rate must be positive (MB/s)")
        relay = RelayLimits(rate=args.relay_rate * 1e6)
    slowdown = _slowdown(args) if role == "node" else 1.0
    cfg = DaemonConfig(role=role, home=home, listen=listen, bootstrap=tuple(args.bootstrap), announce=tuple(args.announce_addr),
                       device=getattr(args, "device", "cpu"), swarm=swarm, relay=relay,
                       hole_punch=bool(getattr(args, "hole_punch", False)), compute_slowdown=slowdown,
                       memory=_memory(args))
    startup = Startup(StartupConfig(defer=args.defer_startup, nice=args.startup_nice)) if role == "node" else None
    cpus = None
    disk = None
    if role == "node":
        # The job service's options are checked here, before anything starts; its NodeJobConfig (which checks
        # them again) is built after the node listens: importing the job service imports torch (issue 40).
        from fusionp2p.net.addrs import tcp_endpoint
        from fusionp2p.sizes import parse_size

        disk = parse_size(args.disk, "--disk")
        if args.data_announce is not None:
            tcp_endpoint(args.data_announce, "--data-announce", announce=True)
        if args.data_listen is not None:
            _check_bindable(*tcp_endpoint(args.data_listen, "--data-listen"), "--data-listen")
        if not args.progress_interval >= 0:
            raise ConfigError("--progress-interval must be >= 0")
        cpus = _cpu_share() if slowdown != 1.0 else None
        if cpus is not None and not 0.0 < cpus <= 1024.0:
            raise ConfigError("the CPU share of an emulated slowdown must be in (0, 1024] cores")
    http = None
    if args.http is not None:
        from fusionp2p.ops import parse_http_addr

        http = parse_http_addr(args.http)
        _check_bindable(http.host, http.port, "--http")
    setup_logging(args.log_level, home / "libp2p.log")

    def ready(addrs: Sequence[str]) -> None:
        for a in addrs:
            print(a, flush=True)

    async def ops(swarm: SwarmNode, jobs: Any) -> None:
        from fusionp2p.ops import serve_ops

        assert http is not None
        async with trio.open_nursery() as nursery:
            url = await nursery.start(lambda task_status: serve_ops(swarm, http, jobs=jobs, task_status=task_status))
            print(url, flush=True)   # after the multiaddrs: the dashboard's address

    def prepare() -> None:
        """(a node, in a worker thread once it listens) torch and the job service imported, torch's threads set."""
        import torch

        import fusionp2p.jobs.node  # noqa: F401

        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)

    async def serve_jobs(jobs: Any, nursery: trio.Nursery) -> None:
        await nursery.start(jobs.run)
        assert startup is not None
        startup.serve(jobs.handle)   # the job requests that started the start-up are answered now

    def services(swarm: SwarmNode, nursery: trio.Nursery) -> None:
        from fusionp2p.jobs.records import register_rankers

        register_rankers(swarm.transport)   # bootstraps hold DHT records too: keep the newest of each
        jobs = None
        if role == "node":
            from fusionp2p.jobs.node import NodeJobConfig, NodeJobService
            from fusionp2p.jobs.store import StoreConfig

            job_cfg = NodeJobConfig(data_listen=args.data_listen, data_announce=args.data_announce,
                                    progress_interval=args.progress_interval, compute_slowdown=slowdown,
                                    device=cfg.device, compute_cpus=cpus, store=StoreConfig(disk_bytes=disk))
            jobs = NodeJobService(swarm, home, job_cfg)
            nursery.start_soon(serve_jobs, jobs, nursery)
        if http is not None:
            nursery.start_soon(ops, swarm, jobs)

    trio.run(lambda: run_daemon(cfg, on_ready=ready, extra_services=services, prepare=prepare if role == "node" else None,
                                startup=startup))
    return 0


def _memory(args: argparse.Namespace) -> int | None:
    """--memory in bytes (a node's), or None (measured)."""
    text = getattr(args, "memory", None)
    if text is None:
        return None
    from fusionp2p.sizes import parse_size

    return parse_size(text, "--memory")


def _slowdown(args: argparse.Namespace) -> float:
    """``--emulate-slowdown``, else ``$FUSIONP2P_COMPUTE_SLOWDOWN`` (set by the testbed for a host's
    ``slowdown``), else 1."""
    if args.emulate_slowdown is not None:
        return float(args.emulate_slowdown)
    env = _env_float("FUSIONP2P_COMPUTE_SLOWDOWN", "unset it or give a factor like 2")
    return 1.0 if env is None else env


def _cpu_share() -> float | None:
    """This host's CPU share in cores, for ``--emulate-slowdown``: ``$FUSIONP2P_TESTBED_CPUS`` (the
    testbed's ``cpus``; a namespace's processes may not see their cgroup), else our cgroup quota."""
    env = _env_float("FUSIONP2P_TESTBED_CPUS", "unset it or give a number of cores")
    if env is not None:
        return env
    from fusionp2p.swarm.device import own_cpu_quota

    quota = own_cpu_quota()
    return quota[0] if quota is not None else None


def _env_float(name: str, fix: str) -> float | None:
    """The number in ``$name`` (None: unset or empty); a one-line ConfigError saying *fix* otherwise."""
    env = os.environ.get(name, "").strip()
    try:
        return float(env) if env else None
    except ValueError:
        raise ConfigError(f"{name}={env!r} is not a number; {fix}") from None


def _check_bindable(host: str, port: int, flag: str) -> None:
    """A user mistake (port in use, address not ours) as one line before the daemon starts."""
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"{flag}: cannot listen on {host}:{port}: {exc.strerror}; choose another address or port") from None


def _status(args: argparse.Namespace) -> int:
    from fusionp2p.cli.status import cli_status

    setup_logging(args.log_level if args.log_level != "info" else "warning", None)
    return cli_status(args)


def _testbed(args: argparse.Namespace) -> int:
    from fusionp2p.testbed import emulator as testbed

    setup_logging(args.log_level, None)
    if args.testbed_cmd == "up":
        return int(testbed.cli_up(args.spec, start_nodes=not args.no_nodes, detach=args.detach, wait_nodes=args.wait_nodes) or 0)
    return int(testbed.cli_down(args.name) or 0)


if __name__ == "__main__":
    sys.exit(main())
