"""Stages that lie plausibly (issue 46), and an in-process pipeline that spot-checks them.

Every lie is finite and well-shaped, so every check on bytes lets it through:

* ``bias``: a stage adds ``BIAS`` (or its ``bias``) times the tensor's own standard deviation, along one
  fixed direction of its features, to every activation it sends (a small, steady push on everything downstream);
* ``zeros``: a stage skips its backward and sends zeros for the gradients it owes upstream (it saves
  its backward's compute; the stages before it stop learning);
* ``bias-hidden`` and ``zeros-hidden``: the same lies on the wire, while the stage's transcript (what it
  claims and serves to its checker) holds the honest tensors: the recomputation agrees with the claim,
  and only the neighbours' stamps of what they received (``train/receipts.py``) give it away.

A liar lies on a fraction ``lie_rate`` of its micro-batches (drawn from its own seeded generator) and is
honest on the others. :func:`spot_checked_run` trains a :class:`~fusionp2p.graph.local.LocalPipeline`
with one stage replaced by a liar, while a second holder of each stage spot-checks sampled micro-batches
as ``train/verify.py`` describes (the leader's signed seed after each step, the stage's signed claim,
recomputation, a verdict acted on by ``jobs/suspects.py``). :func:`verified_job` runs the same checks as
a job runs them (``train/spot.py``): real stage workers of S stages x R replicas in one process, each
replica keeping a ledger and checked by another replica of its stage.
"""

from __future__ import annotations

import dataclasses
import math
import resource
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from fusionp2p.graph.executor import StageExecutor
from fusionp2p.graph.local import LocalPipeline
from fusionp2p.graph.program import StageProgram
from fusionp2p.jobs.events import StageConvicted, decode_event, encode_event
from fusionp2p.jobs.suspects import Suspects
from fusionp2p.net.identity import Identity
from fusionp2p.plan.plan import Fence, Plan, Stage
from fusionp2p.testing.channels import memory_channel_pair
from fusionp2p.train.config import TrainConfig
from fusionp2p.train.receipts import Signer, Stamp, StampBook, StampedChannel, TensorDigests
from fusionp2p.train.spot import Bundle, Checker, Ledger, TappedExecutor
from fusionp2p.train.verify import (
    Claim,
    Unverifiable,
    Verdict,
    VerifyConfig,
    challenge,
    check,
    claim,
    digest,
    sampled,
)
from fusionp2p.train.worker import DataFn, StageContext, StageReport, StageWorker

STAGE_ATTACKS = ("bias", "zeros", "bias-hidden", "zeros-hidden")
BIAS = 0.05     # of the activation's standard deviation


class LyingStage(TappedExecutor):
    """A stage that lies with ``attack`` (None: honest) on a fraction ``lie_rate`` of its micro-batches.
    It lies in its forward *and* in its backward for the same micro-batch (``lying``)."""

    def __init__(self, *args: Any, attack: str | None = None, lie_rate: float = 1.0, seed: int = 0,
                 bias: float = BIAS, **kwargs: Any) -> None:
        if attack is not None and attack not in STAGE_ATTACKS:
            raise ValueError(f"attack must be one of {STAGE_ATTACKS}, got {attack!r}")
        super().__init__(*args, **kwargs)
        self.attack, self.lie_rate, self.bias = attack, lie_rate, bias
        self.hidden = attack is not None and attack.endswith("-hidden")   # honest in the transcript, lying on the wire
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
        out = super().forward(micro, inputs)      # the tap has recorded the honest outputs of a hidden liar
        return self._bias(out) if self._lie_now and self.hidden and self.attack == "bias-hidden" else out

    def _outputs(self, outs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        res = super()._outputs(outs)
        return self._bias(res) if self._lie_now and self.attack == "bias" else res

    def _bias(self, res: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        res = dict(res)
        for o in self.program.send:
            t = res[o.name]
            if t.is_floating_point():
                res[o.name] = t + self.bias * t.float().std() * self._direction(t.shape[-1]).to(t.dtype)
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
        if self.attack not in ("zeros", "zeros-hidden") or (self.step, micro) not in self.lying:
            return super().backward(micro, grad_outputs, loss_scale=loss_scale)
        if self.hidden:       # the honest backward, recorded, and zeros sent
            honest = super().backward(micro, grad_outputs, loss_scale=loss_scale)
            return {k: torch.zeros_like(v) for k, v in honest.items()}
        self.drop(micro)      # the backward it skips
        out = {r.name: torch.zeros(r.meta.shape, dtype=self.wire_dtype(r.meta.dtype)) for r in self.program.recv
               if r.needs_grad}
        self.tap.backward(self.step, micro, grad_outputs, out, loss_scale)
        return out


def frame(me: Signer, c: Claim, reason: str = "outputs differ (made up)") -> Verdict:
    """A lying checker's verdict against claim *c*, whatever a recomputation says: signed by *me* over the
    stage's signed claim, so that it is valid evidence to anyone who does not recompute it
    (``jobs/verified.py`` ``Arbiter``: the leader does, and strikes *me*)."""
    v = Verdict(claim=c, checker=me.peer_id, reason=f"step {c.step} micro {c.micro}: {reason}")
    return dataclasses.replace(v, signature=me.sign(v.body()))


@dataclass(kw_only=True)
class SpotRun:
    """What :func:`spot_checked_run` saw."""

    losses: list[float] = field(default_factory=list)     # mean micro-batch loss per step
    excluded_at: int | None = None                        # the step whose check excluded the liar
    rolled_back_to: int | None = None                     # the checkpoint's step the run went back to, if any
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
                     stop_when_excluded: bool = True, bias: float = BIAS, checkpoint_every: int = 0) -> SpotRun:
    """Train *programs* for *steps* steps of SGD (gradients clipped to norm 1) on ``data(step)``'s
    micro-batches, stage *liar* lying with *attack* (``bias``: its strength in standard deviations), every
    stage spot-checked at ``cfg.rate`` by a second holder of it. With *stop_when_excluded* the run ends at
    the step whose check excluded the liar; otherwise an honest holder takes its stage over from the next
    step: with *checkpoint_every* > 0, from the newest checkpoint (every stage's state at the start of a
    step that is a multiple of it) no later than the convicted step, and the run trains on from there to
    *steps*, as a job's leader rolls back after a conviction (``jobs/verified.py:rollback``); with 0 from
    the state the liar left (no roll-back)."""
    cfg = cfg or VerifyConfig()
    torch.manual_seed(seed)
    pipe = LocalPipeline(programs)
    ids = [Identity(bytes([s + 1]) * 32) for s in range(len(programs))]
    checkers = [Identity(bytes([s + 101]) * 32) for s in range(len(programs))]
    leader = Identity(bytes([200]) * 32)
    execs: list[LyingStage] = []
    for s, prog in enumerate(programs):
        ex = LyingStage(prog, attack=attack if s == liar else None, lie_rate=lie_rate, seed=seed + 7, bias=bias)
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
    checkpoints: dict[int, tuple[list[dict[str, torch.Tensor]], torch.Tensor]] = {}   # step -> (states, RNG state)
    step = -1
    while step + 1 < steps:
        step += 1
        if checkpoint_every > 0 and step % checkpoint_every == 0 and run.excluded_at is None:
            checkpoints[step] = ([{k: v.detach().clone() for k, v in ex.state_dict().items()} for ex in execs],
                                 torch.get_rng_state())
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
            if execs[liar if liar is not None else 0].attack is not None and checkpoints:
                back = max(c for c in checkpoints if c <= run.excluded_at)
                states_back, rng = checkpoints[back]
                torch.set_rng_state(rng)   # dropout's draws too, as a checkpoint with its RNG state
                with torch.no_grad():
                    for ex, st in zip(execs, states_back):
                        for k, live in ex.state_dict().items():   # detached views of the parameters: copied in place
                            live.copy_(st[k])
                del run.losses[back:]
                run.rolled_back_to, step = back, back - 1
            execs[liar if liar is not None else 0].attack = None
    run.lies = sum(len(ex.lying) for ex in execs)
    run.state = {k: v for ex in reversed(execs) for k, v in ex.state_dict().items()}
    return run


@dataclass(kw_only=True)
class VerifiedJob:
    """What :func:`verified_job` saw."""

    ids: dict[tuple[int, int], Identity]                  # (stage, replica) -> the node's identity
    plan: Plan
    leader: Suspects                                      # the leader's (the checkers' nodes' verdicts)
    others: Suspects                                      # a node's that judges the gossiped StageConvicted events
    events: list[StageConvicted]
    workers: dict[tuple[int, int], StageWorker]
    ledgers: dict[tuple[int, int], Ledger]
    checkers: dict[tuple[int, int], Checker]              # the checker OF (stage, replica)
    reports: list[StageReport]
    books: dict[tuple[int, int], StampBook] = field(default_factory=dict)   # each node's stamps (stamped runs)
    cpu_s: float = 0.0                                    # the process's CPU seconds (user + sys) for the run


def verified_job(programs: Sequence[StageProgram], data: DataFn, config: TrainConfig, *, rate: float | None,
                 liar: tuple[int, int] | None = None, attack: str | None = None, lie_rate: float = 1.0,
                 timeout: float = 600.0, stamped: bool = True) -> VerifiedJob:
    """Run a job of ``len(programs)`` stages (a chain) x ``config.replicas`` replicas on real
    :class:`~fusionp2p.train.worker.StageWorker` s over in-memory channels, in one process. With *rate*,
    every stage replica keeps a :class:`~fusionp2p.train.spot.Ledger` and is checked by the next replica
    of its stage (``train/spot.py``); a verdict goes to the leader's :class:`Suspects`, and its
    ``StageConvicted`` event through the wire codec to another node's. The request of a bundle is a direct
    call here (the in-process stand-in of the node-to-node request). *rate* None: no ledgers, no checkers,
    plain executors (the baseline). Replica *liar* = (stage, replica) lies with *attack*. With *stamped* (and
*rate*), the pipeline links sign and check every boundary message (``train/receipts.py``) and a checker
compares the claims with the neighbours' stamps (their books, read directly)."""
    S, R = len(programs), config.replicas or 1
    if R < 2 and rate is not None:
        raise ValueError("verified_job checks a replica by another: replicas >= 2")
    ids = {(s, r): Identity(bytes([16 * s + r + 1]) * 32) for s in range(S) for r in range(R)}
    n = S   # one unit a stage in the plan (Suspects reads only the stages' replicas)
    plan = Plan(job="j", epoch=0, snapshot_hash="h", algorithm="test", seed=0, n_units=n,
                micro_batches=config.micro_batches,
                stages=tuple(Stage(start=s, end=s + 1, replicas=tuple(sorted(ids[s, r].peer_id for r in range(R))))
                             for s in range(S)),
                fences=tuple(Fence(index=s, unit=s + 1, dense_bytes=1.0, rho=1.0) for s in range(S - 1)))
    leader, others = Suspects(), Suspects()
    events: list[StageConvicted] = []
    reports: list[StageReport] = []

    async def report(rep: StageReport) -> None:
        reports.append(rep)

    async def on_verdict(v: Verdict) -> None:
        ev = leader.verdict(v, plan)
        if ev is not None:
            events.append(ev)
            others.observe(ev.peer, decode_event(encode_event(ev)), plan)

    def checker_of(s: int, r: int) -> Identity:
        return ids[s, (r + 1) % R]

    vcfg = VerifyConfig(rate=rate or 0.0)
    inbox = {k: trio.open_memory_channel[list[Claim]](math.inf) for k in ids}
    checkers = {(s, r): Checker(checker_of(s, r), programs[s], vcfg, job=plan.job, epoch=plan.epoch,
                                on_verdict=on_verdict) for (s, r) in ids} if rate is not None else {}
    ledgers: dict[tuple[int, int], Ledger] = {}
    pipe = {(s, r): memory_channel_pair(ids[s, r].peer_id, ids[s + 1, r].peer_id, window=8)
            for s in range(S - 1) for r in range(R)}
    books = ({k: StampBook(memo=TensorDigests(size=8 * config.micro_batches)) for k in ids}
             if rate is not None and stamped else {})
    peer_ch: dict[tuple[int, int], list[Any]] = {k: [] for k in ids}
    for s in range(S):
        for a in range(R):
            for b in range(a + 1, R):
                x, y = memory_channel_pair(f"s{s}r{a}", f"s{s}r{b}", window=8)
                peer_ch[s, a].append(x)
                peer_ch[s, b].append(y)
    workers: dict[tuple[int, int], StageWorker] = {}
    for (s, r), idt in ids.items():
        prog = programs[s]
        ex: StageExecutor = (LyingStage(prog, attack=attack if (s, r) == liar else None, lie_rate=lie_rate)
                             if rate is not None or (s, r) == liar else StageExecutor(prog))
        links: dict[int, Any] = {**({s - 1: pipe[s - 1, r][1]} if s > 0 else {}),
                                 **({s + 1: pipe[s, r][0]} if s < S - 1 else {})}
        if books:
            links = {d: StampedChannel(ch, idt, epoch=plan.epoch, book=books[s, r]) for d, ch in links.items()}
        if rate is not None:
            assert isinstance(ex, TappedExecutor)
            ledgers[s, r] = Ledger(idt, ex, job=plan.job, epoch=plan.epoch, replica=r,
                                   checkers=[checker_of(s, r).peer_id], cfg=vcfg, publish=inbox[s, r][0].send,
                                   memo=books[s, r].memo if books else None)
        workers[s, r] = StageWorker(StageContext(
            job=plan.job, executor=ex, config=config, replica=r, replicas=R, links=links, peers=peer_ch[s, r],
            data=data, tokens_per_micro=1, report=report, recv_timeout=timeout, spot=ledgers.get((s, r))))

    async def check_loop(k: tuple[int, int]) -> None:
        async def fetch(c: Claim, seed: bytes) -> Bundle:
            return ledgers[k].bundle(checkers[k].me.peer_id, seed, c.step, c.micro)
        async def stamps(c: Claim) -> list[Stamp]:   # what the replica's neighbours hold of the micro-batch
            s, r = k
            return [st for n in ((s - 1, r), (s + 1, r)) if n in books for st in books[n].of(c.peer, c.step, c.micro)]
        async for claims in inbox[k][1]:
            await checkers[k].step(claims, fetch, stamps if books else None)

    async def main() -> None:
        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                for k in checkers:
                    nursery.start_soon(check_loop, k)
                async with trio.open_nursery() as w:
                    for wk in workers.values():
                        w.start_soon(wk.run)
                for send, _ in inbox.values():
                    await send.aclose()

    r0 = resource.getrusage(resource.RUSAGE_SELF)
    trio.run(main)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return VerifiedJob(ids=ids, plan=plan, leader=leader, others=others, events=events, workers=workers,
                       ledgers=ledgers, checkers=checkers, reports=reports, books=books,
                       cpu_s=(r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))


__all__ = ["BIAS", "STAGE_ATTACKS", "LyingStage", "SpotRun", "TappedExecutor", "VerifiedJob", "frame", "spot_checked_run",
           "verified_job"]
