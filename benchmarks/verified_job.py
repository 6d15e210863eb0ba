"""Verified stages as a job runs them: what the spot checks cost an honest run, in CPU seconds, and how soon
they convict a lying stage.

The GPT-2 reference of benchmarks.convergence, cut into two stages, trains as a job of 2 stages x 2
replicas (CO2 across the replicas) on real stage workers over in-memory channels in one process
(``fusionp2p.testing.lying_stages.verified_job``). With the checks on, every stage replica keeps a ledger
(its state copied and hashed before each step, a signed claim per micro-batch after it) and the other
replica of its stage checks it (its own signed seed draws the sample, it fetches and recomputes the
sampled micro-batches: ``train/spot.py``). Runs, alternated so that the machine's load hits both alike:

* ``unchecked`` (no ledgers, no checkers, plain executors) and ``checked`` at ``--rate``, ``--pairs``
  times each: the process's CPU seconds (user + sys) of the whole run, and the threads' CPU seconds of
  the stages' commitments and of the checkers;
* ``bias`` (stage 0, replica 1 adds 5% of its activations' spread to them) and ``zeros`` (stage 1,
  replica 0 sends zeros for its backward), and their ``-hidden`` forms (the same lies sent, the honest
  tensors claimed: caught only by the neighbours' stamps, ``train/receipts.py``), lying on ``--lie-rate``
  of their micro-batches: the step of the first conviction, and whether anyone else was convicted.

With the checks on, every pipeline message is also stamped (its sender signs a BLAKE3 digest of its encoded
payload, its receiver checks it): ``stamp_cpu_s``, counted with the commitments.

Headline: the CPU seconds the checks add (the stages' commitments and the checkers, measured on the threads
that run them) over the unchecked run's CPU seconds, the median over the pairs, target <= 0.05. The whole
process's checked over unchecked CPU is reported beside it (``cpu_ratio_per_pair``): it also counts what
the threads do not (memory traffic, scheduling), but on a loaded machine two runs of the same job differ
by more than the checks cost. ``wall_ratio_per_pair``: the same in wall time (the step-time cost, on an
idle machine only). ``python -m benchmarks.verified_job`` (``--quick``: 10 steps instead of 40, one pair).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks._common import headline, parser, write
from benchmarks.convergence import SEQ, base_config, make_model
from fusionp2p.data import BatchSampler, SamplerConfig, corpus_tokens
from fusionp2p.graph import coarsen, partition, stages_from_fences, trace
from fusionp2p.testing.lying_stages import STAGE_ATTACKS, VerifiedJob, verified_job
from fusionp2p.train.verify import p_catch

MICROS = 4


def main() -> None:
    p = parser("verified_job", __doc__)
    p.add_argument("--rate", type=float, default=0.05, help="the sampling rate p")
    p.add_argument("--lie-rate", type=float, default=0.5, help="the fraction f of micro-batches a liar lies on")
    p.add_argument("--pairs", type=int, default=None, help="unchecked/checked pairs (default 3, --quick 1)")
    p.add_argument("--steps", type=int, default=None, help="steps a run (default 40, --quick 10)")
    args = p.parse_args()
    steps = args.steps or (10 if args.quick else 40)
    pairs = args.pairs or (1 if args.quick else 3)
    torch.set_num_threads(1)
    cfg = base_config(steps)
    tokens = corpus_tokens("pydoc")
    train = tokens[:int(len(tokens) * 0.9)]
    sampler = BatchSampler(SamplerConfig(num_tokens=len(train), seq_len=SEQ, micro_batch=cfg.micro_batch,
                                         micro_batches=MICROS, seed=cfg.seed))
    ex = (torch.from_numpy(sampler.inputs(train, 0, 0)), torch.from_numpy(sampler.targets(train, 0, 0)))
    dag = trace(make_model("gpt2"), ex, count_flops=False)
    coarse = coarsen(dag)
    programs = partition(coarse, stages_from_fences(len(coarse.units), [len(coarse.units) // 2]))

    def data(sstep: int, mu: int) -> dict[str, torch.Tensor]:
        return dict(zip(dag.data_inputs, (torch.from_numpy(sampler.inputs(train, sstep, mu)),
                                          torch.from_numpy(sampler.targets(train, sstep, mu))), strict=True))

    runs: list[dict[str, Any]] = []

    def go(name: str, rate: float | None, **kw: Any) -> tuple[dict[str, Any], VerifiedJob]:
        t0 = time.perf_counter()
        job = verified_job(programs, data, cfg, rate=rate, **kw)
        wall = time.perf_counter() - t0
        ch = list(job.checkers.values())
        conv = sorted(v.claim.step for c in ch for v in c.verdicts)
        out = {"run": name, "rate": rate, "cpu_s": job.cpu_s, "wall_s": wall,
               "stage_commit_cpu_s": sum(led.cpu_s for led in job.ledgers.values()) + sum(
                   b.cpu_s for b in job.books.values()),
               "stamp_cpu_s": sum(b.cpu_s for b in job.books.values()),
               "checker_cpu_s": sum(c.cpu_s for c in ch), "checks": sum(c.checks for c in ch),
               "unverifiable": sum(c.unverifiable for c in ch), "verdicts": sum(len(c.verdicts) for c in ch),
               "convicted": sorted(job.leader.excluded), "first_conviction_step": conv[0] if conv else None,
               "final_loss": statistics.mean(r.loss for r in job.reports if r.loss is not None and r.step >= steps - 3)}
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}, flush=True)
        runs.append(out)
        return out, job

    base: list[dict[str, Any]] = []
    checked: list[dict[str, Any]] = []
    for _ in range(pairs):
        base.append(go("unchecked", None)[0])
        checked.append(go("checked", args.rate)[0])
    ratios = [c["cpu_s"] / b["cpu_s"] for b, c in zip(base, checked, strict=True)]
    added = [(c["stage_commit_cpu_s"] + c["checker_cpu_s"]) / b["cpu_s"] for b, c in zip(base, checked, strict=True)]
    per: dict[str, Any] = {}
    for attack in STAGE_ATTACKS:
        liar = (0, 1) if attack.startswith("bias") else (1, 0)
        out, job = go(attack, args.rate, liar=liar, attack=attack, lie_rate=args.lie_rate)
        bad = job.ids[liar].peer_id
        per[attack] = {"liar": list(liar), "first_conviction_step": out["first_conviction_step"],
                       "convicted_liar": bad in job.leader.excluded,
                       "convicted_honest": len(job.leader.excluded - {bad})}
    b_cpu = statistics.median(b["cpu_s"] for b in base)
    results = {
        "steps": steps, "micro_batches": MICROS, "stages": 2, "replicas": 2, "rate": args.rate,
        "lie_rate": args.lie_rate, "runs": runs, "per_attack": per,
        "cpu_ratio_per_pair": ratios, "added_cpu_per_pair": added,
        "wall_ratio_per_pair": [c["wall_s"] / b["wall_s"] for b, c in zip(base, checked, strict=True)],
        "stage_commit_over_unchecked_cpu": statistics.median(c["stage_commit_cpu_s"] for c in checked) / b_cpu,
        "stamps_over_unchecked_cpu": statistics.median(c["stamp_cpu_s"] for c in checked) / b_cpu,
        "checker_over_unchecked_cpu": statistics.median(c["checker_cpu_s"] for c in checked) / b_cpu,
        "honest_verdicts": sum(c["verdicts"] for c in checked),
        "p_catch_per_stage_run": p_catch(args.rate, args.lie_rate, steps * MICROS),
    }
    print({k: v for k, v in results.items() if k != "runs"})
    write("verified_job", args.out, results,
          headline("CPU seconds the spot checks add to an honest job, over the job's", statistics.median(added), "x",
                   0.05, "lower", "the same job without ledgers or checkers, same process, alternated"),
          quick=args.quick)


if __name__ == "__main__":
    main()
