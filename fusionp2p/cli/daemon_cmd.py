"""``fusionp2p node`` and ``fusionp2p bootstrap``: a daemon's set-up from its arguments. Apart from the
dispatcher (cli/main.py) so that the demo's forked node processes (cli/forked.py) run the same code
without importing the demo that forks them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from fusionp2p.cli.base import _data_home, run_cli, setup_logging
from fusionp2p.errors import ConfigError


def daemon_main(argv: Sequence[str]) -> int:
    """``fusionp2p node ...`` / ``fusionp2p bootstrap ...`` as the command line runs it (*argv* without
    the program name), for a process forked from a preloaded parent."""
    return run_cli(argv, _run_daemon)


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
    setup_logging(args.log_level, home / "libp2p.log", args.libp2p_log_level)

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

    early: list[tuple[str, Any]] = []
    if startup is not None:   # a node
        # the JOB wire format only (no torch): a request before the job service runs starts the start-up
        from fusionp2p.jobs import proto as job_proto
        from fusionp2p.wire.protocols import JOB

        early.append((JOB, job_proto.serve(startup.early_job, timeout=startup.config.on_demand_timeout + 600)))
    trio.run(lambda: run_daemon(cfg, on_ready=ready, extra_services=services, prepare=prepare if role == "node" else None,
                                startup=startup, early_handlers=early))
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

