"""Models larger than any node (issue 37): how big a transformers Llama N ``fusionp2p node --memory M``
processes train together, against the largest one such node trains alone.

Method. A ladder of ``LlamaForCausalLM`` configs as shipped (only sizes change: width, layers, vocab);
for each swarm size N (1 and ``--nodes``) the planner names the largest rung it can cut into stages that
fit N nodes of ``--memory`` (the same ``choose_plan`` the nodes run, on N profiles of that memory); that
rung is then trained for real on N CLI node processes on loopback, and the benchmark records

* whether the job ended DONE and its download reloads strictly into a fresh model;
* per node: its idle resident size, its measured peak (``VmHWM``), and the stage memory the node
  predicted (its log line ``stage S needs X MiB``, ``jobs/weights.py: stage_memory``) plus its idle
  size; peak over that prediction (target within 20%), and peak against the offer;
* time from submit to the first step and its parts: the trace (``build_job``: the DAG, its FLOP count and the
  weight pieces), the announcement, the plan (until the client sees it), each node's stage set-up (its
  memory check and its pieces fetched, from its log) and the links; the publisher's own peak resident size
  over the weights;
* the step time of the pipeline (wall seconds and the nodes' CPU-seconds between the first and the last step
  the client saw) against single-process training of the same model in this process, after the cluster
  is down, on the same cores with the same threads (one), micro-batches and optimizer.

Headline: the parameters of the largest model N nodes trained over those of the largest one node
trained (target at least 0.8 x N). ``--quick`` uses tiny memories and models (a few minutes). The issue's
full size is ``--memory 3GiB`` (the default) on 4 nodes: about 14 GiB of this machine's memory at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import headline, parser, write
from fusionp2p.cli.cluster import LocalCluster, wait_until
from fusionp2p.data import BuiltinCorpus, Examples
from fusionp2p.errors import PlanError
from fusionp2p.jobs.build import build_job, plan_for_snapshot
from fusionp2p.jobs.download import load_download
from fusionp2p.jobs.events import JobStateChanged, PlanChanged, StepProgress
from fusionp2p.net.identity import Identity
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.sdk import LOCAL_PROFILE, Swarm
from fusionp2p.sizes import parse_size
from fusionp2p.train.config import TrainConfig

MiB = 2**20
SEQ = 32
_NEEDS = re.compile(r"stage (\d+) needs ([\d.]+) MiB")
_SETUP = re.compile(r"epoch 0: state of stage \d+ from \d+ files in ([\d.]+) s")
_LINKS = re.compile(r"epoch 0: \d+ links up in ([\d.]+) s")
_TRAINED = re.compile(r"trained at (\d+) ms per micro-batch over (\d+)")
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, kw_only=True, slots=True)
class Rung:
    """One Llama size of the ladder."""

    hidden: int
    layers: int
    vocab: int

    def model(self, seed: int = 0) -> torch.nn.Module:
        import transformers

        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.hidden * 8 // 3,
                                       num_hidden_layers=self.layers, num_attention_heads=self.heads,
                                       num_key_value_heads=self.heads // 2 if self.heads % 2 == 0 else self.heads,
                                       max_position_embeddings=SEQ)
        return transformers.LlamaForCausalLM(cfg)

    @property
    def heads(self) -> int:
        return max(1, self.hidden // 64)

    def params(self) -> int:
        return sum(p.numel() for p in self.model().parameters())


def ladder(quick: bool) -> list[Rung]:
    """Sizes in steps of about 1.3-1.5x in parameters (``--quick``); about 1.1x (the full ladder)."""
    if quick:
        return [Rung(hidden=h, layers=layers, vocab=4096) for h, layers in
                [(128, 2), (192, 2), (256, 2), (256, 4), (320, 4), (384, 4), (384, 6), (448, 6), (512, 6), (512, 8),
                 (576, 8), (640, 8), (640, 10), (768, 10)]]
    return [Rung(hidden=h, layers=layers, vocab=32000) for h, layers in   # 19M .. 1.24B, ~1.1x apart from 31M to 250M
            [(256, 4), (384, 4), (384, 6), (448, 4), (512, 4), (512, 5), (512, 6), (512, 7), (512, 8), (640, 4), (640, 6),
             (640, 8), (768, 6), (768, 8), (768, 10), (768, 12), (768, 14), (832, 12), (896, 12), (896, 14), (960, 12),
             (1024, 12), (1024, 14), (1024, 16), (1152, 16), (1280, 16), (1408, 16), (1536, 16), (1536, 20), (1536, 24),
             (1792, 24), (2048, 24)]]


def config(steps: int, nodes: int) -> TrainConfig:
    return TrainConfig(steps=steps, micro_batch=2, micro_batches=max(2, nodes), lr=1e-4, replicas=1, averaging="none",
                       compression="none", schedule="1f1b", seed=1)


def dataset() -> Examples:
    return Examples.causal_lm(BuiltinCorpus(seq_len=SEQ), SEQ)


def fits(rung: Rung, nodes: int, memory: int, cfg: TrainConfig) -> bool:
    """Whether the planner cuts *rung* into stages for *nodes* nodes of *memory* bytes each."""
    me = Identity.generate()
    built = build_job(rung.model(), None, dataset(), cfg, publisher=me.peer_id, sign=me.sign, now=1.0, nonce=b"m" * 16)
    profile = dataclasses.replace(LOCAL_PROFILE, memory_bytes=memory)
    snap = Snapshot(job=built.spec.job_id, epoch=0, members={f"p{i:02d}": profile for i in range(nodes)}, links={})
    try:
        plan_for_snapshot(built.spec, built.dag, snap)
    except PlanError:
        return False
    return True


def largest(rungs: list[Rung], nodes: int, memory: int, cfg: TrainConfig) -> Rung | None:
    """The largest rung the planner fits on *nodes* nodes that offer *memory* bytes to a stage (bisection:
    a larger rung never fits where a smaller one does not)."""
    lo, hi = -1, len(rungs)          # rungs[lo] fits (or none), rungs[hi] does not (or none left)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(rungs[mid], nodes, memory, cfg):
            lo = mid
        else:
            hi = mid
    return rungs[lo] if lo >= 0 else None


def cpu_seconds(pid: int) -> float:
    """User + system CPU-seconds of process *pid* so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def single_process(rung: Rung, cfg: TrainConfig, steps: int = 3) -> dict[str, float]:
    """Wall and CPU-seconds per step of training *rung* in this process (one thread): the job's micro-batches
    of its micro-batch size, gradients summed over them, AdamW; the first step (the optimizer's state
    allocated) not counted."""
    model = rung.model()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(0)
    walls, cpus = [], []
    for step in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(cfg.micro_batches):
            x = torch.randint(0, rung.vocab, (cfg.micro_batch, SEQ), generator=gen)
            (model(input_ids=x, labels=x).loss / cfg.micro_batches).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    return {"step_wall_s": sorted(walls)[len(walls) // 2], "step_cpu_s": sorted(cpus)[len(cpus) // 2], "steps": steps}


def status(pid: int) -> dict[str, int]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in text.splitlines())
            if k in ("VmRSS", "VmHWM")}


_ROOM = re.compile(r"--memory [\d.]+ MiB: ([\d.]+) MiB for a stage")


def stage_rooms(cluster: LocalCluster, names: list[str]) -> dict[str, int]:
    """What each node offers to a stage (its log line, ``swarm/device.py: stage_memory_of``)."""
    def read() -> dict[str, int] | None:
        got = {}
        for n in names:
            m = _ROOM.search((cluster.home / f"{n}.log").read_text(errors="replace"))
            if m is None:
                return None
            got[n] = int(float(m.group(1)) * MiB)
        return got
    return wait_until(read, timeout=180, interval=0.5, what="every node's stage memory")


def train(rungs: list[Rung], nodes: int, memory: int, steps: int, root: Path) -> dict[str, Any]:
    """The largest rung *nodes* CLI nodes of *memory* train: planned, trained, reloaded, and each node's peak
    resident size against the prediction (its size at start, the reserve, its stage's figure) and its offer."""
    cfg = config(steps, nodes)
    cluster = LocalCluster(nodes, root, dead_timeout=15.0, probe_interval=60.0)
    cluster.node_args += ["--memory", str(memory)]
    out: dict[str, Any] = {"nodes": nodes, "memory": memory}
    with cluster, Swarm.connect([cluster.bootstrap], home=root / "client", listen="/ip4/127.0.0.1/tcp/0") as sw:
        wait_until(lambda: len(sw.members()) >= nodes, timeout=180, interval=0.5, what=f"{nodes} members")
        pids = {n: p.pid for n, p in cluster.procs.items() if n != "bootstrap"}
        rooms = stage_rooms(cluster, list(pids))
        t0, c0 = time.monotonic(), sum(cpu_seconds(pid) for pid in pids.values())
        rung = largest(rungs, nodes, min(rooms.values()), cfg)
        out["plan_search_s"] = time.monotonic() - t0
        # the nodes' own CPU while no job runs (heartbeats, the DHT, the event loop): CPU-seconds per second
        out["idle_cpu_rate"] = (sum(cpu_seconds(pid) for pid in pids.values()) - c0) / out["plan_search_s"]
        if rung is None:
            out["state"] = "no rung fits"
            return out
        out.update(hidden=rung.hidden, layers=rung.layers, vocab=rung.vocab, params=rung.params(),
                   weights_bytes=4 * rung.params())
        print(f"{nodes} node(s) of --memory {memory / MiB:.0f} MiB ({min(rooms.values()) / MiB:.0f} MiB for a stage): "
              f"{rung} ({rung.params() / 1e6:.1f}M parameters); load {os.getloadavg()[0]:.1f}", flush=True)
        idle = {n: status(pid)["VmRSS"] for n, pid in pids.items()}
        t0 = time.monotonic()
        model = rung.model()
        built = build_job(model, None, dataset(), cfg, publisher=sw.publisher_id, sign=sw.sign, now=time.time(),
                          nonce=os.urandom(16), name="model-scale")
        del model
        out["trace_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        job = sw.publish_built(built)
        del built
        out["announce_s"] = time.monotonic() - t1
        out["publish_s"] = time.monotonic() - t0    # trace and announce
        state, first, plan = "", None, None
        seen: list[tuple[int, float, float]] = []   # (step, wall, the nodes' CPU-seconds) as the client saw steps
        for ev in job.events(timeout=3600):
            if isinstance(ev, PlanChanged) and plan is None:
                plan = list(ev.stage_sizes)
                out["plan_s"] = time.monotonic() - t0
            elif isinstance(ev, StepProgress):
                if first is None:
                    first = time.monotonic() - t0
                if not seen or ev.step > seen[-1][0]:
                    seen.append((ev.step, time.monotonic(), sum(cpu_seconds(pid) for pid in pids.values())))
            elif isinstance(ev, JobStateChanged):
                state = ev.state
        job.wait(timeout=60)
        out["publisher_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["wall_s"] = time.monotonic() - t0
        out["first_step_s"] = first
        out["state"] = state
        out["stage_sizes"] = plan
        if len(seen) >= 2:
            (s0, w0, c0), (s1, w1, c1) = seen[0], seen[-1]
            out["pipeline_step_wall_s"] = (w1 - w0) / (s1 - s0)
            out["pipeline_step_cpu_s"] = (c1 - c0) / (s1 - s0)   # all nodes together
            out["pipeline_steps_timed"] = s1 - s0
            # less what the nodes spend idle over the same wall time (a loaded host stretches the wall time)
            out["pipeline_step_cpu_net_s"] = out["pipeline_step_cpu_s"] - out["idle_cpu_rate"] * out["pipeline_step_wall_s"]
        peaks = {n: status(pid)["VmHWM"] for n, pid in pids.items()}
        try:
            path = job.download(root / "out")
            rung.model(seed=9).load_state_dict(load_download(path), strict=True)
            out["reloaded"] = True
        except Exception as exc:  # the figure to report, not a crash of the benchmark
            out["reloaded"] = f"{type(exc).__name__}: {exc}"
    per: dict[str, Any] = {}
    for n in pids:
        needs = [float(m.group(2)) * MiB for m in _NEEDS.finditer((root / f"{n}.log").read_text(errors="replace"))]
        row: dict[str, Any] = {"idle_rss": idle[n], "peak_rss": peaks[n], "stage_room": rooms[n], "offer": memory,
                               "peak_over_offer": peaks[n] / memory}
        if needs:   # its size at start and the reserve (memory - room), and its stage's figure
            row["stage_need"] = needs[-1]
            row["predicted_peak"] = memory - rooms[n] + needs[-1]
            row["peak_over_predicted"] = peaks[n] / row["predicted_peak"]
        log_text = (root / f"{n}.log").read_text(errors="replace")
        for key, rx in (("setup_s", _SETUP), ("links_s", _LINKS)):
            if (m := rx.search(log_text)) is not None:
                row[key] = float(m.group(1))
        if (m := _TRAINED.search(log_text)) is not None:
            row["busy_ms_per_micro"] = float(m.group(1))
        row["recomputed"] = "(activation recomputation)" in log_text
        per[n] = row
    out["per_node"] = per
    if out.get("state") == "done":   # the same model in one process, the cluster down (its memory free)
        try:
            out["single"] = single_process(rung, cfg)
        except Exception as exc:  # the figure to report, not a crash of the benchmark
            out["single"] = {"error": f"{type(exc).__name__}: {exc}"}
        if "pipeline_step_wall_s" in out and "step_wall_s" in out["single"]:
            out["pipeline_over_single_wall"] = out["pipeline_step_wall_s"] / out["single"]["step_wall_s"]
            out["pipeline_over_single_cpu"] = out["pipeline_step_cpu_s"] / out["single"]["step_cpu_s"]
            out["pipeline_over_single_cpu_net"] = out["pipeline_step_cpu_net_s"] / out["single"]["step_cpu_s"]
    return out


def main() -> None:
    ap = parser("model_scale", __doc__)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--memory", default=None, help="each node's --memory (default 3GiB; --quick 640MiB)")
    ap.add_argument("--steps", type=int, default=None, help="steps per job (default 3; --quick 2)")
    ap.add_argument("--only", type=int, default=None, help="train only this swarm size (1 or --nodes)")
    ap.add_argument("--one-from", default=None, metavar="JSON",
                    help="carry the one-node run from this earlier result (same --memory) instead of running it")
    args = ap.parse_args()
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    memory = parse_size(args.memory or ("640MiB" if args.quick else "3GiB"), "--memory")
    steps = args.steps or (2 if args.quick else 3)
    rungs = ladder(args.quick)
    results: dict[str, Any] = {"memory": memory, "nodes": args.nodes, "runs": {}}
    if args.one_from is not None:
        earlier = json.loads(Path(args.one_from).read_text())
        earlier = earlier.get("results", earlier)   # a result file (benchmarks/_common.write) or its results
        if earlier.get("memory") != memory:
            raise SystemExit(f"--one-from {args.one_from}: its --memory was {earlier.get('memory')} bytes, not {memory}")
        results["runs"]["1"] = dict(earlier["runs"]["1"], carried_from=args.one_from)
    for n in (1, args.nodes):
        if (args.only is not None and n != args.only) or str(n) in results["runs"]:
            continue
        got = train(rungs, n, memory, steps, Path(tempfile.mkdtemp(prefix=f"fusionp2p-bench-scale{n}-")))
        results["runs"][str(n)] = got
        for name, row in sorted(got.get("per_node", {}).items()):
            print(f"  {name}: idle {row['idle_rss'] / MiB:.0f} MiB, peak {row['peak_rss'] / MiB:.0f} MiB, predicted "
                  f"{row.get('predicted_peak', 0) / MiB:.0f} MiB (stage {row.get('stage_need', 0) / MiB:.0f} MiB), "
                  f"peak/predicted {row.get('peak_over_predicted', float('nan')):.2f}, peak/offer {row['peak_over_offer']:.2f}")
        setups = [row.get("setup_s", 0.0) for row in got.get("per_node", {}).values()]
        print(f"  trace {got.get('trace_s', 0):.0f} s, announce {got.get('announce_s', 0):.1f} s, plan seen at "
              f"{got.get('plan_s', 0):.0f} s, stage set-up (check + fetch) up to {max(setups, default=0):.0f} s; step "
              f"{got.get('pipeline_step_wall_s', float('nan')):.2f} s wall / {got.get('pipeline_step_cpu_s', float('nan')):.2f}"
              f" CPU-s (one process: {got.get('single', {}).get('step_wall_s', float('nan')):.2f} / "
              f"{got.get('single', {}).get('step_cpu_s', float('nan')):.2f})", flush=True)
        print(f"  {got['state']}, reloaded {got.get('reloaded')}, stages {got.get('stage_sizes')}, publish "
              f"{got.get('publish_s', 0):.0f} s, plan {got.get('plan_s', 0):.0f} s, first step {got.get('first_step_s')} s, "
              f"wall {got.get('wall_s', 0):.0f} s, publisher peak {got.get('publisher_peak_bytes', 0) / MiB:.0f} MiB "
              f"for {got.get('weights_bytes', 0) / MiB:.0f} MiB of weights; load {os.getloadavg()[0]:.1f}", flush=True)
    one, many = results["runs"].get("1", {}), results["runs"].get(str(args.nodes), {})
    done = one.get("state") == many.get("state") == "done"
    ratio = many["params"] / one["params"] if done else float("nan")
    write("model_scale", args.out, results,
          headline("largest model N nodes train over one node's", ratio, "x", 0.8 * args.nodes, "higher",
                   f"the largest Llama one node of the same --memory trains (N = {args.nodes})"), quick=args.quick)


if __name__ == "__main__":
    main()
