"""What the heap's mmap threshold (net/heap.py ``keep_freed_heap``) costs a training step: CPU and page faults.

Each setting trains the same model in a fresh process (the heap settings bind once per process), one
torch thread, a node's step: ``--micro-batches`` forward and backward passes accumulated, AdamW, the
gradients dropped (``Executor.zero_grad``: set to None, so each step allocates them afresh). Per setting:
CPU-seconds a step (user + system, after warm-up), minor page faults a step, and the peak resident size.
The settings run ``--rounds`` times each, alternating, so that the machine's load drifts over all alike;
the page faults do not depend on the load, the CPU-seconds less than the wall clock.

Settings: ``glibc`` (``FUSIONP2P_KEEP_HEAP=0``: glibc's adaptive threshold), the node's (every block of 1
MiB or more mapped on its own), the old data plane's 256 MiB, and the thresholds given by ``--thresholds``.
Models: the demo's GPT-2 (``fusionp2p demo``: 4 layers, 128 wide, micro-batches of 8 x 64 tokens) and a
wider one (4 layers, 512 wide, 8 x 128 tokens: multi-MiB activations and gradients).
Headline: the node's CPU a step over glibc's, on the wider model (1.0: free).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks._common import headline, parser, write

NAME = "heap_step"
MiB = 1 << 20
MODELS = {"demo": (4, 128, 4, 64), "wide": (4, 512, 8, 128)}   # layers, width, heads, tokens


def child(model_name: str, steps: int, warmup: int, micro_batches: int) -> dict[str, Any]:
    """One setting's run in this process (the environment carries the setting)."""
    from fusionp2p.net.heap import keep_freed_heap

    keep_freed_heap()   # what the data plane's first channel does in a node
    import torch

    from fusionp2p.models.gpt2 import GPT2, GPT2Config

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers, width, heads, tokens = MODELS[model_name]
    model = GPT2(GPT2Config.tiny(block_size=tokens, n_layer=layers, n_head=heads, n_embd=width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (8, tokens + 1), generator=g) for _ in range(micro_batches)]

    def step() -> None:
        for b in batches:
            logits = model(b[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
            (loss / micro_batches).backward()  # type: ignore[no-untyped-call]
        opt.step()
        for p in model.parameters():
            p.grad = None

    for _ in range(warmup):
        step()
    cpu, faults = [], []
    for _ in range(steps):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        step()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append(time.process_time() - t0)
        faults.append(r1.ru_minflt - r0.ru_minflt)
    return {"cpu_step_s": statistics.median(cpu), "minflt_step": statistics.median(faults),
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "params": sum(p.numel() for p in model.parameters())}


def run_setting(env: dict[str, str], model_name: str, steps: int, warmup: int, micro_batches: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.heap_step", "--child", model_name, "--steps", str(steps), "--warmup",
           str(warmup), "--micro-batches", str(micro_batches)]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    p = parser(NAME, __doc__)
    p.add_argument("--child", choices=sorted(MODELS), help=argparse_hide())
    p.add_argument("--steps", type=int, default=0, help="timed steps per run (default 8, --quick 4)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=0, help="runs of each setting, alternating (default 3, --quick 2)")
    p.add_argument("--thresholds", default="4,32", help="further mmap thresholds to try, in MiB, comma-separated")
    p.add_argument("--models", default="demo,wide")
    p.add_argument("--thp", action="store_true", help="also the node's threshold with transparent huge pages")
    args = p.parse_args()
    steps = args.steps or (4 if args.quick else 8)
    if args.child:
        print(json.dumps(child(args.child, steps, args.warmup, args.micro_batches)))
        return
    settings: dict[str, dict[str, str]] = {"glibc": {"FUSIONP2P_KEEP_HEAP": "0"}, "node (1 MiB)": {},
                                           "256 MiB": {"FUSIONP2P_MMAP_THRESHOLD": str(256 * MiB)}}
    for t in filter(None, args.thresholds.split(",")):
        settings[f"{t} MiB"] = {"FUSIONP2P_MMAP_THRESHOLD": str(int(float(t) * MiB))}
    if args.thp:   # the node's threshold, its mappings in transparent huge pages (glibc's, or torch's own)
        settings["1 MiB+THP glibc"] = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
        settings["1 MiB+THP torch"] = {"THP_MEM_ALLOC_ENABLE": "1"}
    rounds = args.rounds or (2 if args.quick else 3)
    res: dict[str, Any] = {"steps": steps, "micro_batches": args.micro_batches, "rounds": rounds, "models": {}}
    for model_name in args.models.split(","):
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in settings}
        for _ in range(rounds):
            for label, env in settings.items():
                r = run_setting(env, model_name, steps, args.warmup, args.micro_batches)
                r["loadavg"] = os.getloadavg()[0]
                runs[label].append(r)
        table = {}
        print(f"\n== {model_name} ({runs['glibc'][0]['params'] / 1e6:.1f}M parameters), {steps} steps x {rounds} runs a setting")
        print(f"{'setting':14} {'CPU s/step':>10} {'faults/step':>12} {'peak RSS MiB':>13} {'load':>6}")
        for label, rs in runs.items():
            table[label] = row = {"cpu_step_s": min(r["cpu_step_s"] for r in rs), "cpu_step_all": [r["cpu_step_s"] for r in rs],
                                  "minflt_step": statistics.median(r["minflt_step"] for r in rs),
                                  "maxrss_mib": max(r["maxrss_mib"] for r in rs), "loadavg": [r["loadavg"] for r in rs]}
            print(f"{label:14} {row['cpu_step_s']:10.4f} {row['minflt_step']:12.0f} {row['maxrss_mib']:13.0f} "
                  f"{statistics.mean(row['loadavg']):6.1f}")
        res["models"][model_name] = table
    last = res["models"]["wide" if "wide" in res["models"] else next(iter(res["models"]))]
    ratio = last["node (1 MiB)"]["cpu_step_s"] / last["glibc"]["cpu_step_s"]
    res["node_over_glibc"] = ratio
    write(NAME, args.out, res, headline("node_heap_cpu_over_glibc", ratio, "x", 1.05, "lower",
                                        "glibc's adaptive mmap threshold, same model, same run"), quick=args.quick)


def argparse_hide() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
