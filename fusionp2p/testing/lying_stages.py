"""Stages that lie plausibly (issue 46), and an in-process pipeline that spot-checks them.

Every lie is finite and well-shaped, so every check on bytes lets it through:

* ``bias``: a stage adds ``BIAS`` times the tensor's own standard deviation, along one fixed direction of
  its features, to every activation it sends (a small, steady push on everything downstream);
* ``zeros``: a stage skips its backward and sends zeros for the gradients it owes upstream (it saves
  its backward's compute; the stages before it stop learning).

A liar lies on a fraction ``lie_rate`` of its micro-batches (drawn from its own seeded generator) and is
honest on the others. :func:`spot_checked_run` trains a :class:`~fusionp2p.graph.local.LocalPipeline`
with one stage replaced by a liar, while a second holder of each stage spot-checks sampled micro-batches
as ``train/verify.py`` describes (the leader's signed seed after each step, the stage's signed claim,
recomputation, a verdict acted on by ``jobs/suspects.py``).
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionp2p.graph.executor import StageExecutor
from fusionp2p.graph.local import LocalPipeline
from fusionp2p.graph.program import StageProgram
from fusionp2p.jobs.suspects import Suspects
from fusionp2p.net.identity import Identity
from fusionp2p.plan.plan import Fence, Plan, Stage
from fusionp2p.train.spot import TappedExecutor
from fusionp2p.train.verify import (
    Unverifiable,
    Verdict,
    VerifyConfig,
    challenge,
    check,
    claim,
    digest,
    sampled,
)

STAGE_ATTACKS = ("bias", "zeros")
BIAS = 0.05     # of the activation's standard deviation


class LyingStage(TappedExecutor):
    """A stage that lies with ``attack`` (None: honest) on a fraction ``lie_rate`` of its micro-batches.
    It lies in its forward *and* in its backward for the same micro-batch (``lying``)."""

    def __init__(self, *args: Any, attack: str | None = None, lie_rate: float = 1.0, seed: int = 0,
                 **kwargs: Any) -> None:
        if attack is not None and attack not in STAGE_ATTACKS:
            raise ValueError(f"attack must be one of {STAGE_ATTACKS}, got {attack!r}")
        super().__init__(*args, **kwargs)
        self.attack, self.lie_rate = attack, lie_rate
        self._gen = torch.Generator().manual_seed(seed)
        self.lying: set[tuple[int, int]] = set()     # (step, micro) it lied on
        self._lie_now = False
        self._dir: torch.Tensor | None = None

    def _lies(self, micro: int) -> bool:
        if self.attack is None:
            return False
        if float(torch.rand((), generator=self._gen)) < self.lie_rate:
            self.lying.add((self.step, micro))
        return (self.step, micro) in self.lying

    def forward(self, micro: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._lie_now = self._lies(micro)
        return super().forward(micro, inputs)

    def _outputs(self, outs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        res = super()._outputs(outs)
        if self._lie_now and self.attack == "bias":
            for o in self.program.send:
                t = res[o.name]
                if t.is_floating_point():
                    res[o.name] = t + BIAS * t.float().std() * self._direction(t.shape[-1]).to(t.dtype)
        return res

    def _direction(self, n: int) -> torch.Tensor:
        """A fixed direction over the last dimension, of unit mean square and zero mean (a constant shift
        would pass through a LayerNorm unseen)."""
        if self._dir is None or self._dir.numel() != n:
            d = torch.randn(n, generator=torch.Generator().manual_seed(12345))
            d = d - d.mean()
            self._dir = d / d.pow(2).mean().sqrt()
        return self._dir

    def backward(self, micro: int, grad_outputs: Mapping[str, torch.Tensor], *,
                 loss_scale: float = 1.0) -> dict[str, torch.Tensor]:
        if self.attack != "zeros" or (self.step, micro) not in self.lying:
            return super().backward(micro, grad_outputs, loss_scale=loss_scale)
        self.drop(micro)      # the backward it skips
        out = {r.name: torch.zeros(r.meta.shape, dtype=self.wire_dtype(r.meta.dtype)) for r in self.program.recv
               if r.needs_grad}
        self.tap.backward(self.step, micro, grad_outputs, out, loss_scale)
        return out


@dataclass(kw_only=True)
class SpotRun:
    """What :func:`spot_checked_run` saw."""

    losses: list[float] = field(default_factory=list)     # mean micro-batch loss per step
    excluded_at: int | None = None                        # the step whose check excluded the liar
    checks: int = 0                                       # micro-batches recomputed
    lies: int = 0                                         # micro-batches the liar lied on (all steps run)
    verdicts: list[Verdict] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)   # every stage's state at the end, by DAG name
    train_cpu_s: float = 0.0                              # CPU seconds of training (forward, backward, SGD)
    commit_cpu_s: float = 0.0                             # CPU seconds of the stages' commitments (state copy, digests, claims)
    check_cpu_s: float = 0.0                              # CPU seconds of the checkers (verification, recomputation)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def spot_checked_run(programs: Sequence[StageProgram], data: Callable[[int], Sequence[Mapping[str, torch.Tensor]]],
                     *, steps: int, liar: int | None = None, attack: str | None = None, lie_rate: float = 1.0,
                     cfg: VerifyConfig | None = None, lr: float = 0.05, seed: int = 0,
                     stop_when_excluded: bool = True) -> SpotRun:
    """Train *programs* for *steps* steps of SGD (gradients clipped to norm 1) on ``data(step)``'s
    micro-batches, stage *liar* lying with *attack*, every stage spot-checked at ``cfg.rate`` by a second
    holder of it. With *stop_when_excluded* the run ends at the step whose check excluded the liar;
    otherwise an honest holder takes its stage over from the next step (its state as the liar left it:
    no roll-back)."""
    cfg = cfg or VerifyConfig()
    torch.manual_seed(seed)
    pipe = LocalPipeline(programs)
    ids = [Identity(bytes([s + 1]) * 32) for s in range(len(programs))]
    checkers = [Identity(bytes([s + 101]) * 32) for s in range(len(programs))]
    leader = Identity(bytes([200]) * 32)
    execs: list[LyingStage] = []
    for s, prog in enumerate(programs):
        ex = LyingStage(prog, attack=attack if s == liar else None, lie_rate=lie_rate, seed=seed + 7)
        execs.append(ex)
    pipe.executors = list(execs)
    n = len(programs)
    plan = Plan(job="spot", epoch=0, snapshot_hash="s", algorithm="test", seed=seed, n_units=n, micro_batches=1,
                stages=tuple(Stage(start=s, end=s + 1, replicas=tuple(sorted((ids[s].peer_id, checkers[s].peer_id))))
                             for s in range(n)),
                fences=tuple(Fence(index=s, unit=s + 1, dense_bytes=1.0, rho=1.0) for s in range(n - 1)))
    suspects = Suspects()
    run = SpotRun()
    params = [p for ex in execs for p in ex.parameters().values()]
    checking = [StageExecutor(prog) for prog in programs]      # each checker's own copy of the stage
    for step in range(steps):
        t0 = _cpu()
        # the stage's own cost: its state at the step's start kept and committed to, a signed claim per micro
        states = [{k: v.clone() for k, v in ex.state_dict().items()} for ex in execs]
        digests = [digest(st) for st in states]
        t1 = _cpu()
        for ex in execs:
            ex.step = step
        batches = list(data(step))
        pipe.zero_grad()
        losses = pipe.step(batches)
        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], 1.0)   # SGD spikes otherwise
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
        run.losses.append(sum(losses) / len(losses))
        t2 = _cpu()
        claims = {(s, m): claim(ids[s], job=plan.job, epoch=plan.epoch, stage=s, replica=0, params=digests[s], t=t)
                  for s, ex in enumerate(execs) for m in range(len(batches)) if (t := ex.tap.take(step, m)) is not None}
        t3 = _cpu()
        run.train_cpu_s += t2 - t1
        run.commit_cpu_s += (t1 - t0) + (t3 - t2)
        if cfg.rate > 0:
            seed_t = challenge(leader, plan.job, plan.epoch, step)   # revealed after the step's outputs
            for (s, m), c in claims.items():
                t = execs[s].tap.take(step, m)
                if t is None or not sampled(seed_t, s, 0, m, cfg.rate):
                    continue
                run.checks += 1
                try:
                    v = check(c, programs[s], states[s], t, cfg, checkers[s], executor=checking[s])
                except Unverifiable:
                    continue
                if v is not None:
                    run.verdicts.append(v)
                    if suspects.convict(v, plan) and run.excluded_at is None:
                        run.excluded_at = step
        run.check_cpu_s += _cpu() - t3
        if run.excluded_at is not None:
            if stop_when_excluded:
                break
            execs[liar if liar is not None else 0].attack = None
    run.lies = sum(len(ex.lying) for ex in execs)
    run.state = {k: v for ex in reversed(execs) for k, v in ex.state_dict().items()}
    return run


__all__ = ["BIAS", "STAGE_ATTACKS", "LyingStage", "SpotRun", "TappedExecutor", "spot_checked_run"]
