"""Our all-reduce with one process per replica, the way nodes run it and the way the hivemind anchor runs.

``benchmarks.averaging --hivemind`` measures ours both ways: four replicas in one process (one event
loop and one GIL for all four, as the rest of benchmarks.averaging) and here, four processes on loopback,
each one replica: its own ``ReplicaAverager`` over encrypted ``BulkChannel``\\ s (the data plane's
channel, AES-GCM, its default lanes) to the three others. The channels' keys are handed to the
processes by this parent (the data plane's ticket exchange costs milliseconds once per channel and is
not what is measured, as in benchmarks.stream). Every replica holds ``torch.full((n,), rank)`` and
checks each round's mean. A replica's round time runs from its ``round_boundary`` call to its result
(rank 0's is reported, as in the one-process form); every process finishes its rounds before any
closes its channels (the parent says when).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import trio


async def _read_exactly(stream: trio.SocketStream, n: int) -> bytes:
    got = b""
    while len(got) < n:
        data = await stream.receive_some(n - len(got))
        if not data:
            raise EOFError("peer closed during the lane handshake")
        got += data
    return got


async def _peer(rank: int, n: int, n_elems: int, rounds: int, keys: dict[str, str]) -> None:
    from fusionp2p.average.outer import OuterConfig
    from fusionp2p.net.bulk import DataPlaneConfig
    from fusionp2p.net.bulk_channel import BulkChannel, _detach
    from fusionp2p.net.channel import TensorChannel
    from fusionp2p.train.averager import AveragerConfig, open_replica_averager

    torch.set_num_threads(1)
    cfg = DataPlaneConfig(keepalive=1.0, dead_after=30.0)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    ports: list[int] = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))

    def pair_keys(other: int) -> tuple[bytes, bytes]:   # (ours to send, theirs): one key per direction
        return bytes.fromhex(keys[f"{rank}-{other}"]), bytes.fromhex(keys[f"{other}-{rank}"])

    chans: dict[str, TensorChannel] = {}
    all_up = trio.Event()
    arrived: dict[int, dict[int, Any]] = {}
    times: list[float] = []
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            def up(other: int, socks: list[Any]) -> BulkChannel:
                ch = BulkChannel(socks, f"r{other}", pair_keys(other), cfg)
                chans[f"r{other}"] = ch
                if len(chans) == n - 1:
                    all_up.set()
                return ch

            async def handle(stream: trio.SocketStream) -> None:
                src, lanes, index = await _read_exactly(stream, 3)
                arrived.setdefault(src, {})[index] = _detach(stream)
                if len(arrived[src]) == lanes:
                    await nursery.start(up(src, [arrived[src].pop(i) for i in range(lanes)]).run)

            nursery.start_soon(trio.serve_listeners, handle, listeners)
            for other in range(rank + 1, n):   # the lower rank dials
                streams = []
                for i in range(cfg.lanes):
                    streams.append(await trio.open_tcp_stream("127.0.0.1", ports[other]))
                    await streams[-1].send_all(bytes([rank, cfg.lanes, i]))
                await nursery.start(up(other, list(streams)).run)
            if n > 1:
                await all_up.wait()
            peers = [f"r{i}" for i in range(n)]
            acfg = AveragerConfig(outer=OuterConfig(), job="bench-ar", stage=0, round_timeout=300.0)
            vec = torch.full((n_elems,), float(rank))
            async with open_replica_averager(acfg, peers=peers, me=f"r{rank}", channels=chans, initial=vec) as avg:
                c0 = time.process_time()
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    res = await avg.round_boundary(vec)
                    times.append(time.perf_counter() - t0)
                    if res.anchor is None or abs(float(res.anchor[-1]) - (n - 1) / 2) > 1e-6:
                        raise RuntimeError(f"all-reduce gave a wrong mean: {res}")
                    del res
                cpu = time.process_time() - c0
            print(json.dumps({"rank": rank, "times": times, "cpu_s": cpu}), flush=True)
            await trio.to_thread.run_sync(sys.stdin.readline)   # every replica is done: close
            nursery.cancel_scope.cancel()


def run_procs(n_elems: int, *, replicas: int = 4, rounds: int = 7, timeout: float = 600.0) -> dict[str, Any]:
    """*rounds* all-reduces of *n_elems* fp32 among *replicas* processes; the first round is left out of
    best and median. ``{"times": rank 0's seconds, "cpu_per_round_s": all processes' CPU a round, ...}``."""
    keys = {f"{a}-{b}": os.urandom(16).hex() for a in range(replicas) for b in range(replicas) if a != b}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH", "")]))}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.allreduce_procs", str(r), str(replicas), str(n_elems),
                               str(rounds), json.dumps(keys)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env) for r in range(replicas)]
    try:
        assert all(p.stdin is not None and p.stdout is not None for p in procs)
        ports = [int(p.stdout.readline()) for p in procs]   # type: ignore[union-attr]
        for p in procs:
            p.stdin.write(json.dumps(ports) + "\n")   # type: ignore[union-attr]
            p.stdin.flush()   # type: ignore[union-attr]
        got = [json.loads(p.stdout.readline()) for p in procs]   # type: ignore[union-attr]
        for p in procs:
            p.stdin.write("\n")   # type: ignore[union-attr]
            p.stdin.flush()   # type: ignore[union-attr]
        for p in procs:
            if p.wait(timeout=timeout) != 0:
                raise RuntimeError(f"replica process exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    times = got[0]["times"]
    timed = times[1:] if len(times) > 1 else times
    return {"n_elems": n_elems, "replicas": replicas, "rounds": rounds, "processes": replicas, "t_allreduce_all_s": times,
            "t_allreduce_s": min(timed), "t_allreduce_median_s": statistics.median(timed),
            "cpu_per_round_s": sum(g["cpu_s"] for g in got) / rounds}


if __name__ == "__main__":
    r, n, elems, rnds = (int(a) for a in sys.argv[1:5])
    trio.run(_peer, r, n, elems, rnds, json.loads(sys.argv[5]))
