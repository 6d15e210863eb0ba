"""What shadow copies cost a job's step time (jobs/shadow.py): the same calm job with and without them.

Three nodes of the embedded swarm (one process, the in-memory transport) train the demo's GPT-2 cut into
three single-replica stages (``planner="even_layers"``, one replica), so that every stage keeps shadow
copies. The job runs ``--rounds`` times with copies and as often without, alternating so that the
machine's load drifts over both alike. Per run: the training phase's seconds (the first to the last
step the loss stage reported) and the CPU-seconds of the whole run (every node is in this process; on a
shared machine the load-independent figure). Headline: steps per second with copies / without (1.0: free).
"""

from __future__ import annotations

import logging
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
from fusionp2p.cli.demo import SEQ_LEN, demo_model
from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.events import JobStateChanged, ProgressEvent, StepProgress
from fusionp2p.jobs.host import NodeJobConfig
from fusionp2p.jobs.shadow import ShadowConfig
from fusionp2p.train.config import TrainConfig


async def _one(home: Path, steps: int, shadow: bool, nonce: bytes) -> dict[str, Any]:
    jobs = NodeJobConfig(shadow=ShadowConfig(enabled=shadow), progress_interval=0.0)
    cfg = TrainConfig(steps=steps, micro_batch=8, micro_batches=4, lr=2e-3, planner="even_layers", replicas=1, seed=0)
    seen: dict[int, float] = {}
    states: list[str] = []

    def emit(ev: ProgressEvent) -> None:
        if isinstance(ev, StepProgress) and ev.loss is not None:
            seen.setdefault(ev.step, time.monotonic())   # progress_interval 0: one event per step
        elif isinstance(ev, JobStateChanged):
            states.append(ev.state)

    with trio.fail_after(900):
        async with embedded_job(3, home, jobs=jobs, model=demo_model(), dataset=BuiltinCorpus(seq_len=SEQ_LEN), cfg=cfg,
                                nonce=nonce) as (pub, built):
            await pub.run_job(built, emit, home / "checkpoints")
    if not states or states[-1] != "done" or len(seen) < 2:
        raise RuntimeError(f"the job did not train to the end: states {states}, {len(seen)} steps seen")
    first, last = min(seen), max(seen)
    train_s = seen[last] - seen[first]
    return {"shadow": shadow, "train_s": train_s, "steps_per_s": (last - first) / train_s}


def main() -> None:
    ap = parser("shadow_cost", __doc__)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    steps = 40 if args.quick else 120
    rounds = 1 if args.quick else args.rounds
    root = Path(tempfile.mkdtemp(prefix="fusionp2p-bench-shadow-"))
    runs = []
    for i in range(rounds):
        for shadow in (True, False) if i % 2 == 0 else (False, True):
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            r = trio.run(_one, root / f"r{i}-{int(shadow)}", steps, shadow, bytes([i, shadow]))
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            # the whole run's CPU (every node of the embedded swarm is in this process): what copies cost when the
            # machine is shared and wall-clock rates drift with the neighbours' load
            r["cpu_s"] = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime
            print(f"round {i} shadow {'on ' if shadow else 'off'}: {r['steps_per_s']:.2f} steps/s ({r['train_s']:.1f} s, "
                  f"{r['cpu_s']:.1f} CPU-s for the run)")
            runs.append(r)
    on = statistics.median(r["steps_per_s"] for r in runs if r["shadow"])
    off = statistics.median(r["steps_per_s"] for r in runs if not r["shadow"])
    cpu_on = statistics.median(r["cpu_s"] for r in runs if r["shadow"])
    cpu_off = statistics.median(r["cpu_s"] for r in runs if not r["shadow"])
    print(f"with shadow copies {on:.2f} steps/s, without {off:.2f}: ratio {on / off:.3f}; CPU-seconds of the run "
          f"{cpu_on:.1f} with, {cpu_off:.1f} without: ratio {cpu_on / cpu_off:.3f}")
    write("shadow_cost", args.out, {"runs": runs, "steps": steps, "with_steps_per_s": on, "without_steps_per_s": off,
                                    "with_cpu_s": cpu_on, "without_cpu_s": cpu_off, "cpu_ratio": cpu_on / cpu_off},
          headline("steps per second with shadow copies / without (3 single-replica stages, demo GPT-2)",
                   on / off, "x", 0.95, "higher", "the same job without shadow copies"),
          quick=args.quick)


if __name__ == "__main__":
    main()
