"""What every ``fusionp2p`` command shares: the argument parser, logging set-up and the error handling
that turns a user mistake into one line on stderr (exit status 2) and never a traceback. Logging
handlers are configured here and only here (STYLE.md 17): our own loggers go to stderr, py-libp2p's
(noisy at ERROR for routine events) to ``<home>/libp2p.log``. The commands themselves are
``cli/main.py`` (the dispatcher) and ``cli/daemon_cmd.py`` (``node`` and ``bootstrap``, which the demo's
forked nodes run without the dispatcher, cli/forked.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from fusionp2p.errors import ConfigError, FusionError, PeerUnavailable, leaf_errors

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger("fusionp2p.cli")


def _data_home() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "fusionp2p"


def setup_logging(level: str, libp2p_log: Path | None, libp2p_level: str | None = None) -> None:
    # --log-level applies to our loggers; third-party ones (multiaddr logs every parse at DEBUG) stay at WARNING;
    # py-libp2p's go to *libp2p_log* at *libp2p_level* (None: DEBUG with --log-level debug, else INFO)
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
        lp.setLevel(getattr(logging, (libp2p_level or ("debug" if level == "debug" else "info")).upper()))
    else:
        lp.setLevel(logging.CRITICAL)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _libp2p_log(p: argparse.ArgumentParser) -> None:
    # py-libp2p at DEBUG was ~20% of a node's event-loop samples while 20 processes probed (py-spy, 2026-11-30):
    # a benchmark that wants our debug log (benchmarks.membership --log-dir) keeps py-libp2p's at INFO
    p.add_argument("--libp2p-log-level", default=None, choices=["debug", "info", "warning", "error"],
                   help="py-libp2p's log level in <home>/libp2p.log (default: debug with --log-level debug, else info)")


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
    _libp2p_log(b)

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
                        "bandwidth probes are done, when a job request comes, or this long after joining (default "
                        "15; the swarm forms first), then up to 45 s more while those probes still progress")
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
    _libp2p_log(n)

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




def run_cli(argv: Sequence[str] | None, dispatch: Callable[[argparse.Namespace], int]) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = dispatch(args)
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

