"""Pipeline schedules (GPipe and 1F1B) as a pure state machine per stage, per training step.

Theory of operation. A stage of an ``S``-stage pipeline runs ``M`` micro-batches through one
compute slot: forward ``F(m)`` needs the activation of ``m`` from the previous stage (stage 0 reads
data, so its inputs are always ready), backward ``B(m)`` needs ``F(m)`` done and the gradient of
``m`` from the next stage (the last stage computes the loss itself, so its gradient is ready as
soon as ``F(m)`` is done). The trio shell feeds events in and performs the actions out; it never
decides anything::

    sched = StageSchedule(ScheduleConfig(kind="1f1b", stages=S, micro_batches=M, stage=s))
    actions = sched.start()
    ...  actions += sched.handle(ActivationArrived(micro=m))   # from the previous stage
    ...  actions += sched.handle(ForwardDone(micro=m))          # when RunForward(m) finished

At most one ``RunForward``/``RunBackward`` is outstanding at a time (one compute slot); sends are
emitted right after the compute that produced them and never block the machine (the shell applies
backpressure on the channel). When all ``M`` backwards are done the machine emits one
``OptimizerStep``; ``OptimizerDone`` completes the step. The shell makes a new machine per step and
buffers early messages of the next step by their step number (the data-plane key carries it).

Policies, among the work that is *ready*:

* ``gpipe``: all forwards first (lowest micro first), then the backwards. Up to ``M`` activations
  are stashed at once.
* ``1f1b``: a ready backward always goes first (it frees a stash); a forward starts only while
  fewer than ``min(S - stage, M)`` micro-batches are in flight (forwarded, not yet backwarded).
  That bounds the stash by ``S - stage`` (the classic 1F1B bound) and cannot deadlock for any
  message arrival order: the in-flight set of stage ``s+1`` is a subset of stage ``s``'s and is
  strictly smaller when ``s`` is full, so the last stage (bound 1) always makes progress.

Errors: a peer event that cannot happen (unknown micro, a duplicate, a gradient before our forward)
raises :class:`RemoteProtocolError`; a misuse by the shell (a ``ForwardDone`` for a compute never
started) raises :class:`LocalProtocolError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusionp2p.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from fusionp2p.plan.config import in_flight_limit

KINDS = ("gpipe", "1f1b")


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleConfig:
    kind: str
    stages: int
    micro_batches: int
    stage: int
    max_in_flight: int | None = None  # 1F1B only: override the S - stage bound (>= 1)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"schedule must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.stages < 1 or self.micro_batches < 1:
            raise ConfigError("a schedule needs at least one stage and one micro-batch")
        if not 0 <= self.stage < self.stages:
            raise ConfigError(f"stage {self.stage} outside [0, {self.stages})")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ConfigError("max_in_flight must be >= 1")

    @property
    def in_flight_limit(self) -> int:
        """Most micro-batches stashed at once (forwarded, backward not yet done): ``plan/config.py:
        in_flight_limit``, the figure the planner prices and the nodes hold a stage against."""
        return in_flight_limit(self.kind, self.stages, self.stage, self.micro_batches, self.max_in_flight)


# ---- events (into the machine) -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ActivationArrived:
    """The previous stage's output for *micro* is here (never sent to stage 0)."""

    micro: int


@dataclass(frozen=True, slots=True)
class GradientArrived:
    """The next stage's input gradient for *micro* is here (never sent to the last stage)."""

    micro: int


@dataclass(frozen=True, slots=True)
class ForwardDone:
    micro: int


@dataclass(frozen=True, slots=True)
class BackwardDone:
    micro: int


@dataclass(frozen=True, slots=True)
class OptimizerDone:
    pass


Event = ActivationArrived | GradientArrived | ForwardDone | BackwardDone | OptimizerDone

# ---- actions (out of the machine) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunForward:
    micro: int


@dataclass(frozen=True, slots=True)
class RunBackward:
    micro: int


@dataclass(frozen=True, slots=True)
class SendActivation:
    micro: int


@dataclass(frozen=True, slots=True)
class SendGradient:
    micro: int


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    pass


Action = RunForward | RunBackward | SendActivation | SendGradient | OptimizerStep


class StageSchedule:
    """The schedule of one stage for one training step. Feed events, perform the returned actions."""

    __slots__ = (
        "_act_ready", "_busy", "_bwd_done", "_fwd_done", "_grad_ready", "_optimizing", "_started",
        "config", "done", "peak_in_flight",
    )

    def __init__(self, config: ScheduleConfig) -> None:
        self.config = config
        m = config.micro_batches
        first = config.stage == 0
        self._act_ready = [first] * m       # stage 0 reads its inputs from data
        self._grad_ready = [False] * m      # the last stage's gradient is set when its forward ends
        self._fwd_done = [False] * m
        self._bwd_done = [False] * m
        self._busy: RunForward | RunBackward | None = None
        self._optimizing = False
        self._started = False
        self.done = False
        self.peak_in_flight = 0

    # -- introspection -----------------------------------------------------------------------------

    @property
    def is_first(self) -> bool:
        return self.config.stage == 0

    @property
    def is_last(self) -> bool:
        return self.config.stage == self.config.stages - 1

    @property
    def in_flight(self) -> int:
        """Micro-batches whose activations are stashed (forward done, backward not yet)."""
        return sum(f and not b for f, b in zip(self._fwd_done, self._bwd_done))

    @property
    def busy(self) -> bool:
        return self._busy is not None or self._optimizing

    # -- the machine -------------------------------------------------------------------------------

    def start(self) -> list[Action]:
        """Begin the step; returns the first actions (stage 0 starts computing at once)."""
        if self._started:
            raise LocalProtocolError("schedule already started")
        self._started = True
        return self._next()

    def handle(self, event: Event) -> list[Action]:
        """Apply one event; return the actions it enables, in the order to perform them."""
        if not self._started:
            raise LocalProtocolError("call start() before handle()")
        out: list[Action] = []
        if isinstance(event, ActivationArrived):
            m = self._peer_micro(event.micro, "activation")
            if self.is_first:
                raise RemoteProtocolError("stage 0 received an activation")
            if self._act_ready[m]:
                raise RemoteProtocolError(f"duplicate activation for micro-batch {m}")
            self._act_ready[m] = True
        elif isinstance(event, GradientArrived):
            m = self._peer_micro(event.micro, "gradient")
            if self.is_last:
                raise RemoteProtocolError("the last stage received a gradient")
            if not self._fwd_done[m] or self._grad_ready[m]:
                # Our forward of m must precede the next stage's backward of m; anything else is forged.
                raise RemoteProtocolError(f"unexpected gradient for micro-batch {m}")
            self._grad_ready[m] = True
        elif isinstance(event, ForwardDone):
            m = self._finish(RunForward(event.micro))
            self._fwd_done[m] = True
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            if self.is_last:
                self._grad_ready[m] = True  # the loss is computed here
            else:
                out.append(SendActivation(m))
        elif isinstance(event, BackwardDone):
            m = self._finish(RunBackward(event.micro))
            self._bwd_done[m] = True
            if not self.is_first:
                out.append(SendGradient(m))
        elif isinstance(event, OptimizerDone):
            if not self._optimizing:
                raise LocalProtocolError("OptimizerDone without an OptimizerStep")
            self._optimizing = False
            self.done = True
        else:  # pragma: no cover - exhaustiveness guard for the type checker
            raise LocalProtocolError(f"unknown event {event!r}")
        out.extend(self._next())
        return out

    def _peer_micro(self, micro: int, what: str) -> int:
        if isinstance(micro, bool) or not isinstance(micro, int) or not 0 <= micro < self.config.micro_batches:
            raise RemoteProtocolError(f"{what} for micro-batch {micro!r} outside [0, {self.config.micro_batches})")
        if self.done:
            raise RemoteProtocolError(f"{what} for micro-batch {micro} after the step finished")
        return micro

    def _finish(self, expected: RunForward | RunBackward) -> int:
        if self._busy != expected:
            raise LocalProtocolError(f"{type(expected).__name__}({expected.micro}) completed but {self._busy!r} was running")
        self._busy = None
        return expected.micro

    def _next(self) -> list[Action]:
        """Pick the next compute, if the slot is free and something is ready."""
        if self._busy is not None or self._optimizing or self.done:
            return []
        m_all = self.config.micro_batches
        if all(self._bwd_done):
            self._optimizing = True
            return [OptimizerStep()]
        fwd = next((m for m in range(m_all) if self._act_ready[m] and not self._fwd_done[m]), None)
        bwd = next((m for m in range(m_all) if self._grad_ready[m] and not self._bwd_done[m]), None)
        action: RunForward | RunBackward | None = None
        if self.config.kind == "gpipe":
            if fwd is not None:
                action = RunForward(fwd)
            elif bwd is not None and all(self._fwd_done):
                action = RunBackward(bwd)
        else:  # 1f1b: backward first; forward only under the in-flight bound
            if bwd is not None:
                action = RunBackward(bwd)
            elif fwd is not None and self.in_flight < self.config.in_flight_limit:
                action = RunForward(fwd)
        if action is None:
            return []
        self._busy = action
        return [action]
