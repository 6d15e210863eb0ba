"""How soon a node behind a NAT is reachable: seconds from its join to its reach verdict and to its relay slot
(issue 40), real node processes in the namespace testbed.

``specs/nat4.json``: a public bootstrap host (bootstrap and a node), a public node, and two home nodes behind
one NAT router (iptables MASQUERADE, nothing forwarded in); ``--spec nat2lan``: two LANs behind two routers,
whose pairs across can be probed only through the relay. Every host runs a ``fusionp2p node`` with its defaults (the
deferred start-up: ``--defer-startup`` 15 s + jitter, then up to 45 s while its probes progress). Read from
each home node's own log (one clock): when it joined (its first ``member ... joined``: the bootstrap's view
taken, one round trip after the connection), when it learned its reach (``reachability: private``), when it
announced its first relayed address (the slot on the bootstrap's relay), and when its start-up began.
Before issue 40's fix the verdict waited for the data plane, i.e. for the start-up; now both come on joining.

    python -m benchmarks.nat_reach [--quick] [--runs N] [--spec nat4|nat2lan]

Headline: the worst home node's seconds from join to relay slot, over the runs; baseline: the same node's
start-up, measured in the same run (what the verdict used to wait for). Needs root, iproute2 and iptables
(``make iptables``); without them it says so and exits 0. Wall-clock on a shared machine: write the load.
"""

from __future__ import annotations

import datetime as dt
import re
import shutil
import time
from pathlib import Path

from benchmarks._common import headline, parser, write
from fusionp2p.errors import ConfigError
from fusionp2p.testbed import netns
from fusionp2p.testbed.emulator import up
from fusionp2p.testbed.spec import load_spec

NAME = "nat_reach"
SPECS = Path(__file__).resolve().parents[1] / "fusionp2p" / "testbed" / "specs"
EVENTS = {   # event -> the first log line that marks it
    "joined": re.compile(r"fusionp2p\.swarm\.node: member \S+ joined"),
    "reach": re.compile(r"reachability: (private|data)"),
    "relay": re.compile(r"announcing [1-9]\d* relayed address"),
    "startup": re.compile(r"start-up \(torch, job service, device benchmark\) now"),
}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def events(log: str) -> dict[str, float]:
    """Each event's first time (epoch seconds, from the log's own timestamps)."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = STAMP.match(line)
        if m is None:
            continue
        for ev, pat in EVENTS.items():
            if ev not in out and pat.search(line):
                out[ev] = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return out


def one_run(spec: Path, timeout: float, keep: Path | None = None) -> dict[str, dict[str, float | None]]:
    """Seconds from join to each event, per home node (None: not within *timeout*); their logs copied to *keep*."""
    with up(load_spec(spec)) as tb:
        _, addr = tb.start_bootstrap(ready_timeout=120.0)
        nodes = tb.start_nodes(addr, ready_timeout=180.0)
        home = [(h.name, p) for h, p in zip(tb.hosts, nodes) if h.spec.nat]
        deadline = time.monotonic() + timeout
        seen: dict[str, dict[str, float]] = {}
        while True:
            seen = {name: events(p.err_path.read_text(errors="replace")) for name, p in home}
            if all(len(e) == len(EVENTS) for e in seen.values()) or time.monotonic() > deadline:
                break
            time.sleep(1.0)   # polling another process's log file: it has no event to wait on
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for name, p in home:
                shutil.copy(p.err_path, keep / f"{name}.log")
    return {name: {ev: (round(e[ev] - e["joined"], 2) if ev in e and "joined" in e else None)
                   for ev in EVENTS if ev != "joined"} for name, e in seen.items()}


def main(argv: list[str] | None = None) -> int:
    p = parser(NAME, __doc__)
    p.add_argument("--runs", type=int, default=0, help="testbeds brought up one after another (default 1 quick, 3 full)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds a run waits for every event")
    p.add_argument("--spec", default="nat4", help="a NAT spec of fusionp2p/testbed/specs (default nat4; nat2lan: "
                   "two LANs, whose pairs across need the relay before they can be probed)")
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the home nodes' logs here (DIR/runK/HOST.log)")
    args = p.parse_args(argv)
    try:
        netns.check_environment()
    except ConfigError as e:
        print(f"benchmarks.nat_reach skipped: {e}")
        return 0
    if shutil.which("iptables") is None:
        print("benchmarks.nat_reach skipped: the NAT router needs iptables (`make iptables`)")
        return 0
    runs = []
    for i in range(args.runs or (1 if args.quick else 3)):
        r = one_run(SPECS / f"{args.spec}.json", args.timeout, args.keep_logs / f"run{i + 1}" if args.keep_logs else None)
        print(f"run {i + 1}: " + "; ".join(f"{n}: " + ", ".join(f"{k} {v if v is not None else '-'} s" for k, v in e.items())
                                           for n, e in r.items()), flush=True)
        runs.append(r)
    nodes = [e for r in runs for e in r.values()]
    relay = [e["relay"] if e["relay"] is not None else args.timeout for e in nodes]
    worst = max(relay)
    head = headline("seconds from a NAT'd node's join to its relay slot (worst node)", worst, "s", 5.0, "lower",
                    "the same node's deferred start-up, which the verdict waited for before issue 40 "
                    f"(here {min((e['startup'] for e in nodes if e['startup'] is not None), default=float('nan')):.1f} "
                    "s after join at the earliest)")
    write(NAME, args.out, {"spec": args.spec, "runs": runs, "timeout_s": args.timeout}, head, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
