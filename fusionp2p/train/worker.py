"""Stage worker: the thin trio shell that runs one stage replica of a training job.

Theory of operation. A job's plan cuts the model into ``S`` stages, each served by ``R`` replicas.
Replica ``r`` of every stage forms *pipeline* ``r``: it exchanges activations and gradients with
replica ``r`` of the other stages over :class:`~fusionp2p.net.channel.TensorChannel` s, and reads
its own slice of the data order (global step ``step * R + r`` of the job's
:class:`~fusionp2p.data.BatchSampler`), so ``R = 1`` reproduces single-process training exactly.
Replicas of one stage average their parameters with CO2 through a
:class:`~fusionp2p.train.averager.ReplicaAverager`. By default (``CO2(stream=True)``) one of
``tau`` fragments of the parameter vector is snapshotted after every step and averaged in the
background of the next step, whose end applies it as a jump that keeps the local progress; with
``stream=False`` the whole vector is snapshotted every ``tau`` steps and its one-round-stale average
enters through the outer step (``CO2(sync=True)`` blocks instead). A final round at the end leaves
every replica and the checkpoint with the same consensus weights.
Replicas of a job without CO2 all-reduce their gradients before every optimizer step (synchronous
data parallelism).

Per step the worker makes a fresh pure :class:`~fusionp2p.train.schedule.StageSchedule` and
only moves data: it performs the schedule's actions in order (compute in a worker thread so that
the channels keep flowing), feeds arrivals back as events, and buffers messages of a later step
by the step number in their key. Sends never deadlock: every channel has a reader task that
drains it into a local queue, bounded by two steps' worth of messages (``train/guard.py``: a peer that
sends more is a protocol error for the job). A step whose gradients are not finite is skipped, and
too many in a row fail the job (``StepGuard``): a peer's NaN never reaches the parameters.

Links that the plan marks (fence ``rho < 1``) carry AdaTopK-compressed activations forward and
gradients backward; everything else is sent dense with the identity codec.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import trio

from fusionp2p import device as dev
from fusionp2p.average.outer import OuterConfig
from fusionp2p.average.robust import RobustConfig
from fusionp2p.compress.codec import kept_mask
from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.graph.executor import Inbox, StageExecutor, tied_sum
from fusionp2p.graph.program import DATA
from fusionp2p.net.channel import TensorChannel, TensorMessage
from fusionp2p.swarm.device import slowed
from fusionp2p.train.averager import AveragerConfig, ReplicaAverager, load_anchor_, open_replica_averager
from fusionp2p.train.boundary import check_tied_message, decode_boundary, encoded
from fusionp2p.train.claims import SpeedCheck
from fusionp2p.train.config import TrainConfig
from fusionp2p.train.deal import REDEAL_MIN_MICROS, Deal, redeals_in_band
from fusionp2p.train.guard import StepGuard, all_finite, pipeline_budget, replica_budget
from fusionp2p.train.local_step import is_local, local_actions, nonfinite_loss, run_local
from fusionp2p.train.optim import make_optimizer
from fusionp2p.train.schedule import (
    ActivationArrived,
    BackwardDone,
    ForwardDone,
    GradientArrived,
    OptimizerDone,
    OptimizerStep,
    RunBackward,
    RunForward,
    ScheduleConfig,
    SendActivation,
    SendGradient,
    StageSchedule,
)
from fusionp2p.train.spot import StepHooks
from fusionp2p.train.state import (
    StageState,
    load_optimizer_tensors,
    momentum_slices,
    optimizer_tensors,
    stream_segments,
)
from fusionp2p.types import AveragingStats

log = logging.getLogger(__name__)

# Marker queued by a reader when its channel ends (compared by identity).
_CLOSED = TensorMessage(job="", kind="closed")
_T = TypeVar("_T")

DataFn = Callable[[int, int], Mapping[str, torch.Tensor]]   # (global step, micro) -> data inputs by DAG name
ProgressFn = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class StageReport:
    """What one stage replica did in one step (the job runner turns it into progress events)."""

    step: int
    stage: int
    replica: int
    loss: float | None          # mean micro-batch loss on the loss stage, else None
    compute_s: float            # seconds spent in forward/backward/optimizer
    wall_s: float               # seconds of the whole step
    tokens: int                 # tokens this pipeline processed in the step
    eval: bool = False          # the final evaluation pass (forward only, consensus weights)
    averaging: AveragingStats | None = None   # CO2 rounds of this replica so far (None without CO2)
    skipped: str = ""           # why this step's optimizer step was skipped ("" when it ran)
    outliers: tuple[str, ...] = ()   # replicas (peer ids) this one stopped averaging with: clipped too often


@dataclass(kw_only=True)
class StageContext:
    """Everything one stage replica needs (runtime objects; built by the job runner)."""

    job: str
    executor: StageExecutor
    config: TrainConfig
    replica: int
    replicas: int
    links: Mapping[int, TensorChannel]             # other stage of this pipeline -> channel
    peers: Sequence[TensorChannel] = ()            # the other replicas of this stage (sorted by peer id)
    data: DataFn
    tokens_per_micro: int
    rho_out: Mapping[int, float] = field(default_factory=dict)   # dst stage -> AdaTopK kept fraction
    report: Callable[[StageReport], Awaitable[None]]
    checkpoint: Callable[[int, dict[str, torch.Tensor]], Awaitable[None]] | None = None
    boundary: Callable[[int], Awaitable[None]] | None = None   # after each step, with the steps completed
    start_step: int = 0
    stop_step: int | None = None                   # train steps [start_step, stop_step); None: config.steps
    restore: StageState | None = None              # state handed over at a re-plan or read from a checkpoint
    halt: Halt | None = None                       # set by the job while training: stop at a step boundary
    recv_timeout: float | None = None              # seconds to wait for any one message (None: forever)
    eval_data: DataFn | None = None                # the held-out examples (for the final evaluation)
    data_ready: Callable[[int, int], Awaitable[None]] | None = None   # a streamed dataset's wait (jobs/data_shards.py)
    # micro-batches per ``micro_period`` steps of every pipeline (replica index), in proportion to speed
    # (``Plan.micro``); () = ``config.micro_batches`` a step each. Each step's ``micro_batches x replicas``
    # micro-batches are dealt out in pipeline order by ``plan.micro_schedule``, and the averages weigh
    # each replica by its share.
    micro: Sequence[int] = ()
    micro_period: int = 1
    # streaming CO2: apply each fragment's round this many steps after its snapshot (OuterConfig.lag; the
    # job sets it from the plan: jobs/build.averaging_lag)
    averaging_lag: int = 1
    # CO2.wire "bf16": the replicas whose links carry it, priced per link (jobs/build.averaging_bf16; None: all)
    averaging_bf16: frozenset[int] | None = None
    # emulation (the testbed's ``slowdown``, ``fusionp2p node --emulate-slowdown``): every forward, backward
    # and optimizer step takes this many times what it takes at the host's CPU share (``compute_cpus``
    # cores, None: its wall time), the extra as a sleep in the compute thread, the way a slower
    # accelerator keeps the host's CPU free for the node's networking
    compute_slowdown: float = 1.0
    compute_cpus: float | None = None
    spot: StepHooks | None = None   # verified stages (train/spot.py Ledger): state kept before a step, claims after


@dataclass(slots=True)
class Halt:
    """A planned stop that the job may ask for while the worker runs (a re-plan at a step boundary).

    ``at``: the worker runs no step ``>= at``; the step before it ends the way the last step of the
    job does (CO2's final round, so that the replicas agree), without the evaluation pass.
    """

    at: int | None = None


class StageWorker:
    """Runs ``config.steps`` training steps of one stage replica, then a final evaluation pass."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.ex = ctx.executor
        self.prog = ctx.executor.program
        self._local = is_local(self.prog)
        params = self.ex.parameters()
        self._names = list(self.prog.param_names)
        self._params = [params[n] for n in self._names if n in params]
        self.opt = make_optimizer(self._params, ctx.config)
        self.completed = ctx.start_step      # steps whose optimizer update is applied (the next step to run)
        self._momentum: list[tuple[int, torch.Tensor]] | None = None   # our CO2 momentum slices, kept at the end
        if ctx.restore is not None:
            self._restore(ctx.restore)
        comp = ctx.config.adatopk
        # the dense finish (AdaTopK.dense_finish): from this step on, every fence ramps up to dense (_rho_at)
        self._dense_from = comp.dense_from(ctx.config.steps) if comp is not None else ctx.config.steps
        co2 = ctx.config.co2
        # CO2 across the replicas of this stage runs in a ReplicaAverager (train/averager.py): streaming
        # (default) averages one of tau fragments per step in the background of the next step; stream=False
        # averages the whole vector every tau steps, applied one round late; sync=True blocks instead.
        self._outer: OuterConfig | None = None
        if co2 is not None and ctx.replicas > 1:
            self._outer = OuterConfig(
                tau=co2.tau, outer_lr=co2.outer_lr, outer_momentum=co2.outer_momentum,
                penalty=co2.penalty, penalty_value=co2.penalty_scale,
                clip="elementwise" if co2.clip is not None else "none",
                clip_threshold=co2.clip if co2.clip is not None else math.inf, sync=co2.sync, stream=co2.stream,
                lag=ctx.averaging_lag)
        self._queue_send, self._queue_recv = trio.open_memory_channel[tuple[int, TensorMessage]](math.inf)
        self._avg_send, self._avg_recv = trio.open_memory_channel[TensorMessage](math.inf)
        self._early: dict[int, list[tuple[int, TensorMessage]]] = {}
        self._deferred: list[tuple[int, TensorMessage]] = []   # training messages an evaluation pass set aside
        self._kept: dict[tuple[int, str], torch.Tensor] = {}   # this step's forward keep-masks of compressed inputs
        self._tied_box: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}   # (param, stage) -> (grad, ok)
        self._grads_ahead: dict[int, dict[str, torch.Tensor]] = {}   # all-reduce gradients of the next step, by replica
        self.src_of = {r.name: r.src for r in self.prog.recv}
        self._closed_links: set[int] = set()
        self._avg: ReplicaAverager | None = None
        # hostile peers (train/guard.py): bounded queues, and no non-finite value reaches the parameters
        self._guard = StepGuard(stage=self.prog.stage)
        self._skipped = ""
        # which of each step's micro-batches this pipeline runs (train/deal.py), and whether the replicas
        # re-deal them by the speeds their averaging rounds carry
        self._deal = Deal(ctx.micro, ctx.micro_period, replica=ctx.replica, replicas=ctx.replicas,
                          micro_batches=ctx.config.micro_batches)
        self._redealing = self._outer is not None and redeals_in_band(ctx.config.co2, ctx.micro, self.prog.num_stages)
        # ... by the speeds as checked against when each replica's parts arrive (train/claims.py)
        # ... with 3 or more replicas: with 2 each is the other's only witness (one word against another), and the
        # arrival times of an honest pair on a busy host contradicted its claims and dealt it lopsided (2.5 of 8
        # micro-batches, swinging every step: benchmarks.churn's goodput 0.81 -> 0.70)
        self.claims = SpeedCheck(enabled=ctx.config.co2 is not None and ctx.config.co2.robust and ctx.replicas >= 3)
        # forward + backward seconds and micro-batches of this epoch's steps after its first (which warms up):
        # the speed this replica trains at, which the job's leader may re-balance the micro-batches by
        # (jobs/rebalance.py). Not the optimizer step nor the all-reduce: they do not scale with the count
        self.busy_s = 0.0
        self.busy_micros = 0
        self._first_done: tuple[float, int] | None = None   # (when, completed) at the end of this epoch's first step
        self._pipe_budget = pipeline_budget(self.prog, self._deal.most)
        self._avg_budget = replica_budget(self.prog, len(ctx.peers), sum(p.numel() for p in self._params))

    def speed_report(self) -> dict[str, Any]:
        """This replica's forward + backward seconds per micro-batch (``micro_s``, over ``micros``; its own
        figure) and, by peer id, the other replicas' as the averaging rounds measured them (``peers_s``:
        ``train/claims.py``); the leader re-balances by both (``jobs/rebalance.py:bounded``)."""
        out: dict[str, Any] = {"micro_s": self.busy_s / self.busy_micros, "micros": self.busy_micros} if self.busy_micros else {}
        me, avg = f"r{self.ctx.replica}", self._avg
        if avg is not None and self.claims.measured:
            out["peers_s"] = {avg.peer_of(n): s for n, s in self.claims.measured.items() if n != me}
        return out

    def seconds_left(self) -> float | None:
        """The job's steps left at the rate this epoch has trained since its first step (which warms up);
        None until a step after the first completed."""
        if self._first_done is None:
            return None
        t0, s0 = self._first_done
        if self.completed <= s0:
            return None
        return max(0, self.ctx.config.steps - self.completed) * (time.monotonic() - t0) / (self.completed - s0)

    # ------------------------------------------------------------------ state
    def _layout(self) -> list[tuple[str, int]]:
        return [(n, p.numel()) for n, p in zip([n for n in self._names if n in self.ex.parameters()], self._params,
                                                strict=True)]

    def _restore(self, st: StageState) -> None:
        """Load a handed-over state: every parameter and buffer of this stage must be in it."""
        own = self.ex.state_dict()
        missing = sorted(set(own) - set(st.tensors))
        if missing:
            raise RemoteProtocolError(f"stage {self.prog.stage}: the handed-over state lacks {missing[:5]}")
        with torch.no_grad():
            for name, t in own.items():
                src = st.tensors[name]
                if src.shape != t.shape:
                    raise RemoteProtocolError(f"stage {self.prog.stage}: {name} has shape {tuple(src.shape)}, "
                                              f"expected {tuple(t.shape)}")
                t.copy_(src.to(t.dtype))
        names = {p: n for n, p in self.ex.parameters().items()}
        if st.optimizer:
            load_optimizer_tensors(self.opt, names, st.optimizer, st.optimizer_groups)

    def export_state(self, *, copy: bool = True) -> StageState:
        """This replica's state after its last completed step (parameters, optimizer, momentum shard). Without
        *copy*, on a CPU stage the state's tensors are the live ones: for a caller that has it written before
        the next step changes them (a node's stage file: a copy would double the stage's memory)."""
        names = {p: n for n, p in self.ex.parameters().items()}
        opt, groups = optimizer_tensors(self.opt, names)
        momentum: dict[str, tuple[tuple[int, torch.Tensor], ...]] = {}
        for lo, shard in self._momentum or ():   # one slice per fragment in streaming mode
            for name, sl in momentum_slices(self._layout(), lo, shard).items():
                momentum[name] = momentum.get(name, ()) + sl
        own = self.ex.state_dict()
        def host(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {k: v.clone() if copy else v for k, v in zip(ts, dev.to_host(list(ts.values())))}
        return StageState(step=self.completed, tensors=host(own), optimizer=host(opt), optimizer_groups=groups,
                          momentum=momentum)

    def _stop(self) -> int:
        cfg = self.ctx.config
        stop = cfg.steps if self.ctx.stop_step is None else min(cfg.steps, self.ctx.stop_step)
        if self.ctx.halt is not None and self.ctx.halt.at is not None:
            stop = min(stop, max(self.ctx.halt.at, self.completed))   # a step already under way ends the run
        return stop

    # ------------------------------------------------------------------ params
    def _flat(self) -> torch.Tensor:
        if not self._params:
            return torch.zeros(0)
        return torch.cat([p.reshape(-1).to(torch.float32) for p in dev.to_host(self._params)])   # CO2 runs on the host

    # ------------------------------------------------------------------ main
    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for src, ch in self.ctx.links.items():
                nursery.start_soon(self._reader, src, ch, False)
            if self._outer is None:
                for ch in self.ctx.peers:   # gradient all-reduce messages (the averager owns them under CO2)
                    nursery.start_soon(self._reader, -2, ch, True)
                await self._train(None)
            else:
                names = await self._replica_names()
                me = f"r{self.ctx.replica}"
                co2, bf16 = self.ctx.config.co2, self.ctx.averaging_bf16
                acfg = AveragerConfig(outer=self._outer, job=self.ctx.job, stage=self.prog.stage,
                                      round_timeout=self.ctx.recv_timeout or 600.0, weight=self._deal.share,
                                      wire=co2.wire if co2 is not None else "fp32", bf16_peers=None if bf16 is None
                                      else frozenset(f"r{k}" for k in bf16),
                                      robust=RobustConfig() if co2 is not None and co2.robust else None)
                restored = self.ctx.restore
                momentum = restored.momentum_vector(self._layout()) if restored is not None else None
                async with open_replica_averager(acfg, peers=sorted([me, *names]), me=me, channels=names,
                                                 initial=self._flat(), momentum=momentum,
                                                 segments=stream_segments(self._layout(), {tp.name for tp in self.prog.tied})) as avg:
                    self._avg = avg
                    try:
                        await self._train(avg)
                    finally:
                        self._momentum = avg.momentum_shards()
            if self.completed >= self.ctx.config.steps:
                await self._eval_pass(self.ctx.config.steps)
            nursery.cancel_scope.cancel()

    async def _train(self, avg: ReplicaAverager | None) -> None:
        cfg = self.ctx.config
        step = self.ctx.start_step
        t_start = time.perf_counter()
        t_steps = t_avg = t_comp = t_wall = 0.0   # where the time goes (logged at the end)
        t_final = w_max = 0.0                     # of t_avg: the last step's average; the longest other boundary
        while step < self._stop():
            t0 = time.perf_counter()
            if self.ctx.spot is not None:
                await self.ctx.spot.before(step)
            compute, wall = await self._train_step(step)
            if self.ctx.spot is not None:
                await self.ctx.spot.after(step)
            t1 = time.perf_counter()
            t_steps += t1 - t0
            t_comp += compute
            t_wall += wall
            last = step + 1 >= self._stop()    # the job's end, or a planned halt asked for meanwhile
            if avg is not None and self._outer is not None and self._outer.streaming:
                # streaming CO2: one fragment averaged per step, applied one step late; the last step
                # instead averages every fragment so that the replicas end identical
                if last:
                    final_all = await avg.finalize(self._params)
                    if final_all is not None:
                        self._load_anchor(final_all.anchor, step)
                else:
                    measured = self._redealing and self.busy_micros >= REDEAL_MIN_MICROS
                    avg.speed = self.busy_s / self.busy_micros if measured else 0.0
                    res = await avg.round_boundary(self._params, lr=cfg.lr_at(step))
                    self._load_anchor(res.anchor, step, ranges=res.ranges)
                    self.claims.launched(res.launched_round, self._deal.counts(step))
                    if self._redealing and res.speeds:
                        self._redeal(self.claims.check(res.consumed_round, res.speeds, res.arrivals), step + 1, avg)
            elif avg is not None and self._outer is not None and ((step + 1) % self._outer.tau == 0 or last):
                res = await avg.round_boundary(self._params, lr=cfg.lr_at(step))
                self._load_anchor(res.anchor, step)
                if last:
                    final = await avg.finalize()   # the round still in flight (async mode)
                    if final is not None:
                        self._load_anchor(final.anchor, step)
            dt = time.perf_counter() - t1
            t_avg += dt
            if last:
                t_final = dt
            else:
                w_max = max(w_max, dt)
            self.completed = step + 1
            if self._first_done is None:
                self._first_done = (time.monotonic(), self.completed)
            if self.ctx.checkpoint is not None and (last or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)):
                await self.ctx.checkpoint(step + 1, self.ex.state_dict())
            if self.ctx.boundary is not None and not last:
                await self.ctx.boundary(step + 1)   # the job's background state copies (jobs/shadow.py)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and not last:
                await self._eval_pass(step + 1)    # the held-out loss every eval_every steps
            step += 1
        n = step - self.ctx.start_step
        if n:
            total = time.perf_counter() - t_start
            st = avg.stats if avg is not None else None
            rounds = (f", rounds {st.seconds / st.rounds:.3f} s on average, applied {self._outer.lag if self._outer else 1} "
                      f"step(s) late" if st is not None and st.rounds else "")
            log.info("stage %d replica %d: %d steps in %.2f s: train steps %.2f s (%.4g micro-batches each; compute "
                     "%.2f s, messages and waits %.2f s, progress report %.2f s), averaging boundaries %.2f s (the "
                     "last step's %.2f s, the longest other %.3f s%s), the rest (checkpoints, evaluation) %.2f s",
                     self.prog.stage, self.ctx.replica, n, total, t_steps, self._deal.share, t_comp, t_wall - t_comp,
                     t_steps - t_wall, t_avg, t_final, w_max, rounds, total - t_steps - t_avg)

    def _load_anchor(self, anchor: torch.Tensor | None, step: int, *, ranges: Sequence[tuple[int, int]] = ()) -> None:
        """Load the averaged vector, or (streaming) one fragment of it into its flat *ranges*."""
        if anchor is None:
            return
        if not all_finite([anchor]):   # the round refuses non-finite parts; this is the last line
            log.warning("stage %d, step %d: averaged anchor is not finite; not loaded", self.prog.stage, step)
            return
        load_anchor_(self._params, anchor, ranges)

    async def _replica_names(self) -> dict[str, TensorChannel]:
        """Name each replica channel by the replica index its far end announces (a one-message hello)."""
        me = f"r{self.ctx.replica}"
        for ch in self.ctx.peers:
            await ch.send(TensorMessage(job=self.ctx.job, kind="avg-hello", stage=self.prog.stage, name=me))
        out: dict[str, TensorChannel] = {}
        for ch in self.ctx.peers:
            with trio.fail_after(self.ctx.recv_timeout or 600.0):
                msg = await ch.receive()
            if msg.kind != "avg-hello" or msg.job != self.ctx.job or not msg.name.startswith("r") or msg.name in out or msg.name == me:
                raise RemoteProtocolError(f"stage {self.prog.stage}: bad replica hello {msg.key}")
            out[msg.name] = ch
        return out

    async def _reader(self, src: int, ch: TensorChannel, avg: bool) -> None:
        while True:
            try:
                msg = await ch.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                # A neighbour closes only when it is done (or gave up); queue a marker behind its last
                # message so that a wait for more from it ends at once instead of at the deadline.
                if not avg:
                    self._queue_send.send_nowait((src, _CLOSED))
                return
            if msg.job != self.ctx.job:
                raise RemoteProtocolError(f"message of job {msg.job!r} on a channel of job {self.ctx.job!r}")
            if avg:
                self._avg_budget.admit(msg)
                self._avg_send.send_nowait(msg)
            else:
                self._pipe_budget.admit(msg)
                self._queue_send.send_nowait((src, msg))

    async def _next_message(self, step: int) -> tuple[int, TensorMessage]:
        for i, (src, msg) in enumerate(self._deferred):   # set aside by an evaluation pass (already counted)
            if msg.step == step:
                del self._deferred[i]
                return src, msg
        early = self._early.get(step)
        if early:
            got = early.pop(0)
            self._pipe_budget.release(got[1])
            return got
        while True:
            src, msg = await self._receive(self._queue_recv, f"stage {self.prog.stage}, step {step}")
            if msg is _CLOSED:
                self._closed_links.add(src)
                if self._closed_links >= set(self.ctx.links):
                    raise PeerUnavailable(f"stage {src}", f"every link of stage {self.prog.stage} closed before step {step} ended")
                continue
            if msg.step == step:
                self._pipe_budget.release(msg)
                return src, msg
            if msg.step < step:
                raise RemoteProtocolError(f"stage {self.prog.stage}: message of past step {msg.step}")
            self._early.setdefault(msg.step, []).append((src, msg))

    async def _receive(self, ch: trio.MemoryReceiveChannel[Any], what: str) -> Any:
        timeout = self.ctx.recv_timeout
        if timeout is None:
            return await ch.receive()
        try:
            with trio.fail_after(timeout):
                return await ch.receive()
        except trio.TooSlowError:
            raise PeerUnavailable("neighbour", f"{what}: no message within {timeout:.0f} s") from None

    def _redeal(self, speeds: Sequence[tuple[str, float]], step: int, avg: ReplicaAverager) -> None:
        """From *step* on, the deal for the speeds a consumed round carried (:meth:`Deal.redeal`), with this
        replica's new share as its weight in the rounds it launches."""
        old = self._deal.share
        v = self._deal.redeal(speeds)
        if v is None:
            return
        deal = self._deal
        avg.weight = deal.share
        log.info("stage %d replica %d: from step %d, %s micro-batches a step by the measured %s ms per "
                 "micro-batch (this replica %.4g -> %.4g)", self.prog.stage, self.ctx.replica, step,
                 ", ".join(f"{c / deal.period:.4g}" for c in deal.micro), ", ".join(f"{1e3 * x:.0f}" for x in v),
                 old, deal.share)

    async def _data(self, sstep: int, micro: int) -> Mapping[str, torch.Tensor]:
        if self.ctx.data_ready is not None:
            await self.ctx.data_ready(sstep, micro)
        return self.ctx.data(sstep, micro)

    def _sample(self, step: int, k: int) -> tuple[int, int]:
        """The data index (sampler step, micro) of micro-batch *k* of *step*'s ``M x R`` (this pipeline's
        micro-batch ``mu`` is ``first + mu``: ``(step * R + r, mu)`` when every pipeline runs ``M``)."""
        m = self.ctx.config.micro_batches
        return step * self.ctx.replicas + k // m, k % m

    async def _train_step(self, step: int) -> tuple[float, float]:
        """One training step; its compute and wall seconds (the wall before the progress report)."""
        cfg, prog, ex = self.ctx.config, self.prog, self.ex
        t0 = time.perf_counter()
        compute = fb = 0.0                 # fb: forward and backward only
        m_count, first = self._deal.at(step)
        sched = StageSchedule(ScheduleConfig(kind=cfg.schedule, stages=prog.num_stages, micro_batches=m_count,
                                             stage=prog.stage))
        inbox = Inbox(prog)
        self._kept = {}           # (micro, input name) -> entries the compressed forward kept, for the backward
        has_remote_in = any(r.src != DATA for r in prog.recv)
        has_data = any(r.src == DATA for r in prog.recv)
        ready_in: dict[int, dict[str, torch.Tensor]] = {}
        ready_grad: dict[int, dict[str, torch.Tensor]] = {}
        outs: dict[int, dict[str, torch.Tensor]] = {}
        backs: dict[int, dict[str, torch.Tensor]] = {}
        losses: dict[int, float] = {}
        for mu in range(m_count):
            if not has_data:
                break   # a stage that reads no data input asks for none (a streamed dataset is not fetched here)
            data = await self._data(*self._sample(step, first + mu))
            done = None
            for r in prog.recv:
                if r.src == DATA:
                    done = inbox.put_activation(mu, r.name, data[r.name])
            if done is not None:
                ready_in[mu] = done
        scale = 1.0 / m_count
        if self._local:   # a stage that talks to no other one: the step in one thread call
            compute, fb, losses = await self._local_step(step, sched, ready_in, scale)
            actions, finished = [], True
        else:
            actions, finished = list(sched.start()), False
        while not finished:
            while actions:
                act = actions.pop(0)
                if isinstance(act, RunForward):
                    t = time.perf_counter()
                    outs[act.micro] = await trio.to_thread.run_sync(self._slowed(ex.forward), act.micro, ready_in.pop(act.micro))
                    dt = time.perf_counter() - t
                    compute, fb = compute + dt, fb + dt
                    if prog.loss is not None:
                        losses[act.micro] = float(outs[act.micro][prog.loss])
                        if not math.isfinite(losses[act.micro]) and cfg.on_nonfinite == "fail":
                            raise nonfinite_loss(f"stage {prog.stage}, step {step}", act.micro, losses[act.micro])
                    actions += sched.handle(ForwardDone(micro=act.micro))
                elif isinstance(act, SendActivation):
                    await self._send_acts(step, act.micro, outs.pop(act.micro))
                elif isinstance(act, RunBackward):
                    t = time.perf_counter()
                    backs[act.micro] = await trio.to_thread.run_sync(self._slowed(
                        lambda mu=act.micro: ex.backward(mu, ready_grad.pop(mu, {}), loss_scale=scale)))
                    dt = time.perf_counter() - t
                    compute, fb = compute + dt, fb + dt
                    actions += sched.handle(BackwardDone(micro=act.micro))
                elif isinstance(act, SendGradient):
                    await self._send_grads(step, act.micro, backs.pop(act.micro))
                elif isinstance(act, OptimizerStep):
                    compute += await self._step_optimizer(step)
                    actions += sched.handle(OptimizerDone())
                    finished = True
            if finished:
                break
            src, msg = await self._next_message(step)
            if msg.kind == "tied":
                self._keep_tied(src, msg)   # a holder that finished its backward first (not a coded tensor)
                continue
            t_in = decode_boundary(msg)
            if msg.kind == "act":
                if not has_remote_in:
                    raise RemoteProtocolError(f"stage {prog.stage} receives no activations")
                mask = kept_mask(msg.tensors, msg.meta) if msg.meta else None
                if mask is not None:
                    self._kept[(msg.micro, msg.name)] = mask
                done = inbox.put_activation(msg.micro, msg.name, t_in)
                if done is not None:
                    ready_in[msg.micro] = done
                    actions += sched.handle(ActivationArrived(micro=msg.micro))
            elif msg.kind == "grad":
                got = inbox.put_grad(msg.micro, msg.name, src, t_in)
                if got is not None:
                    ready_grad[msg.micro] = got
                    actions += sched.handle(GradientArrived(micro=msg.micro))
            else:
                raise RemoteProtocolError(f"unexpected message kind {msg.kind!r} on a pipeline link")
        loss = sum(losses[m] for m in sorted(losses)) / len(losses) if losses else None
        wall = time.perf_counter() - t0
        if step > self.ctx.start_step:
            self.busy_s, self.busy_micros = self.busy_s + fb, self.busy_micros + m_count
        await self.ctx.report(StageReport(step=step, stage=prog.stage, replica=self.ctx.replica, loss=loss,
                                          compute_s=compute, wall_s=wall,
                                          tokens=self.ctx.tokens_per_micro * m_count,
                                          averaging=self._avg.stats if self._avg is not None else None,
                                          skipped=self._skipped, outliers=self._avg.new_outliers() if self._avg is not None else ()))
        return compute, wall

    async def _step_optimizer(self, step: int) -> float:
        """Tied sums, the all-reduce (replicas without CO2) and the optimizer step; their seconds."""
        t = time.perf_counter()
        if self.prog.tied:
            await self._sum_tied(step)          # tied weights: one logical parameter (TiedParam)
        if self._outer is None and self.ctx.peers:
            await self._allreduce_grads(step)   # replicas without CO2: synchronous data parallelism
        await trio.to_thread.run_sync(self._slowed(self._optimizer_step), step)
        return time.perf_counter() - t

    async def _local_step(self, step: int, sched: StageSchedule, inputs: dict[int, dict[str, torch.Tensor]],
                          scale: float) -> tuple[float, float, dict[int, float]]:
        """A local stage's step (train/local_step.py): compute seconds, forward and backward seconds, losses.
        The optimizer step runs in the same call unless tied sums or the all-reduce must come first."""
        alone = not self.prog.tied and not (self._outer is None and self.ctx.peers)
        res = await trio.to_thread.run_sync(functools.partial(
            run_local, self.ex, local_actions(sched), inputs, scale=scale, slowed=self._slowed,
            fail_nonfinite=self.ctx.config.on_nonfinite == "fail", where=f"stage {self.prog.stage}, step {step}",
            optimizer=functools.partial(self._optimizer_step, step) if alone else None))
        extra = 0.0 if res.stepped else await self._step_optimizer(step)
        return res.fb_s + res.optimizer_s + extra, res.fb_s, res.losses

    async def _send_acts(self, step: int, micro: int, out: Mapping[str, torch.Tensor], *, dense: bool = False,
                         kind: str = "act") -> None:
        for o in self.prog.send:
            for d in o.dsts:
                meta, tensors = await encoded(out[o.name], 1.0 if dense else self._rho_at(step, self.ctx.rho_out.get(d, 1.0)))
                await self.ctx.links[d].send(TensorMessage(job=self.ctx.job, kind=kind, stage=d, step=step,
                                                           micro=micro, name=o.name, meta=meta, tensors=tensors))

    async def _send_grads(self, step: int, micro: int, grads: Mapping[str, torch.Tensor]) -> None:
        for name, g in grads.items():
            src = self.src_of[name]
            # the gradient goes back over the same fence as its activation, with the same kept fraction.
            # It is the exact gradient of the forward's masking (AdaTopK's "masked" backward): zero where
            # the forward dropped the entry, so at most the forward's k entries are left and the top-k
            # below keeps them. Top-k of the raw gradient (straight-through) sent other entries than the
            # forward kept, and a 2 x 2 GPT-2 with its fence at 0.23 stopped learning at a loss of 3.2
            # (benchmarks.convergence, 2,000 steps; docs/averaging.md)
            mask = self._kept.pop((micro, name), None)
            if mask is not None:
                g = g * dev.to_device(mask, g.device)
            meta, tensors = await encoded(g, self._rho_at(step, self.ctx.rho_out.get(-1 - src, 1.0)))   # fence in
            await self.ctx.links[src].send(TensorMessage(job=self.ctx.job, kind="grad", stage=src, step=step,
                                                         micro=micro, name=name, meta=meta, tensors=tensors))

    def _rho_at(self, step: int, rho: float) -> float:
        """The kept fraction of a fence at *rho* in *step*: *rho*, then in the dense finish a geometric ramp
        from *rho* up to dense at the last step (a switch straight to dense raised the byte MLP's loss from
        1.59 to 2.62, and 40 steps at the end of a cosine schedule did not bring it back)."""
        if step < self._dense_from or rho >= 1.0:
            return rho
        frac = min(1.0, (step - self._dense_from + 1) / (self.ctx.config.steps - self._dense_from))
        return math.pow(rho, 1.0 - frac)

    def _keep_tied(self, src: int, msg: TensorMessage) -> None:
        params = self.ex.parameters()
        holders = {tp.name: (tp.stages, tuple(params[tp.name].shape), params[tp.name].dtype) for tp in self.prog.tied}
        g, flag = check_tied_message(msg, src=src, holders=holders, stage=self.prog.stage)
        self._tied_box.setdefault((msg.name, src), (g, flag))

    async def _sum_tied(self, step: int) -> None:
        """Sum the gradients of every tied parameter with its other holders (ascending stage order, the
        same sum on every holder, see graph/program.py TiedParam). Each message carries the holder's
        partial gradient and whether all its gradients are finite; a holder that will skip this step
        makes every holder skip it (the tied gradient turns NaN), so the copies never diverge."""
        prog, params = self.prog, self.ex.parameters()
        ok = torch.tensor([1.0 if all_finite([p.grad for p in self._params]) else 0.0])
        mine: dict[str, torch.Tensor] = {}
        for tp in prog.tied:
            p = params[tp.name]
            mine[tp.name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            _, (host,) = await encoded(mine[tp.name], 1.0)
            for other in tp.stages:
                if other != prog.stage:
                    await self.ctx.links[other].send(TensorMessage(job=self.ctx.job, kind="tied", stage=other, step=step,
                                                                   name=tp.name, tensors=(host, ok)))
        need = {(tp.name, o) for tp in prog.tied for o in tp.stages if o != prog.stage}
        while not need <= set(self._tied_box):
            src, msg = await self._next_message(step)
            if msg.kind != "tied":
                raise RemoteProtocolError(f"stage {prog.stage}: {msg.kind!r} message while summing tied gradients")
            self._keep_tied(src, msg)
        with torch.no_grad():
            for tp in prog.tied:
                p = params[tp.name]
                parts: list[torch.Tensor | None] = []
                healthy = True
                for o in tp.stages:
                    if o == prog.stage:
                        parts.append(mine[tp.name])
                        healthy = healthy and bool(ok.item() == 1.0)
                        continue
                    g, flag = self._tied_box.pop((tp.name, o))   # shape and dtype checked at receipt
                    parts.append(dev.to_device(g, p.device))
                    healthy = healthy and flag.numel() == 1 and bool(flag.item() == 1.0)
                total = tied_sum(parts)
                assert total is not None
                p.grad = total if healthy else torch.full_like(total, math.nan)

    async def _allreduce_grads(self, step: int) -> None:
        """Average parameter gradients with the other replicas of this stage (every step, blocking)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        mine = torch.cat([g.reshape(-1).to(torch.float32) for g in grads]) if grads else torch.zeros(0)
        _, (mine,) = await encoded(mine, 1.0)   # averaged on the host, where the peers' parts arrive
        me = f"g{self.ctx.replica}"
        for ch in self.ctx.peers:
            await ch.send(TensorMessage(job=self.ctx.job, kind="grad-avg", stage=self.prog.stage, step=step, name=me,
                                        tensors=(mine,)))
        got = {me: mine}
        for name, g in self._grads_ahead.pop(step, {}).items():
            got.setdefault(name, g)
        micro = self._deal.counts(step)
        weight = {f"g{k}": float(m) for k, m in enumerate(micro)}
        names = {f"g{k}" for k in range(len(self.ctx.peers) + 1)}
        while len(got) <= len(self.ctx.peers):
            msg = await self._receive(self._avg_recv, f"stage {self.prog.stage}, gradient all-reduce at step {step}")
            self._avg_budget.release(msg)
            if (msg.kind != "grad-avg" or msg.step not in (step, step + 1) or len(msg.tensors) != 1
                    or msg.tensors[0].shape != mine.shape):
                raise RemoteProtocolError(f"stage {self.prog.stage}: bad gradient message {msg.key}")
            if msg.name not in names:
                raise RemoteProtocolError(f"stage {self.prog.stage}: gradient from an unknown replica {msg.name!r}")
            if msg.step == step + 1:
                # from 3 replicas on: one that has every gradient of this step went on to the next before a
                # third replica's gradient of this step reached us. No replica can be two steps ahead (it
                # would need our gradient of the next step), so one held message per replica at most.
                self._grads_ahead.setdefault(msg.step, {}).setdefault(msg.name, msg.tensors[0].to(torch.float32))
                continue
            got.setdefault(msg.name, msg.tensors[0].to(torch.float32))
        if micro:   # each replica's gradient is the mean over its own micro-batches: weigh by their count
            total = sum(weight[k] for k in got)
            avg = sum(got[k] * (weight[k] / total) for k in sorted(got))
            assert isinstance(avg, torch.Tensor)
        else:
            avg = torch.stack([got[k] for k in sorted(got)]).mean(dim=0)   # same order, same bits on every replica
        off = 0
        with torch.no_grad():
            for p, g in zip(self._params, grads, strict=True):
                n = g.numel()
                p.grad = dev.to_device(avg[off:off + n].view_as(g), g.device, dtype=g.dtype).clone()
                off += n

    def _slowed(self, fn: Callable[..., _T]) -> Callable[..., _T]:
        """*fn* slowed by the emulated slowdown (``swarm.device.slowed``)."""
        return slowed(fn, self.ctx.compute_slowdown, self.ctx.compute_cpus)

    def _optimizer_step(self, step: int) -> None:
        cfg = self.ctx.config
        self.ex.unscale_grads()   # fp16's loss scale (train/config.py precision)
        self._skipped = self._guard.check(step, [p.grad for p in self._params])
        if self._skipped:
            self.ex.zero_grad()
            return
        if cfg.grad_clip is not None and self._params:
            # the norm is this stage's; tied copies are clipped by their own norm, the same on every holder
            tied = {self.ex.parameters()[tp.name] for tp in self.prog.tied}
            for group in ([p for p in self._params if p not in tied], [p for p in self._params if p in tied]):
                if group:
                    torch.nn.utils.clip_grad_norm_(group, cfg.grad_clip)
        lr = cfg.lr_at(step)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.ex.zero_grad()
        dev.sync(self.ex.device)   # the step's timing covers the kernels, not their launches

    async def _eval_pass(self, step: int) -> None:
        """Forward only (dropout off) with the weights after *step* steps (at the end: the final,
        consensus weights), on one step's worth of the held-out examples when the dataset has them,
        else on the next training batch. Its messages are of kind ``eval``, apart from the training
        step *step*'s ``act`` messages, which carry the same step tag."""
        prog, ex = self.prog, self.ex
        losses: list[float] = []
        inbox = Inbox(prog)
        for mu in range(self.ctx.config.micro_batches):
            held = self.ctx.eval_data
            reads = any(r.src == DATA for r in prog.recv)
            data = held(0, mu) if held is not None else await self._data(step * self.ctx.replicas + self.ctx.replica, mu) if reads else {}
            ready = None
            for r in prog.recv:
                if r.src == DATA:
                    ready = inbox.put_activation(mu, r.name, data[r.name])
            while ready is None:
                src, msg = await self._next_message(step)
                if msg.kind in ("act", "grad", "tied"):
                    # the next step's messages (its tag is this pass's): a neighbour that finished its
                    # evaluation first and went on; kept for the training step that reads them
                    self._deferred.append((src, msg))
                    continue
                if msg.kind != "eval":
                    raise RemoteProtocolError(f"unexpected {msg.kind!r} message in the evaluation pass")
                ready = inbox.put_activation(msg.micro, msg.name, decode_boundary(msg))
            out = await trio.to_thread.run_sync(ex.evaluate, ready)
            if prog.loss is not None:
                losses.append(float(out[prog.loss]))
            await self._send_acts(step, mu, out, dense=True, kind="eval")   # evaluate the weights, not the codec
        loss = sum(losses) / len(losses) if losses else None
        await self.ctx.report(StageReport(step=step, stage=prog.stage, replica=self.ctx.replica, loss=loss,
                                          compute_s=0.0, wall_s=0.0, tokens=0, eval=True))
