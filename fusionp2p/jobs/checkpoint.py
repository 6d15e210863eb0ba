"""Per-stage safetensors checkpoints, their assembly into one model, and resume. Never pickle.

Layout under a checkpoint root (one per node; the publisher collects stage files into its own)::

    <root>/<job>/step-00000120/stage-000.safetensors
    <root>/<job>/step-00000120/stage-001.safetensors

A stage file holds the stage's parameters under their OP-DAG names, optionally its optimizer state
under ``__optim__::<param>::<key>`` and its slices of CO2's outer momentum under
``__momentum__::<param>@<offset>`` (``train/state.py``), and string metadata: format, job, stage, num_stages, step,
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
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file, save_file

from fusionp2p.errors import JobError, RemoteProtocolError
from fusionp2p.train.state import StageState
from fusionp2p.wire.stfile import Layout, chunks, layout

log = logging.getLogger(__name__)

FORMAT = "fusionp2p-stage/1"
OPTIM_PREFIX = "__optim__::"
MOMENTUM_PREFIX = "__momentum__::"
MAX_STATE_BYTES = 16 << 30     # a stage state a peer hands over (the content fetch bounds it first)
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


def state_layout(meta: StageCheckpointMeta, state: StageState) -> Layout:
    """One stage's whole state as the layout of a stage file (``wire/stfile.py``): its bytes are views of
    the state's own tensors, written out (``ContentService.put_chunks``) without a copy of the state."""
    if any(k.startswith(("__optim__", "__momentum__")) for k in state.tensors):
        raise CheckpointError("parameter names must not start with __optim__ or __momentum__")
    tensors = {k: v.detach().to("cpu") for k, v in state.tensors.items()}
    tensors.update({OPTIM_PREFIX + k: v.detach().to("cpu") for k, v in state.optimizer.items()})
    for name, slices in state.momentum.items():
        for off, vals in slices:
            tensors[f"{MOMENTUM_PREFIX}{name}@{off}"] = vals.detach().to("cpu")
    md = meta.to_metadata()
    if state.optimizer_groups:
        md["optim_groups"] = state.optimizer_groups
    return layout(tensors, md)


def encode_state(meta: StageCheckpointMeta, state: StageState) -> bytes:
    """One stage's whole state as the bytes of a stage file (content-addressed when handed over)."""
    return b"".join(chunks(state_layout(meta, state)))


MAX_HEADER_BYTES = 100 << 20   # safetensors' own bound on a header


class _Reads(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


def read_state_meta(f: _Reads, *, job: str | None = None) -> StageCheckpointMeta:
    """The coordinates of the stage file *f* (of *job*) from its header alone, without loading a tensor (a
    keeper's check of a file it holds for another node); RemoteProtocolError if it is not one."""
    try:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= MAX_HEADER_BYTES:
            raise ValueError(f"header of {n} bytes")
        head = f.read(n)
        if len(head) != n:
            raise ValueError("truncated header")
        header = json.loads(head)
        if not isinstance(header, dict):
            raise ValueError("the header is not a map")
        meta = StageCheckpointMeta.from_metadata(header.get("__metadata__"), "a handed-over stage state")
    except (ValueError, CheckpointError) as exc:
        raise RemoteProtocolError(f"bad stage state: {exc}") from None
    if job is not None and meta.job != job:
        raise RemoteProtocolError(f"stage state of job {meta.job}, not {job}")
    return meta


def decode_state(blob: bytes, *, job: str | None = None) -> tuple[StageCheckpointMeta, StageState]:
    """Parse a stage file's bytes from a peer; RemoteProtocolError if it is not one (of *job*)."""
    if len(blob) > MAX_STATE_BYTES:
        raise RemoteProtocolError(f"stage state of {len(blob)} bytes exceeds {MAX_STATE_BYTES}")
    try:
        tensors = load_bytes(blob)
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8:8 + n])
        meta = StageCheckpointMeta.from_metadata(header.get("__metadata__"), "a handed-over stage state")
    except (SafetensorError, ValueError, OverflowError, CheckpointError) as exc:
        raise RemoteProtocolError(f"bad stage state: {exc}") from None
    if job is not None and meta.job != job:
        raise RemoteProtocolError(f"stage state of job {meta.job}, not {job}")
    params, optim = {}, {}
    momentum: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for k, v in tensors.items():
        if k.startswith(OPTIM_PREFIX):
            optim[k[len(OPTIM_PREFIX):]] = v
        elif k.startswith(MOMENTUM_PREFIX):
            name, _, off = k[len(MOMENTUM_PREFIX):].rpartition("@")
            # ASCII digits only, at most 18 of them: "²".isdigit() is true but int() refuses it, and
            # int() refuses more than 4300 digits; either was a ValueError, not a protocol error
            if not (off.isascii() and off.isdigit() and len(off) <= 18) or v.dim() != 1:
                raise RemoteProtocolError(f"bad momentum entry {k[:100]!r}")
            momentum.setdefault(name, []).append((int(off), v))
        else:
            params[k] = v
    groups = str(header["__metadata__"].get("optim_groups", ""))
    return meta, StageState(step=meta.step, tensors=params, optimizer=optim, optimizer_groups=groups,
                            momentum={k: tuple(v) for k, v in momentum.items()})


def state_from_checkpoint(blob: bytes, job: str) -> tuple[int, int, Mapping[str, torch.Tensor]]:
    """(stage, step, tensors) of a stage file; for tools that read what a job left in the swarm."""
    meta, st = decode_state(blob, job=job)
    return meta.stage, meta.step, st.tensors


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
    params = {k: v for k, v in tensors.items() if not k.startswith((OPTIM_PREFIX, MOMENTUM_PREFIX))}
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


def complete_files(root: str | os.PathLike[str], job: str, step: int) -> list[Path]:
    """The stage files of *step* in stage order; CheckpointError when they are not a complete set."""
    files = _complete(job, step, list_steps(root, job).get(step, {}))
    if files is None:
        raise CheckpointError(f"step {step} of job {job} is incomplete under {root}: a stage file is missing or differs")
    return files


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
            # a buffer read by several stages is copied to each (read-only), and a tied parameter's
            # copies take the same steps: copies must be equal, and the first stands for all
            have = merged.setdefault(name, t)
            if have is not t and not torch.equal(have, t):
                raise CheckpointError(f"{name} appears in two stages of step {step} with different values")
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
