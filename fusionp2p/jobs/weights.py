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

A node that keeps its pieces (a content store on disk) announces once, when its stage's pieces are all
in, that it holds pieces of the job's manifest (``wire/pieces.py: holders_key``): one DHT provider record
a node and job. A fetcher looks that key up once for its stage and asks each piece of the holders (those
of its own stage first: a holder that answered "not found" for a piece is asked after the others), then
of the publisher; a piece whose turn comes before the lookup answered is asked of the publisher at once
(in a job's first epoch nobody else holds it yet). Before, every piece had its own lookup and its own
announcement, each a DHT walk of about ten streams: in the 4-node demo (26 pieces a stage) those were
85% of the weight phase's CPU (issue 40). A peer that serves a piece of the wrong size or bytes is
counted against it (``Refusals``) and the piece is asked of the next holder; every piece is checked
against its hash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import trio

from fusionp2p.errors import FusionError, JobError, PeerUnavailable, RemoteProtocolError, leaf_errors
from fusionp2p.graph.executor import recomputable
from fusionp2p.graph.program import StageProgram
from fusionp2p.jobs.build import AcceptedJob, job_cost_model
from fusionp2p.jobs.content import FETCH_BACKOFF, FETCH_ROUNDS, ContentService
from fusionp2p.plan import Plan
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.train.state import StageState
from fusionp2p.types import DeviceProfile, short_peer
from fusionp2p.wire.pieces import WeightManifest, holders_key, join_pieces

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger(__name__)


@dataclass
class WeightFetches:
    """What a node fetched of a job's published weights (read by tests and the benchmark)."""

    tensors: set[str] = field(default_factory=set)
    pieces: int = 0
    bytes: int = 0


def stage_memory(accepted: AcceptedJob, plan: Plan, snap: Snapshot, stage: int, prog: StageProgram | None = None, *,
                 recompute: bool = False) -> float:
    """The memory *stage* of *plan* needs on each of its replicas, in bytes: the planner's figure with the
    activations of the micro-batches the schedule keeps in flight at once, plus,
    with the stage's program *prog*, the parameters it holds that the planner counts in another stage's
    units (a tied weight's copy: GPT-2's ``lm_head`` reads the embedding's ``wte``), at the same factor.
    With *recompute* (activation recomputation), one micro-batch's activations (the one recomputed) and,
    per micro-batch in flight, only the tensors the stage received and sent."""
    st = plan.stages[stage]
    cm = job_cost_model(accepted.spec, accepted.dag, snap)[0]
    replicated = len(st.replicas) > 1
    factor = cm.config.param_memory_factor + (cm.config.replica_memory_factor if replicated else 0.0)
    # the planner's own figure (plan/estimator.py: range_memory) with the micro-batches the schedule keeps in
    # flight at once, the bound the stage worker runs under (plan/config.py: in_flight_limit): one source
    boundary = None
    if recompute and prog is not None:   # what the stage receives and sends, exactly
        boundary = float(sum(r.meta.nbytes for r in prog.recv) + sum(o.meta.nbytes for o in prog.send))
    need = cm.range_memory(st.start, st.end, replicated=replicated, in_flight=cm.in_flight(stage, len(plan.stages)),
                           recompute=recompute, boundary=boundary)
    if prog is not None:
        held = sum(s.meta.nbytes for s in prog.inputs if s.kind == "param")
        need += factor * max(0.0, held - cm.range_params(st.start, st.end))
    return need


def stage_recompute(accepted: AcceptedJob, plan: Plan, snap: Snapshot, stage: int,
                    prog: StageProgram | None = None) -> bool:
    """Whether *stage* of *plan* runs with activation recomputation (``TrainConfig.recompute``): "always",
    never with "never", and with "auto" exactly when the stage without it is over the memory its
    smallest replica offers (the snapshot's profiles: every replica decides the same); never for a program
    that writes a tensor in place (``graph/executor.py: recomputable``). A pure function of
    the plan, so the planner's fallback (``jobs/build.py: choose_plan``) and the nodes agree."""
    mode = accepted.spec.config.recompute
    if mode == "never" or (prog is not None and not recomputable(prog)):
        return False
    if mode == "always":
        return True
    offers = [snap.members[p].memory_bytes for p in plan.stages[stage].replicas if p in snap.members]
    return bool(offers) and stage_memory(accepted, plan, snap, stage, prog) > min(offers)


def stage_fit(accepted: AcceptedJob, plan: Plan, snap: Snapshot, stage: int, profile: DeviceProfile | None,
              prog: StageProgram | None = None) -> str:
    """Why this node (*profile*) cannot hold *stage* of *plan* within its memory ("" when it can), with
    activation recomputation where the stage runs with it (:func:`stage_recompute`)."""
    if profile is None:
        return ""
    memory_bytes = profile.memory_bytes
    recompute = stage_recompute(accepted, plan, snap, stage, prog)
    need = stage_memory(accepted, plan, snap, stage, prog, recompute=recompute)
    log.info("job %s epoch %d: stage %d needs %.1f MiB of the %.1f MiB this node offers%s", accepted.spec.job_id,
             plan.epoch, stage, need / 2**20, memory_bytes / 2**20, " (activation recomputation)" if recompute else "")
    if need <= memory_bytes:
        return ""
    return (f"stage {stage} needs {need / 2**20:.0f} MiB (parameters, gradients, optimizer state and activations"
            f"{', recomputed' if recompute else ''}), more than the {memory_bytes / 2**20:.0f} MiB this node offers "
            "(--memory)")


PROVIDERS_TIMEOUT = 5.0   # seconds the DHT lookup of a stage's holders may take before its named peers are asked alone
LOOKUP_GRACE = 0.5        # seconds from a stage's start its fetches wait for that lookup; then the publisher
# a stage of fewer bytes waits only SMALL_GRACE: the publisher serves it in well under LOOKUP_GRACE, and a job's first
# epoch (nobody else holds a piece) waited the whole grace for a lookup that took 0.5-4 s to find nobody (issue 40)
SMALL_STAGE_BYTES = 16 * 2**20
SMALL_GRACE = 0.05
FETCHES_AT_ONCE = 1       # pieces in flight at once per node: 4 (16 streams to a 4-node job's publisher) broke
                          # py-libp2p's connection to it under load (streams refused, then reset): a re-plan


async def find_holders(content: ContentService, manifest_hash: str) -> list[str]:
    """The nodes that announced pieces of the weight manifest *manifest_hash* (its :func:`holders_key`), from
    one DHT lookup bounded by :data:`PROVIDERS_TIMEOUT`: [] when it has not answered by then."""
    with trio.move_on_after(PROVIDERS_TIMEOUT):
        return await content.transport.find_providers(holders_key(manifest_hash))
    return []


async def fetch_piece(content: ContentService, h: str, size: int, peers: Sequence[str], *,
                      holders: Sequence[str] = (), misses: Counter[str] | None = None, keep: bool = False,
                      rounds: int = FETCH_ROUNDS) -> bytes:
    """Content *h* of exactly *size* bytes (a weight piece, a data shard: any bounded blob by its hash): from
    the store, else from its *holders* (nodes that announced pieces of its manifest) and then *peers* (its
    publisher), in turn, in up to *rounds* rounds (a stream that fails under load is tried again after a
    backoff). Every blob is checked against its hash as it comes (``ContentService.fetch_from``). A peer that
    serves bytes of the wrong hash is counted against it and not asked again; PeerUnavailable when none
    delivers.

    A holder announced the manifest, not this piece: one of another stage answers "not found". *misses*
    (shared by the pieces of one stage) counts those answers per holder, and holders that missed are asked
    after those that did not, so a stage's pieces go to the holders of the same stage first.

    With *keep*, a node whose store is on disk keeps the piece there (no memory copy: the tensors built from
    it are the stage's), so that it can serve it to later fetchers. A store in memory does not keep it (its
    copy would double the stage's weights in memory for as long as the node runs)."""
    store = content.store
    if store.has(h) and store.size(h) == size:
        return store.get(h)
    me = content.transport.peer_id
    # the holders first, each fetcher starting at its own place among them (spreads the load), those that missed
    # an earlier piece after the others (a stable sort keeps the rotation among equals), the publisher last
    ring = sorted(p for p in holders if p != me and p not in peers)
    if ring:
        k = int.from_bytes(hashlib.sha256(me.encode()).digest()[:4], "big") % len(ring)
        ring = ring[k:] + ring[:k]
    missed = misses if misses is not None else Counter[str]()
    ring.sort(key=lambda p: missed[p])
    errors: list[str] = []
    bad: set[str] = set()
    delay = FETCH_BACKOFF
    for attempt in range(rounds):
        if attempt:
            await trio.sleep(delay)   # a bounded backoff between rounds
            delay *= 2
        for peer in [*ring, *(p for p in peers if p != me)]:
            if peer in bad:
                continue
            try:
                blob = await content.fetch_from(peer, h, max_size=size)
            except RemoteProtocolError as exc:
                content.refusals.refuse(peer, "weights/piece", now=trio.current_time(), detail=str(exc)[:200])
                errors.append(f"{short_peer(peer)}: {type(exc).__name__}")
                bad.add(peer)
                missed[peer] += 1
                continue
            except (PeerUnavailable, trio.TooSlowError) as exc:
                log.info("piece %s… from %s: %s", h[:16], short_peer(peer), exc)
                errors.append(f"{short_peer(peer)}: {type(exc).__name__}")
                missed[peer] += 1
                continue
            if len(blob) != size:   # the right hash of the wrong size: the manifest is the publisher's mistake
                raise RemoteProtocolError(f"piece {h[:16]}… has {len(blob)} bytes, the manifest says {size}")
            if keep and store.on_disk:
                await content.put_chunks([blob], size)
            return blob
    raise PeerUnavailable(f"holders of piece {h[:16]}…", "; ".join(errors[-6:]) or "no holder delivered it")


async def fetch_tensors(content: ContentService, manifest: WeightManifest, names: Sequence[str], *,
                        peers: Sequence[str], fetches: WeightFetches | None = None,
                        announce: Callable[[str], None] | None = None,
                        manifest_hash: str | None = None) -> dict[str, torch.Tensor]:
    """The published tensors *names*, each rebuilt from its pieces (and nothing else; see :func:`fetch_piece`).

    One DHT lookup finds the holders of the manifest (*manifest_hash*, the spec's ``weights_hash``; computed
    from *manifest* when not given), bounded by :data:`PROVIDERS_TIMEOUT`; the pieces are fetched
    :data:`FETCHES_AT_ONCE` at a time from those holders, then *peers* (the publisher). A piece whose turn
    comes before the lookup answered (and after :data:`LOOKUP_GRACE` from the start, :data:`SMALL_GRACE` for a
    stage under :data:`SMALL_STAGE_BYTES`) does not wait for it:
    it is asked of *peers* in one round, and only if none delivers does it wait for the holders. In a job's
    first epoch nobody but the publisher holds a piece, and in the 4-node demo every lookup ran into its cap
    with no holder (issue 40).

    With *announce*, a node whose store is on disk keeps the pieces there and, once the stage's pieces are
    all in, calls ``announce(holders_key(manifest_hash))`` once, for the caller to provide that key on the
    DHT: later fetchers then find this node as well as the publisher."""
    by_name = manifest.by_name()
    for name in names:
        if name not in by_name:
            raise RemoteProtocolError(f"the weight manifest has no tensor {name[:80]!r}")
    store = content.store
    fetching = trio.CapacityLimiter(FETCHES_AT_ONCE)
    small = sum(n for _, n in manifest.pieces_of(names)) < SMALL_STAGE_BYTES
    grace = trio.current_time() + (SMALL_GRACE if small else LOOKUP_GRACE)
    key_of = manifest_hash if manifest_hash is not None else manifest.content_hash
    me = content.transport.peer_id
    keep = announce is not None
    holders: list[str] = []
    looked_up = trio.Event()
    misses: Counter[str] = Counter()
    out: dict[str, torch.Tensor] = {}

    async def lookup() -> None:
        nonlocal holders
        try:
            holders = await find_holders(content, key_of)
        finally:
            looked_up.set()

    async def piece(h: str, size: int, blobs: list[bytes], i: int) -> None:
        async with fetching:
            if not (store.has(h) and store.size(h) == size):
                with trio.move_on_at(grace):   # a lookup that answers soon is waited for
                    await looked_up.wait()
                if not looked_up.is_set() and any(p != me for p in peers):
                    # the lookup has not answered: the publisher now, rather than the fetch slot idle; if it does
                    # not deliver, the holders the lookup finds
                    with contextlib.suppress(PeerUnavailable):
                        blobs[i] = await fetch_piece(content, h, size, peers, keep=keep, rounds=1)
                        return
                await looked_up.wait()
            blobs[i] = await fetch_piece(content, h, size, peers, holders=holders, misses=misses, keep=keep)

    async def tensor(name: str) -> None:
        entry = by_name[name]
        sizes = manifest.piece_sizes(entry)
        blobs: list[bytes] = [b""] * len(entry.pieces)
        async with trio.open_nursery() as nursery:
            for i, (h, n) in enumerate(zip(entry.pieces, sizes, strict=True)):
                nursery.start_soon(piece, h, n, blobs, i)
        out[name] = await trio.to_thread.run_sync(join_pieces, manifest, entry, blobs)
        if fetches is not None:
            fetches.tensors.add(name)
            fetches.pieces += len(blobs)
            fetches.bytes += entry.nbytes

    try:
        async with trio.open_nursery() as outer:
            if any(not store.has(h) for h, _ in manifest.pieces_of(names)):
                outer.start_soon(lookup)
            else:
                looked_up.set()
            async with trio.open_nursery() as nursery:
                for name in dict.fromkeys(names):
                    nursery.start_soon(tensor, name)
            outer.cancel_scope.cancel()   # every piece is in: the lookup (if it still runs) is not needed
    except BaseExceptionGroup as group:   # the first piece that failed, as one piece fetched alone raises it
        leaves = [e for e in leaf_errors(group) if not isinstance(e, trio.Cancelled)]
        ours = [e for e in leaves if isinstance(e, FusionError)]
        if ours or leaves:
            raise (ours or leaves)[0] from group
        raise
    if announce is not None and store.on_disk and all(store.has(h) for h, _ in manifest.pieces_of(names)):
        announce(holders_key(key_of))   # one provider record for the whole stage, not one a piece
    return {name: out[name] for name in names}


async def prepare_stage(content: ContentService, accepted: AcceptedJob, prog: StageProgram, restore: StageState | None,
                        *, peers: Sequence[str], fetches: WeightFetches | None = None,
                        announce: Callable[[str], None] | None = None) -> StageProgram:
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
        tensors = await fetch_tensors(content, accepted.weights, names, peers=peers, fetches=got, announce=announce,
                                      manifest_hash=accepted.spec.weights_hash)
        log.info("job %s: stage %d's %d tensors from %d published pieces, %.1f MB", accepted.spec.job_id, prog.stage,
                 len(names), got.pieces - before[0], (got.bytes - before[1]) / 1e6)
    return dataclasses.replace(prog, tensors=tensors)


__all__ = ["WeightFetches", "fetch_piece", "fetch_tensors", "find_holders", "prepare_stage", "stage_fit", "stage_memory",
           "stage_recompute"]
