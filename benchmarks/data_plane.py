"""The data plane of a streamed dataset (issue 38): what each stage receives against what it reads.

An embedded swarm of six nodes trains a GPT-2 tiny cut into three stages of two replicas each on a
token file of random tokens, streamed as content-addressed shards for one epoch; then (``--kind``) on the
same windows as an ``Examples`` dataset (``idx_BT``/``targets_BT``, a few held out), sharded alike. Per node: the shard
bytes it received from peers, the bytes of the samples it read (seq_len tokens a sample), their ratio
(target at most 1.1 on the reading stages, 0 bytes on the others), the seconds its first step waited
for data after the plan, and how often a step waited for a shard past ``late_after``. Baseline: before
issue 38 every node fetched the whole dataset at the offer (nodes x dataset bytes). Each run's CPU-seconds
(user + sys of this process, which holds every node) and the load average are recorded beside it.
"""

from __future__ import annotations

import os
import random
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks._common import headline, parser, write
from fusionp2p.data import Examples, TokenFile
from fusionp2p.jobs.build import build_job
from fusionp2p.jobs.lifecycle import JobState
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.sdk import Swarm
from fusionp2p.train.config import TrainConfig

SEQ = 32


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(*, shards: int, per_shard: int, micro_batch: int, micro_batches: int, epochs: int,
        kind: str = "tokens") -> dict[str, object]:
    torch.set_num_threads(1)
    shard_tokens = per_shard * SEQ + 1
    replicas = 2
    held = micro_batch * micro_batches      # examples: the held-out ones of the evaluation
    steps = epochs * shards * per_shard // (replicas * micro_batches * micro_batch)
    cfg = TrainConfig(steps=steps, micro_batch=micro_batch, micro_batches=micro_batches, lr=1e-3, replicas=replicas,
                      averaging="none", compression="none", planner="even_layers", seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "tokens.txt"
        text.write_bytes(random.Random(0).randbytes(shards * shard_tokens))
        data: TokenFile | Examples = TokenFile(str(text), seq_len=SEQ)
        dataset = shards * shard_tokens
        if kind == "examples":   # the same number of windows to train on, as rows of two int64 fields
            toks = np.random.default_rng(0).integers(0, 256, (shards * per_shard + held) * SEQ + 1)
            data = Examples.causal_lm(toks, SEQ, shift=1, names=("idx_BT", "targets_BT"), holdout=held,
                                      shard_bytes=per_shard * 2 * SEQ * 8)
            dataset = data.num_examples * 2 * SEQ * 8
        with Swarm.local(n_nodes=6, home=Path(tmp) / "swarm") as sw:
            torch.manual_seed(0)
            built = build_job(GPT2(GPT2Config.tiny(block_size=SEQ, n_layer=3)), None, data,
                              cfg, publisher=sw.publisher_id, sign=sw.sign, now=1.0, nonce=b"b" * 16,
                              shard_tokens=shard_tokens)
            t0, cpu0 = time.perf_counter(), _cpu_s()
            job = sw.publish_built(built)
            job.wait(timeout=1800)
            wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
            if job.state is not JobState.DONE:
                raise RuntimeError(f"the job ended {job.state}")
            assert sw.embedded is not None
            runs = {n.peer_id: n.jobs.jobs[built.spec.job_id] for n in sw.embedded.nodes}
            plan = next(r.plan for r in runs.values() if r.plan is not None)
            assert plan is not None
            rows: list[dict[str, float | int | None]] = []
            for s, st in enumerate(plan.stages):
                for r, peer in enumerate(st.replicas):
                    d = runs[peer].data
                    rows.append({"stage": s, "replica": r, "received_bytes": d.received_bytes,
                                 "consumed_bytes": d.consumed_bytes, "disk_bytes": d.disk_bytes,
                                 "ratio": d.received_bytes / d.consumed_bytes if d.consumed_bytes else None,
                                 "first_wait_s": d.first_wait_s, "waited_s": d.waited_s, "late": d.late,
                                 "shards": d.shards, "refused": d.refused})
    return {"kind": kind, "steps": steps, "epochs": epochs, "dataset_bytes": dataset,
            "shard_bytes": shard_tokens if kind == "tokens" else per_shard * 2 * SEQ * 8, "wall_s": wall, "cpu_s": cpu,
            "loadavg": os.getloadavg(),
            "stages": [len(st.replicas) for st in plan.stages], "nodes": rows,
            "received_total": sum(r["received_bytes"] or 0 for r in rows),
            "before_issue_38": 6 * dataset}


def _show(res: dict[str, object]) -> float:
    rows = res["nodes"]
    assert isinstance(rows, list)
    print(f"{res['kind']}:")
    print(f"{'stage':>5} {'rep':>3} {'received':>10} {'consumed':>10} {'ratio':>6} {'first wait s':>12} {'late':>4}")
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        first = f"{r['first_wait_s']:.3f}" if r["first_wait_s"] is not None else "-"
        print(f"{r['stage']:>5} {r['replica']:>3} {r['received_bytes']:>10} {r['consumed_bytes']:>10} {ratio:>6} "
              f"{first:>12} {r['late']:>4}")
    readers = [r for r in rows if r["consumed_bytes"]]
    others = [r for r in rows if not r["consumed_bytes"]]
    load = res["loadavg"]
    assert isinstance(load, tuple)
    print(f"dataset {res['dataset_bytes']} B, received by all nodes {res['received_total']} B "
          f"(before issue 38: {res['before_issue_38']} B); non-readers received "
          f"{sum(int(r['received_bytes']) for r in others)} B; {res['steps']} steps in {res['wall_s']:.1f} s, "
          f"{res['cpu_s']:.1f} CPU-s, load {load[0]:.1f}")
    return max(float(r["ratio"]) for r in readers)


def main() -> None:
    p = parser("data_plane", __doc__)
    p.add_argument("--kind", choices=["tokens", "examples", "both"], default="both", help="the dataset kinds to run")
    args = p.parse_args()
    shards, per_shard = (96, 8) if args.quick else (160, 16)
    kinds = ["tokens", "examples"] if args.kind == "both" else [args.kind]
    res = {k: run(shards=shards, per_shard=per_shard, micro_batch=2, micro_batches=2, epochs=1, kind=k) for k in kinds}
    worst = max(_show(r) for r in res.values())
    write("data_plane", args.out, res, headline(
        "bytes received / bytes read, worst reading stage replica", worst, "x", 1.1, "lower",
        "the same run's bytes read; before issue 38 every node received the whole dataset"), quick=args.quick)


if __name__ == "__main__":
    main()
