"""End-to-end job vs single-process training of the same model: tokens/s and final loss.

The distributed side is the demo job (GPT-2 demo model, 2 stages x 2 replicas, CO2, AdaTopK) on the
embedded local swarm (all nodes in this process, in-memory channels); the baseline trains the same
module, same data order and optimizer, in one process. Headline: throughput ratio (swarm / single).
"""

from __future__ import annotations

import time

import torch

from benchmarks._common import headline, parser, write
from fusionp2p.data import BatchSampler, BuiltinCorpus, SamplerConfig, corpus_tokens
from fusionp2p.demo import SEQ_LEN, demo_config, demo_model
from fusionp2p.runtime.metrics import StepProgress
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


def main() -> None:
    args = parser("e2e", __doc__).parse_args()
    torch.set_num_threads(1)
    steps = 20 if args.quick else 100
    one = single(steps)
    many = swarm(steps, 4)
    ratio = many["tokens_per_s"] / one["tokens_per_s"]
    print(f"{'run':<24}{'tokens/s':>12}{'final loss':>12}{'wall s':>10}")
    print(f"{'single process':<24}{one['tokens_per_s']:>12,.0f}{one['final_loss']:>12.3f}{one['wall_s']:>10.1f}")
    print(f"{'local swarm 2x2':<24}{many['tokens_per_s']:>12,.0f}{many['final_loss']:>12.3f}{many['wall_s']:>10.1f}")
    print(f"throughput ratio (swarm / single): {ratio:.2f}")
    write("e2e", args.out, {"steps": steps, "single": one, "swarm": many, "ratio": ratio},
          headline("tokens/s, local swarm 2x2 vs single process", ratio, "x", 1.0, "higher", "single-process training"),
          quick=args.quick)


if __name__ == "__main__":
    main()
