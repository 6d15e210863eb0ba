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
import os
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from fusionp2p.cli.progress import Followed
    from fusionp2p.jobs.build import BuiltJob
    from fusionp2p.models.gpt2 import GPT2
    from fusionp2p.net.identity import Identity
    from fusionp2p.sdk import Job, Swarm
    from fusionp2p.train.config import TrainConfig

# torch, the SDK and the model are imported where they are used, not here: the demo starts its node processes
# first and imports and traces in a thread while they boot (issue 40: before, the demo's own imports and the
# trace, 3-4 and 2-3 CPU-seconds, came before and after the swarm's start instead of beside it)

log = logging.getLogger(__name__)

SEQ_LEN = 64


def demo_model() -> GPT2:
    """The demo's GPT-2: 4 layers, 128 wide, byte vocabulary (~0.8M parameters)."""
    import torch

    from fusionp2p.models.gpt2 import GPT2, GPT2Config

    torch.manual_seed(0)
    return GPT2(GPT2Config.tiny(block_size=SEQ_LEN, n_layer=4, n_head=4, n_embd=128))


def demo_config(steps: int, nodes: int) -> TrainConfig:
    from fusionp2p.train.config import TrainConfig

    return TrainConfig(steps=steps, micro_batch=8, micro_batches=4, lr=2e-3, lr_schedule="cosine",
                       replicas=max(1, nodes // 2), averaging="co2", compression="adatopk",
                       checkpoint_every=max(1, steps // 2), seed=0)


def build_demo_job(steps: int, nodes: int, identity: Identity) -> tuple[BuiltJob, int]:
    """The demo job traced and signed by *identity* (the publisher's key), and the model's parameter count."""
    import torch

    from fusionp2p.data import BuiltinCorpus
    from fusionp2p.jobs.build import build_job

    torch.set_num_threads(1)
    model = demo_model()
    built = build_job(model, None, BuiltinCorpus(seq_len=SEQ_LEN), demo_config(steps, nodes), publisher=identity.peer_id,
                      sign=identity.sign, now=time.time(), nonce=os.urandom(16), name="demo")
    return built, model.num_params()


def _follow(job: Job, out: Path, console: Console) -> tuple[int, Followed]:
    from fusionp2p.cli.progress import Followed, follow_and_download

    def interrupted() -> int:
        console.print("[yellow]interrupted: cancelling the job[/]")   # the demo's swarm stops with it
        job.cancel()
        raise KeyboardInterrupt

    seen = Followed()
    return follow_and_download(job, console, out, on_interrupt=interrupted, seen=seen), seen


def _embedded(swarm: Swarm, steps: int, nodes: int, out: Path, console: Console) -> int:
    from fusionp2p.data import BuiltinCorpus

    job = swarm.publish(model=demo_model(), dataset=BuiltinCorpus(seq_len=SEQ_LEN), config=demo_config(steps, nodes),
                        name="demo")
    return _follow(job, out, console)[0]


def run_demo(nodes: int = 4, steps: int = 60, out: Path = Path("out/demo"), *, embedded: bool = False,
             home: Path | None = None, wan: str | None = None, preload: bool = True) -> int:
    """Run the demo; 0 on success. *wan*: emulate two sites joined by links of that rate (embedded). *preload*:
    fork the node processes from one pre-imported forkserver (False: each is its own ``python -m fusionp2p.cli``)."""
    t0 = time.perf_counter()
    console = Console()
    if wan is not None or embedded:
        import torch

        from fusionp2p.sdk import Swarm, sites

        torch.set_num_threads(1)
        console.print(f"[bold]fusionp2p demo[/]: {nodes} nodes, GPT-2 ({demo_model().num_params():,} params), "
                      f"{steps} steps on the built-in pydoc corpus")
        if wan is not None:
            half = nodes // 2
            console.print(f"two emulated sites of {half} and {nodes - half} nodes joined by {wan} links; "
                          "the nodes measure them before the job is planned")
            with Swarm.local(n_nodes=nodes, links=sites([half, nodes - half], between=wan)) as swarm:
                rc = _embedded(swarm, steps, nodes, out, console)
        else:
            with Swarm.local(n_nodes=nodes) as swarm:
                rc = _embedded(swarm, steps, nodes, out, console)
    else:
        rc = _processes(nodes, steps, out, home, console, t0, preload)
    console.print(f"total wall time {time.perf_counter() - t0:.1f} s")
    return rc


def _processes(nodes: int, steps: int, out: Path, home: Path | None, console: Console, t0: float,
               preload: bool) -> int:
    """The demo on a bootstrap and *nodes* node processes: they are started first, and this process imports
    torch and traces the job in a thread while they boot; it publishes once the bootstrap lists them all. At the
    end, where the wall time went (each phase from this process's clock)."""
    from fusionp2p.cli.cluster import LocalCluster, wait_until
    from fusionp2p.net.identity import Identity

    console.print(f"[bold]fusionp2p demo[/]: {nodes} node processes, GPT-2, {steps} steps on the built-in pydoc corpus")
    if logging.getLogger().level >= logging.WARNING:
        # py-libp2p warns at routine events (a peer that reset a DHT stream once its lookup was answered); the nodes'
        # own logs keep them
        logging.getLogger("libp2p").setLevel(logging.ERROR)
    identity = Identity.generate()   # the publisher's key: the job is signed with it before the client connects
    root = home or Path(tempfile.mkdtemp(prefix="fusionp2p-demo-"))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="demo-build") as pool:
        building: Future[tuple[BuiltJob, int]] = pool.submit(build_demo_job, steps, nodes, identity)
        # the nodes are forked from one forkserver that imported torch, torch._dynamo (each node's first optimizer
        # and first DAG check import it: sympy, mpmath, ~800 modules) and the node's modules once: ~5 CPU-s a node
        # spared on a machine whose cores this process, the bootstrap and the nodes share (cli/forked.py)
        with LocalCluster(nodes, root, preload=preload) as cluster:
            console.print(f"bootstrap {cluster.bootstrap}\n{nodes} node processes, logs in {root}")
            from fusionp2p.sdk import Swarm

            with Swarm.connect([cluster.bootstrap], home=root / "client", listen="/ip4/127.0.0.1/tcp/0",
                               identity=identity) as swarm:
                built, params = building.result()
                traced = time.perf_counter()
                console.print(f"job traced and signed after {traced - t0:.1f} s: GPT-2, {params:,} params")
                wait_until(lambda: len(swarm.members()) >= nodes, timeout=120, interval=0.2,
                           what=f"{nodes} nodes in the swarm")
                ready = time.perf_counter()
                console.print(f"swarm ready after {ready - t0:.1f} s: {nodes} members")
                rc, seen = _follow(swarm.publish_built(built), out, console)
                downloaded = time.perf_counter()
                cpu = cluster.cpu_seconds()
            codes = cluster.exit_codes
        stopped = time.perf_counter()
    console.print("swarm stopped: " + ", ".join(f"{n} exit {c}" for n, c in codes.items()))
    if any(c != 0 for c in codes.values()):
        rc = rc or 1
    marks = [("swarm ready", ready), *(((label, at) for label, at in (
        ("publish -> running", seen.started), ("running -> first step done", seen.first_step),
        (f"the other {max(0, len(seen.losses) - 1)} steps", seen.last_step), ("last step -> job done", seen.ended)) if at > 0)),
        ("downloaded", downloaded), ("swarm stopped", stopped)]
    parts, last = [], t0
    for label, at in marks:
        parts.append(f"{label} {at - last:.1f} s")
        last = at
    console.print("phases: " + ", ".join(parts) + f" (the job was traced beside the start-up, by {traced - t0:.1f} s)")
    if cpu:   # load-independent, unlike the wall times above
        console.print("CPU-s by process, at the end of the job: " + ", ".join(f"{n} {c:.1f}" for n, c in cpu.items())
                      + f"; total {sum(cpu.values()):.1f}")
    return rc


__all__ = ["SEQ_LEN", "build_demo_job", "demo_config", "demo_model", "run_demo"]
