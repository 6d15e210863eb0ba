"""End-to-end job vs single-process training of the same model: tokens/s and final loss.

The distributed side is the demo job (GPT-2 demo model, CO2, AdaTopK; the planner's layout: 2 stages x 2
replicas until issue 40, 1 stage x 2 replicas on 2 of the 4 nodes since the plan counts the cores they share) on a
real loopback swarm: a bootstrap and 4 ``fusionp2p node`` processes, the job published with
``Swarm.connect`` over libp2p, tensors over the encrypted data plane. For reference the same job also
runs on the embedded ``Swarm.local`` (one process, in-memory channels). The baseline trains the same
module, same data order and optimizer, in one process. Headline: throughput ratio (processes / single),
tokens counted from the publisher's RUNNING to the last step (swarm start-up and the offer are excluded
and reported separately).

What that wall holds changed without its code changing: on 2026-11-21 (1.48x and 1.40x, full runs of 100
steps) a node fetched the whole model's weights while it verified the offer, before RUNNING; since issue 37
each member fetches its own stage's weight pieces once the plan names its stage, after RUNNING, so the
wall now also holds that fetch (with opening the links and the first step: ``running_to_first_step_s``),
and ``--quick`` spreads it over 20 steps instead of 100. ``ratio_steady`` (first to last step on the
nodes' clock) is the training alone.
"""

from __future__ import annotations

import time

import torch

from benchmarks._common import headline, parser, write
from fusionp2p.cli.demo import SEQ_LEN, demo_config, demo_model
from fusionp2p.data import BatchSampler, BuiltinCorpus, SamplerConfig, corpus_tokens
from fusionp2p.jobs.events import StepProgress
from fusionp2p.sdk import Swarm


def single(steps: int) -> dict[str, float]:
    cfg = demo_config(steps, 2)
    model = demo_model()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    tokens = corpus_tokens("pydoc")
    s = BatchSampler(SamplerConfig(num_tokens=len(tokens), seq_len=SEQ_LEN, micro_batch=cfg.micro_batch,
                                   micro_batches=cfg.micro_batches, seed=cfg.seed))
    t0 = time.perf_counter()
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        tot = 0.0
        for mu in range(cfg.micro_batches):
            x, y = (torch.from_numpy(s.inputs(tokens, step, mu)), torch.from_numpy(s.targets(tokens, step, mu)))
            _, loss = model(x, y)
            (loss / cfg.micro_batches).backward()
            tot += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(tot / cfg.micro_batches)
    wall = time.perf_counter() - t0
    return {"tokens_per_s": steps * cfg.samples_per_step * SEQ_LEN / wall, "final_loss": sum(losses[-5:]) / 5, "wall_s": wall}


def swarm(steps: int, nodes: int) -> dict[str, float]:
    cfg = demo_config(steps, nodes)
    losses: list[float] = []
    with Swarm.local(n_nodes=nodes) as sw:
        t0 = time.perf_counter()
        job = sw.publish(model=demo_model(), dataset=BuiltinCorpus(seq_len=SEQ_LEN), config=cfg)
        t1 = time.perf_counter()
        losses = [e.loss for e in job.events() if isinstance(e, StepProgress) and e.loss is not None and e.step < steps]
        job.wait(timeout=5)
        wall = time.perf_counter() - t1
    r = cfg.replicas or 1
    return {"tokens_per_s": steps * r * cfg.samples_per_step * SEQ_LEN / wall, "final_loss": sum(losses[-5:]) / 5,
            "wall_s": wall, "publish_s": t1 - t0}


def processes(steps: int, nodes: int) -> dict[str, float]:
    import tempfile
    from pathlib import Path

    from fusionp2p.cli.cluster import LocalCluster
    from fusionp2p.jobs.events import JobStateChanged, PlanChanged
    from fusionp2p.testing.wait import wait_until

    cfg = demo_config(steps, nodes)
    losses: list[float] = []
    t_start = time.perf_counter()
    home = Path(tempfile.mkdtemp(prefix="fusionp2p-bench-e2e-"))
    # preload: the nodes are forked from one forkserver that imported torch and torch._dynamo (each node's first
    # optimizer imports it, after RUNNING: inside the headline's wall) once, as the demo's (cli/forked.py)
    with LocalCluster(nodes, home, preload=True) as cluster, \
            Swarm.connect([cluster.bootstrap], home=home / "client", listen="/ip4/127.0.0.1/tcp/0") as sw:
        wait_until(lambda: len(sw.members()) >= nodes, timeout=120, interval=0.5, what="members")
        t0 = time.perf_counter()
        job = sw.publish(model=demo_model(), dataset=BuiltinCorpus(seq_len=SEQ_LEN), config=cfg)
        t_run = t_end = run_at = 0.0
        ats: dict[int, float] = {}   # each step's end on the reporting node's clock (one host: one clock)
        plan: PlanChanged | None = None
        for e in job.events(timeout=600):
            if isinstance(e, PlanChanged):
                plan = e
            elif isinstance(e, JobStateChanged) and e.state == "running":
                t_run, run_at = time.perf_counter(), time.time()
            elif isinstance(e, StepProgress) and e.loss is not None and e.step < steps:
                losses.append(e.loss)
                ats.setdefault(e.step, e.at)
                t_end = time.perf_counter()
        job.wait(timeout=5)
        t_done = time.perf_counter()
    # the pipelines the planner chose (since issue 40 it counts the cores the nodes share: on 2 cores, 1 stage x 2
    # replicas on 2 of the 4 nodes); each runs the job's micro-batches a step
    r = plan.stage_sizes[0] if plan is not None and plan.stage_sizes else cfg.replicas or 1
    wall = t_end - t_run
    # the publisher's RUNNING comes when the members took the start, before they adopt the plan, fetch
    # their stages' weights and open their links: the headline's wall holds those seconds (about 8 of
    # the quick run's 20 steps on an idle machine before issue 40). The steps alone, from the end of the
    # first to the end of the last, on the nodes' clock, for comparison with the plan's prediction
    first, last = min(ats), max(ats)
    steady = (last - first) * r * cfg.samples_per_step * SEQ_LEN / max(1e-9, ats[last] - ats[first])
    return {"tokens_per_s": steps * r * cfg.samples_per_step * SEQ_LEN / wall, "final_loss": sum(losses[-5:]) / 5,
            "steady_tokens_per_s": steady, "step_s": (ats[last] - ats[first]) / max(1, last - first),
            "running_to_first_step_s": ats[first] - run_at,
            "plan": list(plan.stage_sizes) if plan is not None else [], "predicted_step_s": plan.step_s if plan is not None else 0.0,
            "wall_s": wall, "swarm_start_s": t0 - t_start, "publish_to_running_s": t_run - t0,
            "download_s": t_done - t_end, "steps_seen": len(losses), "exit_codes_ok": float(all(
                c == 0 for c in cluster.exit_codes.values()))}


def main() -> None:
    import logging

    args = parser("e2e", __doc__).parse_args()
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)   # py-libp2p warns at routine events
    torch.set_num_threads(1)
    steps = 20 if args.quick else 100
    one = single(steps)
    procs = processes(steps, 4)
    many = swarm(steps, 4)
    ratio = procs["tokens_per_s"] / one["tokens_per_s"]
    print(f"{'run':<34}{'tokens/s':>12}{'final loss':>12}{'train s':>10}")
    stages = procs["plan"]
    shape = f"{len(stages)}x{stages[0]}" if stages else "?"
    for label, r in (("single process", one), (f"loopback processes {shape} (libp2p)", procs), ("embedded Swarm.local", many)):
        print(f"{label:<34}{r['tokens_per_s']:>12,.0f}{r['final_loss']:>12.3f}{r['wall_s']:>10.1f}")
    print(f"processes: swarm start {procs['swarm_start_s']:.1f} s, publish -> running {procs['publish_to_running_s']:.1f} s, "
          f"running -> first step done {procs['running_to_first_step_s']:.1f} s, "
          f"last step -> model downloaded {procs['download_s']:.1f} s")
    steady = procs["steady_tokens_per_s"] / one["tokens_per_s"]
    print(f"throughput ratio (processes / single): {ratio:.2f}; the steps alone (first to last, "
          f"{procs['step_s']:.3f} s a step, the plan predicted {procs['predicted_step_s']:.3f}): {steady:.2f}")
    write("e2e", args.out, {"steps": steps, "single": one, "processes": procs, "embedded": many, "ratio": ratio,
                            "ratio_steady": steady, "ratio_embedded": many["tokens_per_s"] / one["tokens_per_s"]},
          headline("tokens/s, 4 node processes on loopback vs single process", ratio, "x", 1.0, "higher",
                   "single-process training"),
          quick=args.quick)


if __name__ == "__main__":
    main()
