"""One host's share of benchmarks.wan's compute ceiling: its model's training loop and nothing else.

``python -m benchmarks.wan_ceiling --run RUN.json --start T --seconds S --cpus C --slowdown F`` runs in a
scenario host (its namespace and CPU cgroup, beside its idle ``fusionp2p node``) at the same time as
every other host's: the benchmark's model traced to one stage (:class:`~fusionp2p.graph.StageExecutor`,
as a node trains it), forward and backward of one micro-batch after another with an AdamW step every
``micro_batches``, each slowed the way the node slows its compute (``swarm.device.slowed``: a sleep
to ``slowdown`` times its duration at the host's CPU share). No network, no averaging, no gossip, no
trio. It warms up until the wall-clock time ``T``, counts the micro-batches it completes in the next
``S`` seconds, and prints one JSON line ``{"micro": n, "seconds": s}``: ``n`` completions after the
first one in the window, ``s`` from that first to the last.

Together the hosts' rates bound what any plan of whole-model replicas can train on this machine
while all of them compute at once: the full system's ceiling (benchmarks/wan.py, ``ceiling``). The
tokens are random: the compute of a step does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.wan_client import make_model
from fusionp2p.graph import StageExecutor, single_stage, trace
from fusionp2p.swarm.device import slowed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--run", required=True, help="the benchmark's run.json (model and batch sizes)")
    p.add_argument("--start", type=float, required=True, help="wall-clock time (time.time()) the count starts")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--cpus", type=float, default=None,
                   help="the host's CPU share, the slowdown's reference (none: the wall time, as the node)")
    p.add_argument("--slowdown", type=float, default=1.0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)   # as the testbed's nodes (torch_threads 1)
    run = json.loads(Path(a.run).read_text())["run"]
    model = make_model(run)
    shape = (run["micro_batch"], run["seq_len"])
    x, y = torch.randint(0, 256, shape), torch.randint(0, 256, shape)
    dag = trace(model, example_inputs=(x, y))
    ex = StageExecutor(single_stage(dag))
    feed = dict(zip(dag.data_inputs, (x, y), strict=True))
    opt = torch.optim.AdamW(list(ex.parameters().values()), lr=run["lr"])
    fwd, bwd, step = (slowed(f, a.slowdown, a.cpus) for f in (ex.forward, ex.backward, opt.step))
    m = run["micro_batches"]
    end = a.start + a.seconds
    first: float | None = None   # the first completion in the window; the rate counts those after it
    done, last, i = 0, 0.0, 0
    while time.time() < end:
        fwd(i % m, feed)
        bwd(i % m, {}, loss_scale=1.0 / m)
        i += 1
        if i % m == 0:
            step()
            ex.zero_grad()
        now = time.time()
        if now <= a.start or now >= end:
            continue
        if first is None:
            first = now
        else:
            done, last = done + 1, now
    span = last - first if first is not None and done else 0.0
    print(json.dumps({"micro": done, "seconds": span}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
