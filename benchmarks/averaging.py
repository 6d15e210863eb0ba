"""CO2 averaging: step time of 4 replicas with CO2 vs no averaging vs a synchronous all-reduce every step.

All replicas run in one process (one trio loop, torch work in worker threads) and talk over real
loopback TCP: the encrypted data-plane channel (``fusionp2p.net.bulk``, keys exchanged over the
in-memory transport). A second set runs over the in-memory channel pair (``fusionp2p.testing.channels``,
real wire encoding) shaped to ``--mbps`` per link (default 100 Mbit/s, the testbed's figure) with
``--latency-ms``: that is where communication, not CPU, dominates and the overlap shows.

Phases, in one run and on the same model:
  none      every replica trains, no communication                       -> t_none per step
  allreduce sync rounds on a flat vector of the model's size, no training -> T_allreduce, GB/s
  sync      synchronous all-reduce after every step (tau = 1)            -> t_sync per step
  co2       one-step-stale CO2 with tau = suggest_tau(T_allreduce, t_none, margin)
Headline: t_co2 / t_none on the TCP set (target <= 1.05: full overlap).

``--hivemind`` adds the anchor: hivemind 1.1.12's DecentralizedAverager (``make hivemind-venv``; four
processes on loopback, benchmarks/anchors/) averages the same vector in the same run, after our own
all-reduce of it in fp32 and in bf16 (one process) and in fp32 with one process per replica
(benchmarks/allreduce_procs.py, as hivemind runs); the headline is then hivemind's median round over
ours in one process, the all-reduce figure of this benchmark (target >= 4); the ratio to ours in
processes is recorded beside it.
``--allreduce-only`` skips the training phases: only the all-reduces (and the anchor).
"""

from __future__ import annotations

import ctypes
import itertools
import resource
import statistics
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from typing import Any

import torch
import trio

from benchmarks._common import headline, parser, write
from fusionp2p.average.outer import OuterConfig, suggest_tau
from fusionp2p.net.channel import TensorChannel, TensorMessage
from fusionp2p.train.averager import AveragerConfig, load_flat_, open_replica_averager

NAME = "averaging"
REPLICAS = 4
AR_ROUNDS = 7   # all-reduce rounds; the first is left out of best and median


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 16))


@asynccontextmanager
async def tcp_mesh(peers: list[str]) -> AsyncIterator[dict[str, dict[str, TensorChannel]]]:
    """A full mesh of encrypted loopback TCP channels (fusionp2p.net.bulk) among *peers*."""
    from fusionp2p.net.bulk import open_data_plane
    from fusionp2p.net.memory import memory_network

    async with AsyncExitStack() as stack:
        net = await stack.enter_async_context(memory_network())
        hosts = [net.add_host() for _ in peers]
        ids = [h.peer_id for h in hosts]
        # the default dead_after (1 s of silence) is too tight when 4 trainers share 2 cores with the loop
        dps = [await stack.enter_async_context(open_data_plane(h, listen_host="127.0.0.1", keepalive=1.0, dead_after=30.0)) for h in hosts]
        for h in hosts[1:]:
            await hosts[0].connect(h.listen_addrs()[0])
        for i, h in enumerate(hosts):
            for j in range(i + 1, len(hosts)):
                await h.connect(hosts[j].listen_addrs()[0])
        mesh: dict[str, dict[str, TensorChannel]] = {p: {} for p in peers}
        name = dict(zip(ids, peers))
        for i in range(len(peers)):
            for j in range(i + 1, len(peers)):
                ch = await dps[i].connect(ids[j])
                mesh[peers[i]][peers[j]] = ch
                back = await dps[j].incoming.receive()
                mesh[peers[j]][name[back.remote_peer]] = back
        yield mesh


@asynccontextmanager
async def memory_mesh(peers: list[str]) -> AsyncIterator[dict[str, dict[str, TensorChannel]]]:
    from fusionp2p.testing.channels import memory_channel_pair

    mesh: dict[str, dict[str, TensorChannel]] = {p: {} for p in peers}
    for i, a in enumerate(peers):
        for b in peers[i + 1 :]:
            ca, cb = memory_channel_pair(a, b, window=8)
            mesh[a][b], mesh[b][a] = ca, cb
    yield mesh


def trim_heap() -> None:
    """Give freed heap back to the OS (glibc). Four replicas in one process free and re-allocate
    model-sized buffers from several threads; glibc keeps them per arena, and a full run otherwise
    grows past 20 GB of retained-but-free memory. A no-op where there is no glibc."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class ShapedChannel:
    """Wraps a channel with a link model: each message occupies the link for ``bytes/bandwidth`` seconds
    (one message at a time per direction, like a serialising NIC), plus a one-way latency."""

    def __init__(self, inner: TensorChannel, bytes_per_s: float, latency_s: float) -> None:
        self._inner = inner
        self._bps = bytes_per_s
        self._lat = latency_s
        self._link = trio.Lock()

    @property
    def remote_peer(self) -> str:
        return self._inner.remote_peer

    async def send(self, msg: TensorMessage) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in msg.tensors) + 256
        async with self._link:
            await trio.sleep(self._lat + nbytes / self._bps)
            await self._inner.send(msg)

    async def receive(self) -> TensorMessage:
        return await self._inner.receive()

    async def aclose(self) -> None:
        await self._inner.aclose()


@asynccontextmanager
async def shaped_mesh(peers: list[str], mbps: float, latency_s: float) -> AsyncIterator[dict[str, dict[str, TensorChannel]]]:
    async with memory_mesh(peers) as mesh:
        yield {a: {b: ShapedChannel(ch, mbps * 1e6 / 8, latency_s) for b, ch in row.items()} for a, row in mesh.items()}


class Replica:
    def __init__(self, rank: int, width: int, depth: int, batch: int) -> None:
        self.rank = rank
        self.model = make_model(width, depth)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        self.x = torch.randn(batch, width, generator=g)
        self.y = torch.randn(batch, 16, generator=g)

    def step(self) -> None:
        self.opt.zero_grad()
        torch.nn.functional.mse_loss(self.model(self.x), self.y).backward()  # type: ignore[no-untyped-call]
        self.opt.step()


async def run_phase(mode: str, mesh: Mapping[str, Mapping[str, TensorChannel]], reps: list[Replica], steps: int, tau: int, timeout: float) -> dict[str, Any]:
    """Train *steps* steps on every replica; returns wall time per step and skip counts."""
    peers = [f"r{i}" for i in range(len(reps))]
    cfg = OuterConfig(tau=tau, outer_lr=1.0, outer_momentum=0.5 if mode == "co2" else 0.0, sync=mode != "co2")
    skipped = [0]
    waits: list[float] = []

    async def one(rep: Replica, p: str) -> None:
        params = list(rep.model.parameters())
        acfg = AveragerConfig(outer=cfg, job="bench", stage=0, round_timeout=timeout)
        async with open_replica_averager(acfg, peers=peers, me=p, channels=mesh[p], initial=params) as avg:
            for s in range(steps):
                await trio.to_thread.run_sync(rep.step)
                if mode != "none" and (s + 1) % tau == 0:
                    t0 = time.perf_counter()
                    res = await avg.round_boundary(params)
                    waits.append(time.perf_counter() - t0)
                    if res.anchor is not None:
                        load_flat_(params, res.anchor)
                    elif res.consumed_round is not None:
                        skipped[0] += 1
                    del res
                    if p == peers[0]:
                        trim_heap()
            if mode == "co2":
                await avg.finalize()

    trim_heap()
    t0, c0 = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as nursery:
        for rep, p in zip(reps, peers):
            nursery.start_soon(one, rep, p)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    trim_heap()
    # cpu_step_s: this process's CPU seconds per step (all threads); on a shared box it is far less
    # noisy than wall time, and it is what the averaging really costs when cores are the bottleneck
    return {"mode": mode, "tau": tau, "steps": steps, "wall_s": wall, "step_s": wall / steps, "cpu_step_s": cpu / steps,
            "skipped_rounds": skipped[0],
            "boundary_wait_s_mean": sum(waits) / len(waits) if waits else 0.0}


async def allreduce_throughput(mesh: Mapping[str, Mapping[str, TensorChannel]], n_elems: int, rounds: int, timeout: float,
                               *, wire: str = "fp32") -> dict[str, Any]:
    """*rounds* synchronous rounds of a flat *n_elems* vector; the first (buffers, pools) is left out of best and median.

    The heap is trimmed once before the rounds, not after each: a node keeps its freed round buffers in
    glibc's heap (net/heap.py ``keep_freed_heap``), and a trim after every round made each round
    fault in all its buffers again (a third of the round's CPU at 25M floats), which no node pays."""
    peers = [f"r{i}" for i in range(REPLICAS)]
    times: list[float] = []
    faults: list[int] = []   # this process's minor page faults when replica 0 ended each round
    cfg = AveragerConfig(outer=OuterConfig(), job="bench-ar", stage=0, round_timeout=timeout, wire=wire)

    async def one(p: str, rank: int) -> None:
        vec = torch.full((n_elems,), float(rank))
        async with open_replica_averager(cfg, peers=peers, me=p, channels=mesh[p], initial=vec) as avg:
            for _ in range(rounds):
                t0 = time.perf_counter()
                res = await avg.round_boundary(vec)
                if rank == 0:
                    times.append(time.perf_counter() - t0)
                    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
                if res.anchor is None or abs(float(res.anchor[-1]) - 1.5) > 1e-6:
                    raise RuntimeError(f"all-reduce gave a wrong mean: {res}")
                del res

    trim_heap()
    c0, l0 = time.process_time(), time.thread_time()
    async with trio.open_nursery() as nursery:
        for i, p in enumerate(peers):
            nursery.start_soon(one, p, i)
    cpu, loop_cpu = time.process_time() - c0, time.thread_time() - l0
    trim_heap()
    timed = times[1:] if len(times) > 1 else times
    per_round = [b - a for a, b in itertools.pairwise(faults)]
    best, median = min(timed), statistics.median(timed)
    size = n_elems * 4
    return {"n_elems": n_elems, "rounds": rounds, "wire": wire, "t_allreduce_s": best, "t_allreduce_median_s": median,
            "t_allreduce_all_s": times, "cpu_per_round_s": cpu / rounds,
            # the event loop's own thread (every replica's tensor work, message framing, trio): it runs one
            # core at a time, so it bounds the round from below when the channel threads fill the other
            "loop_cpu_per_round_s": loop_cpu / rounds,
            # pages faulted in a round (every replica; the median round: the first ones fill the pools, and the
            # bf16 wire's second): unlike CPU seconds, the machine's load does not move it
            "minflt_per_round": statistics.median(per_round) if per_round else 0,
            "minflt_all": per_round,
            "algbw_GBps": size / best / 1e9, "busbw_GBps": 2 * (REPLICAS - 1) / REPLICAS * size / best / 1e9}


async def run_set(label: str, mesh: Mapping[str, Mapping[str, TensorChannel]], reps: list[Replica], *, steps: int, ar_elems: int, margin: float) -> dict[str, Any]:
    """The four phases on one set of links; prints one table."""
    n = sum(p.numel() for p in reps[0].model.parameters())
    await run_phase("none", mesh, reps, 2, 1, 120)  # warm-up
    none = await run_phase("none", mesh, reps, steps, 1, 120)
    ar = await allreduce_throughput(mesh, ar_elems, AR_ROUNDS, 600)
    ar_model = ar if ar_elems == n else await allreduce_throughput(mesh, n, AR_ROUNDS, 600)
    sync = await run_phase("sync", mesh, reps, max(3, steps // 4), 1, 600)
    tau = suggest_tau(ar_model["t_allreduce_s"], none["step_s"], margin=margin)
    long_tau = 4 * tau  # amortises whatever CPU the averaging itself takes (this box has 2 cores)

    def n_steps(t: int) -> int:
        k = max(steps, 3 * t)
        return k + (-k) % t

    co2 = await run_phase("co2", mesh, reps, n_steps(tau), tau, 600)
    # The machine is shared: interleave a second none/co2 pair and compare best against best.
    none2 = await run_phase("none", mesh, reps, steps, 1, 120)
    co2b = await run_phase("co2", mesh, reps, n_steps(tau), tau, 600)
    co2_long = await run_phase("co2", mesh, reps, n_steps(long_tau), long_tau, 600)
    t_none = min(none["step_s"], none2["step_s"])
    t_co2 = min(co2["step_s"], co2b["step_s"])
    res = {"links": label, "none": none, "none_again": none2, "allreduce": ar, "allreduce_model": ar_model, "sync": sync,
           "co2": co2, "co2_again": co2b, "co2_long_tau": co2_long, "tau": tau, "long_tau": long_tau,
           "t_none_best_s": t_none, "t_co2_best_s": t_co2, "ratio_co2_vs_none": t_co2 / t_none,
           "ratio_co2_long_tau_vs_none": co2_long["step_s"] / t_none, "ratio_sync_vs_none": sync["step_s"] / t_none,
           "cpu_ratio_co2_vs_none": min(co2["cpu_step_s"], co2b["cpu_step_s"]) / min(none["cpu_step_s"], none2["cpu_step_s"]),
           "cpu_ratio_co2_long_tau_vs_none": co2_long["cpu_step_s"] / min(none["cpu_step_s"], none2["cpu_step_s"])}
    print(f"\n== links: {label}")
    print(f"{'mode':32} {'step s':>8} {'cpu s/step':>10} {'tau':>4} {'boundary wait s':>16}")
    for name, r in (("no averaging", none), ("no averaging (again)", none2), ("sync all-reduce every step", sync),
                    (f"CO2 async, tau={tau}", co2), (f"CO2 async, tau={tau} (again)", co2b), (f"CO2 async, tau={long_tau}", co2_long)):
        wait = "-" if r["mode"] == "none" else f"{r['boundary_wait_s_mean']:.3f}"
        print(f"{name:32} {r['step_s']:8.3f} {r['cpu_step_s']:10.3f} {r['tau']:4d} {wait:>16}")
    for a in (ar, ar_model) if ar is not ar_model else (ar,):
        print(f"all-reduce of {a['n_elems'] / 1e6:.1f}M floats among {REPLICAS}: {a['t_allreduce_s']:.3f} s (median {a['t_allreduce_median_s']:.3f}), "
              f"algbw {a['algbw_GBps']:.3f} GB/s, busbw {a['busbw_GBps']:.3f} GB/s; CPU {a['cpu_per_round_s']:.3f} s a round, "
              f"{a['loop_cpu_per_round_s']:.3f} of it on the event loop's thread")
    print(f"best CO2 / best none = {res['ratio_co2_vs_none']:.3f} (tau={tau}), {res['ratio_co2_long_tau_vs_none']:.3f} (tau={long_tau}); "
          f"sync / best none = {res['ratio_sync_vs_none']:.3f}; CPU per step CO2/none = {res['cpu_ratio_co2_vs_none']:.3f} "
          f"(tau={tau}), {res['cpu_ratio_co2_long_tau_vs_none']:.3f} (tau={long_tau})")
    return res


async def anchor_set(peers: list[str], n_elems: int, *, hivemind: bool) -> dict[str, Any]:
    """Our all-reduce of *n_elems* over encrypted loopback TCP in fp32 and bf16, then (*hivemind*)
    hivemind's DecentralizedAverager on the same vector, one after the other in this run."""
    res: dict[str, Any] = {"n_elems": n_elems}
    for wire in ("fp32", "bf16"):
        async with tcp_mesh(peers) as mesh:
            res[wire] = a = await allreduce_throughput(mesh, n_elems, AR_ROUNDS, 600, wire=wire)
        print(f"ours, {wire}: all-reduce of {n_elems / 1e6:.1f}M floats among {REPLICAS}: best {a['t_allreduce_s']:.3f} s, "
              f"median {a['t_allreduce_median_s']:.3f} s, CPU {a['cpu_per_round_s']:.3f} s a round (all replicas; "
              f"{a['loop_cpu_per_round_s']:.3f} on the event loop's thread), {a['minflt_per_round']:.0f} page faults a round")
    if hivemind:
        from benchmarks.allreduce_procs import run_procs
        from benchmarks.anchors import run_hivemind

        # ours as hivemind runs: one process per replica (and as nodes run: one replica each)
        res["fp32_processes"] = a = await trio.to_thread.run_sync(lambda: run_procs(n_elems, replicas=REPLICAS, rounds=AR_ROUNDS))
        print(f"ours, fp32, {REPLICAS} processes: best {a['t_allreduce_s']:.3f} s, median {a['t_allreduce_median_s']:.3f} s, "
              f"CPU {a['cpu_per_round_s']:.3f} s a round (all processes)")
        res["hivemind"] = h = await trio.to_thread.run_sync(lambda: run_hivemind(n_elems, peers=REPLICAS, rounds=AR_ROUNDS))
        res["hivemind_over_ours"] = h["t_median_s"] / res["fp32"]["t_allreduce_median_s"]
        res["hivemind_over_ours_processes"] = h["t_median_s"] / a["t_allreduce_median_s"]
        # CPU seconds a round, all processes (threads) of each side: on a shared machine the steadier figure
        res["hivemind_cpu_over_ours"] = h["cpu_per_round_s"] / res["fp32"]["cpu_per_round_s"]
        print(f"hivemind 1.1.12 DecentralizedAverager, same vector, {REPLICAS} processes: best {h['t_best_s']:.3f} s, "
              f"median {h['t_median_s']:.3f} s, CPU {h['cpu_per_round_s']:.3f} s a round (all its processes); "
              f"hivemind / ours (medians, fp32): {res['hivemind_over_ours']:.2f}x (ours in one process), "
              f"{res['hivemind_over_ours_processes']:.2f}x (ours in {REPLICAS}); CPU a round: {res['hivemind_cpu_over_ours']:.2f}x")
    return res


async def main_async(args: Any) -> dict[str, Any]:
    quick = args.quick
    width, depth = (1024, 5) if quick else (2048, 6)
    batch = 32
    steps = 8 if quick else 16
    peers = [f"r{i}" for i in range(REPLICAS)]
    reps = [Replica(i, width, depth, batch) for i in range(REPLICAS)]
    n = sum(p.numel() for p in reps[0].model.parameters())
    out: dict[str, Any] = {"replicas": REPLICAS, "width": width, "depth": depth, "batch": batch, "params": n,
                           "margin": args.margin, "mbps": args.mbps, "latency_ms": args.latency_ms}
    print(f"model: {n / 1e6:.1f}M parameters x {REPLICAS} replicas in one process, torch threads={torch.get_num_threads()}")
    ar_elems = n if quick else 25_000_000
    if args.hivemind or args.allreduce_only:
        out["anchor"] = await anchor_set(peers, ar_elems, hivemind=args.hivemind)
    if args.allreduce_only:
        return out
    if args.links in ("tcp", "both"):
        async with tcp_mesh(peers) as mesh:
            out["tcp"] = await run_set("encrypted TCP on loopback (fusionp2p.net.bulk)", mesh, reps, steps=steps, ar_elems=ar_elems, margin=args.margin)
    if args.links in ("shaped", "both"):
        label = f"in-memory channels shaped to {args.mbps:g} Mbit/s + {args.latency_ms:g} ms per link"
        async with shaped_mesh(peers, args.mbps, args.latency_ms / 1000) as mesh:
            out["shaped"] = await run_set(label, mesh, reps, steps=steps, ar_elems=n, margin=args.margin)
    return out


def main() -> None:
    p = parser(NAME, __doc__)
    p.add_argument("--links", choices=("tcp", "shaped", "both"), default="both")
    p.add_argument("--mbps", type=float, default=100.0, help="shaped links: bandwidth per link and direction")
    p.add_argument("--latency-ms", type=float, default=5.0, help="shaped links: one-way latency")
    p.add_argument("--margin", type=float, default=1.5, help="tau = suggest_tau(T_allreduce, t_step, margin)")
    p.add_argument("--hivemind", action="store_true",
                   help="anchor: hivemind's DecentralizedAverager on the same vector (make hivemind-venv); headline ours over it")
    p.add_argument("--allreduce-only", action="store_true", help="only the all-reduces (fp32, bf16 and any anchor)")
    args = p.parse_args()
    torch.set_num_threads(1)
    res = trio.run(main_async, args)
    if "hivemind_over_ours" in res.get("anchor", {}):
        a = res["anchor"]
        head = headline("hivemind_allreduce_over_ours", a["hivemind_over_ours"], "x", 4.0, "higher",
                        f"hivemind 1.1.12 DecentralizedAverager, {a['n_elems']} fp32 x {REPLICAS} peers on loopback, same run "
                        f"(medians; ours in one process; in {REPLICAS}: {a['hivemind_over_ours_processes']:.2f}x)")
    elif args.allreduce_only:
        a = res["anchor"]
        head = headline("allreduce_median_s", a["fp32"]["t_allreduce_median_s"], "s", 0.6 if a["n_elems"] >= 25_000_000 else 0.14,
                        "lower", f"{a['n_elems']} fp32 x {REPLICAS} replicas, encrypted TCP on loopback")
    else:
        main_set = res["tcp"] if "tcp" in res else res["shaped"]
        head = headline("co2_step_time_over_no_averaging", main_set["ratio_co2_vs_none"], "x", 1.05, "lower",
                        f"no averaging, same run, {main_set['links']}")
    write(NAME, args.out, res, head, quick=args.quick)


if __name__ == "__main__":
    main()
