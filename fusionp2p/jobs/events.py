"""Progress events of a job (gossiped to the SDK, shown by the CLI) and the JSON-lines metrics log.

Events are small frozen dataclasses. ``encode_event``/``decode_event`` put them on the jobs gossip
topic as one msgpack map with a ``"type"`` key, bounded by ``Limits.max_gossip``; anything else a
peer sends raises :class:`RemoteProtocolError`. :class:`MetricsWriter` appends the same maps as JSON
lines (one flush per line, so a crash loses at most the line being written) for plotting and for
the benchmark reports.

Times (``at``) are injected by the caller (wall clock in seconds), never read here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar

from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.wire.limits import DEFAULT_LIMITS
from fusionp2p.wire.msg import expect_map, packb, unpackb

# Field kinds understood by the decoder: validated before a dataclass is built from peer data.
_STR, _INT, _FLOAT, _OPT_FLOAT, _STRS, _INTS = "str", "int", "float", "float?", "strs", "ints"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepProgress:
    """One stage's report for one step. ``loss`` only from the last stage; utilisations in [0, 1]."""

    KIND: ClassVar[str] = "step"
    SCHEMA: ClassVar[dict[str, str]] = {
        "job": _STR, "step": _INT, "epoch": _INT, "stage": _INT, "peer": _STR, "loss": _OPT_FLOAT,
        "tokens_per_s": _FLOAT, "compute_util": _OPT_FLOAT, "link_util": _OPT_FLOAT, "at": _FLOAT,
    }
    job: str
    step: int
    epoch: int = 0
    stage: int = 0
    peer: str = ""
    loss: float | None = None
    tokens_per_s: float = 0.0
    compute_util: float | None = None
    link_util: float | None = None
    at: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanChanged:
    """A new plan was adopted: ``stages[i]`` lists the peers serving stage i (its replicas)."""

    KIND: ClassVar[str] = "plan"
    SCHEMA: ClassVar[dict[str, str]] = {"job": _STR, "epoch": _INT, "plan_hash": _STR, "stage_sizes": _INTS, "members": _STRS, "at": _FLOAT}
    job: str
    epoch: int
    plan_hash: str
    stage_sizes: tuple[int, ...] = ()   # replicas per stage
    members: tuple[str, ...] = ()       # peers in stage order, replicas adjacent
    at: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class LinksUp:
    """A member's data-plane links of an epoch are up: ``links[i]`` is ``"<peer id>=<path>"``, the path
    ``direct`` (TCP to the peer's data port) or ``libp2p`` (the fallback stream on the libp2p connection,
    slower; docs/networking.md)."""

    KIND: ClassVar[str] = "links"
    SCHEMA: ClassVar[dict[str, str]] = {"job": _STR, "epoch": _INT, "stage": _INT, "peer": _STR, "links": _STRS,
                                        "at": _FLOAT}
    job: str
    epoch: int
    stage: int
    peer: str = ""
    links: tuple[str, ...] = ()
    at: float = 0.0

    def paths(self) -> dict[str, str]:
        """peer id -> path."""
        return dict(x.split("=", 1) for x in self.links if "=" in x)


@dataclass(frozen=True, kw_only=True, slots=True)
class MembersChanged:
    KIND: ClassVar[str] = "members"
    SCHEMA: ClassVar[dict[str, str]] = {"job": _STR, "epoch": _INT, "joined": _STRS, "left": _STRS, "at": _FLOAT}
    job: str
    epoch: int
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    at: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class JobStateChanged:
    KIND: ClassVar[str] = "state"
    SCHEMA: ClassVar[dict[str, str]] = {"job": _STR, "state": _STR, "reason": _STR, "at": _FLOAT}
    job: str
    state: str          # a fusionp2p.jobs.lifecycle.JobState value
    reason: str = ""
    at: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSaved:
    KIND: ClassVar[str] = "checkpoint"
    SCHEMA: ClassVar[dict[str, str]] = {"job": _STR, "step": _INT, "stage": _INT, "peer": _STR, "at": _FLOAT,
                                         "hash": _STR, "start": _INT, "end": _INT}
    job: str
    step: int
    stage: int
    peer: str = ""          # a node that holds it (the saver, or a keeper that copied it)
    at: float = 0.0
    hash: str = ""          # content hash of the stage file (fetch it by hash from any holder)
    start: int = -1         # the coarse units the stage file covers: [start, end)
    end: int = -1


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSkipped:
    """A stage skipped its optimizer step (non-finite gradients: a diverging job, or a peer's NaN)."""

    KIND: ClassVar[str] = "skipped"
    SCHEMA: ClassVar[dict[str, str]] = {"job": _STR, "step": _INT, "stage": _INT, "peer": _STR, "reason": _STR,
                                        "at": _FLOAT}
    job: str
    step: int
    stage: int
    peer: str = ""
    reason: str = ""
    at: float = 0.0


ProgressEvent = StepProgress | PlanChanged | MembersChanged | JobStateChanged | CheckpointSaved | StepSkipped | LinksUp
EVENT_TYPES: dict[str, type[ProgressEvent]] = {
    c.KIND: c for c in (StepProgress, PlanChanged, MembersChanged, JobStateChanged, CheckpointSaved, StepSkipped,
                        LinksUp)}
_MAX_LIST = 4096


def event_to_dict(ev: ProgressEvent) -> dict[str, Any]:
    """``{"type": kind, **fields}`` with tuples as lists (msgpack- and JSON-ready)."""
    out: dict[str, Any] = {"type": ev.KIND}
    for f in dataclasses.fields(ev):
        v = getattr(ev, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def _check(kind: str, name: str, v: Any) -> Any:
    ok: bool
    if kind == _STR:
        ok = isinstance(v, str) and len(v) <= 1024
    elif kind == _INT:
        ok = isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
    elif kind in (_FLOAT, _OPT_FLOAT):
        if v is None and kind == _OPT_FLOAT:
            return None
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        if ok:
            v = float(v)
            ok = not math.isnan(v) or name == "loss"  # a diverged loss is news, not an attack
    elif kind == _STRS:
        ok = isinstance(v, list) and len(v) <= _MAX_LIST and all(isinstance(s, str) and len(s) <= 256 for s in v)
        v = tuple(v) if ok else v
    else:  # _INTS
        ok = isinstance(v, list) and len(v) <= _MAX_LIST and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
        v = tuple(v) if ok else v
    if not ok:
        raise RemoteProtocolError(f"progress event: field {name!r} is not a valid {kind}")
    return v


def event_from_dict(m: Any) -> ProgressEvent:
    """Rebuild an event from a peer's map; RemoteProtocolError for anything unexpected."""
    m = expect_map(m, "progress event")
    cls = EVENT_TYPES.get(m.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise RemoteProtocolError(f"progress event: unknown type {m.get('type')!r}")
    extra = set(m) - set(cls.SCHEMA) - {"type"}
    if extra:
        raise RemoteProtocolError(f"progress event: unknown fields {sorted(extra)}")
    kwargs = {name: _check(kind, name, m[name]) for name, kind in cls.SCHEMA.items() if name in m}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise RemoteProtocolError(f"progress event: {exc}") from None


def encode_event(ev: ProgressEvent) -> bytes:
    return packb(event_to_dict(ev))


def decode_event(data: bytes | bytearray | memoryview) -> ProgressEvent:
    return event_from_dict(unpackb(data, max_size=DEFAULT_LIMITS.max_gossip))


class MetricsWriter:
    """Append events (or plain maps) to a JSON-lines file: ``with MetricsWriter(path) as w: w.write(ev)``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f: IO[str] | None = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot write metrics to {self.path}: {exc.strerror}; choose a writable path") from None

    def write(self, ev: ProgressEvent | dict[str, Any]) -> None:
        if self._f is None:
            raise ValueError("MetricsWriter is closed")
        d = event_to_dict(ev) if not isinstance(ev, dict) else ev
        # allow_nan: a NaN loss is written as NaN (Python's json reads it back) rather than dropped.
        self._f.write(json.dumps(d, sort_keys=True, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete line of a metrics file (a torn last line from a crash is skipped)."""
    out: list[dict[str, Any]] = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            out.append(json.loads(line))
    return out
