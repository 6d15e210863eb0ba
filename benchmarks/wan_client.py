"""The publisher of the geo-distributed benchmark: ``python -m benchmarks.wan_client --job FILE``.

``benchmarks/wan.py`` starts this process inside the testbed's unshaped control namespace, beside the
bootstrap. It joins the swarm of ``fusionp2p node`` processes with :meth:`Swarm.connect` (the SDK,
libp2p), waits until every node is a member, then publishes one job per system, one after the other
(the systems never overlap on the shared cores). Per job it follows the events (deadline: the job
file's ``system_timeout``), waits for DONE, downloads the model and evaluates its held-out loss,
and writes one JSON line ``{"system": ..., ...}`` to stdout; a failed job writes its error instead
and the next system runs. The last line is ``{"done": true}``.

Definitions (every figure comes from the job's own events; the nodes and this process share the
machine's clock):

* training rate: the loss stage's replicas gossip every step; the publisher emits one ``StepProgress``
  per step once every pipeline reported it. ``t(s)`` is when this process received step ``s``'s
  event; between the first step ``s0`` and the
  last ``s1`` (the first step, which includes the lazy start-up of the executors and channels, is
  the origin, not counted) the job trained ``(s1 - s0) * R * micro_batch * micro_batches`` samples
  in ``t(s1) - t(s0)`` seconds, ``R`` the replicas per stage of the elected plan;
* held-out loss: the downloaded ``model.safetensors`` loaded into a fresh module, mean loss over
  ``HELD_OUT_BATCHES`` micro-batches of the corpus drawn at sampler steps from ``HELD_OUT_FROM`` on,
  far beyond any step a job trains (the same definition as benchmarks/churn.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from fusionp2p.data import BatchSampler, BuiltinCorpus, SamplerConfig, corpus_tokens
from fusionp2p.jobs.events import EvalProgress, JobStateChanged, LinksUp, PlanChanged, StepProgress
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.sdk import Swarm
from fusionp2p.testing.wait import wait_until
from fusionp2p.train.config import TrainConfig

HELD_OUT_FROM = 1_000_000
HELD_OUT_BATCHES = 16


def make_model(run: dict[str, Any]) -> GPT2:
    """The benchmark's GPT-2, seeded: every system starts from the same weights."""
    torch.manual_seed(run["seed"])
    return GPT2(GPT2Config.tiny(n_layer=run["n_layer"], n_embd=run["n_embd"], n_head=run["n_head"],
                                block_size=run["seq_len"]))


def make_config(run: dict[str, Any], system: dict[str, Any]) -> TrainConfig:
    kw = {"replicas": run["replicas"], **system["config"]}     # a system may name its own replicas (None: the planner's)
    return TrainConfig(steps=run["steps"], micro_batch=run["micro_batch"], micro_batches=run["micro_batches"],
                       optimizer="adamw", lr=run["lr"], seed=run["seed"], **kw)


def held_out_loss(path: Path, run: dict[str, Any]) -> float:
    model = make_model(run)
    model.load_state_dict(safetensors.torch.load_file(str(path)), strict=True)
    tokens = corpus_tokens("pydoc")
    s = BatchSampler(SamplerConfig(num_tokens=len(tokens), seq_len=run["seq_len"], micro_batch=run["micro_batch"],
                                   micro_batches=1, seed=run["seed"]))
    with torch.no_grad():
        return float(np.mean([float(model(torch.from_numpy(s.inputs(tokens, HELD_OUT_FROM + b, 0)),
                                          torch.from_numpy(s.targets(tokens, HELD_OUT_FROM + b, 0)))[1])
                              for b in range(HELD_OUT_BATCHES)]))


def training_rate(steps: dict[int, float], replicas: int, run: dict[str, Any]) -> dict[str, Any]:
    """Samples/s between the first and the last step reported (module docstring)."""
    done = sorted(steps)
    if len(done) < 2:
        return {"samples_per_s": None, "train_s": None, "steps_timed": 0}
    s0, s1 = done[0], done[-1]
    dt = steps[s1] - steps[s0]
    samples = (s1 - s0) * replicas * run["micro_batch"] * run["micro_batches"]
    return {"samples_per_s": samples / dt if dt > 0 else None, "train_s": dt, "steps_timed": s1 - s0,
            "samples_timed": samples}


WARMUP = {"name": "warmup", "description": "six data-parallel CO2 steps of the whole model on every node, not reported",
          "config": {"planner": "even_layers", "compression": None, "averaging": "co2"}}
WARMUP_STEPS = 6


def run_system(sw: Swarm, run: dict[str, Any], system: dict[str, Any], workdir: Path) -> dict[str, Any]:
    cfg = make_config(run, system)
    t_pub = time.time()
    job = sw.publish(model=make_model(run), dataset=BuiltinCorpus(seq_len=run["seq_len"]), config=cfg,
                     name=f"wan-{system['name']}")
    plan: PlanChanged | None = None
    epochs: set[int] = set()
    t_running = t_links = None
    reported: dict[int, float] = {}     # step -> when this process heard it (once every pipeline reported it)
    node_rates: list[float] = []        # the loss stage's own tokens/s of each step, summed over the pipelines
    losses: dict[int, list[float]] = {}
    evals: list[float] = []
    deadline = time.monotonic() + run["system_timeout"]
    for ev in job.events(timeout=run["system_timeout"]):
        if isinstance(ev, PlanChanged):
            plan = ev
            epochs.add(ev.epoch)
        elif isinstance(ev, JobStateChanged) and ev.state == "running" and t_running is None:
            t_running = ev.at
        elif isinstance(ev, LinksUp):
            t_links = ev.at if t_links is None else max(t_links, ev.at)
        elif isinstance(ev, StepProgress) and ev.loss is not None and ev.step < cfg.steps:
            reported.setdefault(ev.step, ev.at)
            losses.setdefault(ev.step, []).append(ev.loss)
            if ev.tokens_per_s > 0:
                node_rates.append(ev.tokens_per_s / run["seq_len"])
        elif isinstance(ev, EvalProgress):
            evals.append(ev.loss)
        if time.monotonic() > deadline:
            job.cancel()
            raise TimeoutError(f"system {system['name']}: not DONE within {run['system_timeout']} s")
    job.wait(timeout=max(1.0, deadline - time.monotonic()))
    t_done = time.time()
    path = job.download(workdir / f"model-{system['name']}")
    assert plan is not None, "a DONE job has a plan"
    r = plan.stage_sizes[0] if plan.stage_sizes else 1
    rate = training_rate(reported, r, run)
    per_step = r * run["micro_batch"] * run["micro_batches"]
    return {
        "system": system["name"], "description": system["description"], "config": system["config"],
        "job": job.id, "plan": {"stage_sizes": list(plan.stage_sizes), "members": list(plan.members), "rho": list(plan.rho),
                                "link_bps": list(plan.link_bps), "fence_s": list(plan.fence_s), "how": plan.how,
                                "predicted_step_s": plan.step_s, "micro": list(plan.micro)},
        "epochs": sorted(epochs), "replicas": r, "samples": cfg.steps * per_step, **rate,
        # the event's step_s is a whole step, R x M micro-batches (jobs/events.py pipeline_step_s; until
        # 2026-11-30 it was the plan's throughput-equivalent time of M, and this read M per step_s)
        "predicted_samples_per_s": per_step / plan.step_s if plan.step_s > 0 else None,
        "node_reported_samples_per_s": float(np.median(node_rates)) if node_rates else None,
        "loss_curve": [{"step": s, "loss": float(np.mean(v))} for s, v in sorted(losses.items())],
        "held_out_loss": held_out_loss(path, run), "final_eval_loss": evals[-1] if evals else None,
        "publish_to_running_s": (t_running - t_pub) if t_running else None,
        "publish_to_links_s": (t_links - t_pub) if t_links else None, "publish_to_done_s": t_done - t_pub,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.wan_client", description=__doc__)
    ap.add_argument("--job", type=Path, required=True, help="the run file written by benchmarks/wan.py")
    a = ap.parse_args(argv)
    doc = json.loads(a.job.read_text())
    run, workdir = doc["run"], Path(doc["workdir"])
    torch.set_num_threads(1)
    with Swarm.connect([doc["bootstrap"]], home=workdir / "client", listen=doc["listen"]) as sw:
        wait_until(lambda: len(sw.members()) >= doc["nodes"], timeout=120, interval=0.5, what="every node a member")
        print(json.dumps({"members": len(sw.members())}), flush=True)
        # Warm-up, not reported: a node's first job pays one-off costs (lazy imports of torch's tracing
        # stack when it decodes the DAG, first allocations, connections); whichever system ran first paid
        # them (on `lan` baseline A measured 146 samples/s against 328 for B with the same plan). Six
        # data-parallel steps of the whole model, one replica per node, pay them for every operator on
        # every node, and every node announces the speed it trained at (jobs/rebalance.py: figures come
        # from single-stage plans only), as the nodes of a swarm that has trained before do. With CO2's
        # rounds running beside the compute, as in the jobs that follow: without them the 0.165-core hosts
        # measured 0.65-0.74x their benchmark's speed and then trained a CO2 job at 0.42x.
        try:
            run_system(sw, {**run, "steps": WARMUP_STEPS, "replicas": doc["nodes"]}, WARMUP, workdir)
        except Exception as exc:
            print(json.dumps({"warmup_error": f"{type(exc).__name__}: {exc}"}), flush=True)
        for system in doc["systems"]:
            try:
                out = run_system(sw, run, system, workdir)
            except Exception as exc:   # reported in the results; the next system still runs
                out = {"system": system["name"], "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(out), flush=True)
    print(json.dumps({"done": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
