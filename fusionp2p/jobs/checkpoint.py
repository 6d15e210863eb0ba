"""Per-stage safetensors checkpoints, their assembly into one model, and resume. Never pickle.

Layout under a checkpoint root (one per node; the publisher collects stage files into its own)::

    <root>/<job>/step-00000120/stage-000.safetensors
    <root>/<job>/step-00000120/stage-001.safetensors

A stage file holds the stage's parameters under their OP-DAG names, optionally its optimizer state
under ``__optim__::<param>::<key>``, and string metadata: format, job, stage, num_stages, step,
plan_hash (and the optimizer's param groups as JSON). Files are written to a temporary name and
renamed, so a crash never leaves a half-written file under the final name.

A step is *complete* when every stage ``0..num_stages-1`` has a file for it, all agreeing on
num_stages and plan_hash. :func:`latest_complete_step` picks the newest complete step, which is
where a job resumes after every node restarted; :func:`assemble` merges the parameter tensors of
one complete step into a single ``state_dict`` keyed by DAG parameter names.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from fusionp2p.errors import JobError

log = logging.getLogger(__name__)

FORMAT = "fusionp2p-stage/1"
OPTIM_PREFIX = "__optim__::"
_STEP_DIR = re.compile(r"step-(\d{8})")
_STAGE_FILE = re.compile(r"stage-(\d{3})\.safetensors")


class CheckpointError(JobError):
    """A checkpoint is missing, incomplete, inconsistent or unreadable; the message says which."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCheckpointMeta:
    job: str
    stage: int
    num_stages: int
    step: int
    plan_hash: str

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", self.job):
            raise CheckpointError(f"job id {self.job!r} cannot name a checkpoint directory")
        if not (0 <= self.stage < self.num_stages <= 999) or not 0 <= self.step < 10**8:
            raise CheckpointError(f"bad checkpoint coordinates: stage {self.stage}/{self.num_stages}, step {self.step}")

    def to_metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT, "job": self.job, "stage": str(self.stage), "num_stages": str(self.num_stages),
            "step": str(self.step), "plan_hash": self.plan_hash,
        }

    @classmethod
    def from_metadata(cls, md: Mapping[str, str] | None, where: str) -> StageCheckpointMeta:
        if not md or md.get("format") != FORMAT:
            raise CheckpointError(f"{where} is not a fusionp2p stage checkpoint")
        try:
            return cls(job=md["job"], stage=int(md["stage"]), num_stages=int(md["num_stages"]),
                       step=int(md["step"]), plan_hash=md["plan_hash"])
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"{where} has bad metadata: {exc}") from None


def stage_path(root: str | os.PathLike[str], job: str, step: int, stage: int) -> Path:
    return Path(root) / job / f"step-{step:08d}" / f"stage-{stage:03d}.safetensors"


def _cpu_unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors; copies those sharing storage (tied weights), which safetensors refuses."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        c = t.detach().to("cpu").contiguous()
        ptr = c.untyped_storage().data_ptr()
        if ptr in seen and c.numel():
            c = c.clone()
        seen.add(c.untyped_storage().data_ptr())
        out[name] = c
    return out


def save_stage(
    root: str | os.PathLike[str],
    meta: StageCheckpointMeta,
    params: Mapping[str, torch.Tensor],
    *,
    optimizer: Mapping[str, torch.Tensor] | None = None,
    optimizer_groups: str = "",
) -> Path:
    """Write one stage's checkpoint atomically; returns its path.

    *params* maps DAG parameter names to tensors; *optimizer* / *optimizer_groups* come from
    :func:`optimizer_tensors`.
    """
    if any(k.startswith(OPTIM_PREFIX) for k in params):
        raise CheckpointError(f"parameter names must not start with {OPTIM_PREFIX!r}")
    tensors = dict(params)
    for k, v in (optimizer or {}).items():
        tensors[OPTIM_PREFIX + k] = v
    md = meta.to_metadata()
    if optimizer_groups:
        md["optim_groups"] = optimizer_groups
    path = stage_path(root, meta.job, meta.step, meta.stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(_cpu_unshared(tensors), str(tmp), metadata=md)
    os.replace(tmp, path)
    log.debug("saved %s (%d tensors)", path, len(tensors))
    return path


@dataclass(frozen=True, slots=True)
class StageCheckpoint:
    meta: StageCheckpointMeta
    params: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    optimizer_groups: str


def read_meta(path: str | os.PathLike[str]) -> StageCheckpointMeta:
    """Only the metadata (reads the header, not the tensors)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata()
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    return StageCheckpointMeta.from_metadata(md, str(path))


def load_stage(path: str | os.PathLike[str]) -> StageCheckpoint:
    try:
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    meta = StageCheckpointMeta.from_metadata(md, str(path))
    params = {k: v for k, v in tensors.items() if not k.startswith(OPTIM_PREFIX)}
    optim = {k[len(OPTIM_PREFIX):]: v for k, v in tensors.items() if k.startswith(OPTIM_PREFIX)}
    return StageCheckpoint(meta, params, optim, md.get("optim_groups", ""))


def list_steps(root: str | os.PathLike[str], job: str) -> dict[int, dict[int, Path]]:
    """``{step: {stage: path}}`` of the stage files present for *job* (unchecked)."""
    out: dict[int, dict[int, Path]] = {}
    base = Path(root) / job
    if not base.is_dir():
        return out
    for d in base.iterdir():
        m = _STEP_DIR.fullmatch(d.name)
        if not m or not d.is_dir():
            continue
        for f in d.iterdir():
            fm = _STAGE_FILE.fullmatch(f.name)
            if fm:
                out.setdefault(int(m.group(1)), {})[int(fm.group(1))] = f
    return out


def _complete(job: str, step: int, files: Mapping[int, Path]) -> list[Path] | None:
    """The stage files of *step* in stage order if they form a complete, consistent set."""
    try:
        metas = {s: read_meta(p) for s, p in files.items()}
    except CheckpointError as exc:
        log.warning("skipping step %d of job %s: %s", step, job, exc)
        return None
    if not metas:
        return None
    first = next(iter(metas.values()))
    n, plan = first.num_stages, first.plan_hash
    for s, md in metas.items():
        if (md.job, md.step, md.stage, md.num_stages, md.plan_hash) != (job, step, s, n, plan):
            return None
    if set(metas) != set(range(n)):
        return None
    return [files[s] for s in range(n)]


def latest_complete_step(root: str | os.PathLike[str], job: str) -> int | None:
    """The newest step whose stage files are all present and agree (where to resume), or None."""
    steps = list_steps(root, job)
    for step in sorted(steps, reverse=True):
        if _complete(job, step, steps[step]) is not None:
            return step
    return None


def assemble(root: str | os.PathLike[str], job: str, step: int | None = None) -> dict[str, torch.Tensor]:
    """One ``state_dict`` from the stage files of *step* (default: the latest complete step)."""
    if step is None:
        step = latest_complete_step(root, job)
        if step is None:
            raise CheckpointError(f"no complete checkpoint of job {job} under {root}; wait for the next save or resume")
    files = _complete(job, step, list_steps(root, job).get(step, {}))
    if files is None:
        raise CheckpointError(f"step {step} of job {job} is incomplete under {root}: a stage file is missing or differs")
    merged: dict[str, torch.Tensor] = {}
    for path in files:
        for name, t in load_stage(path).params.items():
            if name in merged:
                raise CheckpointError(f"parameter {name} appears in two stages of step {step}")
            merged[name] = t
    return merged


def save_model(path: str | os.PathLike[str], state_dict: Mapping[str, torch.Tensor], *, metadata: Mapping[str, str] | None = None) -> Path:
    """Write a whole model (e.g. the assembled download) as one safetensors file, atomically.

    Load it back with ``model.load_state_dict(safetensors.torch.load_file(path), strict=False)``;
    tied weights are stored once per name.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    save_file(_cpu_unshared(state_dict), str(tmp), metadata=dict(metadata or {}))
    os.replace(tmp, p)
    return p


# ---- optimizer state, flattened to named tensors ---------------------------------------------------


def optimizer_tensors(opt: torch.optim.Optimizer, names: Mapping[torch.nn.Parameter, str]) -> tuple[dict[str, torch.Tensor], str]:
    """Flatten *opt*'s state to ``{"<param>::<key>": tensor}`` plus its param groups as JSON.

    Keys by parameter *name*, not position, so the state survives a re-plan that changes which
    parameters a stage holds (a stage loads the entries of the parameters it now owns).
    """
    sd = opt.state_dict()
    order = [p for g in opt.param_groups for p in g["params"]]
    out: dict[str, torch.Tensor] = {}
    for idx, st in sd["state"].items():
        pname = names[order[idx]]
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{pname}::{k}"] = v
            elif isinstance(v, int | float) and not isinstance(v, bool):
                out[f"{pname}::{k}"] = torch.tensor(float(v), dtype=torch.float64)
    groups = []
    pos = 0
    for g in sd["param_groups"]:
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({"hyper": hyper, "params": [names[order[pos + i]] for i in range(len(g["params"]))]})
        pos += len(g["params"])
    return out, json.dumps(groups, sort_keys=True)


def load_optimizer_tensors(
    opt: torch.optim.Optimizer, names: Mapping[torch.nn.Parameter, str], tensors: Mapping[str, torch.Tensor], groups: str
) -> None:
    """Restore state saved by :func:`optimizer_tensors` into *opt* (whose params are named by *names*).

    Hyper-parameters come from the saved groups; state entries of parameters *opt* does not hold are
    ignored, and parameters without saved state start fresh.
    """
    order = [p for g in opt.param_groups for p in g["params"]]
    index = {names[p]: i for i, p in enumerate(order)}
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        pname, _, k = key.rpartition("::")
        if pname in index:
            state.setdefault(index[pname], {})[k] = t
    try:
        saved = json.loads(groups) if groups else []
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"optimizer groups are not valid JSON: {exc}") from None
    cur = opt.state_dict()["param_groups"]
    pg: list[dict[str, Any]] = []
    for i, g in enumerate(cur):
        hyper = dict(saved[i]["hyper"]) if i < len(saved) else {k: v for k, v in g.items() if k != "params"}
        if "betas" in hyper and isinstance(hyper["betas"], list):
            hyper["betas"] = tuple(hyper["betas"])
        pg.append({**hyper, "params": g["params"]})
    opt.load_state_dict({"state": state, "param_groups": pg})
