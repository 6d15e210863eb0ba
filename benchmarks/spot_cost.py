"""What spot checks cost between the nodes of a job (``TrainConfig.spot_rate``, jobs/verified.py), on the GPT-2
reference, and how soon they catch a stage that lies.

Four nodes of the embedded swarm (the node job service and the publisher as in ``fusionp2p node``, one
process, the in-memory transport: every message a real JOB request, every bundle fetched through the content
store) train the GPT-2 reference of benchmarks.convergence (4 layers, 128 wide, byte vocabulary; ``--layers``
and ``--width`` for a larger one) in 2 stages x 2 replicas with CO2, 4 micro-batches of 8 x 64 tokens a step.
The same job runs at ``spot_rate`` 0, 0.01 and 0.05 (``--rates``), ``--rounds`` times each, the order rotated
each round so that the machine's drifting load hits every rate alike. Per run:

* ``cpu_per_step_s``: the process's CPU seconds (user + sys: all four nodes and the publisher are this
  process) from the first to the last training step the publisher saw, over those steps: the
  load-independent cost of a step to all participants together (start-up, tracing and the final
  evaluation are outside it);
* ``step_cpu_s``: that less the swarm's idle CPU for the steps' wall time (``idle_cpu_per_s``, measured for
  ``IDLE_S`` seconds before the job: heartbeats, gossip and probes are timer-driven, so a step stretched by
  the machine's load accrues more of them; in the first runs the unchecked job's raw figure came out 5-9%
  above the checked one's in all three pairs, its steps 1.5-2.3x longer in wall time);
* ``wall_per_step_s``: the same in wall time (the step-time cost; meaningful on an idle machine only);
* the checking threads' CPU seconds (ledgers, stamps, checkers), the checks run, the verdicts (none on an
  honest job), and the memory the checks hold at their peak: the ledgers' kept states and transcripts, the
  checkers' own copy of their stage, and the bundles served and kept in the content store.

Headline: ``step_cpu_s`` at p = 0.01 over p = 0 (the median over the rounds of the per-round ratio), target
<= 1.05; ``cpu_ratio_raw`` is the same without the idle correction, ``checking_threads_over_unchecked_cpu`` the
checking threads' own CPU over the unchecked step's (the figure least touched by load). ``catch``: the probability of catching a stage lying on a fraction f of its m micro-batches a
step, ``1 - (1 - p)^(f*m)`` per step and ``1 - (1 - p)^(f*m*K)`` within K steps (docs/security.md), and
``catch_empirical``: the same counted over simulated liars with the job's own sampling (``verify.sampled``,
a fresh seed a step: the step at which a micro-batch it lied on is first picked).

``python -m benchmarks.spot_cost`` (``--quick``: 12 steps, one round).
"""

from __future__ import annotations

import logging
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trio

from benchmarks._common import headline, parser, write
from benchmarks._embedded import embedded_job
from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs import run as job_run
from fusionp2p.jobs.events import JobStateChanged, PlanChanged, ProgressEvent, StageConvicted, StepProgress
from fusionp2p.jobs.host import NodeJobConfig
from fusionp2p.jobs.verified import EpochChecks
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.verify import sampled

SEQ = 64
MICROS = 4
FRACTIONS = (0.25, 0.5, 1.0)           # f: the fraction of its MICROS micro-batches a stage lies on each step
HORIZONS = (1, 10, 100, 1000)          # K: steps
IDLE_S = 5.0                           # seconds the swarm's idle CPU is measured before each job
TRIALS = 2000                          # liars simulated per (p, f) for the empirical catch probability


def catch_table(rates: list[float], micros: int) -> list[dict[str, Any]]:
    """P(caught within K steps) = 1 - (1 - p)^(f*m*K) for a stage lying on f*m of its m micro-batches a step,
    each sampled with probability p (independently: ``verify.sampled``)."""
    return [{"p": p, "f": f, "m": micros, "K": k, "p_catch": 1.0 - (1.0 - p) ** (f * micros * k)}
            for p in rates if p > 0 for f in FRACTIONS for k in HORIZONS]


def catch_empirical(rates: list[float], micros: int, *, trials: int = TRIALS, seed: int = 0) -> list[dict[str, Any]]:
    """The same probabilities counted: per trial, a stage lying on its first f*m micro-batches every step, a
    fresh 64-byte seed each step (a checker's signature), the step at which ``verify.sampled`` first picks a
    micro-batch it lied on; the fraction of trials caught within each K."""
    rnd = random.Random(seed)
    out = []
    for p in (p for p in rates if p > 0):
        for f in FRACTIONS:
            lied = range(round(f * micros))
            at: list[int] = []
            for _ in range(trials):
                k = 1
                while k <= max(HORIZONS):
                    step_seed = rnd.randbytes(64)
                    if any(sampled(step_seed, 0, 1, m, p) for m in lied):
                        break
                    k += 1
                at.append(k)    # max(HORIZONS) + 1: not caught within the longest horizon
            out += [{"p": p, "f": f, "m": micros, "K": k, "caught": sum(a <= k for a in at) / trials,
                     "formula": 1.0 - (1.0 - p) ** (f * micros * k)} for k in HORIZONS]
    return out


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class _Seen:
    """The EpochChecks of one run (every node's), to read their threads' CPU and their memory."""

    def __init__(self) -> None:
        self.checks: list[EpochChecks] = []
        self.peak: dict[str, int] = {}

    def sample(self) -> None:
        """The memory the checks hold now, the peak kept (read between steps, on the event loop)."""
        now = {"ledger_states": 0, "ledger_transcripts": 0, "checker_stage": 0, "bundles_kept": 0}
        for c in self.checks:
            if c.ledger is not None:
                now["ledger_states"] += sum(_nbytes(s.values()) for s, _ in list(c.ledger._states.values()))
                for t in list(c.ledger.ex.tap._fwd.values()):
                    now["ledger_transcripts"] += sum(_nbytes(d.values()) for d in (t.inputs, t.outputs, t.grad_outputs,
                                                                                   t.grad_inputs)) + _nbytes([t.rng])
            if c.checker is not None:
                ex = c.checker._ex
                now["checker_stage"] += _nbytes(ex.parameters().values()) + _nbytes(ex.buffers().values())
            now["bundles_kept"] += sum(c.content.store.size(h) for h in list(c.bundles) if c.content.store.has(h))
        now["total"] = sum(now.values())
        for k, v in now.items():
            self.peak[k] = max(self.peak.get(k, 0), v)


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _one(home: Path, steps: int, rate: float, nonce: bytes, model: GPT2, seen: _Seen) -> dict[str, Any]:
    jobs = NodeJobConfig(progress_interval=0.0)
    cfg = TrainConfig(steps=steps, micro_batch=8, micro_batches=MICROS, lr=2e-3, stages=2, replicas=2,
                      averaging=CO2(), seed=0, spot_rate=rate)
    at: dict[int, tuple[float, float]] = {}      # step -> (wall, process CPU) when the publisher first saw it
    states: list[str] = []
    plans: list[PlanChanged] = []
    convicted: list[StageConvicted] = []

    def emit(ev: ProgressEvent) -> None:
        if isinstance(ev, StepProgress) and ev.loss is not None and ev.step not in at:
            at[ev.step] = (time.monotonic(), _cpu())
            seen.sample()
        elif isinstance(ev, JobStateChanged):
            states.append(ev.state)
        elif isinstance(ev, PlanChanged):
            plans.append(ev)
        elif isinstance(ev, StageConvicted):
            convicted.append(ev)

    with trio.fail_after(1800):
        async with embedded_job(4, home, jobs=jobs, model=model, dataset=BuiltinCorpus(seq_len=SEQ), cfg=cfg,
                                nonce=nonce) as (pub, built):
            # the swarm's own CPU per wall second with no job (heartbeats, gossip, probes: timer-driven): a step
            # that takes longer on a loaded machine accrues more of it, whatever the checks cost
            w0, c0 = time.monotonic(), _cpu()
            await trio.sleep(IDLE_S)
            idle = (_cpu() - c0) / (time.monotonic() - w0)
            await pub.run_job(built, emit, home / "checkpoints")
    if not states or states[-1] != "done" or len(at) < 3:
        raise RuntimeError(f"the job did not train to the end: states {states}, {len(at)} steps seen")
    # from the second step seen: the first carries the pipeline's warm-up (links, first allocations)
    first, last = sorted(at)[1], max(at)
    n = last - first
    ch = [c.checker for c in seen.checks if c.checker is not None]
    return {
        "rate": rate, "steps": steps, "steps_timed": n, "layout": [list(p.stage_sizes) for p in plans],
        "cpu_per_step_s": (at[last][1] - at[first][1]) / n, "wall_per_step_s": (at[last][0] - at[first][0]) / n,
        "idle_cpu_per_s": idle,
        "step_cpu_s": (at[last][1] - at[first][1] - idle * (at[last][0] - at[first][0])) / n,
        "ledger_cpu_s": sum(c.ledger.cpu_s for c in seen.checks if c.ledger is not None),
        "stamp_cpu_s": sum(c.book.cpu_s for c in seen.checks),
        "checker_cpu_s": sum(c.cpu_s for c in ch), "checks": sum(c.checks for c in ch),
        "unverifiable": sum(c.unverifiable for c in ch), "verdicts": sum(len(c.verdicts) for c in ch),
        "convicted": len(convicted), "memory_peak_bytes": dict(seen.peak),
    }


def run_rate(root: Path, steps: int, rate: float, nonce: bytes, model: GPT2) -> dict[str, Any]:
    seen = _Seen()

    class Recorded(EpochChecks):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            seen.checks.append(self)

    real = EpochChecks
    job_run.EpochChecks = Recorded     # type: ignore[attr-defined,misc]   # the benchmark's probe: every node's checks, read
    try:
        return trio.run(_one, root, steps, rate, nonce, model, seen)
    finally:
        job_run.EpochChecks = real     # type: ignore[attr-defined,misc]


def main() -> None:
    ap = parser("spot_cost", __doc__)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.01, 0.05], help="spot rates (0 first: the baseline)")
    ap.add_argument("--rounds", type=int, default=None, help="runs per rate (default 2, --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps a run (default 40, --quick 12)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    args = ap.parse_args()
    if 0.0 not in args.rates or 0.01 not in args.rates:
        raise SystemExit("--rates must include 0 (the baseline) and 0.01 (the headline)")
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    steps = args.steps or (12 if args.quick else 40)
    rounds = args.rounds or (1 if args.quick else 2)
    torch.manual_seed(0)
    model = GPT2(GPT2Config.tiny(block_size=SEQ, n_layer=args.layers, n_head=4, n_embd=args.width))
    params = sum(p.numel() for p in model.parameters())
    root = Path(tempfile.mkdtemp(prefix="fusionp2p-bench-spot-"))
    runs: list[dict[str, Any]] = []
    per_round: list[dict[float, dict[str, Any]]] = []
    for i in range(rounds):
        order = args.rates[i % len(args.rates):] + args.rates[:i % len(args.rates)]
        got: dict[float, dict[str, Any]] = {}
        for rate in order:
            r = run_rate(root / f"r{i}-{rate}", steps, rate, bytes([i, int(rate * 100)]), model)
            r["round"] = i
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            runs.append(r)
            got[rate] = r
        per_round.append(got)
    ratios = {p: [g[p]["step_cpu_s"] / g[0.0]["step_cpu_s"] for g in per_round] for p in args.rates if p > 0}
    raw = {p: [g[p]["cpu_per_step_s"] / g[0.0]["cpu_per_step_s"] for g in per_round] for p in args.rates if p > 0}
    wall = {p: [g[p]["wall_per_step_s"] / g[0.0]["wall_per_step_s"] for g in per_round] for p in args.rates if p > 0}
    threads = {p: [(g[p]["ledger_cpu_s"] + g[p]["stamp_cpu_s"] + g[p]["checker_cpu_s"])
                   / (g[0.0]["step_cpu_s"] * g[p]["steps"]) for g in per_round] for p in args.rates if p > 0}
    results = {
        "model_params": params, "layers": args.layers, "width": args.width, "stages": 2, "replicas": 2,
        "micro_batches": MICROS, "micro_batch": 8, "seq_len": SEQ, "steps": steps, "rounds": rounds, "runs": runs,
        "cpu_ratio": {str(p): v for p, v in ratios.items()}, "cpu_ratio_raw": {str(p): v for p, v in raw.items()}, "wall_ratio": {str(p): v for p, v in wall.items()},
        "checking_threads_over_unchecked_cpu": {str(p): v for p, v in threads.items()},
        "honest_verdicts": sum(r["verdicts"] for r in runs),
        "catch": catch_table(args.rates, MICROS),
        "catch_empirical": catch_empirical(args.rates, MICROS),
    }
    print({k: v for k, v in results.items() if k not in ("runs", "catch")})
    write("spot_cost", args.out, results,
          headline("CPU seconds per step of all nodes (less the idle swarm's) at spot_rate 0.01 over 0 (GPT-2, 2x2)",
                   statistics.median(ratios[0.01]), "x", 1.05, "lower",
                   "the same job at spot_rate 0, same process, order rotated per round"), quick=args.quick)


if __name__ == "__main__":
    main()
