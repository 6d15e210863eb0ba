"""One emulated host of the geo-distributed benchmark: ``python -m benchmarks.wan_worker --job J --host H``.

The process lives for the whole run and serves every system in turn (one Python + torch + libp2p
start-up per host instead of one per system). Per system it:

1. waits for ``go-<k>`` in the job's work directory (the harness's barrier: it creates the file once
   every worker has printed ``done <k-1>``, so systems never overlap on the shared CPUs);
2. if the plan gives it a stage replica: opens encrypted data-plane channels to its pipeline
   neighbours and to the other replica of its stage (the lower host index dials; the key agreement
   runs over libp2p, then tensors move over AEAD-sealed TCP between the namespaces);
3. runs :class:`~fusionp2p.train.worker.StageWorker` on the system's stage program and writes
   ``result-<k>-<host>.json``: per-step loss and timings, the final evaluation loss, bytes per channel;
4. prints ``done <k>``.

Heterogeneous compute: ``torch.set_num_threads(1)`` in every worker, and a host's ``slowdown`` factor
makes each forward/backward sleep ``(slowdown - 1)`` times its measured duration, i.e. the device is
that many times slower but leaves the shared cores to the others while it "computes".
Synchronous data parallelism (systems A, B, OPF, OPF+TopK): gradients of the two replicas of a stage
are exchanged and averaged before every optimizer step. CO2 (system 5): the stage worker's outer step
every ``tau`` steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio

from fusionp2p.data import BatchSampler, SamplerConfig, corpus_tokens
from fusionp2p.errors import RemoteProtocolError
from fusionp2p.graph.executor import StageExecutor
from fusionp2p.graph.program import StageProgram
from fusionp2p.net.bulk import BulkChannel, DataPlane, open_data_plane
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, Libp2pTransport, open_libp2p_transport
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.worker import StageContext, StageReport, StageWorker
from fusionp2p.wire.dag import decode_stage

log = logging.getLogger(__name__)


class SlowExecutor(StageExecutor):
    """A StageExecutor on an emulated device ``slowdown`` times slower (sleeps, burns no CPU)."""

    def __init__(self, program: StageProgram, *, slowdown: float) -> None:
        super().__init__(program)
        self.slowdown = slowdown

    def _pace(self, t0: float) -> None:
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - t0))

    def forward(self, micro: int, inputs: Any) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        out = super().forward(micro, inputs)
        self._pace(t0)
        return out

    def backward(self, micro: int, grad_outputs: Any, *, loss_scale: float = 1.0) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        out = super().backward(micro, grad_outputs, loss_scale=loss_scale)
        self._pace(t0)
        return out


async def _wait_go(workdir: Path, k: int) -> None:
    # The harness's barrier is a file: stdin is not ours (the testbed gives processes /dev/null).
    # A file in another process's hands cannot set a trio.Event, so this polls (20 ms).
    while not (workdir / f"go-{k}").exists():  # noqa: ASYNC110
        await trio.sleep(0.02)


async def _channels(dp: DataPlane, tp: Libp2pTransport, me: dict[str, Any], others: list[dict[str, Any]],
                    order: dict[str, int], connected: set[str]) -> dict[str, BulkChannel]:
    """One channel per neighbour host; the host with the lower index dials."""
    out: dict[str, BulkChannel] = {}
    expect = {h["peer"]: h["name"] for h in others if order[h["name"]] < order[me["name"]]}
    for h in others:
        if order[h["name"]] > order[me["name"]]:
            if h["peer"] not in connected:
                await tp.connect(f"/ip4/{h['addr']}/tcp/{h['port']}/p2p/{h['peer']}")
                connected.add(h["peer"])
            out[h["name"]] = await dp.connect(h["peer"])
    while expect:
        ch = await dp.incoming.receive()
        name = expect.pop(ch.remote_peer, None)
        if name is None:
            raise RemoteProtocolError(f"unexpected data-plane channel from {ch.remote_peer}")
        out[name] = ch
    return out


async def run_system(k: int, sysd: dict[str, Any], job: dict[str, Any], me: dict[str, Any], dp: DataPlane,
                     tp: Libp2pTransport, connected: set[str], tokens: np.ndarray[Any, Any],
                     opened: list[BulkChannel]) -> dict[str, Any] | None:
    hosts = {h["name"]: h for h in job["hosts"]}
    order = {h["name"]: i for i, h in enumerate(job["hosts"])}
    role = next(((s, st["replicas"].index(me["name"])) for s, st in enumerate(sysd["stages"])
                 if me["name"] in st["replicas"]), None)
    if role is None:
        return None
    s, r = role
    stages = sysd["stages"]
    workdir = Path(job["workdir"])
    prog = decode_stage((workdir / stages[s]["program"]).read_bytes())
    nbr_stages = sorted({x.src for x in prog.recv if x.src >= 0} | {d for o in prog.send for d in o.dsts})
    link_host = {d: stages[d]["replicas"][r] for d in nbr_stages}
    peer_hosts = [h for h in stages[s]["replicas"] if h != me["name"]]
    chans = await _channels(dp, tp, me, [hosts[n] for n in sorted({*link_host.values(), *peer_hosts})], order, connected)
    run = job["run"]
    co2 = sysd["averaging"] == "co2"
    cfg = TrainConfig(steps=job["steps"], micro_batch=run["micro_batch"], micro_batches=run["micro_batches"],
                      optimizer="adamw", lr=run["lr"], schedule="gpipe", seed=run["seed"], lr_schedule="constant",
                      averaging=CO2(tau=run["tau"], outer_lr=run["outer_lr"], outer_momentum=run["outer_momentum"],
                                    sync=True) if co2 else None)
    rho_out: dict[int, float] = {}
    if s + 1 < len(stages):
        rho_out[s + 1] = sysd["rho"][s]
    if s > 0:
        rho_out[-1 - (s - 1)] = sysd["rho"][s - 1]
    sampler = BatchSampler(SamplerConfig(num_tokens=len(tokens), seq_len=run["seq_len"], micro_batch=run["micro_batch"],
                                         micro_batches=run["micro_batches"], seed=run["seed"]))
    names = [x.name for x in prog.recv if x.src < 0]

    def data(step: int, micro: int) -> dict[str, torch.Tensor]:
        x = torch.from_numpy(np.asarray(sampler.inputs(tokens, step, micro)))
        y = torch.from_numpy(np.asarray(sampler.targets(tokens, step, micro)))
        # token ids feed the first stage ("idx"), targets the loss stage ("targets")
        return {n: (y if "target" in n else x) for n in names}

    steps: list[dict[str, Any]] = []
    final: list[float] = []
    t_start = time.time()

    async def report(rep: StageReport) -> None:
        if rep.eval:
            if rep.loss is not None:
                final.append(rep.loss)
            return
        steps.append({"step": rep.step, "loss": rep.loss, "wall_s": rep.wall_s, "compute_s": rep.compute_s,
                      "t_end": time.time()})

    ctx = StageContext(job=f"wan-{k}", executor=SlowExecutor(prog, slowdown=float(me["slowdown"])), config=cfg,
                       replica=r, replicas=len(stages[s]["replicas"]),
                       links={d: chans[h] for d, h in link_host.items()},
                       peers=[chans[h] for h in peer_hosts], data=data,
                       tokens_per_micro=run["micro_batch"] * run["seq_len"], rho_out=rho_out, report=report)
    # replicas all-reduce gradients every step unless the system averages with CO2 (StageWorker does both)
    worker = StageWorker(ctx)
    await worker.run()
    t_end = time.time()
    sent = {h: ch.bytes_sent for h, ch in chans.items()}
    # Closing now would reset a neighbour still in its evaluation pass (its reader would see the
    # connection go); the caller closes these after the harness's next barrier.
    opened.extend(chans.values())
    return {"system": sysd["name"], "host": me["name"], "stage": s, "replica": r, "t_start": t_start, "t_end": t_end,
            "steps": steps, "eval_loss": final[0] if final else None, "bytes_sent": sent,
            "roles": {h: ("replica" if h in peer_hosts else "pipeline") for h in chans}}


async def main_async(job: dict[str, Any], host: str) -> None:
    me = next(h for h in job["hosts"] if h["name"] == host)
    workdir = Path(job["workdir"])
    tokens = corpus_tokens("pydoc")
    completed = False
    ident = Identity(bytes.fromhex(me["seed"]))
    lcfg = Libp2pConfig(listen=(f"/ip4/{me['addr']}/tcp/{me['port']}",), dial_timeout=30.0, stream_timeout=30.0)
    async with open_libp2p_transport(ident, lcfg) as tp, open_data_plane(
            tp, listen_host=me["addr"], dead_after=60.0, keepalive=1.0, connect_timeout=60.0, ticket_ttl=60.0) as dp:
        print("up", flush=True)
        connected: set[str] = set()
        opened: list[BulkChannel] = []
        for k, sysd in enumerate(job["systems"]):
            await _wait_go(workdir, k)
            for ch in opened:   # every worker finished system k-1: its channels can go
                await ch.aclose()
            opened.clear()
            try:
                res = await run_system(k, sysd, job, me, dp, tp, connected, tokens, opened)
            except BaseException:
                # the transports' context managers may swallow what unwinds through them: log it here
                log.exception("system %s failed on %s", sysd["name"], host)
                print(f"failed {k}", flush=True)
                raise
            if res is not None:
                (workdir / f"result-{k}-{host}.json").write_text(json.dumps(res))
            print(f"done {k}", flush=True)
        await _wait_go(workdir, len(job["systems"]))   # a neighbour may still be evaluating: wait for all
        completed = True
    if not completed:
        raise SystemExit(f"{host}: the transport closed before every system ran")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wan_worker", description=__doc__.split("\n")[0])
    p.add_argument("--job", type=Path, required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU (sched_setaffinity)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    if a.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {a.cpu % (os.cpu_count() or 1)})
    job = json.loads(a.job.read_text())
    trio.run(main_async, job, a.host)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

