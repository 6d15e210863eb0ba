"""``fusionp2p demo`` (``make demo``): a real swarm on loopback trains the GPT-2 reference, live.

What it does, in order:

1. starts a bootstrap and ``nodes`` ``fusionp2p node`` processes on 127.0.0.1 (tracked by PID,
   terminated on exit and on Ctrl-C; :class:`~fusionp2p.cli.cluster.LocalCluster`);
2. connects to it with ``Swarm.connect`` (a libp2p client in a background thread) and waits, with a
   deadline, until the bootstrap's view lists every node;
3. publishes a small GPT-2 on the built-in byte-level pydoc corpus: at most ``nodes // 2`` replicas
   per stage, CO2 averaging between replicas, AdaTopK on links the plan finds slow (prints the plan:
   stages, replicas, and per fence the link and the kept ratio); the nodes verify the signed
   job, fetch the model and weights by hash from this process, elect the plan over gossip, and train
   over the encrypted data plane;
4. shows live progress (rich), then the loss at the start and the end and the throughput, downloads
   the stage checkpoints by hash, saves ``<out>/model.safetensors``, and shuts the swarm down.

``embedded=True`` runs the same job on ``Swarm.local`` (one process, in-memory transport) instead;
``wan="16mbit"`` (``fusionp2p demo --wan 16mbit``) runs it there on two emulated sites joined by links
of that rate (``Swarm.local(links=sites(...))``): the nodes measure them, and the plan printed at the
start shows its fences, the link each crosses, and the AdaTopK ratio chosen for it (with two nodes per
site each site holds a pipeline and no fence crosses; with ``--nodes 2`` the one fence crosses and is
compressed).
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console

from fusionp2p.cli.progress import follow_and_download
from fusionp2p.data import BuiltinCorpus
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.sdk import Swarm, sites
from fusionp2p.train.config import TrainConfig

log = logging.getLogger(__name__)

SEQ_LEN = 64


def demo_model() -> GPT2:
    """The demo's GPT-2: 4 layers, 128 wide, byte vocabulary (~0.8M parameters)."""
    torch.manual_seed(0)
    return GPT2(GPT2Config.tiny(block_size=SEQ_LEN, n_layer=4, n_head=4, n_embd=128))


def demo_config(steps: int, nodes: int) -> TrainConfig:
    return TrainConfig(steps=steps, micro_batch=8, micro_batches=4, lr=2e-3, lr_schedule="cosine",
                       replicas=max(1, nodes // 2), averaging="co2", compression="adatopk",
                       checkpoint_every=max(1, steps // 2), seed=0)


def _train(swarm: Swarm, steps: int, nodes: int, out: Path, console: Console) -> int:
    job = swarm.publish(model=demo_model(), dataset=BuiltinCorpus(seq_len=SEQ_LEN), config=demo_config(steps, nodes),
                        name="demo")
    def interrupted() -> int:
        console.print("[yellow]interrupted: cancelling the job[/]")   # the demo's swarm stops with it
        job.cancel()
        raise KeyboardInterrupt

    return follow_and_download(job, console, out, on_interrupt=interrupted)


def run_demo(nodes: int = 4, steps: int = 60, out: Path = Path("out/demo"), *, embedded: bool = False,
             home: Path | None = None, wan: str | None = None) -> int:
    """Run the demo; 0 on success. *wan*: emulate two sites joined by links of that rate (embedded)."""
    from fusionp2p.cli.cluster import LocalCluster, wait_until

    console = Console()
    torch.set_num_threads(1)
    console.print(f"[bold]fusionp2p demo[/]: {nodes} nodes, GPT-2 ({demo_model().num_params():,} params), "
                  f"{steps} steps on the built-in pydoc corpus")
    t0 = time.perf_counter()
    if wan is not None:
        half = nodes // 2
        console.print(f"two emulated sites of {half} and {nodes - half} nodes joined by {wan} links; "
                      "the nodes measure them before the job is planned")
        with Swarm.local(n_nodes=nodes, links=sites([half, nodes - half], between=wan)) as swarm:
            rc = _train(swarm, steps, nodes, out, console)
    elif embedded:
        with Swarm.local(n_nodes=nodes) as swarm:
            rc = _train(swarm, steps, nodes, out, console)
    else:
        root = home or Path(tempfile.mkdtemp(prefix="fusionp2p-demo-"))
        with LocalCluster(nodes, root) as cluster:
            console.print(f"bootstrap {cluster.bootstrap}\n{nodes} node processes, logs in {root}")
            with Swarm.connect([cluster.bootstrap], home=root / "client", listen="/ip4/127.0.0.1/tcp/0") as swarm:
                wait_until(lambda: len(swarm.members()) >= nodes, timeout=120, interval=0.5,
                           what=f"{nodes} nodes in the swarm")
                console.print(f"swarm ready after {time.perf_counter() - t0:.1f} s: {nodes} members")
                rc = _train(swarm, steps, nodes, out, console)
        codes = cluster.exit_codes
        console.print("swarm stopped: " + ", ".join(f"{n} exit {c}" for n, c in codes.items()))
        if any(c != 0 for c in codes.values()):
            rc = rc or 1
    console.print(f"total wall time {time.perf_counter() - t0:.1f} s")
    return rc


__all__ = ["SEQ_LEN", "demo_config", "demo_model", "run_demo"]
