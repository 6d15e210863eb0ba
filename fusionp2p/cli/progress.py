"""Live progress of a job in the terminal (rich): plan, states, checkpoints, loss and throughput."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fusionp2p.errors import JobError
from fusionp2p.jobs.events import (
    AveragingOutlier,
    CheckerStruck,
    CheckpointSaved,
    DataLate,
    EvalProgress,
    JobStateChanged,
    LinksUp,
    PlanChanged,
    StageConvicted,
    StepProgress,
    StepSkipped,
)
from fusionp2p.sdk import Job
from fusionp2p.types import short_peer


@dataclass
class Followed:
    """What :func:`follow` saw: per-step losses and throughputs, and the wall time of the run."""

    losses: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    started: float = 0.0      # perf_counter at the RUNNING state
    ended: float = 0.0        # perf_counter at the terminal state
    first_step: float = 0.0   # perf_counter when the first step's progress came
    last_step: float = 0.0    # perf_counter when the last step's progress came

    def summary(self, job: Job) -> Table:
        table = Table(title=f"job {job.id}: {job.state.value}")
        table.add_column("metric")
        table.add_column("value", justify="right")
        k = min(5, len(self.losses))
        if k:
            table.add_row(f"loss, first {k} steps", f"{sum(self.losses[:k]) / k:.3f}")
            table.add_row(f"loss, last {k} steps", f"{sum(self.losses[-k:]) / k:.3f}")
        # the downloaded weights' loss: on the held-out examples when the dataset has them (docs/models.md)
        table.add_row("final eval loss (the download)", f"{job.final_loss:.3f}" if job.final_loss is not None else "-")
        if self.tokens_per_s:
            table.add_row("throughput (median)", f"{sorted(self.tokens_per_s)[len(self.tokens_per_s) // 2]:,.0f} tokens/s")
        if self.ended > self.started > 0:
            table.add_row("training wall time", f"{self.ended - self.started:.1f} s")
        return table


def follow(job: Job, console: Console, *, timeout: float = 900.0, seen: Followed | None = None) -> Followed:
    """Show a job's progress live until it ends (TimeoutError after *timeout* s without an event); what it saw
    goes into *seen* (a new :class:`Followed` by default)."""
    seen = seen if seen is not None else Followed()
    steps = job.spec.config.steps
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("training", total=steps, info="")
        for ev in job.events(timeout=timeout):
            if isinstance(ev, PlanChanged):
                bar.console.print(f"plan {ev.plan_hash[:8]}: {len(ev.stage_sizes)} stages, replicas per stage "
                                  f"{ev.stage_sizes} on {len(set(ev.members))} nodes"
                                  + (f" ({ev.how}; predicted {ev.step_s:.3g} s per step from the nodes' start-up "
                                     "benchmarks, nodes of one host sharing its cores: docs/planning.md)"
                                     if ev.how else ""))
                if ev.idle:
                    bar.console.print(f"idle: {', '.join(short_peer(p) for p in ev.idle)} ({ev.idle_why})")
                if ev.rho:
                    bar.console.print(ev.describe())
            elif isinstance(ev, LinksUp):
                slow = sorted(short_peer(p) for p, path in ev.paths().items() if path == "libp2p")
                relayed = sorted(short_peer(p) for p, path in ev.paths().items() if path == "relay")
                if slow:   # only news: direct links are the normal case
                    bar.console.print(f"stage {ev.stage} on {short_peer(ev.peer)}: tensors to {', '.join(slow)} go over the "
                                      "libp2p connection (their data ports are unreachable; slower, see docs/networking.md)")
                if relayed:
                    bar.console.print(f"stage {ev.stage} on {short_peer(ev.peer)}: tensors to {', '.join(relayed)} go over the "
                                      "libp2p connection through a relay (both sides behind NATs; slowest, see "
                                      "docs/networking.md)")
            elif isinstance(ev, JobStateChanged):
                bar.console.print(f"job {ev.state}" + (f": {ev.reason}" if ev.reason and ev.state != "planned" else ""))
                if ev.state == "running":
                    seen.started = time.perf_counter()
                elif ev.state in ("done", "failed", "cancelled"):
                    seen.ended = time.perf_counter()
            elif isinstance(ev, CheckpointSaved):
                bar.update(task, info=f"checkpoint step {ev.step} stage {ev.stage}")
            elif isinstance(ev, StepSkipped):
                bar.console.print(f"warning: {ev.reason}")
            elif isinstance(ev, DataLate):
                bar.console.print(f"warning: step {ev.step} waits {ev.waited_s:.1f} s for data shard {ev.shard}")
            elif isinstance(ev, AveragingOutlier | StageConvicted | CheckerStruck):
                bar.console.print(f"warning: {ev}")
            elif isinstance(ev, EvalProgress):
                final = " (final, mean over the pipelines)" if not ev.peer else ""
                bar.console.print(f"held-out loss after step {ev.step}: {ev.loss:.4f}{final}")
            elif isinstance(ev, StepProgress) and ev.loss is not None and ev.step < steps:
                seen.losses.append(ev.loss)
                seen.tokens_per_s.append(ev.tokens_per_s)
                seen.last_step = time.perf_counter()
                seen.first_step = seen.first_step or seen.last_step
                bar.update(task, completed=ev.step + 1, info=f"loss {ev.loss:.3f}  {ev.tokens_per_s:,.0f} tok/s")
    return seen


def follow_and_download(job: Job, console: Console, out: Path, *, on_interrupt: Callable[[], int],
                        metrics: bool = False, seen: Followed | None = None) -> int:
    """Show *job* live to its end, download the model to *out* and print the summary: 0 when DONE, 1 when
    it failed, ``on_interrupt()`` after Ctrl-C. What the display saw goes into *seen* when given."""
    try:
        seen = follow(job, console, seen=seen)
    except KeyboardInterrupt:
        return on_interrupt()
    try:
        job.wait(timeout=10)
    except JobError as exc:
        console.print(f"[red]job failed[/]: {exc}")
        return 1
    path = job.download(out)
    table = seen.summary(job)
    table.add_row("model", str(path))
    if metrics:
        table.add_row("metrics", str(job.home / "metrics.jsonl"))
    console.print(table)
    return 0


__all__ = ["Followed", "follow", "follow_and_download"]
