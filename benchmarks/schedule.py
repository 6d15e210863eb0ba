"""Pipeline schedules: simulated step time and activation memory of GPipe vs 1F1B, and the cost of
the pure schedule state machine itself next to the compute it drives.

Part 1 drives the real :class:`fusionp2p.train.schedule.StageSchedule` machines in a discrete-event
simulation (forward cost f, backward 2f, a link latency), over a grid of stages x micro-batches,
and records the step time, the bubble fraction and the peak stash per stage.
Part 2 times ``handle()`` on this machine: all events of one step divided by the micro-batches,
compared with a forward + backward of one small transformer-like block on one micro-batch. The
headline is that ratio (the state machine's share of a stage's time; lower is better).
"""

from __future__ import annotations

import heapq
import time
from typing import Any

import torch

from benchmarks._common import headline, parser, write
from fusionp2p.train.schedule import (
    Action,
    ActivationArrived,
    BackwardDone,
    Event,
    ForwardDone,
    GradientArrived,
    OptimizerDone,
    OptimizerStep,
    RunBackward,
    RunForward,
    ScheduleConfig,
    SendActivation,
    SendGradient,
    StageSchedule,
)

NAME = "schedule"


def simulate(kind: str, stages: int, micro: int, *, fwd: float = 1.0, bwd: float = 2.0, latency: float = 0.1) -> dict[str, Any]:
    """Event-driven run of one step; returns the makespan and each stage's peak stash."""
    scheds = [StageSchedule(ScheduleConfig(kind=kind, stages=stages, micro_batches=micro, stage=s)) for s in range(stages)]
    heap: list[tuple[float, int, int, Event]] = []
    seq = 0
    end = 0.0

    def perform(now: float, s: int, actions: list[Action]) -> None:
        nonlocal seq
        for a in actions:
            if isinstance(a, RunForward):
                item: tuple[float, int, Event] = (now + fwd, s, ForwardDone(a.micro))
            elif isinstance(a, RunBackward):
                item = (now + bwd, s, BackwardDone(a.micro))
            elif isinstance(a, SendActivation):
                item = (now + latency, s + 1, ActivationArrived(a.micro))
            elif isinstance(a, SendGradient):
                item = (now + latency, s - 1, GradientArrived(a.micro))
            elif isinstance(a, OptimizerStep):
                item = (now, s, OptimizerDone())
            seq += 1
            heapq.heappush(heap, (item[0], seq, item[1], item[2]))

    for s, sc in enumerate(scheds):
        perform(0.0, s, sc.start())
    while heap:
        now, _, s, ev = heapq.heappop(heap)
        end = max(end, now)
        perform(now, s, scheds[s].handle(ev))
    assert all(sc.done for sc in scheds)
    ideal = micro * (fwd + bwd)
    return {
        "kind": kind, "stages": stages, "micro_batches": micro, "makespan": round(end, 3),
        "bubble": round(1 - ideal / end, 4), "peak_stash": [sc.peak_in_flight for sc in scheds],
    }


def machine_cost(stages: int, micro: int, reps: int) -> float:
    """Seconds of handle() per micro-batch per stage, replaying a whole step in arrival order."""
    t0 = time.perf_counter()
    for _ in range(reps):
        simulate("1f1b", stages, micro)
    total = time.perf_counter() - t0
    return total / reps / (micro * stages)


def block_cost(reps: int) -> float:
    """Seconds of forward + backward of one small block (8 x 128 tokens, d=128) on one micro-batch."""
    torch.manual_seed(0)
    d = 128
    block = torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
    x = torch.randn(8, 128, d, requires_grad=True)
    for _ in range(3):
        block(x).sum().backward()
    t0 = time.perf_counter()
    for _ in range(reps):
        block(x).sum().backward()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    args = parser(NAME, __doc__).parse_args()
    torch.set_num_threads(1)
    grid = [(2, 4), (4, 8), (4, 16), (6, 16)] if args.quick else [(2, 4), (2, 8), (4, 8), (4, 16), (4, 32), (6, 16), (8, 32)]
    rows = [simulate(k, s, m) for s, m in grid for k in ("gpipe", "1f1b")]
    print(f"{'schedule':8} {'S':>2} {'M':>3} {'step time':>10} {'bubble':>7}  peak stash per stage")
    for r in rows:
        print(f"{r['kind']:8} {r['stages']:>2} {r['micro_batches']:>3} {r['makespan']:>10.2f} {r['bubble']:>7.1%}  {r['peak_stash']}")
    reps = 20 if args.quick else 100
    per_micro = machine_cost(4, 16, reps)
    block = block_cost(10 if args.quick else 50)
    ratio = per_micro / block
    by = {(r["kind"], r["stages"], r["micro_batches"]): r for r in rows}
    mem = by[("1f1b", 4, 16)]["peak_stash"][0] / by[("gpipe", 4, 16)]["peak_stash"][0]
    time_ratio = by[("1f1b", 4, 16)]["makespan"] / by[("gpipe", 4, 16)]["makespan"]
    print(f"\nstate machine: {per_micro * 1e6:.1f} us per micro-batch per stage (S=4, M=16, incl. simulator);"
          f" one block fwd+bwd: {block * 1e3:.2f} ms; ratio {ratio:.2e}")
    print(f"1F1B vs GPipe at S=4, M=16: stage-0 stash {mem:.2f}x, step time {time_ratio:.3f}x")
    results = {
        "simulated": rows,
        "machine_us_per_micro_stage": per_micro * 1e6,
        "block_fwd_bwd_ms": block * 1e3,
        "overhead_ratio": ratio,
        "stash_ratio_1f1b_over_gpipe_s4_m16": mem,
        "step_time_ratio_1f1b_over_gpipe_s4_m16": time_ratio,
        "cost_model": {"fwd": 1.0, "bwd": 2.0, "latency": 0.1},
    }
    head = headline(
        "schedule state-machine time per micro-batch / one block fwd+bwd", ratio, "ratio", 0.01, "lower",
        "forward+backward of a d=128 MLP block on 8x128 tokens, same run, 1 thread",
    )
    write(NAME, args.out, results, head, quick=args.quick)


if __name__ == "__main__":
    main()
