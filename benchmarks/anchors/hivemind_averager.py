"""hivemind's DecentralizedAverager on one flat fp32 vector among N peers on loopback: the anchor of
``benchmarks.averaging --hivemind``.

Runs under the interpreter of ``.venv-hivemind`` (``make hivemind-venv``: hivemind 1.1.12, a
benchmark-only dependency), never under the product's: it imports nothing of fusionp2p. One process per
peer, each with its own DHT (the first is the others' initial peer) and averager; hivemind adds its
own averager process and p2p daemon per peer. Every peer holds ``torch.full((n,), rank)``, so the mean
is ``(N - 1) / 2`` everywhere, which each round checks.

What is timed is the all-reduce only, the part that matches ours: each round the peers match with
``step(require_trigger=True)``, wait at a barrier until every one has its group (hivemind's
matchmaking, seconds through the DHT, is left out: our rounds have no matchmaking), then trigger the
all-reduce together; a peer's time runs from its trigger to its averaged tensor. A round's CPU
is that of every process of the run (peers, hivemind's averager processes and p2p daemons) from the
moment all peers matched until all have their average. Prints one JSON object: ``{"n_elems", "peers",
"rounds", "times": [rank 0's seconds per round], "times_max": [the slowest peer's], "cpu_s": [CPU
seconds per round, all processes]}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from typing import Any

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _peer(rank: int, args: argparse.Namespace, maddrs: Any, barrier: Any, out: Any) -> None:
    import hivemind
    import torch

    torch.set_num_threads(1)
    dht = avg = None
    times: list[float] = []
    cpu: list[float] = []
    try:
        if rank == 0:
            dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
            for _ in range(args.peers - 1):
                maddrs.put([str(a) for a in dht.get_visible_maddrs()])
        else:
            dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=maddrs.get(timeout=args.timeout))
        vec = torch.full((args.n,), float(rank))
        avg = hivemind.averaging.DecentralizedAverager(
            [vec], dht, prefix="anchor", target_group_size=args.peers, min_group_size=args.peers,
            min_matchmaking_time=2.0, request_timeout=1.0, start=True)
        _rounds(rank, args, avg, barrier, times, cpu)
        out.put((rank, times, cpu, ""))
    except Exception as exc:   # reported to the parent, which fails the run
        barrier.abort()
        out.put((rank, times, cpu, f"{type(exc).__name__}: {exc}"))
    finally:
        if avg is not None:
            avg.shutdown()
        if dht is not None:
            dht.shutdown()


def tree_cpu(root: int) -> float:
    """CPU seconds (user + system) so far of *root* and every process below it: the peers, and the
    averager processes and p2p daemons hivemind starts for them."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:   # gone meanwhile
            continue
        stats[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        kids.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += kids.get(pid, [])
    return total


def _rounds(rank: int, args: argparse.Namespace, avg: Any, barrier: Any, times: list[float], cpu: list[float]) -> None:
    from hivemind.averaging.control import AveragingStage

    want = (args.peers - 1) / 2
    for _ in range(args.rounds):
        with avg.get_tensors() as ts:
            ts[0].fill_(float(rank))
        barrier.wait(timeout=args.timeout)
        ctl = avg.step(wait=False, require_trigger=True, timeout=args.timeout)
        deadline = time.monotonic() + args.timeout
        while ctl.stage != AveragingStage.AWAITING_TRIGGER and not ctl.done():
            if time.monotonic() > deadline:
                raise TimeoutError("hivemind: no group formed within the timeout")
            time.sleep(0.002)   # polling hivemind's shared stage flag: it offers no event to wait on
        c0 = tree_cpu(args.root) if rank == 0 else 0.0
        barrier.wait(timeout=args.timeout)   # every peer matched: the all-reduces start together
        t0 = time.perf_counter()
        ctl.allow_allreduce()
        if ctl.result(timeout=args.timeout) is None:
            raise RuntimeError("hivemind: the all-reduce failed")
        times.append(time.perf_counter() - t0)
        barrier.wait(timeout=args.timeout)   # every peer has its average: the round's CPU is spent
        if rank == 0:
            cpu.append(tree_cpu(args.root) - c0)
        with avg.get_tensors() as ts:
            got = float(ts[0][-1])
        if abs(got - want) > 1e-5:
            raise RuntimeError(f"hivemind: mean {got}, expected {want}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, required=True, help="fp32 elements of the averaged vector")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()
    args.root = os.getpid()
    ctx = mp.get_context("fork")   # this parent holds no threads or torch yet; hivemind forks its own processes too
    maddrs, out = ctx.Queue(), ctx.Queue()
    barrier = ctx.Barrier(args.peers)
    procs = [ctx.Process(target=_peer, args=(r, args, maddrs, barrier, out), daemon=False) for r in range(args.peers)]
    for pr in procs:
        pr.start()
    got: dict[int, list[float]] = {}
    cpu: list[float] = []
    try:
        for _ in procs:
            rank, times, peer_cpu, err = out.get(timeout=args.timeout * (args.rounds + 2))
            got[rank] = times
            cpu = peer_cpu or cpu
            if err:
                raise SystemExit(f"hivemind peer {rank}: {err}")
    finally:
        for pr in procs:
            pr.join(timeout=30)
            if pr.is_alive():
                pr.kill()
    print(json.dumps({"n_elems": args.n, "peers": args.peers, "rounds": args.rounds, "times": got[0], "cpu_s": cpu,
                      "times_max": [max(got[r][i] for r in got) for i in range(args.rounds)]}))


if __name__ == "__main__":
    main()
