"""Training-step time of the staged executor against eager PyTorch on the same inputs.

For GPT-2 (4 layers, width 256, sequence 128) and the ResNet reference: one training step (forward +
backward over the micro-batches of a step, gradients accumulated) is timed for

* ``eager``: the nn.Module itself, the baseline;
* ``1 stage``: the traced DAG as one StageProgram in one StageExecutor (fx GraphModule);
* ``4 stages``: the DAG cut into 4 stage programs run by LocalPipeline in this process (boundary
  tensors handed over in memory, gradients routed back).

Variants are interleaved round-robin so that load drifting on a shared machine hits all of them
alike; the table shows the fastest step of each variant (the least disturbed, as ``timeit`` advises)
and the ratios of those, and the JSON also holds every sample, the medians and the median of the
per-round ratios. Also reported: tracing time, serialization (encode/decode)
time and the size of the serialized DAG. Headline: 1-stage step time / eager step time (GPT-2).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._common import headline, parser, write
from fusionp2p.graph import (
    LocalPipeline,
    StageExecutor,
    coarsen,
    partition,
    single_stage,
    stages_from_fences,
    trace,
)
from fusionp2p.models import GPT2, GPT2Config, ResNet, ResNetConfig
from fusionp2p.wire.dag import decode_dag, encode_dag


def _even_fences(n_units: int, stages: int) -> list[int]:
    return sorted({round(n_units * k / stages) for k in range(1, stages)})


def _case(name: str, model: nn.Module, micro: Sequence[tuple[torch.Tensor, ...]],
          loss: Callable[..., torch.Tensor], trace_kw: dict[str, Any], reps: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    dag = trace(model, **trace_kw)
    t_trace = time.perf_counter() - t0
    t0 = time.perf_counter()
    blob = encode_dag(dag)
    t_enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    decode_dag(blob)
    t_dec = time.perf_counter() - t0
    coarse = coarsen(dag)
    one = StageExecutor(single_stage(dag))
    pipe = LocalPipeline(partition(coarse, stages_from_fences(len(coarse.units), _even_fences(len(coarse.units), 4))))
    feeds = [dict(zip(dag.data_inputs, mb)) for mb in micro]
    n = len(micro)

    def eager() -> None:
        model.zero_grad(set_to_none=True)
        for mb in micro:
            (loss(model, mb) / n).backward()  # type: ignore[no-untyped-call]

    def staged1() -> None:
        one.zero_grad()
        for mu, feed in enumerate(feeds):
            one.forward(mu, feed)
            one.backward(mu, {}, loss_scale=1 / n)

    def staged4() -> None:
        pipe.zero_grad()
        pipe.step(feeds)

    variants = {"eager": eager, "1 stage": staged1, "4 stages": staged4}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():   # warm-up (allocator, lazy init)
        fn()
    for _ in range(reps):
        for k, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    # each round runs the variants back to back: a per-round ratio cancels slow load drift
    paired = {k: statistics.median(a / b for a, b in zip(times[k], times["eager"])) for k in times}
    return {
        "model": name, "nodes": len(dag.nodes), "units": len(coarse.units),
        "params": sum(i.meta.nbytes for i in dag.inputs if i.kind == "param") // 4,
        "step_s": best, "median_s": med, "all_s": times,
        "ratio_1stage": best["1 stage"] / best["eager"], "ratio_4stages": best["4 stages"] / best["eager"],
        "paired_ratio_1stage": paired["1 stage"], "paired_ratio_4stages": paired["4 stages"],
        "trace_s": t_trace, "encode_s": t_enc, "decode_s": t_dec, "serialized_bytes": len(blob),
        "boundary_bytes_per_step": pipe.bytes_moved // (reps + 1),
    }


def main() -> None:
    p = parser("executor", __doc__)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    reps = 3 if args.quick else 10
    n_micro, batch = 2, (4 if args.quick else 8)
    vocab = 8192 if args.quick else 50257

    gcfg = GPT2Config(vocab_size=vocab, block_size=128, n_layer=4, n_head=4, n_embd=256)
    gpt = GPT2(gcfg)
    gmicro = [(torch.randint(0, vocab, (batch, 128)), torch.randint(0, vocab, (batch, 128))) for _ in range(n_micro)]

    def gpt_loss(m: nn.Module, mb: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return m(*mb)[1]  # type: ignore[no-any-return]

    rcfg = ResNetConfig(widths=(32, 64, 128), depths=(2, 2, 2))
    res = ResNet(rcfg)
    rmicro = [(torch.randn(batch * 4, 3, 32, 32), torch.randint(0, 10, (batch * 4,))) for _ in range(n_micro)]

    def res_loss(m: nn.Module, mb: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return F.cross_entropy(m(mb[0]), mb[1])

    results = [
        _case(f"GPT-2 4x256 seq128 vocab{vocab} batch{batch}x{n_micro}", gpt, gmicro, gpt_loss,
              {"example_inputs": gmicro[0]}, reps),
        _case(f"ResNet {rcfg.widths}x{rcfg.depths} 32x32 batch{batch * 4}x{n_micro}", res, rmicro, res_loss,
              {"example_inputs": rmicro[0][:1], "loss_fn": F.cross_entropy, "loss_inputs": rmicro[0][1:]}, reps),
    ]
    print(f"{'model (best step, s)':48} {'eager s':>9} {'1 stage':>9} {'4 stages':>9} {'1st/eag':>8} {'4st/eag':>8} "
          f"{'paired1':>8} {'trace s':>8} {'enc s':>7} {'dec s':>7} {'MB':>7}")
    for r in results:
        s = r["step_s"]
        print(f"{r['model']:48} {s['eager']:9.4f} {s['1 stage']:9.4f} {s['4 stages']:9.4f} {r['ratio_1stage']:8.3f} "
              f"{r['ratio_4stages']:8.3f} {r['paired_ratio_1stage']:8.3f} {r['trace_s']:8.2f} {r['encode_s']:7.3f} {r['decode_s']:7.3f} "
              f"{r['serialized_bytes'] / 1e6:7.2f}")
    head = headline("GPT-2 training step, 1-stage executor / eager", results[0]["ratio_1stage"], "ratio", 1.05,
                    "lower", "eager nn.Module on the same inputs, same run (best of interleaved rounds)")
    write("executor", args.out, {"threads": args.threads, "cases": results}, head, quick=args.quick)


if __name__ == "__main__":
    main()
