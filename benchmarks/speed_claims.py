"""Speed claims checked against measurements: what a speed liar costs a job's steps, with and without the check.

Three replicas of one stage (a small MLP, streaming CO2 with tau 2, 2 micro-batches each a step to start)
re-deal their micro-batches by the speeds their averaging rounds carry (``train/deal.py``). Every replica's
compute is stretched by a sleep (``StageContext.compute_slowdown``: the honest ones 20x, replica 2 60x, so it
is 3x slower and the sleeps, not the shared machine's load, set the step time). Runs:

* ``honest``: replica 2 claims what it measures (the baseline: the deal gives it the least);
* ``liar-unchecked``: replica 2 claims 8x its measured speed (``fusionp2p.testing.speed_liar``), the check
  off (``CO2(robust=False)``): it is dealt the most and every step waits for it;
* ``liar-checked``: the same liar, the check on (the default): the replicas deal by what the others measured.

Per run: the deal at the end (micro-batches a step per replica) and the mean seconds a step over the last
half of the steps, from replica 0's reports (its waits for the slowest included). Headline: the checked
liar's step time over the honest run's (target <= 1.1); the unchecked liar's ratio shows the attack bites.

``python -m benchmarks.speed_claims`` (``--quick``: 16 steps instead of 30).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from benchmarks._common import headline, parser, write
from fusionp2p.testing.replicas import (
    one_stage,
    replica_averagers,
    replica_workers,
    run_replicas,
    seeded_batches,
)
from fusionp2p.testing.speed_liar import SpeedLiar
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.worker import StageReport

R = 3
LIAR = R - 1
SLOW = {"honest": 20.0, "liar": 60.0}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 64)
        self.l2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.l2(torch.tanh(self.l1(x))), y)


def run(*, lie: bool, robust: bool, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    prog = one_stage(_Net(), (torch.randn(4, 16), torch.tensor([0, 1, 2, 3])))
    stamps: list[float] = []

    async def report(rep: StageReport) -> None:
        if rep.replica == 0 and not rep.eval:
            stamps.append(time.perf_counter())

    cfg = TrainConfig(steps=steps, micro_batch=4, micro_batches=2, lr=0.05, replicas=R, averaging=CO2(tau=2, robust=robust))
    workers = replica_workers(prog, cfg, data=seeded_batches(prog, batch=4, features=16, classes=4), report=report,
                              tokens_per_micro=4, recv_timeout=60.0, micro=(2,) * R, micro_period=1,
                              slowdown=[SLOW["liar"] if r == LIAR else SLOW["honest"] for r in range(R)])
    with replica_averagers(lambda me: SpeedLiar if lie and me == f"r{LIAR}" else None):   # the liar's averager
        run_replicas(workers, timeout=600)
    d = workers[0]._deal
    half = stamps[len(stamps) // 2:]
    return {"deal": [m / d.period for m in d.micro], "redeals": d.redeals,
            "step_s": (half[-1] - half[0]) / max(len(half) - 1, 1),
            "contradicted": sorted(workers[0].claims.contradicted),
            "measured_ms": {k: round(1e3 * v, 1) for k, v in sorted(workers[0].claims.measured.items())}}


def main() -> None:
    p = parser("speed_claims", __doc__)
    args = p.parse_args()
    steps = 16 if args.quick else 30
    runs = {"honest": run(lie=False, robust=True, steps=steps),
            "liar-unchecked": run(lie=True, robust=False, steps=steps),
            "liar-checked": run(lie=True, robust=True, steps=steps)}
    base = runs["honest"]["step_s"]
    results = {"steps": steps, "replicas": R, "slowdown": SLOW, "runs": runs,
               "unchecked_over_honest": runs["liar-unchecked"]["step_s"] / base,
               "checked_over_honest": runs["liar-checked"]["step_s"] / base}
    print(results)
    write("speed_claims", args.out, results,
          headline("speed liar (checked) over honest step time", results["checked_over_honest"], "x", 1.1, "lower",
                   "the same replicas, the slow one claiming its measured speed"), quick=args.quick)


if __name__ == "__main__":
    main()
