"""``fusionp2p job …``: submit a job to a running swarm from the shell, list, follow, download, cancel.

A job belongs to the swarm once it runs: it goes on when the submitting process ends (Ctrl-C detaches),
and any machine holding the publisher's key (``--key``; by default the client home's ``identity.key``,
created on the first submit) can list, attach, download or cancel it. ``job status`` needs no key: the
job's status record is public and signed by its members.
"""

from __future__ import annotations

import json
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from fusionp2p.errors import ConfigError, JobError
from fusionp2p.net.identity import Identity
from fusionp2p.sdk import Job, Swarm


def _job_from_file(path: str) -> dict[str, Any]:
    """``make_job()`` of a user's Python file: a dict with model, dataset, config and optionally loss."""
    import runpy

    if not Path(path).is_file():
        raise ConfigError(f"job file {path} not found; write one defining make_job() (docs/jobs.md), "
                          "or try --builtin gpt2-tiny")
    ns = runpy.run_path(path)     # the user's own file, run locally (never anything from a peer)
    make = ns.get("make_job")
    if not callable(make):
        raise ConfigError(f"{path} defines no make_job() returning dict(model=..., dataset=..., config=...)")
    spec = make()
    if not isinstance(spec, dict) or not {"model", "dataset", "config"} <= set(spec):
        raise ConfigError(f"make_job() in {path} must return a dict with model, dataset and config")
    return spec


def _identity(args: Any) -> Identity:
    if args.key:
        return Identity.load(args.key)
    return Identity.load_or_create(args.home)


def _connect(args: Any, home: Path) -> Swarm:
    return Swarm.connect(list(args.bootstrap), identity=_identity(args), home=home, listen="/ip4/0.0.0.0/tcp/0")


def cli_job(args: Any) -> int:
    """Dispatch ``fusionp2p job SUBCOMMAND``; 0 on success (a DONE job), 1 when the job failed."""
    import torch
    from rich.console import Console

    torch.set_num_threads(1)
    console = Console()
    cmd = args.job_cmd
    if cmd == "submit":
        return _submit(args, console)
    if cmd == "list":
        return _list(args, console)
    if cmd == "status":
        return _status(args, console)
    if cmd in ("attach", "download"):
        return _attach(args, console, follow_live=cmd == "attach")
    if cmd == "cancel":
        return _cancel(args, console)
    raise ConfigError(f"unknown job command {cmd!r}")


def _submit(args: Any, console: Any) -> int:
    from fusionp2p.cli.demo import SEQ_LEN, demo_config, demo_model
    from fusionp2p.data import BuiltinCorpus

    if args.file and args.builtin:
        raise ConfigError("give either FILE.py or --builtin, not both")
    if args.file:
        spec = _job_from_file(args.file)
    elif args.builtin == "gpt2-tiny":
        spec = {"model": demo_model(), "dataset": BuiltinCorpus(seq_len=SEQ_LEN),
                "config": demo_config(int(args.steps), 4)}
    else:
        raise ConfigError("job submit needs FILE.py or --builtin gpt2-tiny")
    with _connect(args, Path(args.out) / ".fusionp2p") as swarm:
        job = swarm.publish(model=spec["model"], dataset=spec["dataset"], config=spec["config"],
                            loss=spec.get("loss"), name=str(spec.get("name", "")))
        # no member count here: the offer also goes to nodes that have not measured their profile yet (issue 40),
        # which the swarm's view does not count; the plan line below names the nodes that took the job
        console.print(f"published job {job.id} (key {swarm.publisher_id})")
        if args.detach:
            _wait_running(job)
            console.print(f"job {job.id} is running; follow it with: fusionp2p job attach {job.id} "
                          f"--bootstrap {args.bootstrap[0]}")
            return 0
        return _follow_and_download(job, console, Path(args.out))


def _wait_running(job: Job, timeout: float = 600.0) -> None:
    from fusionp2p.jobs.events import JobStateChanged

    for ev in job.events(timeout=timeout):
        if isinstance(ev, JobStateChanged) and ev.state in ("running", "done"):
            return
        if isinstance(ev, JobStateChanged) and ev.state in ("failed", "cancelled"):
            raise JobError(f"job {job.id} {ev.state}: {ev.reason}")


def _follow_and_download(job: Job, console: Any, out: Path) -> int:
    from fusionp2p.cli.progress import follow_and_download

    def detached() -> int:
        console.print(f"[yellow]detached[/]: job {job.id} goes on in the swarm; `fusionp2p job attach {job.id}` "
                      f"follows it again, `fusionp2p job cancel {job.id}` stops it")
        return 130

    return follow_and_download(job, console, out, on_interrupt=detached, metrics=True)


def _list(args: Any, console: Any) -> int:
    from rich.table import Table

    with _connect(args, Path(args.home) / "session") as swarm:
        jobs = swarm.jobs()
    if args.json:
        print(json.dumps(jobs, indent=1, sort_keys=True))
        return 0
    if not jobs:
        console.print(f"no jobs were submitted with this key ({swarm.publisher_id})")
        return 0
    table = Table(title=f"jobs of {swarm.publisher_id[:16]}…")
    for col in ("job", "name", "submitted", "state", "step", "epoch", "members", "final loss"):
        table.add_column(col)
    for j in jobs:
        step = f"{j['step']}/{j['steps']}" if j["step"] is not None else "-"
        table.add_row(j["job"], j["name"] or "-", time.strftime("%Y-%m-%d %H:%M", time.localtime(j["created"])),
                      j["state"], step, str(j["epoch"] if j["epoch"] is not None else "-"), str(j["members"]),
                      f"{j['final_loss']:.3f}" if j["final_loss"] is not None else "-")
    console.print(table)
    return 0


def _status(args: Any, console: Any) -> int:
    with Swarm.connect(list(args.bootstrap), home=Path(args.home) / "session", listen="/ip4/0.0.0.0/tcp/0") as swarm:
        st = swarm.job_status(args.job)
    if st is None:
        raise ConfigError(f"no status of job {args.job} in this swarm (unknown id, or it never started)")
    if args.json:
        d = {k: getattr(st, k) for k in ("job", "publisher", "state", "epoch", "step", "steps", "members",
                                         "stage_sizes", "checkpoint_step", "final_loss", "reason", "at")}
        d["losses"] = [list(x) for x in st.losses[-20:]]
        print(json.dumps(d, indent=1, default=list))
        return 0
    console.print(f"job {st.job}: [bold]{st.state}[/] at step {st.step}/{st.steps}, epoch {st.epoch}, "
                  f"stages {list(st.stage_sizes)} on {len(set(st.members))} nodes")
    if st.losses:
        console.print("recent loss: " + ", ".join(f"{s}: {v:.3f}" for s, v in st.losses[-5:]))
    console.print(f"newest complete checkpoint: step {st.checkpoint_step}" if st.checkpoint_step >= 0 else
                  "no complete checkpoint yet")
    if st.final_loss is not None:
        console.print(f"final eval loss {st.final_loss:.3f}")
    if st.reason:
        console.print(f"reason: {st.reason}")
    return 0


def _attach(args: Any, console: Any, *, follow_live: bool) -> int:
    out = Path(args.out)
    with _connect(args, out / ".fusionp2p") as swarm:
        job = swarm.job(args.job)
        if follow_live:
            return _follow_and_download(job, console, out)
        try:
            job.wait(timeout=None)
        except JobError as exc:
            console.print(f"[red]{exc}[/]")
            return 1
        path = job.download(out)
        console.print(f"job {job.id}: model saved to {path}")
    return 0


def _cancel(args: Any, console: Any) -> int:
    with _connect(args, Path(args.home) / "session") as swarm:
        job = swarm.job(args.job)
        job.cancel()
        with suppress(JobError, TimeoutError):
            job.wait(timeout=30)
        console.print(f"job {job.id}: cancel sent to its members ({job.state.value})")
    return 0


__all__ = ["cli_job"]
