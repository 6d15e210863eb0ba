"""Geo-distributed benchmark (issue 20): the product on the emulated WAN, five job configurations side by side.

``python -m benchmarks.wan --scenario mixed|slow|lan [--quick]`` builds the scenario's testbed
(``fusionp2p/testbed/specs/wan_<scenario>.json``: network namespaces, ``tc tbf`` shaping, a cgroup
CPU cap per host) plus one unshaped control host, starts ``fusionp2p bootstrap`` in the control host
and one ``fusionp2p node`` in every scenario host, waits (deadline) until the nodes have measured
every link with their own probes (``fusionp2p status --json``), then runs the publisher
(``benchmarks/wan_client.py``) in the control host: it publishes one job per system through the SDK
(``Swarm.connect``), the nodes elect the plan from their measured links, train, and the publisher
downloads the model. Everything is torn down at the end (also on failure and Ctrl-C).

The five systems are job configurations of the same product (``TrainConfig``). The baselines run
``replicas=2``, exactly; the OP-Fence systems run ``replicas=None``: the planner chooses the replica
count with the stages (plan/joint.py), which is the system under test (issue 20: ``replicas`` is a
hint or a bound, never part of the baseline's handicap). Samples/s counts every replica's samples:

* ``A``: ``planner="even_layers"``, dense, per-step gradient all-reduce (``averaging=None``);
* ``B``: ``planner="even_flops"``, dense, per-step all-reduce;
* ``OPF``: OP-Fence (the default planner), dense, per-step all-reduce;
* ``OPF+TopK``: OP-Fence with AdaTopK, per-step all-reduce;
* ``OPF+TopK+CO2``: the full system, OP-Fence, AdaTopK and CO2 between the replicas.

Per system: samples/s from the job's step events and the held-out loss of the downloaded model
(definitions in ``benchmarks/wan_client.py``). Headline: samples/s of ``OPF+TopK+CO2`` over ``A``.

A host's ``slowdown`` reaches its node as ``FUSIONP2P_COMPUTE_SLOWDOWN`` (``fusionp2p node
--emulate-slowdown``): the node sleeps after every forward, backward and optimizer step for that many
times its duration, and divides its device benchmark by it, the way a slower accelerator leaves the
host's CPU (its ``cpus``) to the node's networking. ``--slowdown-as-cap`` is the emulation of the runs
before 2026-11-28: the host's CPU cap divided by its slowdown, which slows the node's control plane
(libp2p, gossip, CO2 rounds) along with its compute. Needs root and iproute2; without them it says so
and exits 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS, headline, parser, write
from fusionp2p.errors import ConfigError
from fusionp2p.net.identity import Identity
from fusionp2p.testbed import netns
from fusionp2p.testbed.emulator import Testbed, TestbedHost, fusionp2p_command, up
from fusionp2p.testbed.netns import Proc, TestbedError
from fusionp2p.testbed.spec import HostSpec, TestbedSpec, load_spec

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "fusionp2p" / "testbed" / "specs"
SCENARIOS = ("lan", "mixed", "slow")
TARGETS = {"mixed": 9.4, "slow": 12.0, "lan": 1.0}   # issue 20; lan is reported (no target: >= 1)
CONTROL = "ctl"

_DENSE_SYNC = {"compression": None, "averaging": None}
SYSTEMS: list[dict[str, Any]] = [
    {"name": "A", "description": "even split by layers, replica pairs in peer-id order, dense, per-step all-reduce",
     "config": {"planner": "even_layers", **_DENSE_SYNC}},
    {"name": "B", "description": "even split by FLOPs, replica pairs in peer-id order, dense, per-step all-reduce",
     "config": {"planner": "even_flops", **_DENSE_SYNC}},
    {"name": "OPF", "description": "OP-Fence (joint stages x replicas), dense, per-step all-reduce",
     "config": {"planner": "opfence", "replicas": None, **_DENSE_SYNC}},
    {"name": "OPF+TopK", "description": "OP-Fence + AdaTopK, per-step all-reduce",
     "config": {"planner": "opfence", "replicas": None, "compression": "adatopk", "averaging": None}},
    {"name": "OPF+TopK+CO2", "description": "OP-Fence + AdaTopK + CO2 between the replicas (the full system)",
     "config": {"planner": "opfence", "replicas": None, "compression": "adatopk", "averaging": "co2"}},
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """What every system trains (the same model, data, optimizer and steps)."""

    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 2
    seq_len: int = 64
    micro_batch: int = 8
    micro_batches: int = 4
    steps: int = 48
    replicas: int = 2
    lr: float = 3e-3
    seed: int = 0
    system_timeout: float = 900.0


def scenario_spec(name: str, *, slowdown_as_cap: bool = False) -> TestbedSpec:
    """The scenario's hosts plus the unshaped control host; with *slowdown_as_cap* a host's slowdown
    divides its CPU cap instead of reaching its node (see the module docstring)."""
    if name not in SCENARIOS:
        raise ConfigError(f"unknown scenario {name!r}; choose one of {SCENARIOS}")
    spec = load_spec(SPECS / f"wan_{name}.json")
    hosts = spec.hosts
    if slowdown_as_cap:
        hosts = tuple(dataclasses.replace(h, cpus=(h.cpus / h.slowdown) if h.cpus is not None else None, slowdown=1.0)
                      for h in spec.hosts)
    return TestbedSpec(hosts=(*hosts, HostSpec(name=CONTROL)), bootstrap_host=CONTROL, description=spec.description)


def _status(tb: Testbed, addr: str) -> tuple[int, str]:
    """``fusionp2p status --json`` run in the control host: (exit code, output)."""
    return tb.run(CONTROL, [*fusionp2p_command(), "status", "--bootstrap", addr, "--json"], timeout=60.0)


def wait_for_links(tb: Testbed, addr: str, peers: set[str], timeout: float) -> dict[str, Any]:
    """Poll ``fusionp2p status --json`` in the control host until every ordered pair of *peers* is measured and
    every peer's record carries its device profile (a node's start-up, the device benchmark among it, runs once
    its first probe round is done, so the links may all be measured before the last profile is published: the
    run's ``node_flops`` read None, 2026-11-30)."""
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        # each status call joins the swarm for a few seconds, so this loop paces itself
        rc, out = _status(tb, addr)
        if rc == 0:
            status = json.loads(out)
            alive = {m["peer"] for m in status["members"] if m["alive"]}
            measured = {(e["src"], e["dst"]) for e in status["bandwidth"] if e["measured"]}
            profiled = {m["peer"] for m in status["members"] if m.get("profile")}
            if peers <= alive and peers <= profiled and all((a, b) in measured for a in peers for b in peers if a != b):
                return status
    raise TestbedError(f"the nodes did not measure every link and their devices within {timeout:.0f} s "
                       f"(last status: {status})")


def seed_identity(home: Path, scenario: str, host: str) -> None:
    """Give *host*'s node a fixed identity (an Ed25519 seed from the scenario and host names), written where
    ``fusionp2p node --home`` loads it. The baselines place replica pairs in peer-id order, so with fresh
    random identities each run drew another placement: on `mixed`, baseline A ran 33.8 samples/s with the
    10 Mbit/s pair in the middle stage (two fences over its links) and 67.8 with it in the last (one),
    and the headline moved by that factor from run to run."""
    home.mkdir(parents=True, exist_ok=True)
    Identity(hashlib.sha256(f"fusionp2p benchmarks.wan {scenario} {host}".encode()).digest()).save(home)


def _links(status: dict[str, Any], peers: dict[str, str]) -> list[dict[str, Any]]:
    """The measured links of a ``fusionp2p status --json`` answer, by host name."""
    return [{"src": peers[e["src"]], "dst": peers[e["dst"]], "mbit_s": 8 * e["bytes_per_s"] / 1e6,
             "rtt_ms": 1e3 * e["rtt_s"] if isinstance(e.get("rtt_s"), int | float) else None}
            for e in status["bandwidth"] if e["src"] in peers and e["dst"] in peers and e["measured"]]


def _start_nodes(tb: Testbed, addr: str, hosts: list[TestbedHost], scenario: str) -> dict[str, str]:
    """One ``fusionp2p node`` per scenario host (fixed identities: :func:`seed_identity`); {peer id: host
    name} once each printed its address."""
    procs: list[tuple[TestbedHost, Proc]] = []
    for h in hosts:
        seed_identity(tb.node_home(h), scenario, h.name)
        procs.append((h, tb.spawn(h, tb.node_argv(h, addr), label=f"{h.name}-node")))
    deadline = time.monotonic() + 180.0
    peers = {}
    for h, p in procs:
        line = p.read_line(max(1.0, deadline - time.monotonic()), match=lambda s: "/p2p/" in s)
        peers[line.strip().rsplit("/p2p/", 1)[1]] = h.name
    return peers


def run(scenario: str, cfg: RunConfig, *, systems: list[str] | None = None, link_timeout: float = 240.0,
        keep_logs: bool = False, slowdown_as_cap: bool = False, ceiling: bool = True) -> dict[str, Any]:
    """Run the systems (default all five) once on *scenario*; the summary (raises on a failure of the
    machinery; a failed job is reported in its system's entry). Logs are kept only on a failure, or
    with *keep_logs* (each stage replica logs where its time went: ``grep 'steps in'``). With *ceiling*,
    first the hosts' compute ceiling (:func:`compute_ceiling`)."""
    chosen = [s for s in SYSTEMS if systems is None or s["name"] in systems]
    if not chosen:
        raise ConfigError(f"no system among {systems}; known: {[s['name'] for s in SYSTEMS]}")
    spec = scenario_spec(scenario, slowdown_as_cap=slowdown_as_cap)
    caps, cores = caps_sum(spec), os.cpu_count() or 1
    if caps > 0.8 * cores:
        # the hosts' caps are not reservations: near the machine's cores, every host gets less than its cap
        log.warning("warning: the hosts' CPU caps sum to %.2f cores on a %d-core machine; with the bootstrap, the "
                    "publisher and the shaping, the run is bound by the machine's CPUs, not the caps", caps, cores)
    workdir = Path(tempfile.mkdtemp(prefix=f"wan-{scenario}-"))
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with ExitStack() as stack:
        tb = up(spec, workdir=workdir)
        stack.callback(tb.close)
        stack.callback(lambda: workdir.exists() and log.warning("logs of the run in %s", workdir))
        t0 = time.monotonic()
        _, addr = tb.start_bootstrap(ready_timeout=120.0)
        nodes = [h for h in tb.hosts if h.name != CONTROL]
        peers = _start_nodes(tb, addr, nodes, scenario)
        status = wait_for_links(tb, addr, set(peers), link_timeout)
        swarm_s = time.monotonic() - t0
        measured = _links(status, peers)
        prof = {peers[m["peer"]]: m["profile"] or {} for m in status["members"] if m["peer"] in peers}
        profiles = {h: pm.get("flops_fp32") for h, pm in prof.items()}
        act_rates = {h: pm.get("act_rate") for h, pm in prof.items()}
        log.info("swarm up and measured in %.0f s", swarm_s)
        job_file = workdir / "run.json"
        job_file.write_text(json.dumps({
            "run": dataclasses.asdict(cfg), "systems": chosen, "bootstrap": addr, "nodes": len(nodes),
            "listen": f"/ip4/{tb.host(CONTROL).address}/tcp/0", "workdir": str(workdir)}))
        limit = compute_ceiling(tb, nodes, job_file, cfg, env) if ceiling else None
        client = tb.spawn(CONTROL, [sys.executable, "-m", "benchmarks.wan_client", "--job", str(job_file)],
                          label="publisher", env=env)
        client.read_line(180.0, match=lambda s: s.startswith('{"members"'))
        results: list[dict[str, Any]] = []
        for _ in chosen:
            line = client.read_line(cfg.system_timeout + 120.0, match=lambda s: s.startswith('{"system"'))
            res = json.loads(line)
            results.append(res)
            if "error" in res:
                print(f"  {res['system']:<13} FAILED: {res['error']}", flush=True)
            else:
                print(f"  {res['system']:<13} {res['samples_per_s'] or 0:8.1f} samples/s  held-out loss "
                      f"{res['held_out_loss']:.3f}  plan {res['plan']['stage_sizes']} rho {res['plan']['rho']} "
                      f"({res['publish_to_done_s']:.0f} s publish to DONE)", flush=True)
        client.wait(120.0)
        # the links as the swarm sees them after the runs (refresh probes run during the jobs, so these
        # read the links under the jobs' load)
        rc, out = _status(tb, addr)
        measured_end = _links(json.loads(out), peers) if rc == 0 else None
        for r in results:   # peer ids -> host names, for reading
            if "plan" in r:
                r["plan"]["hosts"] = [peers.get(p, p) for p in r["plan"]["members"]]
        if not keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)   # success: the figures are in the result
        return {"scenario": scenario, "spec": spec.description, "run": dataclasses.asdict(cfg),
                "swarm_up_s": swarm_s, "measured_links": measured, "measured_links_end": measured_end,
                "node_flops": profiles, "node_act_rate": act_rates,
                "systems": results, "ceiling": limit,
                "hosts": [{"name": h.name, "up_bps": h.up_bps, "down_bps": h.down_bps, "cpus": h.cpus,
                           "slowdown": h.slowdown} for h in spec.hosts],
                "slowdown": "cpu cap" if slowdown_as_cap else "node",
                "caps_cores": caps, "machine_cores": cores}


CEILING_WARMUP_S = 30.0   # start-up of a worker on a 0.25-0.5 core host: imports, tracing, the first steps
CEILING_S = 15.0


def compute_ceiling(tb: Testbed, hosts: list[TestbedHost], job_file: Path, cfg: RunConfig,
                    env: dict[str, str]) -> dict[str, Any]:
    """Every scenario host trains the benchmark's model at once with nothing else to do
    (``benchmarks/wan_ceiling.py``: no network, no averaging, no gossip; its node idles beside it, in
    the same CPU cgroup, slowed by the host's ``slowdown`` as the node slows itself), for
    ``CEILING_S`` seconds. The sum of their rates bounds the samples/s of any plan of whole-model
    replicas on this machine with these caps: the full system's ceiling. Per host: micro-batches a
    second; ``samples_per_s`` the sum times ``micro_batch``."""
    start = time.time() + CEILING_WARMUP_S
    procs = [(h, tb.spawn(h, [sys.executable, "-m", "benchmarks.wan_ceiling", "--run", str(job_file),
                              "--start", repr(start), "--seconds", str(CEILING_S), "--slowdown", str(h.spec.slowdown),
                              *(["--cpus", str(h.spec.cpus)] if h.spec.cpus is not None else [])],
                          label=f"{h.name}-ceiling", env=env))
             for h in hosts]
    per_host: dict[str, float] = {}
    for h, p in procs:
        line = p.read_line(CEILING_WARMUP_S + CEILING_S + 120.0, match=lambda s: s.startswith('{"micro"'))
        p.wait(30.0)
        got = json.loads(line)
        if not got["seconds"] > 0:
            raise TestbedError(f"{h.name}: the ceiling worker completed no micro-batch in its window ({got})")
        per_host[h.name] = got["micro"] / got["seconds"]
    total = sum(per_host.values())
    log.info("compute ceiling: %.1f samples/s (%s micro-batches/s)", total * cfg.micro_batch,
             ", ".join(f"{n} {r:.1f}" for n, r in per_host.items()))
    return {"micro_per_s": per_host, "samples_per_s": total * cfg.micro_batch, "seconds": CEILING_S}


def caps_sum(spec: TestbedSpec) -> float:
    """The cores the scenario's hosts may use together (their caps; an uncapped host counts as none)."""
    return sum(h.cpus for h in spec.hosts if h.cpus is not None)


def speedup(res: dict[str, Any]) -> float:
    by = {s["system"]: s for s in res["systems"]}
    a, full = by.get("A", {}), by.get("OPF+TopK+CO2", {})
    if not a.get("samples_per_s") or not full.get("samples_per_s"):
        raise RuntimeError("system A or the full system has no measured rate (see the results)")
    return float(full["samples_per_s"]) / float(a["samples_per_s"])


def table(res: dict[str, Any]) -> str:
    rows = [f"{'system':<13} {'samples/s':>10} {'vs A':>6} {'predicted':>10} {'held-out':>9} {'replicas':>8}  plan"]
    base = next((s.get("samples_per_s") for s in res["systems"] if s["system"] == "A"), None)
    for s in res["systems"]:
        if "error" in s:
            rows.append(f"{s['system']:<13} failed: {s['error']}")
            continue
        rate = s["samples_per_s"] or 0.0
        rows.append(f"{s['system']:<13} {rate:10.1f} {rate / base if base else 0:6.2f} "
                    f"{s['predicted_samples_per_s'] or 0:10.1f} {s['held_out_loss']:9.3f} {s['replicas']:>8}  "
                    f"{'|'.join('+'.join(s['plan']['hosts'][i:i + n]) for i, n in _spans(s['plan']['stage_sizes']))} "
                    f"rho {[round(x, 3) for x in s['plan']['rho']]}")
    lim = res.get("ceiling")
    if lim:
        top = lim["samples_per_s"]
        full = next((s.get("samples_per_s") for s in res["systems"] if s["system"] == "OPF+TopK+CO2"), None)
        share = f"the full system at {full / top:.0%} of it" if full else "the full system not run"
        rows.append(f"{'ceiling':<13} {top:10.1f} {top / base if base else 0:6.2f}  "
                    f"(every host computing at once, nothing else; {share})")
    return "\n".join(rows)


def _spans(sizes: list[int]) -> list[tuple[int, int]]:
    out, i = [], 0
    for n in sizes:
        out.append((i, n))
        i += n
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser("wan", __doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--scenario", choices=SCENARIOS, default="mixed")
    p.add_argument("--steps", type=int, default=None, help="steps per system (default 10 quick, 48 full)")
    p.add_argument("--system-timeout", type=float, default=900.0)
    p.add_argument("--systems", default="", help="comma-separated subset of A,B,OPF,OPF+TopK,OPF+TopK+CO2 (default all)")
    p.add_argument("--keep-logs", action="store_true", help="keep the hosts' logs (the path is printed)")
    p.add_argument("--no-ceiling", action="store_true",
                   help="skip the hosts' compute ceiling (on by default except with --quick; 45 s)")
    p.add_argument("--slowdown-as-cap", action="store_true",
                   help="emulate a host's slowdown by a smaller CPU cap (the runs before 2026-11-28) instead of in its node")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        netns.check_environment()
    except ConfigError as exc:
        print(f"benchmarks.wan skipped: no emulated WAN here ({exc})")
        return 0
    cfg = RunConfig(steps=a.steps or (10 if a.quick else 48), system_timeout=a.system_timeout)
    out = a.out if a.out != RESULTS / "wan.json" or a.scenario == "mixed" else RESULTS / f"wan_{a.scenario}.json"
    load0 = os.getloadavg()
    print(f"scenario {a.scenario} (testbed, tc tbf): {cfg.steps} steps per system, load {load0[0]:.2f}", flush=True)
    t0 = time.monotonic()
    res = run(a.scenario, cfg, systems=a.systems.split(",") if a.systems else None, keep_logs=a.keep_logs,
              slowdown_as_cap=a.slowdown_as_cap, ceiling=not (a.quick or a.no_ceiling))
    res["wall_s"] = time.monotonic() - t0
    res["loadavg_start"], res["loadavg_end"] = list(load0), list(os.getloadavg())
    print(table(res))
    names = {r["system"] for r in res["systems"]}
    if not {"A", "OPF+TopK+CO2"} <= names:
        # a subset without the headline's two systems: its figures, no headline (the summary's JSON is untouched)
        out = out.with_name(out.stem + "_subset.json")
        out.write_text(json.dumps({"benchmark": "wan", "quick": a.quick, "results": res}, indent=2, sort_keys=True) + "\n")
        print(f"no headline: the run needs systems A and OPF+TopK+CO2 -> {out}")
        return 0
    head = headline(f"samples/s of OPF+TopK+CO2 over baseline A ({a.scenario}, fusionp2p node processes)",
                    speedup(res), "x", TARGETS[a.scenario], "higher",
                    "baseline A (planner=even_layers, dense, per-step all-reduce), same swarm, same run")
    write(out.stem, out, res, head, quick=a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
