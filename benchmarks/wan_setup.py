"""Scenarios, calibration and the five systems' plans of the geo-distributed benchmark (issue 8).

The harness (``benchmarks/wan.py``) calls :func:`prepare` once per run. It traces the reference
GPT-2, measures this machine's single-thread compute rate, builds the planner's snapshot from the
scenario's *shaped* rates and the hosts' slowdown factors, plans the five systems, encodes every
stage program (weights included, so that every system starts from the same initial weights) and
writes one job file that each worker process (``benchmarks/wan_worker.py``) reads.

Replicas. The stage worker (``train/worker.py``) runs ``R`` pipelines, replica ``r`` of each
stage talking to replica ``r`` of its neighbours, so every stage must have the same replica count.
All five systems therefore use ``R = 2`` pipelines: hosts are grouped into pairs and each pair acts
as one *replica group* (a virtual device whose speed is the slower member's, and whose link to
another group is the slower of the two pipelines' links). The baselines pair hosts in peer-id order
(blind to the network, as a user who just lists machines would); OP-Fence pairs each host with the
host it has the fastest link to (its bandwidth cluster). The planner then cuts the model over the
groups: ``plan_even_layers`` (A), ``plan_even_flops`` (B), ``make_plan`` without (3) and with (4, 5)
AdaTopK. Systems A, B, 3 and 4 all-reduce gradients between the two replicas of each stage every
step (synchronous data parallelism); system 5 replaces that by a CO2 outer step every ``tau`` steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusionp2p.graph import coarsen, partition, stages_from_fences, to_workload, trace
from fusionp2p.graph.dag import OpDAG
from fusionp2p.models import GPT2, GPT2Config
from fusionp2p.net.identity import Identity
from fusionp2p.plan import (
    Link,
    Plan,
    PlannerConfig,
    Snapshot,
    make_plan,
    plan_even_flops,
    plan_even_layers,
    predict,
)
from fusionp2p.testbed.spec import TestbedSpec, load_spec
from fusionp2p.types import DeviceProfile, WorkloadGraph
from fusionp2p.wire.dag import encode_stage

SPECS = Path(__file__).resolve().parent.parent / "fusionp2p" / "testing" / "specs"
SCENARIOS = ("lan", "mixed", "slow")
SYSTEMS = ("A", "B", "OPF", "OPF+TopK", "OPF+TopK+CO2")
DESCRIPTIONS = {
    "A": "even split by layers, dense, GPipe, sync grad all-reduce",
    "B": "even split by FLOPs, dense, GPipe, sync grad all-reduce",
    "OPF": "OP-Fence, dense, sync grad all-reduce",
    "OPF+TopK": "OP-Fence + AdaTopK, sync grad all-reduce",
    "OPF+TopK+CO2": "OP-Fence + AdaTopK + CO2 across replicas",
}
REPLICAS = 2
GOODPUT = 0.956        # TCP goodput / shaped rate at MTU 1500 (docs/bench/testbed.md)
P2P_PORT = 4400        # libp2p port of every worker inside its own namespace


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """What every system trains: model, data, optimizer, and how many samples."""

    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 2
    seq_len: int = 64
    micro_batch: int = 8
    micro_batches: int = 4
    samples: int = 1024            # sequences per system (all systems train the same number)
    lr: float = 3e-3
    tau: int = 4                   # CO2 local steps between averaging rounds
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        per_step = REPLICAS * self.micro_batch * self.micro_batches
        if self.samples < per_step or self.samples % per_step:
            raise ValueError(f"samples must be a positive multiple of {per_step} (replicas x micro_batch x micro_batches)")
        if self.tau < 1:
            raise ValueError("tau must be >= 1")

    @property
    def steps(self) -> int:
        return self.samples // (REPLICAS * self.micro_batch * self.micro_batches)


def load_scenario(name: str) -> TestbedSpec:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose one of {SCENARIOS}")
    return load_spec(SPECS / f"wan_{name}.json")


def build_model(cfg: RunConfig) -> tuple[OpDAG, WorkloadGraph]:
    """Trace the reference GPT-2 (seeded init, untied head so embedding and head may sit apart)."""
    torch.manual_seed(cfg.seed)
    model = GPT2(GPT2Config.tiny(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, block_size=cfg.seq_len))
    x = torch.zeros(cfg.micro_batch, cfg.seq_len, dtype=torch.long)
    dag = trace(model, (x, x.clone()))
    return dag, to_workload(coarsen(dag), micro_batch=cfg.micro_batch)


def calibrate(dag: OpDAG, wl: WorkloadGraph, cfg: RunConfig, *, repeats: int = 3) -> float:
    """FLOP/s of one torch thread on this machine for this model: a whole forward+backward of one
    micro-batch (best of ``repeats``), so the planner's compute model is in this machine's units."""
    torch.manual_seed(cfg.seed)
    model = GPT2(GPT2Config.tiny(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, block_size=cfg.seq_len))
    x = torch.randint(0, 256, (cfg.micro_batch, cfg.seq_len))
    best = math.inf
    for _ in range(repeats + 1):   # the first round warms up the allocator
        t = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        best = min(best, time.perf_counter() - t)
    work = sum(u.fwd_flops + u.bwd_flops for u in wl.units)
    return work / best


@dataclass(frozen=True, slots=True, kw_only=True)
class HostInfo:
    name: str
    seed: str                  # hex Ed25519 seed of the worker's identity (peer ids known in advance)
    peer: str
    addr: str
    port: int
    slowdown: float
    up_bps: float              # shaped rates in bit/s (inf = unshaped)
    down_bps: float


def hosts_of(spec: TestbedSpec, addrs: Sequence[str], ports: Sequence[int], seed: int) -> list[HostInfo]:
    out = []
    for h, a, p in zip(spec.hosts, addrs, ports, strict=True):
        sd = hashlib.sha256(f"fusionp2p-wan/{seed}/{h.name}".encode()).digest()   # Ed25519 seed
        out.append(HostInfo(name=h.name, seed=sd.hex(), peer=Identity(sd).peer_id, addr=a, port=p,
                            slowdown=h.slowdown, up_bps=float(h.up_bps or math.inf),
                            down_bps=float(h.down_bps or math.inf)))
    return out


def link_bps(a: HostInfo, b: HostInfo) -> float:
    """TCP goodput of a flow a -> b in bytes/s (the testbed shapes a's uplink and b's downlink)."""
    return min(a.up_bps, b.down_bps) * GOODPUT / 8


def group_snapshot(groups: Sequence[tuple[HostInfo, ...]], flops: float, job: str) -> Snapshot:
    """Each replica group becomes one planner device: the slowest member's compute, and towards
    another group the slower of the pipelines' links (both directions; pipelines run in step)."""
    members, links = {}, {}
    for g in groups:
        members[g[0].peer] = DeviceProfile(device="cpu", kind="cpu", name=f"group {'+'.join(h.name for h in g)}",
                                           flops_fp32=flops / max(h.slowdown for h in g), flops_bf16=0.0,
                                           memory_bytes=4 << 30, threads=1)
    for i, g in enumerate(groups):
        for h in groups[i + 1:]:
            bw = min(min(link_bps(a, b), link_bps(b, a)) for a, b in zip(g, h, strict=True))
            links[(g[0].peer, h[0].peer)] = Link(bandwidth_bps=min(bw, 1.25e10), latency_s=2e-4)
    return Snapshot(job=job, epoch=0, members=members, links=links)


def pair_by_peer_id(hosts: Sequence[HostInfo]) -> list[tuple[HostInfo, ...]]:
    s = sorted(hosts, key=lambda h: h.peer)
    return [tuple(s[i:i + REPLICAS]) for i in range(0, len(s) - len(s) % REPLICAS, REPLICAS)]


def pair_by_bandwidth(hosts: Sequence[HostInfo]) -> list[tuple[HostInfo, ...]]:
    """Greedy: the pair with the fastest link (then the most similar compute) first."""
    left = list(hosts)
    out: list[tuple[HostInfo, ...]] = []
    while len(left) >= REPLICAS:
        best = max(((a, b) for i, a in enumerate(left) for b in left[i + 1:]),
                   key=lambda p: (min(link_bps(p[0], p[1]), link_bps(p[1], p[0])),
                                  -abs(p[0].slowdown - p[1].slowdown), p[0].peer))
        out.append(best)
        left = [h for h in left if h not in best]
    return out


def allreduce_s(groups: Sequence[tuple[HostInfo, ...]], plan: Plan, wl: WorkloadGraph) -> float:
    """Predicted seconds of one synchronous all-reduce of every stage's gradients (stages in parallel,
    two replicas exchange their whole gradient over their link)."""
    by_lead = {g[0].peer: g for g in groups}
    worst = 0.0
    for st in plan.stages:
        g = by_lead[st.replicas[0]]
        nbytes = sum(u.param_bytes for u in wl.units[st.start:st.end])
        bw = min(link_bps(a, b) for a in g for b in g if a is not b)
        worst = max(worst, nbytes / bw)
    return worst


def _plan_one(name: str, groups: Sequence[tuple[HostInfo, ...]], wl: WorkloadGraph, flops: float,
              cfg: RunConfig) -> tuple[Plan, float, float, float, list[tuple[HostInfo, ...]]]:
    """(plan, pipeline step, all-reduce, predicted step) of one system on one set of replica groups."""
    pcfg = PlannerConfig(micro_batches=cfg.micro_batches, replicas=False, compression=name not in ("A", "B", "OPF"))
    snap = group_snapshot(groups, flops, job=f"wan-{name}")
    if name == "A":
        plan = plan_even_layers(wl, snap, pcfg, seed=cfg.seed)
    elif name == "B":
        plan = plan_even_flops(wl, snap, pcfg, seed=cfg.seed)
    else:
        plan = make_plan(wl, snap, pcfg, seed=cfg.seed)
    pred = predict(plan, wl, snap, pcfg)
    ar = allreduce_s(groups, plan, wl)
    # CO2: one averaging round per tau steps (the stage worker runs it at the boundary), so it costs
    # ar / tau per step; synchronous data parallelism pays ar every step.
    step = pred.step_time_s + (ar / cfg.tau if name == "OPF+TopK+CO2" else ar)
    return plan, pred.step_time_s, ar, step, list(groups)


def plan_systems(hosts: Sequence[HostInfo], wl: WorkloadGraph, flops: float, cfg: RunConfig) -> list[dict[str, Any]]:
    """The five systems: plan, replica groups, predicted step time (seconds per step of R pipelines).

    OP-Fence plans pipelines; it does not see the replicas' gradient exchange (our replica groups
    are opaque to it). So for the OP-Fence systems every subset of replica groups is planned and the
    subset with the lowest predicted step *including* that exchange (per step for synchronous
    all-reduce, per tau steps for CO2) is kept: a slow group is left idle rather than made to
    all-reduce over its slow link, unless CO2 amortises that link."""
    base = pair_by_peer_id(hosts)
    opf = pair_by_bandwidth(hosts)
    out = []
    for name in SYSTEMS:
        if name in ("A", "B"):
            plan, pipe, ar, step, groups = _plan_one(name, base, wl, flops, cfg)
        else:
            cands = [_plan_one(name, [g for k, g in enumerate(opf) if mask >> k & 1], wl, flops, cfg)
                     for mask in range(1, 1 << len(opf))]
            plan, pipe, ar, step, groups = min(cands, key=lambda c: c[3])
        by_lead = {g[0].peer: g for g in groups}
        stages = [{"start": st.start, "end": st.end, "replicas": [h.name for h in by_lead[st.replicas[0]]]}
                  for st in plan.stages]
        out.append({"name": name, "description": DESCRIPTIONS[name], "algorithm": plan.algorithm,
                    "stages": stages, "fences": [f.unit for f in plan.fences],
                    "rho": [f.rho for f in plan.fences], "averaging": "co2" if name == "OPF+TopK+CO2" else "allreduce",
                    "pred_pipeline_step_s": pipe, "pred_allreduce_s": ar, "pred_step_s": step,
                    "pred_bottleneck_s": plan.bottleneck_s})
    return out


def prepare(spec: TestbedSpec, cfg: RunConfig, workdir: Path, *, addrs: Sequence[str], ports: Sequence[int],
            cpu_share: float) -> dict[str, Any]:
    """Plan everything and write ``workdir/job.json`` plus one stage program file per system and stage."""
    dag, wl = build_model(cfg)
    flops1 = calibrate(dag, wl, cfg)
    flops = flops1 * cpu_share
    hosts = hosts_of(spec, addrs, ports, cfg.seed)
    systems = plan_systems(hosts, wl, flops, cfg)
    coarse = coarsen(dag)
    for k, sysd in enumerate(systems):
        progs = partition(coarse, stages_from_fences(len(coarse.units), sysd["fences"]))
        for s, prog in enumerate(progs):
            path = workdir / f"sys{k}-stage{s}.fpdg"
            path.write_bytes(encode_stage(prog))
            sysd["stages"][s]["program"] = path.name
    job = {"run": dataclasses.asdict(cfg), "steps": cfg.steps, "replicas": REPLICAS,
           "flops_1thread": flops1, "cpu_share": cpu_share, "flops_planned": flops,
           "hosts": [dataclasses.asdict(h) for h in hosts], "systems": systems, "workdir": str(workdir),
           "units": [u.name for u in wl.units]}
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "job.json").write_text(json.dumps(job, indent=1))   # unshaped rates are written as Infinity
    return job


def default_cpu_share(n_hosts: int) -> float:
    """Every emulated device gets an even share of this machine's cores (all processes share them)."""
    return min(1.0, (os.cpu_count() or 1) / n_hosts)


__all__ = ["DESCRIPTIONS", "REPLICAS", "SCENARIOS", "SYSTEMS", "RunConfig", "load_scenario", "prepare"]
