"""The publisher's peak memory while it builds a job of a transformers model it did not write (issue 37).

Each measurement runs in a fresh Python process (``--child``), one at a time:

1. imports, then a warm-up ``build_job`` of a tiny Llama of the same family, so that the import and
   first-trace costs (torch.export's and transformers' own modules, a constant of the process) are paid
   before the baseline is read;
2. the baseline: the resident size then (``VmRSS``), and the peak is reset (``/proc/self/clear_refs``);
3. a ``transformers.LlamaForCausalLM`` built from its config with random init (it holds 1x the weights);
4. ``build_job`` on it (trace, the FLOP run, the weight manifest and its pieces), and the peak
   (``VmHWM``) read again.

Headline: (peak - baseline) / weight bytes (target 1.3: the model itself is 1.0 of it). ``--code DIR``
measures another checkout of the package (the same script, e.g. the code before this change).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._common import headline, parser, write

MiB = 2**20
SEQ = 32


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _llama(hidden: int, layers: int, vocab: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                   num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                   num_key_value_heads=max(1, hidden // 128), max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg)


def child(hidden: int, layers: int, vocab: int) -> dict[str, Any]:
    """One measurement in this process (see the module docstring)."""
    import torch

    import fusionp2p
    from fusionp2p.data import BuiltinCorpus, Examples
    from fusionp2p.jobs.build import build_job
    from fusionp2p.net.identity import Identity
    from fusionp2p.train.config import TrainConfig

    torch.set_num_threads(1)
    me = Identity.generate()
    ds = Examples.causal_lm(BuiltinCorpus(seq_len=SEQ), SEQ)
    cfg = TrainConfig(steps=2, micro_batch=2, micro_batches=4, replicas=1, averaging="none", compression="none")

    def build(model: Any) -> Any:
        return build_job(model, None, ds, cfg, publisher=me.peer_id, sign=me.sign, now=time.time(), nonce=os.urandom(16))

    build(_llama(64, 1, vocab))     # warm-up: imports and first-trace costs out of the figure
    base = _status()["VmRSS"]
    _reset_peak()
    t0 = time.process_time()
    model = _llama(hidden, layers, vocab)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    params = sum(p.numel() for p in model.parameters())
    after_model = _status()["VmRSS"]
    t1 = time.process_time()
    built = build(model)
    t2 = time.process_time()
    st = _status()
    return {"package": str(Path(fusionp2p.__file__).parent), "hidden": hidden, "layers": layers, "vocab": vocab, "params": params, "weight_bytes": weights,
            "baseline_rss": base, "after_model_rss": after_model, "peak_rss": st["VmHWM"], "end_rss": st["VmRSS"],
            "pieces": len(built.blobs), "init_cpu_s": t1 - t0, "build_cpu_s": t2 - t1,
            "model_over_weights": (after_model - base) / weights, "peak_over_weights": (st["VmHWM"] - base) / weights,
            "held_over_weights": (st["VmRSS"] - base) / weights}


def measure(hidden: int, layers: int, vocab: int, code: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    root = code or Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(Path(__file__).resolve().parent.parent)])
    # run as a script from *root*: the package imported is *root*'s (``-m`` would put this checkout first)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", f"{hidden},{layers},{vocab}"],
                         env=env, cwd=root, check=True, capture_output=True, text=True, timeout=3600)
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def main() -> None:
    ap = parser("publish_memory", __doc__)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="hidden,layers,vocab of the Llama (default 1024,16,32000: 250M "
                    "parameters; --quick 512,8,32000: 56M)")
    ap.add_argument("--code", type=Path, default=None, help="measure the package of another checkout (e.g. main)")
    args = ap.parse_args()
    if args.child:
        h, n, v = (int(x) for x in args.child.split(","))
        print(json.dumps(child(h, n, v)))
        return
    h, n, v = (int(x) for x in (args.model or ("512,8,32000" if args.quick else "1024,16,32000")).split(","))
    row = measure(h, n, v, args.code)
    print(f"Llama {row['params'] / 1e6:.0f}M ({row['weight_bytes'] / MiB:.0f} MiB fp32): the model "
          f"{row['model_over_weights']:.2f}x the weights, build_job's peak {row['peak_over_weights']:.2f}x, held after "
          f"{row['held_over_weights']:.2f}x (over the resident size before the model; {row['pieces']} pieces; "
          f"build {row['build_cpu_s']:.1f} CPU-s; {row['package']}; load {os.getloadavg()[0]:.1f})", flush=True)
    write("publish_memory", args.out, row,
          headline("publisher peak over the weights", row["peak_over_weights"], "x", 1.3, "lower",
                   "the resident size before the model was built (imports and a warm-up publish paid)"),
          quick=args.quick)


if __name__ == "__main__":
    main()
