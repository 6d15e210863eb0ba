"""Activation recomputation on one stage of a transformers Llama (issue 37): memory and compute.

A Llama (built from its config, random init) is traced by ``build_job`` and run as one stage
(``StageExecutor``) with every micro-batch of a step in flight at once (GPipe's worst case: all
forwards, then all backwards), with and without ``recompute``. Per variant, in a fresh process each
(``--child``): the rise of the resident peak over the forwards (``VmHWM`` reset before them: the
activations kept in flight) and the CPU seconds of a step, against the planner's per-micro-batch figures
(``plan/estimator.py``: activations ``act_bytes`` without, the stage's fences with).

Headline: activation memory in flight with recomputation over without (lower is better; target 0.5),
with the step's compute ratio beside it (about 1.33: one more forward of three passes' worth).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._common import headline, parser, write

MiB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def child(recompute: bool, hidden: int, layers: int, seq: int, micro_batch: int, micro: int) -> dict[str, Any]:
    import torch
    import transformers

    from fusionp2p.data import BuiltinCorpus, Examples
    from fusionp2p.graph import StageExecutor, single_stage
    from fusionp2p.jobs.build import build_job
    from fusionp2p.net.identity import Identity
    from fusionp2p.train.config import TrainConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                   num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                   num_key_value_heads=max(1, hidden // 128), max_position_embeddings=seq)
    me = Identity.generate()
    ds = Examples.causal_lm(BuiltinCorpus(seq_len=seq), seq)
    tc = TrainConfig(steps=1, micro_batch=micro_batch, micro_batches=micro, replicas=1, averaging="none",
                     compression="none")
    built = build_job(transformers.LlamaForCausalLM(cfg), None, ds, tc, publisher=me.peer_id, sign=me.sign,
                      now=time.time(), nonce=os.urandom(16))
    prog = single_stage(built.dag)
    ex = StageExecutor(prog, recompute=recompute)
    batches = [{k: torch.from_numpy(v) for k, v in ds.batch(range(i * micro_batch, (i + 1) * micro_batch)).items()}
               for i in range(micro)]
    inputs = [{r.name: b[r.name] for r in prog.recv} for b in batches]

    def step() -> float:
        t0 = time.process_time()
        for i in range(micro):
            ex.forward(i, inputs[i])
        for i in range(micro):
            ex.backward(i, {}, loss_scale=1.0 / micro)
        return time.process_time() - t0

    ex.forward(0, inputs[0])   # warm-up of the kernels on one micro-batch; its memory handed back to the system
    ex.backward(0, {}, loss_scale=1.0 / micro)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status("VmRSS")
    for i in range(micro):
        ex.forward(i, inputs[i])
    rise = _status("VmHWM") - start
    for i in range(micro):
        ex.backward(i, {}, loss_scale=1.0 / micro)
    cpu = min(step() for _ in range(3))
    units = sum(n.flops for n in built.dag.nodes)
    return {"recompute": recompute, "in_flight_rise": rise, "step_cpu_s": cpu, "fwd_gflop": units / 1e9,
            "params": sum(p.numel() for p in ex.parameters().values())}


def main() -> None:
    ap = parser("recompute", __doc__)
    ap.add_argument("--child", default=None, help=__import__("argparse").SUPPRESS)
    args = ap.parse_args()
    shape = (256, 4, 128, 4, 8) if args.quick else (512, 8, 256, 4, 8)   # hidden, layers, seq, micro_batch, micro
    if args.child:
        print(json.dumps(child(args.child == "1", *shape)))
        return
    rows = {}
    for rc in ("0", "1"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.recompute", "--child", rc] + (["--quick"] if args.quick else []),
                             check=True, capture_output=True, text=True, timeout=3600, cwd=Path(__file__).resolve().parent.parent)
        rows[rc] = json.loads(out.stdout.strip().splitlines()[-1])
    plain, rc_ = rows["0"], rows["1"]
    mem_ratio = rc_["in_flight_rise"] / plain["in_flight_rise"]
    cpu_ratio = rc_["step_cpu_s"] / plain["step_cpu_s"]
    print(f"Llama {plain['params'] / 1e6:.1f}M, hidden {shape[0]}, {shape[1]} layers, seq {shape[2]}, micro-batch "
          f"{shape[3]}, {shape[4]} in flight: activations in flight {plain['in_flight_rise'] / MiB:.0f} MiB -> "
          f"{rc_['in_flight_rise'] / MiB:.0f} MiB ({mem_ratio:.2f}x); step {plain['step_cpu_s']:.2f} -> "
          f"{rc_['step_cpu_s']:.2f} CPU-s ({cpu_ratio:.2f}x); load {os.getloadavg()[0]:.1f}", flush=True)
    write("recompute", args.out, {"shape": shape, "plain": plain, "recompute": rc_, "memory_ratio": mem_ratio,
                                  "compute_ratio": cpu_ratio},
          headline("activations in flight with recomputation over without", mem_ratio, "x", 0.5, "lower",
                   "the same stage without recomputation, same process setup"), quick=args.quick)


if __name__ == "__main__":
    main()
