"""Training under churn: the same job with and without members dying, on real node processes.

A bootstrap and 5 ``fusionp2p node`` processes on loopback (CLI, ``LocalCluster``) train the demo's
GPT-2 (CO2, AdaTopK) in a layout pinned for both runs (``--stages``, default 1, x 2 replicas; the other
nodes stand by). The undisturbed run trains the
job to the end. The churn run trains the same job while a seeded schedule SIGKILLs one member of the
current plan every ``--every`` seconds (no goodbye) and starts a fresh node ``--rejoin`` seconds later;
the members re-plan around each loss and take the newcomer in.

Per event: the recovery time, from the kill to the first completed step of a newer epoch (the job's
progress events on the publisher; steps still finishing in the broken epoch's other pipeline do not count),
where that time went (``PHASES``: detection, halt, plan adoption, state fetch, links, then the first step,
from the nodes' logs), and the steps lost (trained again). Overall: goodput (steps per second of the
training phase under churn / without), and
the held-out loss of the two trained models (evaluation batches no step trained on) at the same number
of steps. Headline: the goodput ratio (target 0.9 at one kill a minute, 0.75 at one every 25 s with
``--quick``); ``recovery_s_median`` among the results (target 5 s).

**The same layout in both runs.** Goodput and the held-out loss compare churn with calm only if both
train the same layout: left free, the planner chose 1 stage x 2 replicas for the calm run and 2 x 2, then
1 x 2, under churn (its measured speeds differ run to run), so the ratios compared layouts. Both runs' jobs
pin it: ``TrainConfig.stages`` (``--stages``, default 1: the calm run's own choice on this model) and
``replicas=2``, the hint and bound of the replica count, which OP-Fence keeps unless another count is
predicted 10% faster (data parallel on loopback is nearly twice as fast, so it keeps it). A step trains
``replicas x micro_batches x micro_batch`` samples (``data/stream.py``), so equal replicas are equal samples.
The kill schedule keeps enough nodes for the layout: the next kill waits until the last one recovered and
the fresh node started after it accepted the job (``kill_waited_s`` per kill). The result says whether it
held (``same_layout``: every plan of both runs had the same stages x replicas; ``equal_samples``: the
same replicas per stage, with each run's samples).

**A stable recipe.** The demo's job (lr 2e-3 from step 0, no warm-up) spikes early, and how much depends on
the micro-batches each replica runs a step, which the plan deals by the nodes' measured speeds: every 1 x 2 run
dealt evenly spiked at step 8 (loss 5.03 after 3.67, the same in five runs) and stayed on a worse course (Adam's
second moments keep the spike's gradients for hundreds of steps), while runs dealt 3.625/4.375 did not. So the
full-rate comparison of issue 41 (held-out loss ratio 0.864) compared a calm run dealt evenly with a churn run
dealt by speed from step 0, 180 steps before its first kill; their curves part at step 1 and the spike at step 8.
Both runs' job warms the lr up over ``--warmup`` steps (default ``WARMUP``; no spike in the same embedded runs),
and the result lists each run's deals and its loss spikes (``loss_spikes``: a run with one compares courses,
not churn). The deal still moves the loss a little with the warm-up (embedded, the first 100 steps: mean
training loss over steps 80-99 2.518 dealt evenly, 2.475 dealt 3.5/4.5), and the planner deals by speeds
measured anew in each run, so ``deals`` says whether a ratio near the 2% target compares equal deals.

**A joiner's own machine** (``--joiner-nice N``, default 0: not used). All the processes share this host's
cores, so each fresh node's start-up (imports, torch, its device benchmark, the job's intake: several
CPU-seconds) takes them from the members' training, which a node starting on its own machine would not. With
N > 0 each fresh node runs at N above the others' nice value until it accepted the job (``READY``), then at
theirs; the result goes to ``churn[_quick]_joiner_nice.json`` and its headline says so. It is a change of
method, not of the code measured: read it beside the default run's figure.

**Nodes forked pre-imported** (``--preload``, default off). Every node process, the fresh ones included, is
forked from one forkserver that imported torch and the node's modules (``LocalCluster(preload=True)``, as the
demo and benchmarks.e2e run): a fresh node's start-up then costs the members no imports (torch's alone is
some 2.2 CPU-seconds idle), the rest (listening, probes, its device benchmark, the job's intake) as before.
Like ``--joiner-nice`` it changes the method, not the code measured: the result goes to
``churn[_quick][_joiner_nice]_preload.json`` and its headline says so.

**A quiet start, and where the first seconds' CPU went.** Each run starts once the machine is quiet
(``settle``: under ``QUIET_CORES`` busy outside this process, at most ``SETTLE_S`` seconds; the result's
``settled``), and its result holds, per 20 s of its first 80 s, the CPU-seconds of every node process, of
this process and of the machine beyond both (``cpu_first_s``, ``outside``): the full rate's churn run
trained its first 98 steps, before any kill, at 1.75 steps/s against the calm run's 2.68 (2026-11-29 20:33),
with the node processes' CPU a step nearly equal. A diagnostic without kills: ``--every 100000`` runs the
calm job twice (give ``--out``).

**Failing fast.** A run in which no step completes for ``--stall`` seconds (every member killed faster
than fresh nodes came up, under a loaded machine) stops with the reason (the last step, the plan, the
live nodes) instead of waiting out the job's 900 s.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime
import itertools
import logging
import math
import os
import random
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from benchmarks._common import RESULTS, headline, parser, write
from fusionp2p.cli.cluster import LocalCluster, wait_until
from fusionp2p.cli.demo import SEQ_LEN, demo_config, demo_model
from fusionp2p.data import BatchSampler, BuiltinCorpus, SamplerConfig, corpus_tokens
from fusionp2p.jobs.events import JobStateChanged, PlanChanged, StepProgress
from fusionp2p.sdk import Swarm
from fusionp2p.train.config import TrainConfig

HELD_OUT_FROM = 1_000_000     # sampler steps far beyond any job's: batches no step trained on
# Where a recovery's time goes: the nodes' log lines that mark each phase, in the order they happen. For
# each kill the phase's time is that of its last line (over all nodes) before the first step of the new
# epoch, in seconds after the kill: the member that finished the phase last is the one the job waited for.
PHASES = (("noticed", re.compile(r"pipeline broken")),
          ("detected", re.compile(r"leading a re-plan|switching to the fallback plan")),
          ("halted", re.compile(r"units lost every live state|halted at step")),
          ("adopted", re.compile(r"epoch \d+: plan \w+ adopted")),
          ("state", re.compile(r"epoch \d+: state of stage")),
          ("links", re.compile(r"epoch \d+: \d+ links up")))
# lr warm-up steps of both runs' job (module docstring, "A stable recipe"); and what counts as a loss spike
WARMUP = 20
SPIKE = 1.15
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


FIRST = {"noticed"}   # phases timed by their first line (a neighbour of the dead node saw its link break)
TICK = 2.0            # seconds between looks at a run that reports nothing (stall, next kill)
READY = "accepted job"        # a fresh node's log line once it holds the job (a standby the next re-plan takes in)


class Stalled(RuntimeError):
    """No step completed for too long: the run cannot go on (the reason says why)."""


def _events(job: Any, tick: float) -> Any:
    """The job's progress events, with None every *tick* seconds without one (Job.events ends at a timeout)."""
    while True:
        try:
            yield from job.events(timeout=tick)
            return
        except TimeoutError:
            yield None


def samples(layouts: list[tuple[int, list[int], int]], steps: int, per_replica: int) -> int:
    """Samples the trained model saw: per plan, its steps (from its first step to the next plan's) x its
    stage-0 replicas x *per_replica* (micro-batches x micro-batch)."""
    out = 0
    for i, (_, sizes, first) in enumerate(layouts):
        end = layouts[i + 1][2] if i + 1 < len(layouts) else steps
        out += max(0, min(end, steps) - first) * sizes[0] * per_replica
    return out


def phases(home: Path, kill_at: float, resumed_at: float) -> dict[str, float]:
    """Per phase (PHASES), seconds from the kill (wall clock) to its last log line before *resumed_at*
    (its first, for the phases in FIRST)."""
    out: dict[str, float] = {}
    for log_path in home.glob("node*.log"):
        for line in log_path.read_text(errors="replace").splitlines():
            m = _STAMP.match(line)
            if m is None:
                continue
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if not kill_at < t <= resumed_at:
                continue
            for name, pat in PHASES:
                if pat.search(line):
                    old = out.get(name)
                    out[name] = t - kill_at if old is None else (min if name in FIRST else max)(old, t - kill_at)
    return {name: round(out[name], 2) for name, _ in PHASES if name in out}


class CpuMeter:
    """CPU-seconds (user + system) of a cluster's processes over time, read from /proc every *period*
    seconds by a thread: under a loaded machine wall-clock phases stretch, CPU-seconds say what work a
    recovery cost. Dead processes keep their last reading. ``series`` keeps each process's own readings
    (by its cluster name) for :func:`breakdown`."""

    def __init__(self, cluster: LocalCluster, period: float = 0.2) -> None:
        self.cluster, self.period = cluster, period
        self.samples: list[tuple[float, float]] = []   # (wall clock, CPU-seconds of every process so far)
        self.series: dict[str, list[tuple[float, float]]] = {}   # per process: (wall clock, its CPU-seconds so far)
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> float:
        now = time.time()
        for name, p in list(self.cluster.procs.items()):
            try:
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                self._last[p.pid] = cpu = (int(fields[11]) + int(fields[12])) / self._tick
                self.series.setdefault(name, []).append((now, cpu))
            except (OSError, IndexError, ValueError):
                pass   # gone: its last reading stays
        # beside the nodes: this benchmark's own process (its client swarm, the meter) and the whole machine's
        # busy CPU, so that a slow window says whether the CPU the members lacked went to a node, to us or to
        # something outside the cluster (OUTSIDE in first_windows)
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
            self.series.setdefault(BENCH, []).append((now, (int(fields[11]) + int(fields[12])) / self._tick))
        with contextlib.suppress(OSError, IndexError, ValueError):
            cpu_line = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
            # user nice system (idle iowait excluded) irq softirq steal
            busy = sum(int(cpu_line[i]) for i in (0, 1, 2, 5, 6, 7)) / self._tick
            self.series.setdefault(MACHINE, []).append((now, busy))
        return sum(self._last.values())

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append((time.time(), self._read()))

    def __enter__(self) -> CpuMeter:
        self.samples.append((time.time(), self._read()))
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> float:
        """CPU-seconds so far at wall clock *t* (the last sample at or before it)."""
        i = bisect.bisect_right(self.samples, (t, math.inf)) - 1
        return self.samples[max(0, i)][1]

    def phases(self, kill_at: float, ends: dict[str, float]) -> dict[str, float]:
        """CPU-seconds of every process spent in each phase (from the previous phase's end to its own)."""
        out, prev = {}, kill_at
        for name, end in sorted(ends.items(), key=lambda kv: kv[1]):
            out[name] = round(self.at(kill_at + end) - self.at(prev), 2)
            prev = kill_at + end
        return out


BENCH, MACHINE, OUTSIDE = "benchmark", "machine", "outside"   # CpuMeter's series beside the nodes'
FIRST_S = 80.0    # first_windows: the training phase's first seconds (the full rate's first kill comes after 60)
WINDOW_S = 20.0   # the breakdown's windows: the seconds after a kill, and a fresh node's first seconds (its start-up)
_REDEAL = re.compile(r"replica (\d+): from step (\d+), ([\d., ]+) micro-batches a step")


def breakdown(series: dict[str, list[tuple[float, float]]], *, start: float, end: float, kills: list[float],
              joins: dict[str, float], plans: list[tuple[float, list[str]]], step_at: dict[int, float],
              window: float = WINDOW_S) -> dict[str, dict[str, Any]]:
    """Where a run's CPU went, per window of its training phase [*start*, *end*] (wall clock) and per role.

    Windows (they overlap: a kill's window holds its fresh node's first seconds): ``after_kill`` the
    *window* seconds after each kill, ``joiner_start`` each fresh node's first *window* seconds (from its
    start in *joins*), ``between`` the rest, ``all`` the whole phase. Roles at each moment: ``members`` the
    nodes of the plan in force (*plans*: (from when, member names), in order), ``joiner`` a fresh node in
    its first *window* seconds and not yet a member, ``bootstrap``, ``standbys`` every other node. A
    process's CPU between two readings of *series* (name: (wall clock, CPU-seconds so far)) counts at the
    later one; a process started after *start* counts its CPU from 0. Per window: its seconds, the steps
    completed in it (*step_at*: step -> wall clock), CPU-seconds per role and per step."""
    plan_t = [t for t, _ in plans]

    def role(name: str, t: float) -> str:
        i = bisect.bisect_right(plan_t, t) - 1
        if i >= 0 and name in plans[i][1]:
            return "members"
        if name == "bootstrap":
            return "bootstrap"
        return "joiner" if name in joins and joins[name] <= t < joins[name] + window else "standbys"

    def windows(t: float) -> list[str]:
        out = ["all"]
        if any(k <= t < k + window for k in kills):
            out.append("after_kill")
        if any(j <= t < j + window for j in joins.values()):
            out.append("joiner_start")
        if len(out) == 1:
            out.append("between")
        return out

    names = ("all", "between", "after_kill", "joiner_start")
    cpu: dict[str, dict[str, float]] = {w: {} for w in names}
    for name, readings in series.items():
        if name in (BENCH, MACHINE):
            continue   # not a node: first_windows reads them
        prev = 0.0 if readings and readings[0][0] > start else None
        for t, c in readings:
            if prev is not None and start < t <= end:
                r = role(name, t)
                for w in windows(t):
                    cpu[w][r] = cpu[w].get(r, 0.0) + (c - prev)
            prev = c
    # each window's seconds: the phase cut at every window's edges
    edges = sorted({start, end, *(x for k in [*kills, *joins.values()] for x in (k, k + window) if start < x < end)})
    secs = dict.fromkeys(names, 0.0)
    for a, b in itertools.pairwise(edges):
        for w in windows((a + b) / 2):
            secs[w] += b - a
    steps = dict.fromkeys(names, 0)
    for t in step_at.values():
        if start <= t <= end:
            for w in windows(t):
                steps[w] += 1
    out: dict[str, dict[str, Any]] = {}
    for w in names:
        total = sum(cpu[w].values())
        out[w] = {"s": round(secs[w], 1), "steps": steps[w],
                  "steps_per_s": round(steps[w] / secs[w], 3) if secs[w] else None,
                  "cpu_s": {r: round(x, 2) for r, x in sorted(cpu[w].items())}, "cpu_s_all": round(total, 2),
                  "cpu_s_per_step": ({r: round(x / steps[w], 3) for r, x in sorted(cpu[w].items())}
                                     | {"all": round(total / steps[w], 3)}) if steps[w] else {},
                  "cores": {r: round(x / secs[w], 3) for r, x in sorted(cpu[w].items())} if secs[w] else {}}
    return out


QUIET_CORES = 0.3   # settle: a run starts once the machine's CPU outside this process is under this many cores
SETTLE_S = 60.0     # ... or after this long (a shared machine is never quiet: the wait is recorded, not hidden)


def busy_cpu() -> float:
    """CPU-seconds the whole machine spent busy so far, less this process's (/proc/stat, /proc/self/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu_line = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (sum(int(cpu_line[i]) for i in (0, 1, 2, 5, 6, 7)) - int(fields[11]) - int(fields[12])) / tick


def settle(busy: Any = busy_cpu, *, quiet: float = QUIET_CORES, timeout: float = SETTLE_S, period: float = 1.0,
           clock: Any = time.monotonic, sleep: Any = time.sleep) -> dict[str, float]:
    """Wait until the machine is quiet: the cores busy outside this process over the last *period* (*busy*:
    CPU-seconds so far) under *quiet*, or *timeout* passed. The undisturbed run's processes are gone when it
    returns, but what their exit set off (the kernel freeing their memory, a previous benchmark's tail, another
    program) would land in the next run's first seconds; the full rate's churn run trained its first 98 steps at
    1.75 steps/s against the calm run's 2.68, before any kill (BENCHMARKS.md). Both runs wait the same way;
    the result says how long and how busy the machine was (``settled``)."""
    t0 = clock()
    last = busy()
    cores = math.inf
    while True:
        sleep(period)
        now = busy()
        cores, last = (now - last) / period, now
        if cores < quiet or clock() - t0 >= timeout:
            return {"waited_s": round(clock() - t0, 1), "cores": round(cores, 2)}


def first_windows(series: dict[str, list[tuple[float, float]]], *, start: float, step_at: dict[int, float],
                  span: float = FIRST_S, width: float = WINDOW_S) -> list[dict[str, Any]]:
    """CPU-seconds per process in each *width* seconds of the first *span* of a training phase from *start*
    (wall clock), with the steps completed in it: every node by name, ``nodes`` their sum, ``benchmark`` this
    process, ``machine`` the whole host's busy CPU and ``outside`` what the machine spent beyond both (another
    program, a process of an earlier run). Series as CpuMeter's (name: (wall clock, CPU-seconds so far)); a
    process's CPU at a moment is its last reading then (0 before its first: started later)."""
    def at(readings: list[tuple[float, float]], t: float) -> float:
        i = bisect.bisect_right(readings, (t, math.inf)) - 1
        return readings[i][1] if i >= 0 else 0.0

    out = []
    for a in np.arange(0.0, span, width):
        t0, t1 = start + float(a), start + float(a) + width
        cpu = {name: round(at(r, t1) - at(r, t0), 2) for name, r in sorted(series.items()) if r}
        nodes = sum(x for name, x in cpu.items() if name not in (BENCH, MACHINE))
        row: dict[str, Any] = {"from_s": float(a), "steps": sum(t0 <= t < t1 for t in step_at.values()),
                               "cpu_s": cpu, "nodes": round(nodes, 2)}
        if MACHINE in cpu:
            row[OUTSIDE] = round(cpu[MACHINE] - nodes - cpu.get(BENCH, 0.0), 2)
        out.append(row)
    return out


def per_epoch(step_at: dict[int, float], step_epoch: dict[int, int], deals: list[tuple[int, list[float]]]
              ) -> list[dict[str, Any]]:
    """Per epoch that stepped: its steps, their span in seconds (first to last completed), steps a second
    over that span and the plan's deal (micro-batches per replica a step; [] even)."""
    by: dict[int, list[int]] = {}
    for s, e in step_epoch.items():
        by.setdefault(e, []).append(s)
    deal = dict(deals)
    out = []
    for e, ss in sorted(by.items()):
        t0, t1 = min(step_at[s] for s in ss), max(step_at[s] for s in ss)
        out.append({"epoch": e, "first_step": min(ss), "steps": len(ss), "span_s": round(t1 - t0, 2),
                    "steps_per_s": round((len(ss) - 1) / (t1 - t0), 3) if t1 > t0 else None,
                    "deal": deal.get(e, [])})
    return out


def ready_after(home: Path, joins: dict[str, float]) -> dict[str, float]:
    """Per fresh node, seconds from its start to its first ``READY`` line (it holds the job: its start-up and
    intake done); nodes that never logged one are left out."""
    out = {}
    for name, t0 in joins.items():
        log_path = home / f"{name}.log"
        if not log_path.exists():
            continue
        for line in log_path.read_text(errors="replace").splitlines():
            m = _STAMP.match(line)
            if m is not None and READY in line:
                t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                out[name] = round(t - t0, 1)
                break
    return out


def redeals(home: Path) -> list[tuple[str, int, int, str]]:
    """The in-band re-deals the nodes logged (train/deal.py): (node, replica, from step, micro-batches a step)."""
    out = [(log_path.stem, int(m.group(1)), int(m.group(2)), m.group(3)) for log_path in sorted(home.glob("node*.log"))
           for m in _REDEAL.finditer(log_path.read_text(errors="replace"))]
    return sorted(out, key=lambda x: x[2])


def renice(pid: int, nice: int) -> None:
    """Every thread of process *pid* at *nice* (on Linux each thread has its own; threads started later take
    their creator's). A thread or process that ended meanwhile is passed over; lowering it again needs
    CAP_SYS_NICE."""
    with contextlib.suppress(FileNotFoundError):   # the process was killed and reaped (a joiner the run killed)
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)


def held_out_loss(path: Path, steps: int, batches: int = 16) -> float:
    model = demo_model()
    model.load_state_dict(safetensors.torch.load_file(str(path)), strict=True)
    cfg = demo_config(steps, 4)
    tokens = corpus_tokens("pydoc")
    s = BatchSampler(SamplerConfig(num_tokens=len(tokens), seq_len=SEQ_LEN, micro_batch=cfg.micro_batch,
                                   micro_batches=cfg.micro_batches, seed=cfg.seed))
    with torch.no_grad():
        return float(np.mean([float(model(torch.from_numpy(s.inputs(tokens, HELD_OUT_FROM + b, 0)),
                                          torch.from_numpy(s.targets(tokens, HELD_OUT_FROM + b, 0)))[1])
                              for b in range(batches)]))


def job_config(steps: int, stages: int, eval_every: int = 0, warmup: int = WARMUP) -> TrainConfig:
    """The demo's job (2 replicas) with its layout pinned: *stages* stages, and *warmup* steps of linear lr
    warm-up (module docstring); *eval_every*: a held-out loss every that many steps (a diagnostic: each
    costs a forward pass)."""
    cfg = demo_config(steps, 4)
    sched = cfg.lr_sched
    assert sched is not None
    return dataclasses.replace(cfg, stages=stages, eval_every=eval_every,
                               lr_schedule=dataclasses.replace(sched, warmup_steps=warmup))


def spikes(losses: dict[int, float], *, window: int = 5, ratio: float = SPIKE) -> list[tuple[int, float, float]]:
    """The steps whose training loss is over *ratio* x the lowest of the *window* steps before it: (step,
    loss, that ratio). A spike early in a run sets its course (module docstring): the runs compare only
    without one."""
    out = []
    for s in sorted(losses):
        before = [losses[t] for t in range(s - window, s) if t in losses]
        if len(before) == window and losses[s] > ratio * min(before):
            out.append((s, round(losses[s], 3), round(losses[s] / min(before), 2)))
    return out


def run(steps: int, home: Path, *, every: float, rejoin: float, seed: int, churn: bool,
        kills: int = 0, stall: float = 120.0, stages: int = 1, eval_every: int = 0,
        warmup: int = WARMUP, joiner_nice: int = 0, preload: bool = False) -> dict[str, Any]:
    rng = random.Random(seed)
    cfg = job_config(steps, stages, eval_every, warmup)
    events: list[dict[str, Any]] = []
    quiet = settle()   # a quiet machine at the start of each run (settle)
    print(f"{datetime.datetime.now():%H:%M:%S} {'churn' if churn else 'calm'} run starts after {quiet['waited_s']} s "
          f"(the machine {quiet['cores']} cores busy outside this process)", flush=True)
    with LocalCluster(5, home, dead_timeout=3.0, probe_interval=60.0, preload=preload) as cluster, CpuMeter(cluster) as cpu, \
            Swarm.connect([cluster.bootstrap], home=home / "client", listen="/ip4/127.0.0.1/tcp/0") as sw:
        wait_until(lambda: len(sw.members()) >= 5, timeout=120, interval=0.5, what="5 members")
        names = {cluster.peer_id(f"node{i}"): f"node{i}" for i in range(5)}
        job = sw.publish(model=demo_model(), dataset=BuiltinCorpus(seq_len=SEQ_LEN), config=cfg, name="churn")
        plan: list[str] = []
        epoch = 0
        plan_epoch = 0   # the epoch of `plan`: steps of a newer epoch whose plan event has not come mean it is stale
        last_step = -1
        t_run = t_end = w_run = w_end = 0.0
        next_kill = np.inf
        pending: list[dict[str, Any]] = []
        layouts: list[tuple[int, list[int], int]] = []
        deals: list[tuple[int, list[float]]] = []
        stop = threading.Event()
        fresh = [5]
        started: list[str] = []      # fresh nodes started so far
        joins: dict[str, float] = {}     # fresh node -> its start (wall clock)
        plan_at: list[tuple[float, list[str]]] = []   # (wall clock, the plan's member names) per plan event
        step_at: dict[int, float] = {}   # step -> when it completed (wall clock), and its epoch
        step_epoch: dict[int, int] = {}
        niced: dict[str, float] = {}     # fresh node -> seconds its start-up ran at --joiner-nice
        killed_n = 0
        last_progress = time.monotonic()
        first_step = False

        def rejoin_later(at: float) -> None:
            while time.monotonic() < at and not stop.is_set():
                time.sleep(0.1)
            if not stop.is_set():
                name = f"node{fresh[0]}"
                fresh[0] += 1
                joins[name] = time.time()
                pid = cluster.add_node(name).pid
                base = os.getpriority(os.PRIO_PROCESS, pid)
                if joiner_nice:   # its start-up beside the training as if on a machine of its own (module docstring)
                    renice(pid, base + joiner_nice)
                names[cluster.peer_id(name)] = name
                started.append(name)
                if joiner_nice:
                    while not stop.is_set() and READY not in (home / f"{name}.log").read_text(errors="replace"):
                        time.sleep(0.1)
                    renice(pid, base)   # a role's training at the priority of every other member
                    niced[name] = round(time.time() - joins[name], 1)

        def ready() -> bool:
            """The last kill recovered and the fresh node started after it accepted the job (a re-plan before then
            plans without it: 3 nodes, one stage x 2 replicas and every fence moved)."""
            if pending or len(started) < killed_n:
                return False
            return all(READY in (home / f"{n}.log").read_text(errors="replace") for n in started[-1:])

        for ev in _events(job, TICK):
            now = time.monotonic()
            if now - last_progress > (stall if first_step else max(stall, 600.0)):
                alive = [names.get(p, p[-8:]) for p in plan if names.get(p) in cluster.alive()]
                raise Stalled(f"no step for {now - last_progress:.0f} s (last step {last_step}, epoch {epoch}; plan "
                              f"{[names.get(p, p[-8:]) for p in plan]}, of which alive {alive}; nodes alive "
                              f"{cluster.alive()}): the job cannot go on")
            if ev is None:
                continue
            if isinstance(ev, JobStateChanged) and ev.state == "running" and not t_run:
                t_run, w_run = now, time.time()
                next_kill = now + every if churn else np.inf
            elif isinstance(ev, PlanChanged):
                plan, plan_epoch = list(ev.members), ev.epoch
                plan_at.append((time.time(), [names.get(p, p) for p in plan]))
                layouts.append((ev.epoch, list(ev.stage_sizes), last_step + 1))   # replicas per stage, from about which step
                deals.append((ev.epoch, list(ev.micro)))   # micro-batches per replica a step ([]: even)
                epoch = max(epoch, ev.epoch)
            elif isinstance(ev, StepProgress) and ev.loss is not None and ev.step < steps:
                step_at.setdefault(ev.step, ev.at or time.time())
                step_epoch[ev.step] = max(ev.epoch, step_epoch.get(ev.step, 0))
                for p in [p for p in pending if ev.epoch > p["epoch"]]:
                    p["recovery_s"] = now - p["t"]
                    wall = time.time()
                    p["phases_s"] = {**phases(home, p["wall"], wall), "stepped": round(wall - p["wall"], 2)}
                    p["cpu_s"] = round(cpu.at(wall) - cpu.at(p["wall"]), 2)
                    print(f"{datetime.datetime.now():%H:%M:%S.%f} step {ev.step} of epoch {ev.epoch}: recovered after "
                          f"{p['recovery_s']:.1f} s ({p['phases_s']})", flush=True)
                    p["resumed_at_step"] = ev.step
                    p["resumed_in_epoch"] = ev.epoch
                    events.append(p)
                    pending.remove(p)
                last_step = max(last_step, ev.step)
                epoch = max(epoch, ev.epoch)   # a kill is timed from the newest epoch that stepped
                t_end, w_end, last_progress = now, time.time(), now
                first_step = True
                if now >= next_kill and plan and plan_epoch == epoch and steps - last_step > 10 \
                        and not (kills and killed_n >= kills) and ready():   # only members of the plan that steps
                    victim = rng.choice(sorted(set(plan)))
                    cluster.kill(names[victim])
                    killed_n += 1
                    pending.append({"t": now, "wall": time.time(), "killed": names[victim], "at_step": last_step,
                                    "epoch": epoch, "kill_waited_s": round(now - next_kill, 2)})
                    print(f"{datetime.datetime.now():%H:%M:%S.%f} killed {names[victim]} after step {last_step}", flush=True)
                    threading.Thread(target=rejoin_later, args=(now + rejoin,), daemon=True).start()
                    next_kill = now + every
        stop.set()
        events += [{**p, "recovery_s": None} for p in pending]   # killed too close to the end to re-plan
        time.sleep(2 * cpu.period)
        for e in events:   # CPU-seconds per phase, once the meter has read past the last one
            if e["recovery_s"] is not None:
                e["phases_cpu_s"] = cpu.phases(e["wall"], e["phases_s"])
        job.wait(timeout=30)
        out = home / "model"
        path = job.download(out)
        epochs = max((e.epoch for e in job.history if isinstance(e, PlanChanged)), default=0)
        cpu_s = cpu.at(w_end) - cpu.at(w_run)   # every node process's, over the training phase
        cpu_by = breakdown(cpu.series, start=w_run, end=w_end, kills=[e["wall"] for e in events], joins=joins,
                           plans=plan_at, step_at=step_at)
        in_band = redeals(home)
        first = first_windows(cpu.series, start=w_run, step_at=step_at)
    return {"steps": steps, "train_s": t_end - t_run, "steps_per_s": steps / (t_end - t_run), "events": events,
            "epochs": epochs, "held_out_loss": held_out_loss(path, steps), "final_eval_loss": job.final_loss,
            "layouts": layouts, "cpu_s": round(cpu_s, 1), "cpu_s_per_step": cpu_s / steps,
            # the loss curve: each step's training loss (the mean over the replicas) and the held-out losses
            "losses": {s: round(v, 4) for s, v in sorted(job.losses.items())},
            "eval_losses": {s: round(v, 4) for s, v in sorted(job.eval_losses.items())},
            "loss_spikes": spikes(job.losses), "deals": deals, "cpu_breakdown": cpu_by, "redeals": in_band,
            "cpu_first_s": first,   # CPU-s per process in each 20 s of the first 80 s (first_windows)
            "epoch_rates": per_epoch(step_at, step_epoch, deals), "joiner_nice": joiner_nice, "joiners_niced_s": niced,
            "settled": quiet, "preload": preload,
            "joiners_ready_s": ready_after(home, joins),   # each fresh node's start to holding the job
            # steps completed in each 20 s from the start of training: the calm and churn runs side by side
            "steps_per_20s": [int(sum(w_run + a <= t < w_run + a + 20.0 for t in step_at.values()))   # JSON: no np.int64
                              for a in np.arange(0.0, w_end - w_run, 20.0)], "warmup": cfg.lr_sched.warmup_steps if cfg.lr_sched else 0,
            "samples": samples(layouts, steps, cfg.micro_batches * cfg.micro_batch)}


def calm_only(args: Any, base: dict[str, Any], steps: int) -> None:
    """``--no-churn``: the undisturbed run's held-out loss and loss curve (mean training loss per 50 steps)."""
    curve = base["losses"]
    bins = {lo: round(statistics.fmean(v), 4) for lo in range(0, steps, 50)
            if (v := [x for s, x in curve.items() if lo <= s < lo + 50])}
    print(f"calm: {steps} steps in {base['train_s']:.1f} s, held-out loss {base['held_out_loss']:.4f}; mean training "
          f"loss per 50 steps {bins}; held-out losses {base['eval_losses']}; micro-batches per replica "
          f"{base['deals']}; loss spikes {base['loss_spikes']}")
    write("churn", args.out, {"calm": base, "curve_50": bins, "stages": args.stages, "seed": args.seed,
                              "warmup": args.warmup},
          headline("held-out loss of the undisturbed run", base["held_out_loss"], "nats", math.inf, "lower",
                   "none: the noise of the churn benchmark's baseline"), quick=args.quick)


def main() -> None:
    ap = parser("churn", __doc__)
    ap.add_argument("--every", type=float, default=60.0, help="seconds between kills (default: one a minute)")
    ap.add_argument("--rejoin", type=float, default=5.0, help="seconds from a kill to a fresh node's start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0, help="the job's steps (default: 300 with --quick, else 900)")
    ap.add_argument("--kills", type=int, default=0, help="kill at most this many members (default: every interval)")
    ap.add_argument("--no-calm", action="store_true",
                    help="skip the undisturbed run (no goodput): a recovery's timeline only")
    ap.add_argument("--no-churn", action="store_true",
                    help="the undisturbed run only (its held-out loss and loss curve: the noise of the baseline)")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="a held-out loss every this many steps in both runs (a diagnostic; default 0: at the end)")
    ap.add_argument("--warmup", type=int, default=WARMUP,
                    help=f"lr warm-up steps of both runs' job (default {WARMUP}; 0: the demo's recipe, which spikes)")
    ap.add_argument("--stages", type=int, default=1,
                    help="pipeline stages of every plan of both runs (x 2 replicas; default 1)")
    ap.add_argument("--joiner-nice", type=int, default=0,
                    help="run each fresh node's start-up (until it accepted the job) this much nicer than the other "
                         "nodes: its own machine's start-up, not the members' CPU (module docstring; default 0)")
    ap.add_argument("--preload", action="store_true",
                    help="fork every node from one forkserver that imported torch and the node's modules once, as the "
                         "demo and benchmarks.e2e do: a fresh node's start-up without its imports (module docstring)")
    ap.add_argument("--stall", type=float, default=120.0,
                    help="stop with the reason when no step completes for this many seconds (default 120)")
    args = ap.parse_args()
    if args.no_calm and args.no_churn:
        raise SystemExit("--no-calm and --no-churn leave nothing to run: give at most one")
    if args.quick and args.out == RESULTS / "churn.json":
        args.out = RESULTS / "churn_quick.json"   # the quick rate's figures beside the full rate's
    if args.joiner_nice and args.out in (RESULTS / "churn.json", RESULTS / "churn_quick.json"):
        args.out = args.out.with_name(args.out.stem + "_joiner_nice.json")   # another method: beside, not over it
    if args.preload and args.out.parent == RESULTS and args.out.stem.startswith("churn"):
        args.out = args.out.with_name(args.out.stem + "_preload.json")   # the same: beside the default figure
    if args.no_churn and args.out in (RESULTS / "churn.json", RESULTS / "churn_quick.json"):
        args.out = RESULTS / "churn_calm.json"    # never over the recorded comparison
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    steps = args.steps or (300 if args.quick else 900)
    every = min(args.every, 25.0) if args.quick else args.every
    root = Path(tempfile.mkdtemp(prefix="fusionp2p-bench-churn-"))
    try:
        base: dict[str, Any] = ({"steps_per_s": math.nan, "train_s": math.nan, "epochs": 0, "held_out_loss": math.nan, "layouts": [],
                 "deals": [], "loss_spikes": [],
                 "events": [], "cpu_s_per_step": math.nan, "samples": 0} if args.no_calm else
                run(steps, root / "calm", every=every, rejoin=args.rejoin, seed=args.seed, churn=False, stall=args.stall,
                    stages=args.stages, eval_every=args.eval_every, warmup=args.warmup, preload=args.preload))
        if args.no_churn:
            calm_only(args, base, steps)
            return
        churn = run(steps, root / "churn", every=every, rejoin=args.rejoin, seed=args.seed, churn=True,
                    kills=args.kills, stall=args.stall, stages=args.stages, eval_every=args.eval_every,
                    warmup=args.warmup, joiner_nice=args.joiner_nice, preload=args.preload)
    except Stalled as exc:
        raise SystemExit(f"benchmarks.churn stopped: {exc} (node logs under {root})") from None
    rec = [e["recovery_s"] for e in churn["events"] if e["recovery_s"] is not None]
    goodput = churn["steps_per_s"] / base["steps_per_s"]
    loss_ratio = churn["held_out_loss"] / base["held_out_loss"]
    print(f"{'run':<10}{'train s':>9}{'steps/s':>9}{'epochs':>8}{'held-out loss':>15}")
    for label, r in (("calm", base), ("churn", churn)):
        print(f"{label:<10}{r['train_s']:>9.1f}{r['steps_per_s']:>9.2f}{r['epochs']:>8}{r['held_out_loss']:>15.3f}")
    for e in churn["events"]:
        if e["recovery_s"] is None:
            print(f"killed {e['killed']} after step {e['at_step']}: the job ended before a new epoch stepped")
        else:
            print(f"killed {e['killed']} after step {e['at_step']}: a new epoch stepped after "
                  f"{e['recovery_s']:.1f} s (step {e['resumed_at_step']}, epoch {e['resumed_in_epoch']}; "
                  + ", ".join(f"{k} {v:.1f}" for k, v in e.get("phases_s", {}).items()) + ")")
    med = statistics.median(rec) if rec else float("nan")
    stepped = [e for e in churn["events"] if e["recovery_s"] is not None]
    # steps trained again after a kill: those after the last one the progress showed done, before the kill
    lost = [max(0, e["at_step"] + 1 - e["resumed_at_step"]) for e in stepped]
    names = [*(n for n, _ in PHASES), "stepped"]
    phase_med = {name: round(statistics.median(v), 2) for name in names
                 if (v := [e["phases_s"][name] for e in stepped if name in e.get("phases_s", {})])}
    cpu_med = {name: round(statistics.median(v), 2) for name in names
               if (v := [e["phases_cpu_s"][name] for e in stepped if name in e.get("phases_cpu_s", {})])}
    for label, r in (("calm", base), ("churn", churn)):   # the replicas per stage decide the samples per step
        print(f"{label} plans (epoch, replicas per stage, from step): {r['layouts']}")
    for label, r in (("calm", base), ("churn", churn)):   # a spike early on sets a run's course (module docstring)
        print(f"{label}: micro-batches per replica (epoch, [] even) {r.get('deals', [])}; loss spikes (step, loss, "
              f"x the lowest of the 5 before) {r.get('loss_spikes', [])}")
    print(f"steps lost per kill {lost}; median seconds from a kill to each phase's end: {phase_med}")
    for label, r in (("calm", base), ("churn", churn)):   # where the CPU went, per window and role (breakdown)
        for w, x in r.get("cpu_breakdown", {}).items():
            if x["steps"]:
                print(f"{label} {w}: {x['s']} s, {x['steps']} steps ({x['steps_per_s']}/s); CPU-s a step "
                      f"{x['cpu_s_per_step']}; cores {x['cores']}")
        print(f"{label} steps completed in each 20 s of training: {r.get('steps_per_20s', [])}")
        for row in r.get("cpu_first_s", []):   # the first 80 s, per process: where the members' CPU went
            print(f"{label} from {row['from_s']:g} s: {row['steps']} steps; CPU-s nodes {row['nodes']}, benchmark "
                  f"{row['cpu_s'].get(BENCH)}, machine {row['cpu_s'].get(MACHINE)}, outside {row.get(OUTSIDE)}; per node "
                  f"{ {k: v for k, v in row['cpu_s'].items() if k not in (BENCH, MACHINE)} }")
        if r.get("joiners_ready_s"):
            print(f"{label}: seconds from each fresh node's start to holding the job {r['joiners_ready_s']}")
        print(f"{label} per epoch (steps/s over its span, deal): "
              + "; ".join(f"{e['epoch']}: {e['steps']} from {e['first_step']}, {e['steps_per_s']}/s, {e['deal']}"
                          for e in r.get("epoch_rates", []))
              + f"; in-band re-deals {r.get('redeals', [])}")
    print(f"median CPU-seconds of all node processes in each phase (from the previous phase's end): {cpu_med}")
    # equal samples: every plan of the churn run with the undisturbed run's replicas per stage (module docstring)
    equal = not args.no_calm and {sz[0] for _, sz, _ in churn["layouts"]} == {sz[0] for _, sz, _ in base["layouts"]}
    same = not args.no_calm and len({tuple(sz) for _, sz, _ in [*churn["layouts"], *base["layouts"]]}) == 1
    cpu_goodput = base["cpu_s_per_step"] / churn["cpu_s_per_step"]   # the same work for the CPU it took: load-proof
    print(f"samples trained: calm {base['samples']}, churn {churn['samples']} ({'equal' if equal else 'NOT equal'}); "
          f"CPU-seconds a step of all node processes: calm {base['cpu_s_per_step']:.2f}, churn "
          f"{churn['cpu_s_per_step']:.2f} ({cpu_goodput:.2f}x); every plan of both runs "
          f"{'in one layout' if same else 'NOT in one layout'}")
    print(f"goodput {goodput:.2f}, recovery median {med:.1f} s over {len(rec)} events, "
          f"held-out loss ratio {loss_ratio:.3f} at equal steps{'' if equal else ' (samples differ: see the plans)'}")
    write("churn", args.out, {"calm": base, "churn": churn, "goodput": goodput, "recovery_s_median": med,
                              "recovery_s": rec, "held_out_loss_ratio": loss_ratio, "equal_samples": equal,
                              "same_layout": same, "stages": args.stages,
                              "cpu_goodput": cpu_goodput, "steps_lost": lost,
                              "phases_s_median": phase_med, "phases_cpu_s_median": cpu_med, "every_s": every,
                              "rejoin_s": args.rejoin, "seed": args.seed, "recovery_s_target": 5.0,
                              "joiner_nice": args.joiner_nice, "preload": args.preload,
                              "warmup": args.warmup},
          headline(f"goodput under churn (one member SIGKILLed every {every:g} s, a fresh node {args.rejoin:g} s "
                   "later" + (f", its start-up at nice +{args.joiner_nice}" if args.joiner_nice else "")
                   + (", nodes forked pre-imported" if args.preload else "") + ") / undisturbed", goodput, "x", 0.75 if every < 60 else 0.9, "higher",
                   "the same job without churn"),
          quick=args.quick)


if __name__ == "__main__":
    main()
