"""Signed DHT records that let a job outlive its publisher's session.

* ``/fusionp2p/job/<job>/status``: a :class:`JobStatus` signed by the member that leads the job (or
  led it last): state, epoch, members (and the standbys that may lead it on), the step reached, recent
  losses, the newest complete checkpoint and, once the job ended, the final stage files by content
  hash. Anyone reads it (``fusionp2p job status``, ``job attach``, ``job download``); the signer must
  be a member it names.
* ``/fusionp2p/job/<job>/spec``: the publisher-signed job envelope (``jobs/spec.py``), so that a
  machine holding the publisher's key can follow and download a job it did not submit from.
* ``/fusionp2p/publisher/<peer>/jobs``: a :class:`JobIndex` signed by the publisher, the jobs it
  submitted (newest last, at most ``MAX_INDEX``).

Envelope as for swarm records (``wire/records.py``): ``{"v": 1, "t": TYPE, "b": BODY, "s": SIG}``, SIG
the Ed25519 signature of ``TYPE || 0x00 || BODY`` by ``body["peer"]``. Every field is checked before
use; a malformed record raises :class:`RemoteProtocolError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.types import short_peer
from fusionp2p.wire.check import malformed
from fusionp2p.wire.msg import expect_map, packb, unpackb
from fusionp2p.wire.records import Signer, Verifier

VERSION = 1
MAX_STATUS = 256 * 1024
MAX_INDEX = 256
MAX_LOSSES = 512
MAX_MEMBERS = 1024
STATES = ("pending", "planned", "running", "done", "failed", "cancelled")


def status_key(job: str) -> str:
    return f"/fusionp2p/job/{job}/status"


def spec_key(job: str) -> str:
    return f"/fusionp2p/job/{job}/spec"


def index_key(publisher: str) -> str:
    return f"/fusionp2p/publisher/{publisher}/jobs"


@dataclass(frozen=True, slots=True, kw_only=True)
class StageFile:
    """A stage's state file at a step: its content hash and nodes known to hold it."""

    stage: int
    hash: str
    holders: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobStatus:
    job: str
    peer: str                                   # the signer (the job's leader when it wrote this)
    publisher: str
    state: str
    epoch: int
    step: int                                   # steps completed by the whole pipeline
    steps: int                                  # the job's length
    members: tuple[str, ...] = ()               # of the current plan
    stage_sizes: tuple[int, ...] = ()
    losses: tuple[tuple[int, float], ...] = ()  # (step, mean loss), the newest MAX_LOSSES
    checkpoint_step: int = -1                   # newest complete checkpoint, -1: none yet
    checkpoint: tuple[StageFile, ...] = ()
    final: tuple[StageFile, ...] = ()           # the trained model's stage files (state done)
    final_loss: float | None = None
    reason: str = ""
    at: float = 0.0                             # the signer's wall clock
    # the job's nodes without a role in the current plan (its snapshots' standbys): any of them may lead it on
    # once the plan's members die, so a follower that knows the job from this record alone (`job attach`) must
    # believe their plans and records. Optional on the wire (an older leader writes none; omitted when empty)
    standbys: tuple[str, ...] = ()

    @property
    def terminal(self) -> bool:
        return self.state in ("done", "failed", "cancelled")

    def order(self) -> tuple[int, int, int]:
        """Newer records compare larger: terminal beats running, then epoch, then step."""
        return (int(self.terminal), self.epoch, self.step)

    def body(self) -> dict[str, Any]:
        return {
            "job": self.job, "peer": self.peer, "publisher": self.publisher, "state": self.state,
            "epoch": self.epoch, "step": self.step, "steps": self.steps, "members": list(self.members),
            "sizes": list(self.stage_sizes), "losses": [[s, float(v)] for s, v in self.losses],
            "ckpt_step": self.checkpoint_step, "ckpt": [_file_wire(f) for f in self.checkpoint],
            "final": [_file_wire(f) for f in self.final],
            "final_loss": None if self.final_loss is None else float(self.final_loss),
            "reason": self.reason[:2000], "at": float(self.at),
            **({"standbys": list(self.standbys[:MAX_MEMBERS])} if self.standbys else {}),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class JobIndex:
    peer: str                                     # the publisher
    jobs: tuple[tuple[str, str, float], ...]      # (job id, name, created)

    def body(self) -> dict[str, Any]:
        return {"peer": self.peer, "jobs": [[j, n, float(c)] for j, n, c in self.jobs[-MAX_INDEX:]]}


def _file_wire(f: StageFile) -> list[Any]:
    return [f.stage, f.hash, list(f.holders)]


def _tag(t: str, body: bytes) -> bytes:
    return t.encode() + b"\x00" + body


def encode_record(rec: JobStatus | JobIndex, sign: Signer) -> bytes:
    t = "job-status" if isinstance(rec, JobStatus) else "job-index"
    body = packb(rec.body())
    return packb({"v": VERSION, "t": t, "b": body, "s": sign(_tag(t, body))})


def decode_record(data: bytes, verify: Verifier) -> JobStatus | JobIndex:
    """Decode and verify a job record; RemoteProtocolError on anything wrong."""
    env = expect_map(unpackb(data, max_size=MAX_STATUS), "job record")
    if env.get("v") != VERSION or set(env) != {"v", "t", "b", "s"}:
        raise RemoteProtocolError("job record: bad envelope")
    t, body_bytes, sig = env["t"], env["b"], env["s"]
    if not (isinstance(t, str) and isinstance(body_bytes, bytes) and isinstance(sig, bytes)):
        raise RemoteProtocolError("job record: bad envelope")
    b = expect_map(unpackb(body_bytes, max_size=MAX_STATUS), "job record body")
    peer = _str(b, "peer")
    if not verify(peer, _tag(t, body_bytes), sig):
        raise RemoteProtocolError(f"bad signature on {t} record claiming to be from {short_peer(peer)}")
    with malformed(f"{t[:16]} record"):
        if t == "job-status":
            return _status(b)
        if t == "job-index":
            return _index(b)
    raise RemoteProtocolError(f"unknown job record type {t[:32]!r}")


def _str(b: dict[str, Any], k: str, limit: int = 256) -> str:
    v = b.get(k)
    if not isinstance(v, str) or len(v) > limit:
        raise RemoteProtocolError(f"job record: field {k!r} is not a string of at most {limit} characters")
    return v


def _int(b: dict[str, Any], k: str) -> int:
    v = b.get(k)
    if not isinstance(v, int) or isinstance(v, bool) or not -1 <= v < 2**53:
        raise RemoteProtocolError(f"job record: field {k!r} is not an integer in range")
    return v


def _float(v: Any, k: str) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise RemoteProtocolError(f"job record: field {k!r} is not a finite number")
    return float(v)


def _list(b: dict[str, Any], k: str, limit: int) -> list[Any]:
    v = b.get(k)
    if not isinstance(v, list) or len(v) > limit:
        raise RemoteProtocolError(f"job record: field {k!r} is not a list of at most {limit}")
    return v


def _files(b: dict[str, Any], k: str) -> tuple[StageFile, ...]:
    out = []
    for f in _list(b, k, 4096):
        if not (isinstance(f, list) and len(f) == 3 and isinstance(f[0], int) and not isinstance(f[0], bool)
                and 0 <= f[0] < 4096 and isinstance(f[1], str) and len(f[1]) <= 128 and isinstance(f[2], list)
                and len(f[2]) <= 64 and all(isinstance(h, str) and len(h) <= 256 for h in f[2])):
            raise RemoteProtocolError(f"job record: bad stage file in {k!r}")
        out.append(StageFile(stage=f[0], hash=f[1], holders=tuple(f[2])))
    return tuple(out)


def _status(b: dict[str, Any]) -> JobStatus:
    want = {"job", "peer", "publisher", "state", "epoch", "step", "steps", "members", "sizes", "losses",
            "ckpt_step", "ckpt", "final", "final_loss", "reason", "at"}
    if not want <= set(b) <= want | {"standbys"}:
        raise RemoteProtocolError(f"job status: fields {sorted(set(b) ^ want)} missing or unknown")
    state = _str(b, "state")
    if state not in STATES:
        raise RemoteProtocolError(f"job status: unknown state {state[:32]!r}")
    members = _list(b, "members", MAX_MEMBERS)
    standbys = _list(b, "standbys", MAX_MEMBERS) if "standbys" in b else []
    sizes = _list(b, "sizes", MAX_MEMBERS)
    if not all(isinstance(m, str) and len(m) <= 256 for m in [*members, *standbys]) or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 < x <= MAX_MEMBERS for x in sizes):
        raise RemoteProtocolError("job status: bad members, standbys or stage sizes")
    losses = []
    for item in _list(b, "losses", MAX_LOSSES):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int) and not isinstance(item[0], bool)):
            raise RemoteProtocolError("job status: bad loss entry")
        v = item[1]
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise RemoteProtocolError("job status: bad loss entry")
        losses.append((item[0], float(v)))    # a diverged loss (nan, inf) is news, not an attack
    fl = b["final_loss"]
    return JobStatus(job=_str(b, "job"), peer=_str(b, "peer"), publisher=_str(b, "publisher"), state=state,
                     epoch=_int(b, "epoch"), step=_int(b, "step"), steps=_int(b, "steps"), members=tuple(members),
                     stage_sizes=tuple(sizes), losses=tuple(losses), checkpoint_step=_int(b, "ckpt_step"),
                     checkpoint=_files(b, "ckpt"), final=_files(b, "final"),
                     final_loss=None if fl is None else _float(fl, "final_loss") if isinstance(fl, int | float) and
                     math.isfinite(fl) else None,
                     reason=_str(b, "reason", 2000), at=_float(b["at"], "at"), standbys=tuple(standbys))


def _index(b: dict[str, Any]) -> JobIndex:
    if set(b) != {"peer", "jobs"}:
        raise RemoteProtocolError("job index: bad fields")
    jobs = []
    for j in _list(b, "jobs", MAX_INDEX):
        if not (isinstance(j, list) and len(j) == 3 and isinstance(j[0], str) and len(j[0]) <= 64
                and isinstance(j[1], str) and len(j[1]) <= 256):
            raise RemoteProtocolError("job index: bad entry")
        jobs.append((j[0], j[1], _float(j[2], "created")))
    return JobIndex(peer=_str(b, "peer"), jobs=tuple(jobs))


__all__ = ["JobIndex", "JobStatus", "StageFile", "decode_record", "encode_record", "index_key", "spec_key",
           "status_key"]
