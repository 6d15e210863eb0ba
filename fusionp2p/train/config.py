"""The user's training settings: :class:`TrainConfig` and its parts (:class:`CO2`, :class:`AdaTopK`,
:class:`LRSchedule`), validated where they are built, with messages that say what to do.

Each config has ``to_wire()`` (a canonical msgpack-able dict) and ``from_wire(obj)``, which turns any
malformed or invalid value from a peer into :class:`RemoteProtocolError`. Floats are normalised to
``float`` in ``__post_init__`` so that an encoding round trip is byte-for-byte identical (the job's
content hash and signature depend on it).

The SDK accepts shorthands, normalised here: ``averaging="co2"`` → ``CO2()``, ``averaging="none"``
→ ``None``, ``compression="adatopk"`` → ``AdaTopK()``, ``lr_schedule="cosine"`` → ``LRSchedule()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fusionp2p.errors import ConfigError
from fusionp2p.wire import codec

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("1f1b", "gpipe")
NONFINITE = ("fail", "skip")
LR_KINDS = ("constant", "cosine", "linear")
PENALTIES = ("none", "constant", "elementwise", "lr_ratio")
CO2_WIRES = ("bf16", "fp32")   # how a CO2 round's parts travel (CO2.wire)
PLANNERS = ("opfence", "even_layers", "even_flops")
PRECISIONS = ("fp32", "bf16", "fp16")   # TrainConfig.precision (graph/executor.py COMPUTE_DTYPES)
RECOMPUTE = ("auto", "never", "always")  # TrainConfig.recompute (jobs/weights.py stage_recompute)



def _pos_int(name: str, v: object, *, minimum: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {v!r}")


def _num(name: str, v: object, *, lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False) -> float:
    """Check a number's range and return it as float (ints are accepted from users)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ConfigError(f"{name} must be a finite number, got {v!r}")
    f = float(v)
    if f < lo or f > hi or (lo_open and f == lo):
        bound = f"> {lo}" if lo_open else f">= {lo}"
        raise ConfigError(f"{name} must be {bound} and <= {hi}, got {f}")
    return f


def _float(obj: object, name: str, v: object, *, lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False) -> None:
    """Validate field *name* of a frozen dataclass and store it back as float (canonical encoding)."""
    object.__setattr__(obj, name, _num(name, v, lo=lo, hi=hi, lo_open=lo_open))


@dataclass(frozen=True, kw_only=True, slots=True)
class CO2:
    """CO2 averaging of the replicas of each stage (ALGORITHMS.md §2): every ``tau`` local steps, an
    outer step with ``outer_lr`` and heavy-ball ``outer_momentum`` on the average, overlapped with
    local compute. Three forms:

    * ``stream=True`` (default, asynchronous): the flat parameter vector is cut into ``tau`` fragments;
      after local step ``t`` fragment ``t mod tau`` is snapshotted and averaged in the background while
      step ``t + 1`` computes, and at the next step boundary its new anchor is applied as a jump that
      keeps the local progress made since the snapshot (Streaming DiLoCo, Douillard et al. 2025, with
      CO2's overlap). Each fragment is averaged once every ``tau`` steps (the bytes of CO2), but each
      average is one local step stale, not ``tau``. Measured (GPT-2 0.87M, 2 x 2, tau 4;
      docs/averaging.md): held-out loss 1.071x / 1.043x / 0.956x the per-step all-reduce at 500 / 800 /
      2,000 steps (1.014x on the byte MLP at 2,000), against 1.774x / 2.015x for ``stream=False`` (500 /
      800) and 1.016x / 1.022x / 0.999x for ``sync=True``.
    * ``stream=False``: the original CO2, the whole vector averaged every ``tau`` steps and applied one
      round (``tau`` local steps) late.
    * ``sync=True``: block on each average (SlowMo); ``stream`` is then ignored.

    Defaults: ``tau=4`` and ``outer_momentum=0.0`` — SlowMo's prior for up to 16 workers. Measured on
    the demo job (GPT-2 0.8M, 2 stages x 2 replicas, 60 steps, embedded swarm), before streaming: the
    one-round-stale form at tau 4, momentum 0 ended at loss 3.20; the reference code's momentum 0.5 at tau 8 ended at 3.98 (its stale momentum
    overshoots at the final outer step), and the synchronous form at tau 8 at 3.24.
    """

    tau: int = 4
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    clip: float | None = None           # element-wise clip of the outer momentum; None = no clip
    penalty: str = field(default="none", metadata={"wire": {"choices": PENALTIES}})   # staleness gap penalty Λ: none | constant | elementwise | lr_ratio
    penalty_scale: float = 1.0
    sync: bool = False                  # True: block on the average (SlowMo); for tests and equivalence
    # streaming (fragmented, one-step-stale) form of the asynchronous average; ignored when sync=True.
    # Left out of the wire map at its default, so older specs keep their bytes and signatures
    stream: bool = field(default=True, metadata={"wire": {"omit_default": True}})
    # "bf16": a round's parts travel as bf16 differences from the last average every replica holds
    # (half the bytes; the first round of each fragment, and any after a failed one, in fp32);
    # "fp32": every part as fp32 values. Left out of the wire map at its default
    wire: str = field(default="bf16", metadata={"wire": {"choices": CO2_WIRES, "omit_default": True}})
    # each shard owner reduces the replicas' parts by CenteredClip (average/robust.py): the exact mean when no
    # part is an outlier, a bounded shift when one lies; a replica clipped too often leaves the averaging.
    # Re-dealing replicas also check each other's speed claims against when their parts arrive
    # (train/claims.py). False: the plain mean, speeds as claimed. Left out of the wire map at its default
    robust: bool = field(default=True, metadata={"wire": {"omit_default": True}})

    def __post_init__(self) -> None:
        _pos_int("CO2.tau", self.tau)
        _float(self, "outer_lr", self.outer_lr, lo=0.0, lo_open=True)
        _float(self, "outer_momentum", self.outer_momentum, lo=0.0, hi=0.999)
        if self.clip is not None:
            _float(self, "clip", self.clip, lo=0.0, lo_open=True)
        if self.penalty not in PENALTIES:
            raise ConfigError(f"CO2.penalty must be one of {', '.join(PENALTIES)}, got {self.penalty!r}")
        _float(self, "penalty_scale", self.penalty_scale, lo=0.0)
        if not isinstance(self.sync, bool):
            raise ConfigError("CO2.sync must be True or False")
        if not isinstance(self.stream, bool):
            raise ConfigError("CO2.stream must be True or False")
        if self.wire not in CO2_WIRES:
            raise ConfigError(f"CO2.wire must be one of {', '.join(CO2_WIRES)}, got {self.wire!r}")
        if not isinstance(self.robust, bool):
            raise ConfigError("CO2.robust must be True or False")

    def to_wire(self) -> dict[str, Any]:
        return codec.to_wire(self)

    @classmethod
    def from_wire(cls, obj: Any) -> CO2:
        return codec.from_wire(cls, obj, "CO2 config")


@dataclass(frozen=True, kw_only=True, slots=True)
class AdaTopK:
    """AdaTopK compression on the links the plan marks slow (ALGORITHMS.md §1.6)."""

    # Smallest kept fraction the planner may choose: bounds the accuracy loss, which the planner's
    # time model does not see. Measured (docs/planning.md "How low a kept fraction may go"): at 0.1 the
    # reference GPT-2 ends ~6% above dense after 100 steps, at 0.01 18%; a byte-level MLP cut before
    # its activation diverged at 0.01 on the product (BENCHMARKS.md). 0.01 until this wave; 0.1 until
    # 2026-11-28, when benchmarks.convergence's byte MLP, its fence after a GELU kept at the floor over
    # 16 Mbit/s links, ended 2,000 steps at 1.61x the per-step all-reduce's held-out loss at 0.1 and 1.02x at
    # 0.3 (the GPT-2 reference's fence, on a residual stream, chose 0.23 and ended at 0.99x)
    rho_min: float = 0.3
    # Over the last ``dense_finish`` fraction of the job's steps every fence's kept fraction ramps up to dense
    # (geometrically, dense at the last step), so that the model the publisher downloads, which is evaluated
    # dense, ends trained on dense activations. A model trained
    # through a fence at a low kept fraction adapts to the top-k (docs/dataplane.md "Dense finish").
    # 0.0 until 2026-11-28, when benchmarks.convergence's byte MLP (its fence at the floor 0.3 before a layer
    # with no normalisation) ended 2,000 steps at 1.025x the per-step all-reduce's held-out loss without a
    # finish, 1.019x with 0.05 and 1.017x with 0.1. It costs a compressed fence about twice its bytes over
    # the finish (``(1 - rho) / ln(1 / rho)`` of dense on average, 0.58 at 0.3), so at most ~5% of such a
    # job's link time; fences the plan left dense cost nothing. Left out of the wire map at its default
    # (a spec without the field means the default of the node that reads it)
    dense_finish: float = field(default=0.05, metadata={"wire": {"omit_default": True}})

    def __post_init__(self) -> None:
        _float(self, "rho_min", self.rho_min, lo=0.0, hi=1.0, lo_open=True)
        _float(self, "dense_finish", self.dense_finish, lo=0.0, hi=1.0)

    def dense_from(self, steps: int) -> int:
        """The first of *steps* steps whose fences go dense (``steps`` when none do)."""
        return steps - round(self.dense_finish * steps)

    def to_wire(self) -> dict[str, Any]:
        return codec.to_wire(self)

    @classmethod
    def from_wire(cls, obj: Any) -> AdaTopK:
        return codec.from_wire(cls, obj, "AdaTopK config")


@dataclass(frozen=True, kw_only=True, slots=True)
class LRSchedule:
    """Linear warm-up over ``warmup_steps``, then ``constant``, ``cosine`` or ``linear`` decay to
    ``min_lr_ratio * lr`` at the last step."""

    kind: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in LR_KINDS:
            raise ConfigError(f"lr_schedule kind must be one of {', '.join(LR_KINDS)}, got {self.kind!r}")
        _pos_int("warmup_steps", self.warmup_steps, minimum=0)
        _float(self, "min_lr_ratio", self.min_lr_ratio, lo=0.0, hi=1.0)

    def to_wire(self) -> dict[str, Any]:
        return codec.to_wire(self)

    @classmethod
    def from_wire(cls, obj: Any) -> LRSchedule:
        return codec.from_wire(cls, obj, "lr schedule")


    def factor(self, step: int, steps: int) -> float:
        """Multiplier of the base lr at 0-based *step* of *steps*."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        span = max(1, steps - 1 - self.warmup_steps)
        frac = min(1.0, max(0.0, (step - self.warmup_steps) / span))
        shape = 0.5 * (1.0 + math.cos(math.pi * frac)) if self.kind == "cosine" else 1.0 - frac
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """How to train: ``TrainConfig(steps=2000, micro_batch=8, micro_batches=4, optimizer="adamw", lr=3e-4,
    averaging=CO2(tau=8), compression="adatopk")``.

    One step = ``micro_batches`` micro-batches of ``micro_batch`` samples through the pipeline, then an
    optimizer step on every stage. ``checkpoint_every=0`` saves only at the end; ``replicas`` is a hint
    for the planner (replicas per stage), ``None`` lets it choose; ``stages`` pins OP-Fence's stage count
    (``None``: it chooses; a benchmark comparing runs holds the layout with it). ``planner`` picks OP-Fence (default)
    or a network-blind baseline (``"even_layers"``, ``"even_flops"``) with exactly ``replicas`` (default 1)
    replicas per stage; with ``averaging=None`` the replicas all-reduce gradients every step.
    """

    steps: int
    micro_batch: int = 8
    micro_batches: int = 4
    optimizer: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.0
    momentum: float = 0.0                       # sgd only
    betas: tuple[float, float] = (0.9, 0.999)   # adamw only
    eps: float = 1e-8
    grad_clip: float | None = None              # global-norm clip per stage; None = off
    # users may name these by a shorthand string; on the wire they are always the normalised object or nil
    lr_schedule: LRSchedule | str | None = field(default=None, metadata={"wire": {"type": LRSchedule | None}})
    averaging: CO2 | str | None = field(default=None, metadata={"wire": {"type": CO2 | None}})
    compression: AdaTopK | str | None = field(default=None, metadata={"wire": {"type": AdaTopK | None}})
    schedule: str = "1f1b"
    checkpoint_every: int = 0
    seed: int = 0
    replicas: int | None = None
    # exactly this many pipeline stages in every plan OP-Fence makes (None: it chooses); a plan is refused where
    # no layout of that many stages fits. Left out of the wire map at its default
    stages: int | None = field(default=None, metadata={"wire": {"omit_default": True}})
    on_nonfinite: str = field(default="fail", metadata={"wire": {"choices": NONFINITE}})  # a NaN/inf loss: "fail" the job, or "skip" the step
    eval_every: int = 0                         # held-out loss every K steps (0: only at the end)
    # who cuts the model: "opfence" (stages, replicas and AdaTopK ratios from the measured links), or a
    # baseline blind to the links ("even_layers", "even_flops": replica groups in peer-id order, dense
    # fences); left out of the wire map at its default, so older specs keep their bytes and signatures
    planner: str = field(default="opfence", metadata={"wire": {"choices": PLANNERS, "omit_default": True}})
    # what the stages compute in: "fp32"; "bf16" (autocast, fp32 master weights and optimizer state,
    # activations and gradients on the wire in bf16: half the bytes, and the planner prices compute at
    # the devices' bf16 rate); "fp16" the same with a static loss scale, for GPUs without bf16. Measured on
    # CPU (tests/unit/test_precision.py): a 2-stage GPT-2's loss after 40 steps 0.10% from fp32's in bf16. Left out
    # of the wire map at its default
    precision: str = field(default="fp32", metadata={"wire": {"choices": PRECISIONS, "omit_default": True}})
    # a private swarm's allow-list: the peer ids that may be members of the job (() = any node). The publisher
    # offers the job to them only, the leader plans and takes in no one else, and every member refuses an
    # epoch whose snapshot names anyone else (jobs/suspects.py, docs/security.md). Left out of the wire map at
    # its default
    allow_members: tuple[str, ...] = field(default=(), metadata={"wire": {"omit_default": True, "max_len": 4096,
                                                                          "item": {"max_len": 128, "min_len": 1}}})
    # reputation-based admission for open swarms (jobs/reputation.py): a member must show signed receipts of at
    # least min_work micro-batches of work in finished jobs of issuers the publisher trusts (itself and
    # trust_issuers). 0: no requirement. Left out of the wire map at their defaults
    min_work: int = field(default=0, metadata={"wire": {"omit_default": True}})
    trust_issuers: tuple[str, ...] = field(default=(), metadata={"wire": {"omit_default": True, "max_len": 256,
                                                                          "item": {"max_len": 128, "min_len": 1}}})
    # activation recomputation: a stage keeps only its received tensors per micro-batch in flight and runs its
    # forward again in backward (about one more forward of compute). "auto": the planner turns to it only when
    # no layout fits the members' memory without it, and then only the stages over their node's offer use it;
    # "never"; "always" (every stage). Left out of the wire map at its default
    recompute: str = field(default="auto", metadata={"wire": {"choices": RECOMPUTE, "omit_default": True}})
    # verified stages (jobs/verified.py, docs/security.md): the probability that a checker (the next replica of
    # the stage) recomputes any one micro-batch of a stage replica; 0 turns the checks, the stamps on the
    # pipeline links and the ledger's state copies off. Off by default: the ledger holds copies of the stage's
    # state (2-3x its weights' memory), which the planner does not count yet; 0.01 costs 4.4% CPU in
    # benchmarks/verified_job.py (within the 5% target) and catches a stage lying on every micro-batch within
    # 100 of them with probability 63%, 460 with 99%. Left out of the wire map at its default
    spot_rate: float = field(default=0.0, metadata={"wire": {"omit_default": True}})

    def __post_init__(self) -> None:
        _pos_int("steps", self.steps)
        _float(self, "spot_rate", self.spot_rate, lo=0.0, hi=1.0)
        allow = self.allow_members
        if isinstance(allow, str) or not isinstance(allow, tuple | list) or \
                not all(isinstance(p, str) and 0 < len(p) <= 128 for p in allow) or len(set(allow)) != len(allow):
            raise ConfigError("allow_members must be a list of distinct peer ids (the nodes' 12D3KooW... ids), "
                              f"got {allow!r}"[:300])
        object.__setattr__(self, "allow_members", tuple(allow))
        _pos_int("min_work", self.min_work, minimum=0)
        trust = self.trust_issuers
        if isinstance(trust, str) or not isinstance(trust, tuple | list) or \
                not all(isinstance(p, str) and 0 < len(p) <= 128 for p in trust) or len(set(trust)) != len(trust):
            raise ConfigError("trust_issuers must be a list of distinct peer ids (publishers whose work receipts "
                              f"count), got {trust!r}"[:300])
        object.__setattr__(self, "trust_issuers", tuple(trust))
        _pos_int("eval_every", self.eval_every, minimum=0)
        if self.on_nonfinite not in NONFINITE:
            raise ConfigError(f"on_nonfinite must be one of {', '.join(NONFINITE)}, got {self.on_nonfinite!r}")
        _pos_int("micro_batch", self.micro_batch)
        _pos_int("micro_batches", self.micro_batches)
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        _float(self, "lr", self.lr, lo=0.0, lo_open=True)
        _float(self, "weight_decay", self.weight_decay, lo=0.0)
        _float(self, "momentum", self.momentum, lo=0.0, hi=0.999)
        if self.optimizer == "adamw" and self.momentum:
            raise ConfigError("momentum applies to sgd only; for adamw set betas=(b1, b2)")
        betas = self.betas
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise ConfigError(f"betas must be a pair (b1, b2), got {betas!r}")
        object.__setattr__(self, "betas", (_num("betas[0]", betas[0], lo=0.0, hi=0.9999), _num("betas[1]", betas[1], lo=0.0, hi=0.99999)))
        _float(self, "eps", self.eps, lo=0.0, lo_open=True)
        if self.grad_clip is not None:
            _float(self, "grad_clip", self.grad_clip, lo=0.0, lo_open=True)
        object.__setattr__(self, "lr_schedule", _shorthand(self.lr_schedule, "lr_schedule", {"cosine": LRSchedule, "linear": lambda: LRSchedule(kind="linear"), "constant": None}, LRSchedule))
        object.__setattr__(self, "averaging", _shorthand(self.averaging, "averaging", {"co2": CO2, "none": None}, CO2))
        object.__setattr__(self, "compression", _shorthand(self.compression, "compression", {"adatopk": AdaTopK, "none": None}, AdaTopK))
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        _pos_int("checkpoint_every", self.checkpoint_every, minimum=0)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.replicas is not None:
            _pos_int("replicas", self.replicas)
        if self.stages is not None:
            _pos_int("stages", self.stages)
            if self.planner != "opfence":
                raise ConfigError(f"stages pins OP-Fence's stage count; planner={self.planner!r} cuts its own "
                                  "(one group of replicas per stage): leave stages=None")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.planner not in PLANNERS:
            raise ConfigError(f"planner must be one of {', '.join(PLANNERS)}, got {self.planner!r}")
        if self.planner != "opfence" and self.adatopk is not None:
            raise ConfigError(f"planner={self.planner!r} sends every fence dense: set compression=None, or "
                              "planner='opfence' for AdaTopK")

    # -- typed views of the normalised fields ------------------------------------------------------

    @property
    def co2(self) -> CO2 | None:
        assert not isinstance(self.averaging, str)
        return self.averaging

    @property
    def adatopk(self) -> AdaTopK | None:
        assert not isinstance(self.compression, str)
        return self.compression

    @property
    def lr_sched(self) -> LRSchedule | None:
        assert not isinstance(self.lr_schedule, str)
        return self.lr_schedule

    def lr_at(self, step: int) -> float:
        """The learning rate of 0-based *step* (the base lr when there is no schedule)."""
        s = self.lr_sched
        return self.lr if s is None else self.lr * s.factor(step, self.steps)

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch * self.micro_batches

    # -- wire ----------------------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        return codec.to_wire(self)

    @classmethod
    def from_wire(cls, obj: Any) -> TrainConfig:
        return codec.from_wire(cls, obj, "train config")


def _shorthand(value: object, name: str, table: dict[str, Any], cls: type) -> Any:
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str) and value.lower() in table:
        make = table[value.lower()]
        return None if make is None else make()
    names = ", ".join(repr(k) for k in table)
    raise ConfigError(f"{name} must be None, one of {names}, or a {cls.__name__}(...) instance; got {value!r}")
