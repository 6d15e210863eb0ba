"""``fusionp2p job …``: publish a job to a running swarm from the shell and follow it."""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path
from typing import Any

import torch

from fusionp2p.errors import ConfigError, JobError
from fusionp2p.sdk import Swarm


def _job_from_file(path: str) -> dict[str, Any]:
    """``make_job()`` of a user's Python file: a dict with model, dataset, config and optionally loss."""
    import runpy

    ns = runpy.run_path(path)     # the user's own file, run locally (never anything from a peer)
    make = ns.get("make_job")
    if not callable(make):
        raise ConfigError(f"{path} defines no make_job() returning dict(model=..., dataset=..., config=...)")
    spec = make()
    if not isinstance(spec, dict) or not {"model", "dataset", "config"} <= set(spec):
        raise ConfigError(f"make_job() in {path} must return a dict with model, dataset and config")
    return spec


def cli_job(args: Any) -> int:
    """``fusionp2p job submit [FILE.py | --builtin gpt2-tiny] --bootstrap ADDR [--steps N] [--out DIR]``.

    Connects to the swarm, publishes the job, shows live progress, downloads the trained model to
    ``--out`` and prints a summary. Ctrl-C cancels the job on every node. Exit 0 when the job is DONE.
    """
    from rich.console import Console

    from fusionp2p.cli.demo import demo_config, demo_model
    from fusionp2p.cli.progress import follow
    from fusionp2p.data import BuiltinCorpus

    if getattr(args, "job_cmd", "submit") != "submit":
        raise ConfigError(f"job {args.job_cmd} is not available yet; see docs/sdk.md")
    console = Console()
    torch.set_num_threads(1)
    if args.file and args.builtin:
        raise ConfigError("give either FILE.py or --builtin, not both")
    if args.file:
        spec = _job_from_file(args.file)
    elif args.builtin == "gpt2-tiny":
        from fusionp2p.cli.demo import SEQ_LEN

        spec = {"model": demo_model(), "dataset": BuiltinCorpus(seq_len=SEQ_LEN),
                "config": demo_config(int(args.steps), 4)}
    else:
        raise ConfigError("job submit needs FILE.py or --builtin gpt2-tiny")
    home = Path(args.out) / ".fusionp2p"
    with Swarm.connect(list(args.bootstrap), home=home, listen="/ip4/0.0.0.0/tcp/0") as swarm:
        job = swarm.publish(model=spec["model"], dataset=spec["dataset"], config=spec["config"],
                            loss=spec.get("loss"), name=str(spec.get("name", "")))
        console.print(f"published job {job.id} to {len(swarm.members())} nodes")
        try:
            seen = follow(job, console)
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: cancelling the job[/]")
            job.cancel()
            with suppress(JobError, TimeoutError):
                job.wait(timeout=20)
            return 130
        try:
            job.wait(timeout=10)
        except JobError as exc:
            console.print(f"[red]{exc}[/]")
            return 1
        path = job.download(args.out)
        table = seen.summary(job)
        table.add_row("model", str(path))
        table.add_row("metrics", str(job.home / "metrics.jsonl"))
        console.print(table)
    return 0


__all__ = ["cli_job"]
