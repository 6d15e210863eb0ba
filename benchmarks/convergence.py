"""Convergence at equal samples: does the system's parallel training land where plain training does?

The same model, data and number of samples for every system; the held-out loss of each final model
(the averaged/consensus weights the publisher downloads). Systems:

* ``adamw``: one process, one AdamW over all ``R*M`` micro-batches of a step (the reference);
* ``allreduce``: the product, ``R`` replicas per stage averaging gradients every step (``averaging=None``);
* ``co2-sync``: the product, CO2 with a blocking average (``CO2(sync=True)``);
* ``co2-async``: the product, CO2 as shipped: streaming (one fragment of the vector averaged per step,
  applied one step late, docs/averaging.md);
* ``co2-stale`` (not in the default set): CO2's original form (``CO2(stream=False)``), the whole vector's
  one-round-stale average overlapped with the next round;
* ``co2-async-fp32`` (not in the default set): ``co2-async`` with every averaging part in fp32
  (``CO2(wire="fp32")``; the default sends bf16 differences from the last average);
* ``co2-async-adatopk``: CO2 async with AdaTopK on an emulated WAN of four sites, one node each, 16 Mbit/s
  between them (``Swarm.local(links=sites(...))``), whose nodes are too small to hold the whole model
  (``WAN_MEMORY`` of what it needs with its optimizer and CO2 state): the model is cut in stages, every
  fence crosses a slow link and is compressed. (With room for the whole model the planner rightly runs
  one stage per node and no fence exists; with two sites of two nodes it keeps a pipeline in each site
  and averages across, and no fence crosses);
* ``opfence``: the planner's own choice (``replicas=None``) on the same WAN, CO2 async + AdaTopK; its step
  count is scaled so that it sees the same number of samples whatever replica count it chose, and when
  that count is not ``R`` an ``allreduce`` at its count is run too (``allreduce-r<N>``, its reference).

Every product run is a real job on ``Swarm.local`` (4 nodes: bootstrap, JOB protocol, election, the
encrypted TCP data plane, stage workers, CO2 averagers, checkpoints, download). Data: the built-in pydoc
corpus, its first 90% for training (a ``TokenFile``) and its last 10% held out. Models: the GPT-2
reference of the demo (``--model gpt2``, 0.87M parameters) or a byte-level MLP language model
(``--model mlp``). Headline: the worst, among the asynchronous or compressed systems, of its held-out loss
over that of the per-step all-reduce at the same replica count and samples, target <= 1.02. Loss curves: ``benchmarks/results/convergence_<model>.png``.

``python -m benchmarks.convergence --steps 2000 --model gpt2`` (``--quick``: 40 steps).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks._common import RESULTS, headline, parser, write
from fusionp2p.data import BatchSampler, SamplerConfig, TokenFile, corpus_tokens
from fusionp2p.graph.coarsen import coarsen
from fusionp2p.graph.workload import to_workload
from fusionp2p.jobs.build import planner_config, trace_job
from fusionp2p.jobs.events import PlanChanged
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.plan.estimator import unit_memory
from fusionp2p.sdk import LOCAL_PROFILE, Swarm, sites
from fusionp2p.train.config import CO2, AdaTopK, TrainConfig

SEQ = 64
NODES = 4
REPLICAS = 2
WAN = "16mbit"          # between the emulated sites (AdaTopK systems)
WAN_SITES = [1, 1, 1, 1]  # nodes per site
WAN_MEMORY = 0.6        # the WAN nodes' memory, as a fraction of what the whole model needs to train replicated
HELD_BATCHES = 16       # held-out micro-batches evaluated per model
ASYNC_OR_COMPRESSED = ("co2-async", "co2-async-adatopk", "opfence")
SYSTEMS = ("adamw", "allreduce", "co2-sync", *ASYNC_OR_COMPRESSED)
EXTRA = ("co2-stale", "co2-async-fp32")   # selectable with --systems, not run by default
CARRIED = ("adamw", "allreduce")   # --reference: the dense references, untouched by the averager and the compression


class ByteMLP(nn.Module):
    """A byte-level MLP language model: each position sees its own byte and the ``context - 1`` before it
    (a causal window gathered by shifted embeddings), two GELU layers, a linear head."""

    def __init__(self, *, context: int = 4, d: int = 64, hidden: int = 256, vocab: int = 256) -> None:
        super().__init__()
        self.context = context
        self.emb = nn.ModuleList([nn.Embedding(vocab, d) for _ in range(context)])
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_BTD = self.emb[0](idx_BT)
        for k in range(1, self.context):   # byte t-k, zero-padded at the start of the window
            shifted = torch.nn.functional.pad(idx_BT[:, :-k], (k, 0))
            x_BTD = x_BTD + self.emb[k](shifted)
        h = torch.nn.functional.gelu(self.fc1(x_BTD))
        h = torch.nn.functional.gelu(self.fc2(h))
        logits_BTV = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1))
        return logits_BTV, loss


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        return GPT2(GPT2Config.tiny(block_size=SEQ, n_layer=4, n_head=4, n_embd=128))
    if name == "mlp":
        return ByteMLP()
    raise SystemExit(f"unknown model {name!r}: gpt2 or mlp")


def base_config(steps: int) -> TrainConfig:
    return TrainConfig(steps=steps, micro_batch=8, micro_batches=4, lr=2e-3, lr_schedule="cosine",
                       replicas=REPLICAS, seed=0)


def system_config(system: str, steps: int, *, dense_finish: float | None = None, rho_min: float | None = None) -> TrainConfig:
    cfg = base_config(steps)
    comp = AdaTopK(**({} if dense_finish is None else {"dense_finish": dense_finish}),
                   **({} if rho_min is None else {"rho_min": rho_min}))
    table: dict[str, dict[str, Any]] = {
        "allreduce": {"averaging": None},
        "co2-sync": {"averaging": CO2(sync=True)},
        "co2-async": {"averaging": CO2()},
        "co2-stale": {"averaging": CO2(stream=False)},
        "co2-async-fp32": {"averaging": CO2(wire="fp32")},
        "co2-async-adatopk": {"averaging": CO2(), "compression": comp},
        "opfence": {"averaging": CO2(), "compression": comp, "replicas": None},
    }
    return dataclasses.replace(cfg, **table[system])


def heldout_loss(model: nn.Module, held: np.ndarray, cfg: TrainConfig) -> float:
    s = BatchSampler(SamplerConfig(num_tokens=len(held), seq_len=SEQ, micro_batch=cfg.micro_batch, micro_batches=1, seed=1))
    model.eval()
    with torch.no_grad():
        out = float(np.mean([float(model(torch.from_numpy(s.inputs(held, b, 0)), torch.from_numpy(s.targets(held, b, 0)))[1])
                             for b in range(HELD_BATCHES)]))
    model.train()
    return out


def run_adamw(model_name: str, cfg: TrainConfig, train: np.ndarray) -> tuple[nn.Module, dict[int, float]]:
    """The reference: one AdamW step per step over the same R*M micro-batches the replicas draw."""
    model = make_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    s = BatchSampler(SamplerConfig(num_tokens=len(train), seq_len=SEQ, micro_batch=cfg.micro_batch,
                                   micro_batches=cfg.micro_batches, seed=cfg.seed))
    curve: dict[int, float] = {}
    n = REPLICAS * cfg.micro_batches
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        losses = []
        for r in range(REPLICAS):
            for mu in range(cfg.micro_batches):
                _, loss = model(torch.from_numpy(s.inputs(train, step * REPLICAS + r, mu)),
                                torch.from_numpy(s.targets(train, step * REPLICAS + r, mu)))
                (loss / n).backward()
                losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
        curve[step] = float(np.mean(losses))
    return model, curve


def wan_memory(model_name: str, cfg: TrainConfig, dataset: TokenFile) -> int:
    """``WAN_MEMORY`` of the bytes the whole model needs on one replicated device (the planner's estimate)."""
    pc = planner_config(cfg)
    wl = to_workload(coarsen(trace_job(make_model(model_name), None, dataset, cfg)), micro_batch=cfg.micro_batch)
    need = sum(unit_memory(u, pc, replicated=True) for u in wl.units) / pc.memory_headroom
    return int(WAN_MEMORY * need)


def run_swarm(model_name: str, cfg: TrainConfig, dataset: TokenFile, *, wan: bool, home: Path,
              timeout: float) -> tuple[nn.Module, dict[int, float], dict[str, Any]]:
    links = sites(WAN_SITES, between=WAN) if wan else None
    profiles = None
    if wan:
        profiles = [dataclasses.replace(LOCAL_PROFILE, memory_bytes=wan_memory(model_name, cfg, dataset))] * NODES
    with Swarm.local(n_nodes=NODES, home=home, links=links, profiles=profiles) as sw:
        job = sw.publish(model=make_model(model_name), dataset=dataset, config=cfg, name=f"convergence-{model_name}")
        job.wait(timeout=timeout)
        model = make_model(model_name)
        job.load_into(model)
        plan = next((e for e in job.history if isinstance(e, PlanChanged)), None)
        info = {"plan": None if plan is None else {"stage_sizes": list(plan.stage_sizes), "rho": list(plan.rho),
                                                    "link_bps": list(plan.link_bps), "how": plan.how},
                "node_memory_bytes": None if profiles is None else profiles[0].memory_bytes}
        return model, dict(job.losses), info


def plot(path: Path, curves: dict[str, dict[int, float]], samples_per_step: dict[str, int], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, curve in curves.items():
        steps = sorted(curve)
        k = max(1, len(steps) // 200)      # a running mean keeps long curves readable
        ys = np.convolve([curve[s] for s in steps], np.ones(k) / k, mode="valid")
        xs = [steps[i + k - 1] * samples_per_step[name] for i in range(len(ys))]
        ax.plot(xs, ys, label=name, linewidth=1.2)
    ax.set_xlabel("samples")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def carry_reference(path: Path, results: dict[str, Any], curves: dict[str, dict[int, float]],
                    per_step: dict[str, int]) -> None:
    """Take the dense references this run did not repeat (``CARRIED``: no CO2, so nothing of the averager or
    the compression reaches them) from an earlier results JSON of the same model and steps."""
    doc = json.loads(path.read_text())
    old, when = doc["results"], doc.get("time", "?")
    if (old["model"], old["steps"], old["replicas"]) != (results["model"], results["steps"], results["replicas"]):
        raise SystemExit(f"{path}: another model, step count or replica count than this run")
    for name, entry in old["systems"].items():
        if name in results["systems"] or name not in CARRIED:
            continue
        results["systems"][name] = {**entry, "from": f"{path} ({when})"}   # the run's time: the file may be overwritten
        if name in old.get("curves", {}):
            per_step[name] = entry["samples"] // entry["steps"]
            curves[name] = dict(enumerate(old["curves"][name]))


def main() -> None:
    p = parser("convergence", __doc__)
    p.add_argument("--steps", type=int, default=2000, help="steps of R=2 replicas (every system sees the same samples)")
    p.add_argument("--model", default="gpt2", choices=("gpt2", "mlp"))
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS + EXTRA))
    p.add_argument("--dense-finish", type=float, default=None,
                   help="AdaTopK.dense_finish of the compressed systems (default: the product's default)")
    p.add_argument("--rho-min", type=float, default=None,
                   help="AdaTopK.rho_min (the floor of a fence's kept fraction) of the compressed systems (default: the product's)")
    p.add_argument("--reference", type=Path, default=None,
                   help="a results JSON of the same model and steps: the dense references (" + ", ".join(CARRIED) +
                        ") this run does not repeat are taken from it, marked with where they came from")
    args = p.parse_args()
    steps = 40 if args.quick else args.steps
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS + EXTRA:
            raise SystemExit(f"unknown system {s!r}")
    torch.set_num_threads(1)
    tokens = corpus_tokens("pydoc")
    cut = int(len(tokens) * 0.9)
    train, held = np.asarray(tokens[:cut]), np.asarray(tokens[cut:])
    work = Path(tempfile.mkdtemp(prefix="fp2p-convergence-"))
    (work / "train.txt").write_bytes(train.tobytes())
    dataset = TokenFile(work / "train.txt", seq_len=SEQ)
    results: dict[str, Any] = {"model": args.model, "steps": steps, "replicas": REPLICAS, "nodes": NODES, "wan": WAN,
                               "wan_sites": WAN_SITES, "wan_memory": WAN_MEMORY,
                               "dense_finish": AdaTopK().dense_finish if args.dense_finish is None else args.dense_finish,
                               "rho_min": AdaTopK().rho_min if args.rho_min is None else args.rho_min,
                               "samples": steps * REPLICAS * base_config(steps).samples_per_step,
                               "systems": {}}
    curves: dict[str, dict[int, float]] = {}
    per_step: dict[str, int] = {}
    for system in systems:
        t0 = time.perf_counter()
        cfg = base_config(steps) if system == "adamw" else system_config(system, steps, dense_finish=args.dense_finish, rho_min=args.rho_min)
        info: dict[str, Any] = {}
        if system == "adamw":
            model, curve = run_adamw(args.model, cfg, train)
            r = REPLICAS
        else:
            wan = system in ("co2-async-adatopk", "opfence")
            timeout = max(600.0, 10.0 * steps)
            model, curve, info = run_swarm(args.model, cfg, dataset, wan=wan, home=work / system, timeout=timeout)
            r = REPLICAS
            sizes = (info.get("plan") or {}).get("stage_sizes") or [REPLICAS]
            if system == "opfence" and sizes[0] != REPLICAS:
                # the planner chose another replica count: run again with the steps that give equal samples
                r = sizes[0]
                cfg = dataclasses.replace(cfg, steps=max(1, round(steps * REPLICAS / r)), replicas=r)
                model, curve, info = run_swarm(args.model, cfg, dataset, wan=True, home=work / f"{system}-r{r}",
                                               timeout=timeout)
                # its reference: the per-step all-reduce at the same replica count and samples
                ref_cfg = dataclasses.replace(system_config("allreduce", steps), steps=cfg.steps, replicas=r)
                ref_model, ref_curve, _ = run_swarm(args.model, ref_cfg, dataset, wan=False,
                                                    home=work / f"allreduce-r{r}", timeout=timeout)
                ref_loss = heldout_loss(ref_model, held, ref_cfg)
                results["systems"][f"allreduce-r{r}"] = {"heldout_loss": ref_loss, "steps": ref_cfg.steps, "replicas": r,
                                                         "samples": ref_cfg.steps * r * ref_cfg.samples_per_step}
                curves[f"allreduce-r{r}"] = ref_curve
                per_step[f"allreduce-r{r}"] = r * ref_cfg.samples_per_step
                info["reference"] = f"allreduce-r{r}"
        loss = heldout_loss(model, held, cfg)
        took = time.perf_counter() - t0
        results["systems"][system] = {"heldout_loss": loss, "steps": cfg.steps, "replicas": r,
                                      "samples": cfg.steps * r * cfg.samples_per_step, "wall_s": round(took, 1),
                                      "final_train_loss": float(np.mean([curve[s] for s in sorted(curve)[-10:]])),
                                      **info}
        curves[system] = curve
        per_step[system] = r * cfg.samples_per_step
        print(f"{system:>18}: held-out loss {loss:.4f}  ({cfg.steps} steps x {r} replicas, {took:.0f} s)", flush=True)
    if args.reference is not None:
        carry_reference(args.reference, results, curves, per_step)
    res = results["systems"]
    # each async/compressed system over its reference: the all-reduce at its own replica count
    ratios = {}
    for s in ASYNC_OR_COMPRESSED:
        ref = res.get(res[s].get("reference", "allreduce"), {}).get("heldout_loss") if s in res else None
        if ref:
            ratios[s] = res[s]["heldout_loss"] / ref
            res[s]["over_reference"] = ratios[s]
    value = max(ratios.values(), default=math.nan)
    results["worst_async_or_compressed_over_allreduce"] = value
    out = args.out if args.out != RESULTS / "convergence.json" else RESULTS / f"convergence_{args.model}.json"
    out_png = out.with_suffix(".png")   # next to the JSON (the default: results/convergence_<model>.png)
    plot(out_png, curves, per_step, f"{args.model}: {steps} steps x {REPLICAS} replicas, {NODES} nodes")
    root = RESULTS.parent.parent
    results["curves_png"] = str(out_png.resolve().relative_to(root)) if out_png.resolve().is_relative_to(root) else str(out_png)
    results["curves"] = {k: [round(v[s], 4) for s in sorted(v)] for k, v in curves.items()}
    head = headline("worst held-out loss of the async/compressed systems / per-step all-reduce", value, "ratio",
                    1.02, "lower", "per-step all-reduce (allreduce) at the same replica count, model, data and samples")
    write("convergence", out, results, head, quick=args.quick)


if __name__ == "__main__":
    main()

