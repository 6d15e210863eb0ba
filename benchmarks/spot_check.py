"""Verified stages: what spot-check recomputation costs, how soon it catches a lying stage, and the lie's bite.

The GPT-2 reference of benchmarks.convergence, traced and cut into two stages, trains in one process
(``fusionp2p.testing.lying_stages.spot_checked_run``: a ``LocalPipeline``, SGD, 4 micro-batches of 8 x 64
tokens a step from the pydoc corpus's first 90%) while a second holder of each stage recomputes the
micro-batches the leader's signed seed samples (``train/verify.py``). Runs:

* ``honest`` at rate 0 (the baseline) and at ``--rate`` (the cost): the stages' own cost (their state kept
  and hashed every step, a signed claim per micro-batch) over their training CPU, and the checkers' cost
  per check over a stage's forward and backward of one micro-batch (measured at rate 1);
* per attack (``bias``: stage 0 adds 5% (``--bias``) of its activations' spread to them; ``zeros``: stage 1 sends zeros
  for its backward), lying on a fraction ``--lie-rate`` of micro-batches: the step at which the checks
  exclude it (an honest holder then takes its stage over from the newest checkpoint at or before the
  conviction, every ``--checkpoint-every`` steps, as a job's leader rolls back: ``jobs/verified.py``), and the
  held-out loss (the corpus's last 10%) with the checks on and off, over the honest run's.

Headline: the worst, over the attacks, of the held-out loss with the checks on over the honest run's
(target <= 1.02). All CPU figures are CPU seconds of the one thread that does everything.

``python -m benchmarks.spot_check`` (``--quick``: 30 steps instead of 200).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from benchmarks._common import headline, parser, write
from benchmarks.convergence import SEQ, base_config, heldout_loss, make_model
from fusionp2p.data import BatchSampler, SamplerConfig, corpus_tokens
from fusionp2p.graph import coarsen, partition, stages_from_fences, trace
from fusionp2p.graph.trace import load_into
from fusionp2p.testing.lying_stages import BIAS, SpotRun, spot_checked_run
from fusionp2p.train.verify import VerifyConfig, p_catch

MICROS = 4
# a checked run's checkpoint cadence (a job's TrainConfig.checkpoint_every): the leader rolls back to the newest
# checkpoint at or before a conviction (jobs/verified.py:rollback); without one the lies before it stay
CHECKPOINT_EVERY = 10
LR = 0.1    # plain SGD (the harness has no AdamW); at 0.5 runs were chaotic (a liar excluded at step 2 still ended 12% up)


def stage_attacks(steps: int, *, rate: float, lie_rate: float, bias: float = BIAS, checkpoint_every: int = CHECKPOINT_EVERY,
                  log: Callable[[dict[str, Any]], None] = print) -> dict[str, Any]:
    """The runs of the module docstring at *steps* steps: the honest baselines and costs, and per attack the
    checked and unchecked runs (``bias``: the bias attack's strength, in its activations' standard deviations;
    a checked run rolls back to its newest checkpoint, every *checkpoint_every* steps, at or before the
    conviction, as a job's leader does; 0: it goes on from the liar's state)."""
    cfg = base_config(steps)
    tokens = corpus_tokens("pydoc")
    cut = int(len(tokens) * 0.9)
    train, held = tokens[:cut], tokens[cut:]
    sampler = BatchSampler(SamplerConfig(num_tokens=len(train), seq_len=SEQ, micro_batch=cfg.micro_batch,
                                         micro_batches=MICROS, seed=cfg.seed))
    model = make_model("gpt2")
    ex = (torch.from_numpy(sampler.inputs(train, 0, 0)), torch.from_numpy(sampler.targets(train, 0, 0)))
    dag = trace(model, ex, count_flops=False)
    coarse = coarsen(dag)
    programs = partition(coarse, stages_from_fences(len(coarse.units), [len(coarse.units) // 2]))

    def data(step: int) -> Sequence[Mapping[str, torch.Tensor]]:
        return [dict(zip(dag.data_inputs, (torch.from_numpy(sampler.inputs(train, step, m)),
                                           torch.from_numpy(sampler.targets(train, step, m))))) for m in range(MICROS)]

    def held_loss(run: SpotRun) -> float:
        m = make_model("gpt2")
        load_into(m, dag, run.state)
        return heldout_loss(m, held, cfg)

    runs: list[dict[str, Any]] = []

    def go(name: str, rate: float, n: int = steps, **kw: Any) -> dict[str, Any]:
        run = spot_checked_run(programs, data, steps=n, cfg=VerifyConfig(rate=rate), lr=LR,
                               stop_when_excluded=False, bias=bias, **kw)
        out = {"run": name, "rate": rate, "steps": len(run.losses), "checks": run.checks, "lies": run.lies,
               "verdicts": len(run.verdicts), "excluded_at": run.excluded_at, "rolled_back_to": run.rolled_back_to,
               "train_cpu_s": run.train_cpu_s, "commit_cpu_s": run.commit_cpu_s, "check_cpu_s": run.check_cpu_s,
               "heldout_loss": held_loss(run), "train_loss_last": float(np.mean(run.losses[-5:]))}
        log({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()})
        runs.append(out)
        return out

    base = go("honest", 0.0)
    checked = go("honest-checked", rate)
    full = go("honest-every-micro", 1.0, n=min(steps, 5))
    # a stage's forward and backward of one micro-batch: the training CPU over the stages' micro-batches
    micro_cpu = full["train_cpu_s"] / (full["steps"] * MICROS * len(programs))
    per_check = full["check_cpu_s"] / max(full["checks"], 1)
    per: dict[str, Any] = {}
    for attack, liar in (("bias", 0), ("zeros", 1)):   # the hidden forms need stamps: benchmarks.verified_job
        on = go(f"{attack}-checked", rate, liar=liar, attack=attack, lie_rate=lie_rate, checkpoint_every=checkpoint_every)
        off = go(f"{attack}-unchecked", 0.0, liar=liar, attack=attack, lie_rate=lie_rate)
        per[attack] = {"liar_stage": liar, "excluded_at_step": on["excluded_at"], "rolled_back_to": on["rolled_back_to"],
                       "checked_over_honest": on["heldout_loss"] / base["heldout_loss"],
                       "unchecked_over_honest": off["heldout_loss"] / base["heldout_loss"]}
    return {
        "steps": steps, "micro_batches": MICROS, "stages": len(programs), "rate": rate, "lie_rate": lie_rate,
        "bias": bias, "checkpoint_every": checkpoint_every, "runs": runs, "per_attack": per,
        "honest_heldout": base["heldout_loss"], "honest_checked_verdicts": checked["verdicts"],
        "stage_cost_over_train_cpu": checked["commit_cpu_s"] / checked["train_cpu_s"],
        "check_cpu_per_check_s": per_check, "stage_micro_cpu_s": micro_cpu,
        "check_over_micro": per_check / micro_cpu,
        "checker_cost_over_train_cpu_at_rate": rate * per_check / micro_cpu,
        "p_catch_per_stage_run": p_catch(rate, lie_rate, steps * MICROS),
    }


def main() -> None:
    p = parser("spot_check", __doc__)
    p.add_argument("--rate", type=float, default=0.05, help="the sampling rate p")
    p.add_argument("--lie-rate", type=float, default=0.5, help="the fraction f of micro-batches a liar lies on")
    p.add_argument("--bias", type=float, default=BIAS, help="the bias attack's strength, in standard deviations")
    p.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY,
                   help="a checked run's checkpoint cadence in steps (0: no roll-back after a conviction)")
    args = p.parse_args()
    torch.set_num_threads(1)
    results = stage_attacks(30 if args.quick else 200, rate=args.rate, lie_rate=args.lie_rate, bias=args.bias,
                            checkpoint_every=args.checkpoint_every)
    print({k: v for k, v in results.items() if k != "runs"})
    worst = max(v["checked_over_honest"] for v in results["per_attack"].values())
    write("spot_check", args.out, results,
          headline("attacked stage (checked) over honest held-out loss, worst attack", worst, "x", 1.02, "lower",
                   "honest run without checks, same process"), quick=args.quick)


if __name__ == "__main__":
    main()
