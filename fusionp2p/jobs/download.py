"""The trained model on disk, stage by stage: a sharded safetensors checkpoint (issue 37).

A model larger than any node is also larger than a publisher wants to hold twice. :func:`write_download`
reads the job's stage files of one complete step one at a time (their parameters and buffers only, not
the optimizer state) and writes each stage's tensors under the module's ``state_dict`` names as one
shard, ``model-00001-of-0000N.safetensors``, plus ``model.safetensors.index.json`` mapping every name to
its shard: the Hugging Face layout, which ``transformers``' ``from_pretrained`` and :func:`load_download`
read. A model under ``single_file_bytes`` is written as one ``model.safetensors`` instead, as before.

A tensor several stages hold (a tied weight, a shared buffer) is written once, in the first shard; its
other copies are checked equal to it by digest, so nothing of another shard is held in memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open

from fusionp2p.graph import OpDAG
from fusionp2p.jobs.checkpoint import (
    MOMENTUM_PREFIX,
    OPTIM_PREFIX,
    CheckpointError,
    assemble,
    complete_files,
    latest_complete_step,
    save_model,
)

SINGLE_FILE_BYTES = 2 << 30       # a model up to this is one model.safetensors
INDEX = "model.safetensors.index.json"
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    raw = t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t.reshape(-1).to(torch.uint8)
    return f"{t.dtype}{tuple(t.shape)}" + hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _state_names(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return [k for k in f.keys() if not k.startswith((OPTIM_PREFIX, MOMENTUM_PREFIX))]   # noqa: SIM118


def _bytes_of(path: Path) -> int:
    with safe_open(str(path), framework="pt") as f:
        total = 0
        for k in f.keys():   # noqa: SIM118
            if not k.startswith((OPTIM_PREFIX, MOMENTUM_PREFIX)):
                sl = f.get_slice(k)
                total += math.prod(sl.get_shape()) * _ITEMSIZE.get(sl.get_dtype(), 8)
        return total


def write_download(directory: str | os.PathLike[str], root: str | os.PathLike[str], job: str, dag: OpDAG, *,
                   step: int | None = None, single_file_bytes: int = SINGLE_FILE_BYTES) -> Path:
    """Write step *step*'s model (default: the latest complete step) under *directory*; return the path
    to load: ``model.safetensors``, or the index of the shards (see the module docstring)."""
    if step is None:
        step = latest_complete_step(root, job)
        if step is None:
            raise CheckpointError(f"no complete checkpoint of job {job} under {root}; wait for the next save or resume")
    files = complete_files(root, job, step)
    out = Path(directory)
    total = sum(_bytes_of(p) for p in files)
    if total <= single_file_bytes:
        from fusionp2p.jobs.build import module_state  # build imports the tracer: load it only here

        return save_model(out / "model.safetensors", module_state(dag, assemble(root, job, step)))
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    seen: dict[str, str] = {}   # DAG name -> digest of the copy written
    n = len(files)
    held = {name for p in files for name in _state_names(p)}
    # a module tensor no stage file holds (none, normally) comes from the published DAG, in the last shard
    extra = {name: t for name, t in dag.tensors.items()
             if name not in held and name in dag.module_names and t.device.type != "meta"}
    lost = sorted(name for name in dag.module_names if name not in held and name not in extra)
    if lost:
        raise CheckpointError(f"step {step} of job {job}: no stage file holds {lost[:5]}")
    size = 0
    for k, path in enumerate(files):
        shard: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for name in _state_names(path):
                t = f.get_tensor(name)
                if name in seen:
                    if _digest(t) != seen[name]:
                        raise CheckpointError(f"{name} appears in two stages of step {step} with different values")
                    continue
                targets = dag.module_names.get(name, ())
                if targets:
                    seen[name] = _digest(t)
                for target in targets:
                    shard[target] = t.clone() if len(targets) > 1 else t
        if k == n - 1:
            shard.update({target: t.detach().clone() for name, t in extra.items() for target in dag.module_names[name]})
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_model(out / fname, shard)
        size += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(shard, fname))
        del shard
    index = out / INDEX
    tmp = index.with_name(index.name + ".tmp")
    tmp.write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))},
                              indent=2))
    os.replace(tmp, index)
    return index


def load_download(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A downloaded model's ``state_dict``: from ``model.safetensors``, an index of shards, or a directory
    holding either."""
    p = Path(path)
    if p.is_dir():
        p = p / INDEX if (p / INDEX).is_file() else p / "model.safetensors"
    if p.name.endswith(".index.json"):
        index = json.loads(p.read_text())
        weight_map: Mapping[str, str] = index["weight_map"]
        state: dict[str, torch.Tensor] = {}
        for fname in sorted(set(weight_map.values())):
            state.update(safetensors.torch.load_file(str(p.parent / fname)))
        return state
    return safetensors.torch.load_file(str(p))


__all__ = ["INDEX", "SINGLE_FILE_BYTES", "load_download", "write_download"]
