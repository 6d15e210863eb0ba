"""GPU check: what a lent GPU must confirm about a node's training path, one printed line per check.

Run ``python -m benchmarks.gpu_check [--quick] [--device cuda:0]`` (a few minutes; ``--quick`` seconds).
On ``cuda`` every check runs there against the same computation on the host:

* ``profile``: the device profile (swarm/device.py) against a synced matmul measured here (within 2x
  on a GPU; on a shared CPU, whose figures move with the load, shown only);
* ``gpt2 step``: a traced 2-stage GPT-2 step on the host and on the device: loss and gradient
  difference, the device of every parameter; ``gpt2 speed``: synced ms per step in fp32, and the
  speed-ups of ``precision="bf16"`` and of TF32 over it;
* ``encode``, ``adatopk``, ``mask``, ``tied sum``, ``mean``, ``state``: device tensors through every
  boundary (the wire encoding and decoding, AdaTopK's selection on the device against the host's,
  keep-masks, tied-weight sums, the weighted mean of averaging, a state exported to the host and
  imported into an AdamW on the device);
* ``nccl``: all-reduce, all-gather and broadcast of device tensors on a one-rank process group;
* ``sync``: a stage's forward timed without and with a device sync, against the encoding (host copy)
  of its outputs: without a sync a CUDA forward times its kernel launches only.

Without CUDA the checks run on the CPU (or the device given), the script says plainly that CUDA was not
checked, and exits 0 when every check that ran passed (1 otherwise). Results go to
``benchmarks/results/gpu_check.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._common import headline, parser, write
from fusionp2p import device as dev
from fusionp2p.average.shard import weighted_mean
from fusionp2p.compress.codec import decode, kept_mask
from fusionp2p.compress.select import select_topk
from fusionp2p.graph import StageExecutor, coarsen, partition, stages_from_fences, trace
from fusionp2p.graph.executor import tied_sum
from fusionp2p.graph.program import StageProgram
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.swarm.device import enable_tf32, measure_profile
from fusionp2p.train.boundary import encode_boundary
from fusionp2p.train.state import load_optimizer_tensors, optimizer_tensors

Feed = dict[str, torch.Tensor]


class Report:
    """The checks' lines and figures; ``failed`` when any check failed."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.failed = False

    def line(self, name: str, ok: bool, text: str, **figures: Any) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name:<10} {text}", flush=True)
        self.rows.append({"check": name, "ok": ok, "text": text, **figures})
        self.failed = self.failed or not ok


def best_s(fn: Callable[[], object], device: torch.device, reps: int, *, synced: bool = True) -> float:
    """The fastest of *reps* calls of *fn* (after one warm-up), synced with *device* unless told not to."""
    fn()
    dev.sync(device)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if synced:
            dev.sync(device)
        best = min(best, time.perf_counter() - t)
    dev.sync(device)
    return best


def check_profile(r: Report, device: torch.device, quick: bool) -> None:
    prof = measure_profile(str(device), seconds=0.05 if quick else 0.5)
    n = 512 if device.type == "cpu" else 4096
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    flops = 2.0 * n**3 / best_s(lambda: a @ b, device, 3 if quick else 10)
    ratio = flops / prof.flops_fp32
    # a GPU's figure must hold; a shared CPU's moves with the load between the two measurements (shown only)
    r.line("profile", 0.5 < ratio < 2.0 or device.type != "cuda",
           f"{prof.name}: fp32 {prof.flops_fp32 / 1e12:.3g} TFLOP/s, bf16 {prof.flops_bf16 / 1e12:.3g}, element-wise "
           f"{prof.act_rate / 1e9:.3g} GB/s, {prof.memory_bytes / 2**30:.1f} GiB free; synced {n}x{n} matmul here "
           f"{flops / 1e12:.3g} TFLOP/s = {ratio:.2f}x the profile",
           profile={"fp32": prof.flops_fp32, "bf16": prof.flops_bf16, "act_rate": prof.act_rate,
                    "memory": prof.memory_bytes}, synced_flops=flops, ratio=ratio)


def gpt2_stages(device: torch.device, quick: bool) -> tuple[list[StageProgram], list[Feed], str]:
    torch.manual_seed(0)
    if quick:
        cfg, batch = GPT2Config.tiny(n_layer=2, n_embd=32, block_size=16), 2
    elif device.type == "cpu":
        # a CPU without bf16 units runs bf16 matmuls ~100x slower than fp32: a small model keeps the
        # script to minutes where it is not the point (no GPU)
        cfg, batch = GPT2Config.tiny(n_layer=2, n_embd=64, block_size=64), 4
    else:
        cfg, batch = GPT2Config(vocab_size=50257, block_size=256, n_layer=6, n_head=12, n_embd=768), 8
    model = GPT2(cfg)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=gen),
                torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=gen)) for _ in range(2)]
    dag = trace(model, example_inputs=batches[0])
    c = coarsen(dag)
    progs = partition(c, stages_from_fences(len(c.units), [len(c.units) // 2]))
    feeds = [dict(zip(dag.data_inputs, b, strict=True)) for b in batches]
    what = f"GPT-2 {cfg.n_layer}x{cfg.n_embd} vocab {cfg.vocab_size}, {batch}x{cfg.block_size} tokens x 2 micro-batches"
    return progs, feeds, what


def step(exs: Sequence[StageExecutor], feeds: Sequence[Feed]) -> float:
    """One training step of the 2-stage pipeline (both micro-batches; boundary tensors through the host,
    as the wire carries them); the mean loss."""
    p0, p1 = exs[0].program, exs[1].program
    assert p1.loss is not None
    total = 0.0
    for mu, feed in enumerate(feeds):
        out0 = exs[0].forward(mu, {r.name: feed[r.name] for r in p0.recv})
        wire = dict(zip(out0, dev.to_host(list(out0.values())), strict=True))
        out1 = exs[1].forward(mu, {r.name: wire[r.name] if r.name in wire else feed[r.name] for r in p1.recv})
        total += float(out1[p1.loss]) / len(feeds)
        g1 = exs[1].backward(mu, {}, loss_scale=1.0 / len(feeds))
        back = dict(zip(g1, dev.to_host(list(g1.values())), strict=True))
        exs[0].backward(mu, {o.name: back[o.name] for o in p0.send if o.needs_grad})
    return total


def check_gpt2(r: Report, device: torch.device, quick: bool, progs: list[StageProgram], feeds: list[Feed],
               what: str) -> dict[str, float]:
    host = [StageExecutor(p) for p in progs]
    on = [StageExecutor(p, device=device) for p in progs]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False   # compare full fp32 with the host
    try:
        loss_h, loss_d = step(host, feeds), step(on, feeds)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    worst = 0.0
    for h, d in zip(host, on, strict=True):
        for name, p in h.parameters().items():
            q = d.parameters()[name]
            if p.grad is not None and q.grad is not None:
                worst = max(worst, float((q.grad.cpu() - p.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-12))
    params = [p for ex in on for p in ex.parameters().values()]
    placed = sum(dev.same(p.device, device) and (p.grad is None or dev.same(p.grad.device, device)) for p in params)
    dloss = abs(loss_d - loss_h) / abs(loss_h)
    r.line("gpt2 step", dloss < 1e-3 and worst < 2e-2 and placed == len(params),
           f"{what}: loss {loss_d:.5f} on {device} vs {loss_h:.5f} on cpu ({dloss:.1e} rel.), worst gradient "
           f"{worst:.1e} of its max, {placed}/{len(params)} parameters and gradients on {device}",
           loss_rel=dloss, grad_rel=worst, params_on_device=placed, params=len(params))

    reps = 2 if quick else 5

    def timed(exs: Sequence[StageExecutor]) -> float:
        def once() -> None:
            step(exs, feeds)
            for ex in exs:
                ex.zero_grad()
        return best_s(once, device, reps)

    fp32 = timed(on)
    bf16 = timed([StageExecutor(p, device=device, precision="bf16") for p in progs])
    text = f"fp32 {fp32 * 1e3:.1f} ms/step, bf16 {bf16 * 1e3:.1f} ms/step ({fp32 / bf16:.2f}x)"
    figures = {"fp32_ms": fp32 * 1e3, "bf16_ms": bf16 * 1e3, "bf16_speedup": fp32 / bf16}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        strict = timed(on)
        enable_tf32(str(device))
        figures.update(no_tf32_ms=strict * 1e3, tf32_speedup=strict / fp32)
        text += f", TF32 {strict / fp32:.2f}x over strict fp32 ({strict * 1e3:.1f} ms/step)"
    else:
        text += ", TF32: not on this device"
    r.line("gpt2 speed", True, text, **figures)
    return figures


def check_boundaries(r: Report, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(2)
    x_h = torch.randn(64, 4096, generator=gen)
    x = dev.to_device(x_h, device)
    meta, sent = encode_boundary(x, 0.1)
    meta_h, sent_h = encode_boundary(x_h, 0.1)
    back = decode(sent, meta)
    r.line("encode", all(t.device.type == "cpu" for t in sent) and meta == meta_h
           and torch.equal(back, decode(sent_h, meta_h)) and torch.equal(encode_boundary(x, 1.0)[1][0], x_h),
           f"{tuple(x.shape)} on {device} at rho 0.1 and dense: host payload, same bytes as the host's encoding")
    flat = x.reshape(-1)
    got = select_topk(flat, 10_000, approx=True, generator=torch.Generator(), index_dtype=torch.int32, bitmap=True)
    ref = select_topk(x_h.reshape(-1), 10_000, approx=False, index_dtype=torch.int32, bitmap=True)
    same = all(g is not None and q is not None and dev.same(g.device, device) and torch.equal(g.cpu(), q)
               for g, q in zip(got, ref, strict=True))
    r.line("adatopk", same, f"top-10,000 of {flat.numel():,} on {device}: values, indices and bitmap there, "
           "equal to the host's exact selection")
    mask = kept_mask(sent, meta)
    assert mask is not None
    g = torch.ones_like(x) * dev.to_device(mask, device)
    r.line("mask", dev.same(g.device, device) and int(g.sum()) == int(mask.sum()),
           f"a keep-mask from the wire applied to a gradient on {device}")
    a, b = torch.randn(1000, device=device), torch.randn(1000, generator=gen)
    total = tied_sum([a, dev.to_device(b, device)])
    assert total is not None
    r.line("tied sum", dev.same(total.device, device) and torch.allclose(total.cpu(), a.cpu() + b),
           f"a host part moved to {device} and summed there")
    parts = [torch.randn(1000, device=device) for _ in range(3)]
    mean = weighted_mean(parts, [1.0, 2.0, 3.0])
    want = weighted_mean([p.cpu() for p in parts], [1.0, 2.0, 3.0])
    r.line("mean", dev.same(mean.device, device) and torch.allclose(mean.cpu(), want, atol=1e-6),
           f"weighted mean of 3 parts on {device}, equal to the host's")
    w = torch.nn.Parameter(torch.randn(256, 256, device=device))
    opt = torch.optim.AdamW([w], lr=1e-2)
    for _ in range(2):
        w.grad = torch.randn(256, 256, generator=gen).to(device)
        opt.step()
    tensors, groups = optimizer_tensors(opt, {w: "w"})
    # a checkpoint / hand-off: host copies (export_state clones them; the host's own tensors would alias)
    saved = {k: v.clone() for k, v in zip(tensors, dev.to_host(list(tensors.values())), strict=True)}
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = torch.optim.AdamW([w2], lr=1e-3)
    load_optimizer_tensors(opt2, {w2: "w"}, saved, groups)
    st = opt2.state[w2]
    g = torch.randn(256, 256, generator=gen).to(device)
    w.grad, w2.grad = g, g.clone()
    opt.step()
    opt2.step()
    r.line("state", all(dev.same(v.device, device) for k, v in st.items() if k != "step")
           and torch.equal(w.detach(), w2.detach()),
           f"AdamW state exported to the host and imported into an AdamW on {device}: same next step")


def check_collectives(r: Report, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,  # type: ignore[attr-defined]
                            device_id=device if device.type == "cuda" else None)
    try:
        t = torch.arange(4.0, device=device)
        dist.all_reduce(t)
        out = [torch.zeros(4, device=device)]
        dist.all_gather(out, t)
        dist.broadcast(t, src=0)
        times = torch.zeros(3, dtype=torch.float64, device=device)   # parallel/search.py's reduction
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        ok = torch.equal(out[0].cpu(), torch.arange(4.0)) and torch.equal(t.cpu(), torch.arange(4.0))
    finally:
        dist.destroy_process_group()
    r.line("nccl" if backend == "nccl" else "gloo", ok,
           f"all-reduce, all-gather, broadcast and a float64 max of {device} tensors on a one-rank {backend} group")


def check_sync(r: Report, device: torch.device, quick: bool, progs: list[StageProgram], feeds: list[Feed]) -> None:
    feed = {x.name: feeds[0][x.name] for x in progs[0].recv}
    reps = 3 if quick else 10
    times = {}
    for synced in (False, True):
        ex = StageExecutor(progs[0], device=device, synced=synced)

        def fwd(ex: StageExecutor = ex) -> None:
            ex.forward(0, feed)
            ex.drop(0)
        times[synced] = best_s(fwd, device, reps, synced=False)   # the executor's own sync or none
    out = StageExecutor(progs[0], device=device).forward(0, feed)
    enc = best_s(lambda: [encode_boundary(t, 1.0) for t in out.values()], device, reps)
    r.line("sync", True, f"stage 0 forward {times[False] * 1e3:.2f} ms unsynced, {times[True] * 1e3:.2f} ms synced; "
           f"encoding its outputs (host copy) {enc * 1e3:.2f} ms",
           unsynced_ms=times[False] * 1e3, synced_ms=times[True] * 1e3, encode_ms=enc * 1e3)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser("gpu_check", __doc__)
    p.add_argument("--device", default=None, help="cuda:N (default: cuda:0 where CUDA is available, else cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the host side (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = dev.resolve(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        enable_tf32(str(device))   # as a node does (swarm/daemon.py)
    else:
        print(f"CUDA was not checked: {'no CUDA device here' if not torch.cuda.is_available() else 'not asked'}; "
              f"the checks below ran on {device}", flush=True)
    r = Report()
    check_profile(r, device, args.quick)
    progs, feeds, what = gpt2_stages(device, args.quick)
    figures = check_gpt2(r, device, args.quick, progs, feeds, what)
    check_boundaries(r, device)
    check_collectives(r, device)
    check_sync(r, device, args.quick, progs, feeds)
    print(f"{len(r.rows) - sum(not x['ok'] for x in r.rows)}/{len(r.rows)} checks passed on {device}"
          + ("" if device.type == "cuda" else " (CUDA not checked)"), flush=True)
    head = headline(f"2-stage GPT-2 step, fp32 / bf16 time on {device}", figures["bf16_speedup"], "ratio", 1.0,
                    "higher", "the same step in fp32, same run")
    write("gpu_check", args.out, {"device": str(device), "cuda_checked": device.type == "cuda", "checks": r.rows},
          head, quick=args.quick)
    return 1 if r.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
