"""A node's stage of a job: does it fit, and its published tensors from their pieces (issue 37).

Theory of operation. A node accepts a job with its DAG's tensors as declarations only (``meta``
tensors; ``jobs/build.py``). Once an epoch's plan names its stage, :func:`prepare_stage`

1. holds the stage against the memory this node offers (its device profile's ``memory_bytes``, which
   ``fusionp2p node --memory`` sets): the planner's own figure for the stage (parameters, gradients,
   optimizer state, CO2's anchor and momentum when replicated, activations of the micro-batches in
   flight; ``plan/estimator.py``), refused with the reason when it is over;
2. fills in the stage program's tensors: from the handed-over state when the resume has one (a
   re-plan), else from the published weight pieces of exactly the tensors the stage reads (its tied
   copies and shared buffers included, as the partition lists them), each piece fetched at its exact
   size and checked against its hash. No tensor of another stage is fetched or built.

A peer that serves a piece of the wrong size or bytes is counted against it (``Refusals``) and
the piece is asked of the next holder. Pieces fetched from the publisher are not kept in the content
store, whose in-memory copy would double the stage's weights on the node.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import trio

from fusionp2p.errors import JobError, PeerUnavailable, RemoteProtocolError
from fusionp2p.graph.program import StageProgram
from fusionp2p.jobs.build import AcceptedJob, job_cost_model
from fusionp2p.jobs.content import ContentService
from fusionp2p.plan import Plan
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.train.state import StageState
from fusionp2p.types import DeviceProfile, short_peer
from fusionp2p.wire.pieces import WeightManifest, join_pieces

log = logging.getLogger(__name__)


@dataclass
class WeightFetches:
    """What a node fetched of a job's published weights (read by tests and the benchmark)."""

    tensors: set[str] = field(default_factory=set)
    pieces: int = 0
    bytes: int = 0


def stage_memory(accepted: AcceptedJob, plan: Plan, snap: Snapshot, stage: int, prog: StageProgram | None = None) -> float:
    """The memory *stage* of *plan* needs on each of its replicas, in bytes: the planner's figure, plus,
    with the stage's program *prog*, the parameters it holds that the planner counts in another stage's
    units (a tied weight's copy: GPT-2's ``lm_head`` reads the embedding's ``wte``), at the same factor."""
    st = plan.stages[stage]
    cm = job_cost_model(accepted.spec, accepted.dag, snap)[0]
    replicated = len(st.replicas) > 1
    need = cm.range_memory(st.start, st.end, replicated=replicated)
    if prog is not None:
        held = sum(s.meta.nbytes for s in prog.inputs if s.kind == "param")
        factor = cm.config.param_memory_factor + (cm.config.replica_memory_factor if replicated else 0.0)
        need += factor * max(0.0, held - cm.range_params(st.start, st.end))
    return need


def stage_fit(accepted: AcceptedJob, plan: Plan, snap: Snapshot, stage: int, profile: DeviceProfile | None,
              prog: StageProgram | None = None) -> str:
    """Why this node (*profile*) cannot hold *stage* of *plan* within its memory ("" when it can)."""
    if profile is None:
        return ""
    memory_bytes = profile.memory_bytes
    need = stage_memory(accepted, plan, snap, stage, prog)
    log.info("job %s epoch %d: stage %d needs %.1f MiB of the %.1f MiB this node offers", accepted.spec.job_id,
             plan.epoch, stage, need / 2**20, memory_bytes / 2**20)
    if need <= memory_bytes:
        return ""
    return (f"stage {stage} needs {need / 2**20:.0f} MiB (parameters, gradients, optimizer state and activations), "
            f"more than the {memory_bytes / 2**20:.0f} MiB this node offers (--memory)")


async def fetch_piece(content: ContentService, h: str, size: int, peers: Sequence[str]) -> bytes:
    """Piece *h* of exactly *size* bytes: from the store, else from *peers* in turn, else from the DHT's
    providers. A peer that serves bad bytes is counted against it."""
    store = content.store
    if store.has(h):
        blob = store.get(h)
        if len(blob) == size:
            return blob
    for peer in peers:
        if peer == content.transport.peer_id:
            continue
        try:
            blob = await content.fetch_from(peer, h, max_size=size)
        except RemoteProtocolError as exc:
            content.refusals.refuse(peer, "weights/piece", now=trio.current_time(), detail=str(exc)[:200])
            continue
        except (PeerUnavailable, trio.TooSlowError) as exc:
            log.info("piece %s… from %s: %s", h[:16], short_peer(peer), exc)
            continue
        if len(blob) != size:   # the right hash of the wrong size: the manifest is the publisher's mistake
            raise RemoteProtocolError(f"piece {h[:16]}… has {len(blob)} bytes, the manifest says {size}")
        # not kept in the content store: its in-memory copy would double the stage's weights on this node
        # for as long as the node runs (the publisher serves them; the tensors live in the stage's program)
        return blob
    blob = await content.fetch(h, max_size=size)
    if len(blob) != size:
        raise RemoteProtocolError(f"piece {h[:16]}… has {len(blob)} bytes, the manifest says {size}")
    return blob


async def fetch_tensors(content: ContentService, manifest: WeightManifest, names: Sequence[str], *,
                        peers: Sequence[str], fetches: WeightFetches | None = None) -> dict[str, torch.Tensor]:
    """The published tensors *names*, each rebuilt from its pieces (and nothing else)."""
    by_name = manifest.by_name()
    out: dict[str, torch.Tensor] = {}
    for name in names:
        entry = by_name.get(name)
        if entry is None:
            raise RemoteProtocolError(f"the weight manifest has no tensor {name[:80]!r}")
        blobs = [await fetch_piece(content, h, n, peers)
                 for h, n in zip(entry.pieces, manifest.piece_sizes(entry), strict=True)]
        out[name] = await trio.to_thread.run_sync(join_pieces, manifest, entry, blobs)
        if fetches is not None:
            fetches.tensors.add(name)
            fetches.pieces += len(blobs)
            fetches.bytes += entry.nbytes
    return out


async def prepare_stage(content: ContentService, accepted: AcceptedJob, prog: StageProgram, restore: StageState | None,
                        *, peers: Sequence[str], fetches: WeightFetches | None = None) -> StageProgram:
    """*prog* with real tensors: the handed-over ones of *restore*, else the published pieces of exactly
    its own tensors (see the module docstring). A program whose tensors are real already is returned."""
    names = [s.name for s in prog.inputs if s.kind != "input"]
    if all(prog.tensors[n].device.type != "meta" for n in names):
        return prog
    if restore is not None and all(n in restore.tensors for n in names):
        tensors = {n: restore.tensors[n] for n in names}
    else:
        if accepted.weights is None:
            raise JobError(f"job {accepted.spec.job_id}: no weight manifest to fetch stage {prog.stage}'s tensors by")
        got = fetches if fetches is not None else WeightFetches()
        before = (got.pieces, got.bytes)
        tensors = await fetch_tensors(content, accepted.weights, names, peers=peers, fetches=got)
        log.info("job %s: stage %d's %d tensors from %d published pieces, %.1f MB", accepted.spec.job_id, prog.stage,
                 len(names), got.pieces - before[0], (got.bytes - before[1]) / 1e6)
    return dataclasses.replace(prog, tensors=tensors)


__all__ = ["WeightFetches", "fetch_piece", "fetch_tensors", "prepare_stage", "stage_fit", "stage_memory"]
