"""What measuring a plan's estimated pairs costs and buys (issue 40; ``plan/verify.py``, ``jobs/verify_links.py``).

For each size N (members of a job: 8, 32, 64; --quick: 8, 32) and seed: every member draws an access link
from ``benchmarks.swarm_scale.LINK_MIX`` (a pair's true rate: the source's uplink and the destination's
downlink, the smaller, both ways; latency the two one-way latencies), announces its capacities truthfully,
and measures the pairs of up to 24 random peers (the swarm's bounded probing), reported at the true rate.
In one run of four, one member lies: it announces 100x its capacities, and nobody has measured a link of it
yet (it joined last: only its own 24 pairs are measured), so nothing contradicts it. The other pairs are estimated by the
real ``BandwidthTable``; the publisher's planning (``verify_links.verified_plan``, with a GPT-2-small-like
workload through ``plan_joint``) then plans, checks and has the deciding pairs "measured" by an answer of
their true rate at once (no network here: the figures are the planner's CPU and its choices).

Figures per size: CPU-s of the plan alone (what the publisher spent before) and of the whole verified
planning (estimates, plan, check, re-plan), the runs where the estimate decided, the pairs asked, and the
predicted step time, on the true matrix, of the plan adopted over that of the plan made on the estimates
(below 1: measuring helped).

Re-plans (``jobs/lead.py _checked_plan``): in each run a random member of the adopted plan then dies, and the
leader's snapshot of the survivors (``verify_links.member_links`` on the same table, the pairs without a figure
filled at the slowest measured one, as after a loss: ``replan.fill_unmeasured``) is planned alone and through
``verify_links.checked_plan``; the same figures (``replan_*``). ``python -m benchmarks.pair_check [--quick]``
"""

from __future__ import annotations

import math
import random
import statistics
import time
from typing import Any

import trio

from benchmarks._common import headline, parser, write
from benchmarks.planner import device, gpt_like
from benchmarks.swarm_scale import LINK_MIX
from fusionp2p.jobs.replan import fill_unmeasured
from fusionp2p.jobs.verify_links import (
    checked_plan,
    estimate_table,
    estimated_links,
    member_links,
    verified_plan,
)
from fusionp2p.plan import Link, PlannerConfig, Snapshot, predict
from fusionp2p.plan.joint import plan_joint
from fusionp2p.plan.plan import Plan
from fusionp2p.plan.snapshot import snapshot_from_records
from fusionp2p.wire.records import BandwidthReport, Measurement

NAME = "pair_check"
PROBED = 24   # peers a node measures (ProbeConfig.peers)


def draw(rng: random.Random) -> tuple[float, float, float]:
    """(uplink, downlink, one-way latency) of one access link from LINK_MIX."""
    x, acc = rng.random(), 0.0
    row = LINK_MIX[-1]
    for r in LINK_MIX:
        acc += r[1]
        if x <= acc:
            row = r
            break
    _, _, down, up, lat = row
    lu = lambda lo_hi: math.exp(rng.uniform(math.log(lo_hi[0]), math.log(lo_hi[1])))  # noqa: E731
    d = lu(down)
    return (lu(up) if up else d), d, rng.uniform(*lat)


def scenario(n: int, seed: int, liar: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    peers = [f"m{i:03d}" for i in range(n)]
    caps = {p: draw(rng) for p in peers}

    def true(a: str, b: str) -> Link:
        return Link(bandwidth_bps=min(caps[a][0], caps[b][1], caps[b][0], caps[a][1]), latency_s=caps[a][2] + caps[b][2])

    lying = peers[0] if liar else ""
    measured: set[tuple[str, str]] = set()
    for a in peers:
        for b in rng.sample([p for p in peers if p != a], min(PROBED, n - 1)):
            if (b, a) not in measured and b != lying:   # nobody has measured the liar yet: it measured its own
                measured.add((a, b))
    reports = []
    for p in peers:
        up, down, _ = caps[p]
        k = 100.0 if p == lying else 1.0
        reports.append(BandwidthReport(peer=p, seq=1, uplink=up * k, downlink=down * k, measurements=tuple(
            Measurement(src=p, dst=b, bandwidth=true(p, b).bandwidth_bps, rtt=2 * true(p, b).latency_s, samples=3)
            for a, b in sorted(measured) if a == p)))
    links = [(a, b, true(a, b)) for a, b in sorted(measured)]
    profiles = [(p, device(math.exp(rng.uniform(math.log(2e12), math.log(2e13))))) for p in peers]
    workload = gpt_like(layers=12, hidden=768, seq=256, batch=4)
    cfg = PlannerConfig(micro_batches=8)

    def planner(snap: Snapshot) -> Plan:
        return plan_joint(workload, snap, cfg)

    def score(plan: Plan, snap: Snapshot) -> float:
        return predict(plan, workload, snap, cfg).step_time_s

    asked: list[tuple[str, str]] = []

    async def ask(a: str, b: str, timeout: float) -> Link | None:
        asked.append((a, b))
        return true(a, b)

    table = estimate_table(reports)
    out: dict[str, Any] = {}

    async def main() -> None:
        c0 = time.process_time()
        _, plan, chk = await verified_plan("bench", profiles, links, table, planner, ask, score=score)
        out["verified_cpu_s"] = time.process_time() - c0
        out["depends"], out["decides"], out["asked"] = len(chk.depends), chk.decides, len(asked)
        out["adopted"] = plan

    trio.run(main)
    full = Snapshot(job="bench", epoch=0, members=dict(profiles), links={
        (a, b): true(a, b) for i, a in enumerate(peers) for b in peers[i + 1:]})
    # the plan on the estimates alone (what was adopted without the check), and its CPU
    est = estimated_links(table, peers, links)
    snap0 = snapshot_from_records("bench", 0, profiles, [*links, *((a, b, lk) for (a, b), lk in est.items())])
    c0 = time.process_time()
    plan0 = planner(snap0)
    out["plan_cpu_s"] = time.process_time() - c0
    t0 = predict(plan0, workload, full, cfg).step_time_s
    adopted = out.pop("adopted")
    t1 = predict(adopted, workload, full, cfg).step_time_s
    out["true_step_ratio"] = t1 / t0
    out.update(n=n, seed=seed, liar=liar, estimated_pairs=len(est))
    out.update(replan(rng.choice(adopted.peers), peers, profiles, table, planner, score, ask, asked, true, workload, cfg))
    return out


def replan(dead: str, peers: list[str], profiles: list[tuple[str, Any]], table: Any, planner: Any, score: Any,
           ask: Any, asked: list[tuple[str, str]], true: Any, workload: Any, cfg: PlannerConfig) -> dict[str, Any]:
    """The leader's re-plan after *dead*, a member of the adopted plan, died (module docstring)."""
    members = [p for p in peers if p != dead]
    links, est = member_links(table, members)
    links, _ = fill_unmeasured(members, links)
    snap = snapshot_from_records("bench", 1, [(p, prof) for p, prof in profiles if p != dead], links)
    out: dict[str, Any] = {"replan_estimated_pairs": len(est)}
    asked.clear()

    async def main() -> None:
        c0 = time.process_time()
        _, plan, chk = await checked_plan("bench", snap, est, table, planner, ask, score=score)
        out["replan_checked_cpu_s"] = time.process_time() - c0
        out["replan_depends"], out["replan_decides"], out["replan_asked"] = len(chk.depends), chk.decides, len(asked)
        out["adopted"] = plan

    trio.run(main)
    c0 = time.process_time()
    plan0 = planner(snap)
    out["replan_cpu_s"] = time.process_time() - c0
    full = Snapshot(job="bench", epoch=1, members=dict(snap.members), links={
        (a, b): true(a, b) for i, a in enumerate(members) for b in members[i + 1:]})
    out["replan_true_step_ratio"] = (predict(out.pop("adopted"), workload, full, cfg).step_time_s
                                     / predict(plan0, workload, full, cfg).step_time_s)
    return out


def main() -> None:
    args = parser(NAME, __doc__).parse_args()
    sizes = (8, 32) if args.quick else (8, 32, 64)
    runs = 4 if args.quick else 8
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    for n in sizes:
        got = [scenario(n, seed, liar=seed % 4 == 0) for seed in range(runs)]
        rows += got
        s = {"n": n, "runs": runs, "plan_cpu_s": statistics.median(r["plan_cpu_s"] for r in got),
             "verified_cpu_s": statistics.median(r["verified_cpu_s"] for r in got),
             "decided": sum(r["decides"] for r in got), "asked_max": max(r["asked"] for r in got),
             "true_step_ratio_min": min(r["true_step_ratio"] for r in got),
             "true_step_ratio_max": max(r["true_step_ratio"] for r in got)}
        s["overhead"] = s["verified_cpu_s"] / s["plan_cpu_s"]
        s.update(replan_cpu_s=statistics.median(r["replan_cpu_s"] for r in got),
                 replan_checked_cpu_s=statistics.median(r["replan_checked_cpu_s"] for r in got),
                 replan_decided=sum(r["replan_decides"] for r in got), replan_asked_max=max(r["replan_asked"] for r in got),
                 replan_true_step_ratio_min=min(r["replan_true_step_ratio"] for r in got),
                 replan_true_step_ratio_max=max(r["replan_true_step_ratio"] for r in got))
        summary.append(s)
        print(f"N={n:3d}: plan {s['plan_cpu_s']:.3f} CPU-s, verified planning {s['verified_cpu_s']:.3f} "
              f"({s['overhead']:.2f}x), decided in {s['decided']}/{runs}, at most {s['asked_max']} pairs asked, "
              f"adopted/unchecked true step time {s['true_step_ratio_min']:.3f}-{s['true_step_ratio_max']:.3f}")
        print(f"       re-plan: plan {s['replan_cpu_s']:.3f} CPU-s, checked {s['replan_checked_cpu_s']:.3f}, decided in "
              f"{s['replan_decided']}/{runs}, at most {s['replan_asked_max']} pairs asked, adopted/unchecked true step "
              f"time {s['replan_true_step_ratio_min']:.3f}-{s['replan_true_step_ratio_max']:.3f}")
    worst = max(s["overhead"] for s in summary)
    write(NAME, args.out, {"rows": rows, "summary": summary},
          headline("CPU of the verified first planning over the plan alone, median per size, worst size", worst,
                   "x", 3.0, "lower", "the publisher's plan without the check, same run"), quick=args.quick)


if __name__ == "__main__":
    main()
