"""Shadow copies: a stage with no live replica survives its holder's death with at most a few steps lost.

Theory of operation (docs/jobs.md "Shadow copies"). A stage that the plan gives one replica has no
live hand-off when its holder dies; before this module it came back from the newest durable checkpoint
(``checkpoint_every``, 0 by default: none), so one death threw the whole job back to step 0. Now its
holder copies the stage's state (parameters, optimizer state, CO2 momentum: the hand-off's own
``encode_state`` bytes) to one other member, its **keeper**, in the background:

1. at a step boundary the worker calls :meth:`Shadows.boundary`; when a copy is due and none is in
   flight, the holder writes its state as a stage file into its content store, streamed from the live
   tensors (no clone: on disk it is never whole in memory; the next step waits for the write), and a
   background task of the epoch asks the keeper to ``keep`` it (``op: keep, shadow: true``): the keeper fetches the blob by hash from the holder (the content
   protocol, off the data plane's links), checks that it is a stage file of this job and step, and
   announces it (``CheckpointSaved``). The holder then drops its own copy: its live state is newer.
2. the keeper keeps the newest ``ShadowConfig.keep`` copies of each stage and drops the older ones
   from its store (a copy every few steps would otherwise fill it).
3. at a re-plan, ``replan.plan_resume`` fills every unit that lost every live state from the newest
   stage file a live node holds (a shadow copy or a checkpoint), and the new epoch resumes at the
   oldest of the per-unit newest steps: the dead stage's last copy, the others' live states.

**Cadence** (:class:`Cadence`, pure): a copy costs ``c = t_encode + B / R`` seconds of background work
(B the encoded bytes, R the link rate the last copy's fetch measured, t_encode its encoding), and a
step takes ``t_step`` (the interval between step boundaries, smoothed). The holder copies every
``n = clamp(ceil(c / (share * t_step)), 1, max_every)`` steps, so that copies keep the link and a CPU
busy at most ``share`` of the time, and starts no copy while one is in flight. A death then costs the
steps since the newest copy that reached the keeper: at most ``n`` plus those one copy spans
(``c / t_step``, at most ``n * share`` once the rule holds), so at most ``max_every + 1`` at the
default share; the first copy goes at the first boundary of each epoch, before anything is measured.

Keepers: a standby of the job (it has no stage to train, and may be the node that takes the stage over:
it then finds the copy in its own store), else a member of another stage, spread by stage index.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from fusionp2p.errors import FusionError, PeerUnavailable, RemoteProtocolError
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs import shadow_plane
from fusionp2p.jobs.checkpoint import StageCheckpointMeta, read_state_meta, state_layout
from fusionp2p.jobs.events import CheckpointSaved, ProgressEvent
from fusionp2p.jobs.shadow_config import ShadowConfig
from fusionp2p.plan import Plan
from fusionp2p.types import short_peer
from fusionp2p.wire.stfile import chunks

if TYPE_CHECKING:
    from fusionp2p.jobs.host import JobHost
    from fusionp2p.net.transport import Transport
    from fusionp2p.train.worker import StageWorker

log = logging.getLogger(__name__)

LINK_LINGER = 5.0   # seconds a copy's push may go on after the keeper answered (it closes the link)
MAX_SHELVED = 64    # stages (unit ranges) a keeper holds shadow copies of for one job: bounds what peers pin here


class Cadence:
    """When the next copy is due (pure: times are passed in). See the module docstring for the rule."""

    SMOOTH = 0.3   # weight of the newest measurement in the moving averages

    def __init__(self, config: ShadowConfig) -> None:
        self.config = config
        self.step_s: float | None = None    # smoothed seconds between step boundaries
        self.copy_s: float | None = None    # smoothed seconds one copy takes (encode + fetch)
        self.link_Bps: float | None = None  # bytes per second the last copy's fetch moved
        self.copied = -math.inf             # the step of the newest copy started
        self._last: float | None = None

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1.0 - self.SMOOTH) * old + self.SMOOTH * new

    def on_step(self, now: float) -> None:
        if self._last is not None:
            self.step_s = self._avg(self.step_s, max(0.0, now - self._last))
        self._last = now

    def on_copy(self, nbytes: int, encode_s: float, fetch_s: float) -> None:
        if fetch_s > 0:
            self.link_Bps = nbytes / fetch_s
        self.copy_s = self._avg(self.copy_s, max(0.0, encode_s) + max(0.0, fetch_s))

    @property
    def every(self) -> int:
        cfg = self.config
        if self.copy_s is None or not self.step_s:
            return 1
        return max(1, min(cfg.max_every, math.ceil(self.copy_s / (cfg.share * self.step_s))))

    def due(self, step: int) -> bool:
        return step - self.copied >= self.every


def keeper_for(plan: Plan, stage: int, me: str, standbys: Collection[str], alive: Callable[[str], bool]) -> str | None:
    """Who keeps stage *stage*'s copies: a live standby, else a live member of another stage (spread by
    stage index, so that one keeper does not hold every stage's copies); None when nobody else is there."""
    spare = sorted(p for p in standbys if p != me and p not in plan.peers and alive(p))
    if spare:
        return spare[stage % len(spare)]
    n = len(plan.stages)   # else the next stage's first live replica, round the pipeline
    others = [p for i in range(1, n) for p in plan.stages[(stage + i) % n].replicas if p != me and alive(p)]
    return others[0] if others else None


class _Run(Protocol):
    """What a shadow needs of its job run (``jobs/run.py``)."""

    svc: JobHost
    transport: Transport
    me: str
    job_id: str
    members: frozenset[str] | None
    checkpoints: dict[int, dict[tuple[int, int], tuple[str, list[str]]]]
    _worker: StageWorker | None

    def _alive(self, peer: str) -> bool: ...
    def _holds(self, step: int, units: tuple[int, int], h: str, peer: str) -> None: ...
    async def _provide(self, h: str) -> None: ...
    async def _gossip(self, ev: ProgressEvent) -> None: ...


@dataclass
class _Lane:
    """One epoch's copies of this node's stage."""

    plan: Plan
    stage: int
    keeper: str
    cadence: Cadence
    nursery: trio.Nursery
    busy: bool = False
    copies: int = 0
    refused: set[str] = field(default_factory=set)   # keepers a copy failed to reach this epoch


class Shadows:
    """A job run's shadow copies: the holder's side (:meth:`running`, :meth:`boundary`) and the keeper's
    (:meth:`keep`). Owned by :class:`~fusionp2p.jobs.run.JobRun`."""

    def __init__(self, run: _Run, config: ShadowConfig) -> None:
        self.run = run
        self.config = config
        self._lane: _Lane | None = None
        self._shelf: dict[tuple[int, int], list[tuple[int, str]]] = {}   # keeper: units -> [(step, hash)], oldest first

    @asynccontextmanager
    async def running(self, plan: Plan, stage: int) -> AsyncIterator[None]:
        """Around an epoch's training: copies of *stage* go out while it trains; one in flight at its end
        is cancelled (the hand-off at a halt is newer)."""
        run = self.run
        keeper = keeper_for(plan, stage, run.me, run.members or (), run._alive)
        if not self.config.enabled or len(plan.stages[stage].replicas) != 1 or keeper is None:
            yield
            return
        async with trio.open_nursery() as nursery:
            self._lane = _Lane(plan=plan, stage=stage, keeper=keeper, cadence=Cadence(self.config), nursery=nursery)
            try:
                yield
            finally:
                lane, self._lane = self._lane, None
                nursery.cancel_scope.cancel()
                if lane is not None and lane.copies:
                    c = lane.cadence
                    log.info("job %s epoch %d: %d shadow copies of stage %d to %s (every %d steps; step %.3f s, "
                             "copy %.3f s, link %.3g MB/s)", run.job_id, plan.epoch, lane.copies, stage,
                             short_peer(keeper), c.every, c.step_s or 0.0, c.copy_s or 0.0, (c.link_Bps or 0.0) / 1e6)

    async def boundary(self, completed: int) -> None:
        """The worker completed *completed* steps (its hook): start a copy when one is due."""
        lane, worker = self._lane, self.run._worker
        if lane is None or worker is None:
            return
        lane.cadence.on_step(trio.current_time())
        if lane.busy or not lane.cadence.due(completed):
            return
        lane.busy = True
        lane.cadence.copied = completed
        # the copy is written from the live tensors (views: no clone), streamed to the content store (on disk,
        # never whole in memory), while the next step waits: it must not change the tensors under it. A clone
        # and its encoded bytes held twice the stage's state beside the live one: measured 550-1040 MiB (5-6x
        # the stage's parameter bytes) over the stage figure on 4 nodes of --memory 1.25GiB, each past its offer
        # (benchmarks/model_scale.py, Llama 127M)
        run, plan, s = self.run, lane.plan, lane.stage
        try:
            t0 = trio.current_time()
            st = await trio.to_thread.run_sync(functools.partial(worker.export_state, copy=False))
            meta = StageCheckpointMeta(job=run.job_id, stage=s, num_stages=len(plan.stages), step=st.step,
                                       plan_hash=plan.plan_hash())
            lay = state_layout(meta, st)
            h = await run.svc.content.put_chunks(chunks(lay), lay.size)
        except (FusionError, OSError) as exc:
            lane.busy = False
            log.info("job %s: shadow copy of stage %d at step %d not written: %s", run.job_id, s, completed, exc)
            return
        except BaseException:
            lane.busy = False
            raise
        lane.nursery.start_soon(self._copy, lane, h, st.step, lay.size, trio.current_time() - t0)

    async def _copy(self, lane: _Lane, h: str, step: int, size: int, write_s: float) -> None:
        """Ask the keeper to fetch the copy *h* (the state at *step*, *size* bytes, written in *write_s*) and
        drop ours once it holds it."""
        run, plan, s = self.run, lane.plan, lane.stage
        store = run.svc.content.store
        units = (plan.stages[s].start, plan.stages[s].end)
        name = shadow_plane.link_name(plan.epoch, s, step)
        try:
            t1 = trio.current_time()
            refused: FusionError | None = None
            async with trio.open_nursery() as pushing:   # the bytes over the data plane (jobs/shadow_plane.py)
                pushing.start_soon(self._push, lane.keeper, name, h)
                try:
                    await job_proto.request(run.transport, lane.keeper, {
                        "op": "keep", "job": run.job_id, "hash": h, "step": step, "stage": s, "holder": run.me,
                        "units": list(units), "shadow": True, "link": name, "size": size},
                        timeout=run.svc.config.accept_timeout)
                except FusionError as exc:   # raised out of the nursery it would come wrapped in a group, which
                    refused = exc            # the handler below does not catch: the epoch ended ("pipeline broken")
                finally:   # a keeper that fetched instead (an older node) never claims the link
                    pushing.cancel_scope.deadline = trio.current_time() + LINK_LINGER
            if refused is not None:
                raise refused
            lane.cadence.on_copy(size, write_s, trio.current_time() - t1)
            lane.copies += 1
            run._holds(step, units, h, lane.keeper)
        # nursery-ok: the keep request's FusionError is raised out of the nursery (above); _push catches its own
        except (PeerUnavailable, RemoteProtocolError, FusionError) as exc:
            log.info("job %s: shadow copy of stage %d at step %d not kept by %s: %s", run.job_id, s, step,
                     short_peer(lane.keeper), exc)
            # another keeper for the next copy (one the view still calls alive may have just died)
            lane.refused.add(lane.keeper)
            lane.keeper = keeper_for(plan, s, run.me, run.members or (),
                                     lambda p: p not in lane.refused and run._alive(p)) or lane.keeper
        finally:
            store.discard(run.job_id, h)   # the keeper holds the copy; our live state is newer
            lane.busy = False

    async def _push(self, keeper: str, name: str, h: str) -> None:
        """Send copy *h* to *keeper* on the data plane; a failure only logged (the keeper fetches instead)."""
        try:
            await shadow_plane.send_copy(self.run.svc, self.run.job_id, keeper, name, h)
        except Exception as exc:   # groups too: the channel's own nursery wraps a link lost as the epoch ends,
            # and a background copy must never end its epoch ("pipeline broken ... channel stopped", 4 CLI nodes)
            log.info("job %s: shadow copy %s… not pushed to %s (%s); it fetches it", self.run.job_id, h[:12],
                     short_peer(keeper), exc)

    async def replicate(self, plan: Plan, s: int, h: str, step: int) -> None:
        """Ask one other member (the keeper) to hold a copy of a (checkpoint or final) stage file, so that it
        survives our death."""
        run = self.run
        peers = sorted(p for p in plan.peers if p not in plan.stages[s].replicas) or sorted(
            p for p in plan.peers if p != run.me) or sorted(   # a plan of one: a standby keeps it
            p for p in (run.members or ()) if p != run.me and run._alive(p))
        if not peers:
            return
        keeper = peers[(plan.peers.index(run.me) if run.me in plan.peers else 0) % len(peers)]
        try:
            st = plan.stages[s]
            await job_proto.request(run.transport, keeper, {"op": "keep", "job": run.job_id, "hash": h,
                                                             "step": step, "stage": s, "holder": run.me,
                                                             "units": [st.start, st.end]},
                                    timeout=run.svc.config.accept_timeout)
        except (PeerUnavailable, RemoteProtocolError) as exc:
            log.info("checkpoint %s of stage %d not replicated to %s: %s", h[:12], s, keeper[:12], exc)

    async def keep(self, h: str, step: int, stage: int, units: tuple[int, int], holder: str, *, shadow: bool,
                   link: str = "", size: int = 0) -> None:
        """Hold a copy of another member's stage file (we are its keeper) and announce it. A shadow copy
        supersedes the older ones of its stage beyond ``keep``, which leave the store. With *link* (and its
        *size*) the holder pushes the bytes on that data-plane link; else, or when the link fails, they are
        fetched over the content protocol."""
        run = self.run
        with trio.fail_after(run.svc.config.accept_timeout):   # to disk as it comes: never whole in memory
            if link and 0 < size <= run.svc.config.max_state_bytes:
                try:
                    t0 = trio.current_time()
                    await shadow_plane.receive_copy(run.svc, run.job_id, holder, link, h, size, alive=run._alive)
                    log.info("job %s: shadow copy %s… of stage %d from %s: %d bytes on the data plane in %.2f s",
                             run.job_id, h[:12], stage, short_peer(holder), size, trio.current_time() - t0)
                except (PeerUnavailable, RemoteProtocolError, trio.TooSlowError) as exc:   # IntegrityError too
                    log.info("job %s: shadow copy %s… from %s not received on the data plane (%s); fetching it",
                             run.job_id, h[:12], short_peer(holder), exc)
            await run.svc.content.fetch_to_store(h, max_size=run.svc.config.max_state_bytes, peers=[holder], provide=False)
        with run.svc.content.store.reader(h) as f:
            meta = read_state_meta(f, job=run.job_id)   # a stage file of this job, not any blob
        if meta.step != step:
            raise RemoteProtocolError(f"keep: the file is of step {meta.step}, not {step}")
        run.svc.nursery.start_soon(run._provide, h)   # the DHT's announcement: seconds the holder need not wait
        run._holds(step, units, h, holder)
        run._holds(step, units, h, run.me)
        if shadow:
            self._shelve(units, step, h)
        await run._gossip(CheckpointSaved(job=run.job_id, step=step, stage=stage, peer=run.me, hash=h,
                                          start=units[0], end=units[1], at=time.time()))

    def _shelve(self, units: tuple[int, int], step: int, h: str) -> None:
        run = self.run
        shelf = self._shelf.setdefault(units, [])
        shelf.append((step, h))
        shelf.sort()
        dropped = [(units, old) for old in shelf[:-self.config.keep]]
        del shelf[:-self.config.keep]
        if len(self._shelf) > MAX_SHELVED:   # a peer naming ever new unit ranges: the stalest range goes
            stale = min(self._shelf, key=lambda u: self._shelf[u][-1][0])
            dropped += [(stale, old) for old in self._shelf.pop(stale)]
        for rng, (old_step, old) in dropped:
            run.svc.content.store.discard(run.job_id, old)
            held = run.checkpoints.get(old_step, {}).get(rng)
            if held is not None and run.me in held[1]:
                held[1].remove(run.me)   # a re-plan led here must not name us for a copy we dropped


__all__ = ["Cadence", "ShadowConfig", "Shadows", "keeper_for"]
