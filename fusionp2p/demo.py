"""``fusionp2p demo``: train the GPT-2 reference on an embedded swarm and show it.

Starts ``Swarm.local(nodes)`` (all nodes in one process, in-memory transport: see docs/sdk.md for
what is and is not real about it), publishes a small GPT-2 on the built-in byte-level corpus with
2 stages x ``nodes // 2`` replicas, CO2 averaging and AdaTopK, shows live progress (rich), prints
the loss at the start and end and the throughput, and saves the trained model.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fusionp2p.data import BuiltinCorpus
from fusionp2p.errors import JobError
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.runtime.metrics import PlanChanged, StepProgress
from fusionp2p.runtime.trainconfig import TrainConfig
from fusionp2p.sdk import Swarm

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


def run_demo(nodes: int = 4, steps: int = 60, out: Path = Path("out/demo")) -> int:
    """Run the demo; 0 on success."""
    console = Console()
    torch.set_num_threads(1)
    cfg = demo_config(steps, nodes)
    console.print(f"[bold]fusionp2p demo[/]: {nodes} nodes, GPT-2 ({demo_model().num_params():,} params), "
                  f"{steps} steps on the built-in pydoc corpus")
    t0 = time.perf_counter()
    losses: list[float] = []
    tps: list[float] = []
    with Swarm.local(n_nodes=nodes) as swarm:
        job = swarm.publish(model=demo_model(), dataset=BuiltinCorpus(seq_len=SEQ_LEN), config=cfg, name="demo")
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("training", total=steps, info="")
            for ev in job.events():
                if isinstance(ev, PlanChanged):
                    console.print(f"plan {ev.plan_hash[:12]}: stages x replicas = {ev.stage_sizes}")
                elif isinstance(ev, StepProgress) and ev.loss is not None and ev.step < steps:
                    losses.append(ev.loss)
                    tps.append(ev.tokens_per_s)
                    bar.update(task, completed=ev.step + 1, info=f"loss {ev.loss:.3f}  {ev.tokens_per_s:,.0f} tok/s")
        try:
            job.wait(timeout=5)
        except JobError as exc:
            console.print(f"[red]job failed[/]: {exc}")
            return 1
        path = job.download(out)
    wall = time.perf_counter() - t0
    table = Table(title="demo summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    k = min(5, len(losses))
    table.add_row("loss, first steps", f"{sum(losses[:k]) / k:.3f}")
    table.add_row("loss, last steps", f"{sum(losses[-k:]) / k:.3f}")
    table.add_row("final eval loss", f"{job.final_loss:.3f}" if job.final_loss is not None else "-")
    table.add_row("throughput (median)", f"{sorted(tps)[len(tps) // 2]:,.0f} tokens/s")
    table.add_row("wall time", f"{wall:.1f} s")
    table.add_row("model", str(path))
    console.print(table)
    return 0


__all__ = ["demo_config", "demo_model", "run_demo"]
