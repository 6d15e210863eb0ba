"""The ``fusionp2p`` command: bootstrap, node, status, testbed, demo, job.

User mistakes end with one line on stderr and exit status 2; nothing here prints a traceback for
them. Logging handlers are configured here and only here (STYLE.md 17): our own loggers go to
stderr, py-libp2p's (noisy at ERROR for routine events) to ``<home>/libp2p.log``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fusionp2p.errors import ConfigError, FusionError, PeerUnavailable

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
        lp.setLevel(logging.INFO)
    else:
        lp.setLevel(logging.CRITICAL)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


_GOSSIP_RATE_HELP = ("swarm-wide heartbeat messages per second: a node's heartbeat period stretches to "
                     "members / rate when that is longer than --heartbeat (default 5)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fusionp2p", description="Peer-to-peer decentralized training node.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("bootstrap", help="run a bootstrap node (DHT server, no training)")
    b.add_argument("--listen", action="append", default=None, help="multiaddr to listen on (default /ip4/0.0.0.0/tcp/4001)")
    b.add_argument("--announce-addr", action="append", default=[], help="public multiaddr to announce")
    b.add_argument("--bootstrap", action="append", default=[], help="other bootstrap nodes to peer with")
    b.add_argument("--home", default=None, help="directory for the identity key and logs")
    b.add_argument("--gossip-rate", type=float, default=5.0, help=_GOSSIP_RATE_HELP)
    _common(b)

    n = sub.add_parser("node", help="run a training node that joins a swarm")
    n.add_argument("--bootstrap", action="append", required=True, help="full multiaddr of a bootstrap (repeatable)")
    n.add_argument("--listen", action="append", default=None, help="multiaddr to listen on (default /ip4/0.0.0.0/tcp/0)")
    n.add_argument("--announce-addr", action="append", default=[], help="public multiaddr to announce")
    n.add_argument("--home", default=None, help="directory for the identity key, checkpoints and logs")
    n.add_argument("--device", default="cpu", help="cpu or cuda:N")
    n.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat period, seconds")
    n.add_argument("--dead-timeout", type=float, default=5.0, help="seconds without heartbeat before a peer is dead")
    n.add_argument("--gossip-rate", type=float, default=5.0, help=_GOSSIP_RATE_HELP)
    n.add_argument("--probe-interval", type=float, default=10.0, help="seconds between bandwidth probe rounds")
    n.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    _common(n)

    s = sub.add_parser("status", help="print the swarm's members and bandwidth matrix")
    s.add_argument("--bootstrap", action="append", required=True, help="full multiaddr of any swarm member")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--timeout", type=float, default=15.0)
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
    _common(d)

    j = sub.add_parser("job", help="submit, watch, cancel and download training jobs")
    jsub = j.add_subparsers(dest="job_cmd", required=True)
    js = jsub.add_parser("submit", help="publish a job")
    js.add_argument("file", nargs="?", help="a Python file defining make_job() (see docs/jobs.md)")
    js.add_argument("--builtin", choices=["gpt2-tiny"], default=None)
    js.add_argument("--bootstrap", action="append", required=True)
    js.add_argument("--steps", type=int, default=100)
    js.add_argument("--out", default="out/job")
    _common(j)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except ConfigError as exc:
        print(f"fusionp2p: error: {exc}", file=sys.stderr)
        return 2
    except PeerUnavailable as exc:
        print(f"fusionp2p: error: {exc}", file=sys.stderr)
        return 3
    except FusionError as exc:
        print(f"fusionp2p: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


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

        setup_logging(args.log_level, None)
        return run_demo(nodes=args.nodes, steps=args.steps, out=Path(args.out))
    if cmd == "job":
        from fusionp2p.cli.job import cli_job

        setup_logging(args.log_level, None)
        return cli_job(args)
    raise ConfigError(f"unknown command {cmd}")


def _run_daemon(args: argparse.Namespace) -> int:
    import trio

    from fusionp2p.swarm.daemon import DaemonConfig, check_home, run_daemon
    from fusionp2p.swarm.node import SwarmConfig
    from fusionp2p.swarm.probe import ProbeConfig

    role = args.cmd
    home = check_home(args.home, _data_home() / role)
    listen = tuple(args.listen or (["/ip4/0.0.0.0/tcp/4001"] if role == "bootstrap" else ["/ip4/0.0.0.0/tcp/0"]))
    if role == "node":
        swarm = SwarmConfig(role="node", heartbeat=args.heartbeat, dead_timeout=args.dead_timeout,
                            gossip_rate=args.gossip_rate, probe=ProbeConfig(interval=args.probe_interval))
        if args.torch_threads:
            import torch

            torch.set_num_threads(args.torch_threads)
    else:
        swarm = SwarmConfig(role="bootstrap", gossip_rate=args.gossip_rate)
    cfg = DaemonConfig(role=role, home=home, listen=listen, bootstrap=tuple(args.bootstrap), announce=tuple(args.announce_addr),
                       device=getattr(args, "device", "cpu"), swarm=swarm)
    setup_logging(args.log_level, home / "libp2p.log")

    def ready(addrs: Sequence[str]) -> None:
        for a in addrs:
            print(a, flush=True)

    services = None
    if role == "node":
        from fusionp2p.jobs.service import attach_worker

        services = attach_worker(home)
    trio.run(lambda: run_daemon(cfg, on_ready=ready, extra_services=services))
    return 0


def _status(args: argparse.Namespace) -> int:
    import trio

    from fusionp2p.net.identity import Identity
    from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport, parse_peer_addr
    from fusionp2p.swarm.membership import BandwidthTable
    from fusionp2p.swarm.node import fetch_view
    from fusionp2p.wire.records import BandwidthReport, NodeRecord

    for b in args.bootstrap:
        parse_peer_addr(b)
    setup_logging(args.log_level if args.log_level != "info" else "warning", None)

    async def go() -> dict[str, Any]:
        # one deadline over everything, the transport's start and teardown included
        with trio.fail_after(args.timeout + 10):
            return await _go()

    async def _go() -> dict[str, Any]:
        async with open_libp2p_transport(Identity.generate(), Libp2pConfig(listen=("/ip4/127.0.0.1/tcp/0",))) as t:
            last: Exception | None = None
            for addr in args.bootstrap:
                try:
                    peer = await t.connect(addr)
                    return await fetch_view(t, peer, timeout=args.timeout)
                except (PeerUnavailable, trio.TooSlowError) as exc:
                    last = exc
            raise PeerUnavailable(args.bootstrap[0], f"no bootstrap answered ({last})")

    try:
        view = trio.run(go)
    except trio.TooSlowError:
        raise PeerUnavailable(args.bootstrap[0].rsplit("/p2p/", 1)[-1], f"no answer within {args.timeout + 10:.0f} s") from None
    alive = set(view["alive"])
    recs = {r.peer: r for r in view["records"] if isinstance(r, NodeRecord)}
    table = BandwidthTable()
    for r in view["bw"]:
        if isinstance(r, BandwidthReport):
            table.on_report(r)
    nodes = sorted(p for p, r in recs.items() if r.role == "node" and p in alive)
    out = {
        "members": [
            {"peer": p, "role": r.role, "alive": p in alive, "addrs": list(r.addrs),
             "profile": r.profile.to_wire() if r.profile else None}
            for p, r in sorted(recs.items()) if not r.leaving
        ],
        "dead": view["dead"],
        "bandwidth": [
            {"src": a, "dst": b, "bytes_per_s": e.bandwidth, "rtt_s": e.rtt, "measured": e.measured}
            for (a, b), e in sorted(table.matrix(nodes).items())
        ],
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_status(out)
    return 0


def _print_status(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    t = Table(title="members")
    for col in ("peer", "role", "alive", "device", "GFLOP/s fp32", "memory GiB"):
        t.add_column(col)
    for m in out["members"]:
        p = m["profile"] or {}
        t.add_row(m["peer"][-12:], m["role"], "yes" if m["alive"] else "DEAD", p.get("name", "-"),
                  f"{p['flops_fp32'] / 1e9:.1f}" if p else "-", f"{p['memory_bytes'] / 2**30:.1f}" if p else "-")
    c.print(t)
    bw = Table(title="bandwidth (MB/s, rtt ms)")
    for col in ("src", "dst", "MB/s", "rtt ms", "measured"):
        bw.add_column(col)
    for e in out["bandwidth"]:
        bw.add_row(e["src"][-12:], e["dst"][-12:], f"{e['bytes_per_s'] / 1e6:.1f}", f"{e['rtt_s'] * 1e3:.2f}", "yes" if e["measured"] else "est.")
    c.print(bw)


def _testbed(args: argparse.Namespace) -> int:
    from fusionp2p.testbed import emulator as testbed

    setup_logging(args.log_level, None)
    if args.testbed_cmd == "up":
        return int(testbed.cli_up(args.spec, start_nodes=not args.no_nodes, detach=args.detach, wait_nodes=args.wait_nodes) or 0)
    return int(testbed.cli_down(args.name) or 0)


if __name__ == "__main__":
    sys.exit(main())
