"""Verified stages in a running job: the stage replica's ledger of claims, and the checker that samples them.

``train/verify.py`` is the sans-IO core (claims, seeds, recomputation, verdicts); this module puts it on
the stage worker's step. Per step of a stage replica (the worker's ``StageContext.spot`` hooks):

1. ``before(step)``: the :class:`Ledger` keeps the stage's state as the step starts (a copy: the step's
   optimizer changes it) and its digest, the ``params`` every claim of the step binds;
2. the step runs on a :class:`TappedExecutor`, which records each micro-batch's inputs, outputs, random
   state and gradients as they crossed the wire (:class:`~fusionp2p.train.verify.Tap`);
3. ``after(step)``: the ledger signs one :class:`~fusionp2p.train.verify.Claim` per micro-batch and hands
   them to the stage's checkers (``publish``): from then on the stage is bound to those tensors.

A :class:`Checker` (another replica of the stage: it holds the same program) takes a step's claims and
draws its sample only now: its seed is its own Ed25519 signature over (job, epoch, step)
(``verify.challenge``), deterministic and checkable by anyone, unknowable to the stage before it asks.
For each sampled micro-batch it fetches the bundle (the state and the transcript) from the stage, which
serves it only to one of its checkers whose seed samples that micro-batch (:meth:`Ledger.bundle`: a
checker cannot make a stage ship every state), checks it against the claim's digests and recomputes it
(``verify.check``), after comparing the claimed transcript with the stamps its neighbours hold of what
crossed its links (``train/receipts.py``: a stage that sends a lie and claims the honest tensors is caught there). A mismatch is a :class:`~fusionp2p.train.verify.Verdict` handed to ``on_verdict``:
between the nodes of a real job (``jobs/verified.py``) the leader re-judges it from the bundle and, when its
own recomputation agrees, gossips a ``StageConvicted`` event on which every node's ``Suspects`` leaves the
stage replica out of the next plan (``jobs/suspects.py``).

Limits (docs/security.md): the ledger keeps ``keep`` steps of transcripts and states (memory: that many
copies of the stage's state and of its boundary tensors); a bundle asked for later is gone, and a check
the stage does not answer is no evidence. That the claims are what crossed the links is checked against
the neighbours' stamps (``train/receipts.py``) on dense links only. The random state is the process's CPU generator: two stages of one process drawing dropout at once
cannot be replayed (a node runs one stage).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import torch
import trio

from fusionp2p.graph.executor import StageExecutor
from fusionp2p.graph.program import StageProgram
from fusionp2p.threads import run_abandonable
from fusionp2p.train.receipts import Signer, Stamp, TensorDigests
from fusionp2p.train.verify import (
    Claim,
    Tap,
    Transcript,
    Unverifiable,
    Verdict,
    VerifyConfig,
    challenge,
    challenge_ok,
    check,
    claim,
    digest,
    sampled,
)
from fusionp2p.types import short_peer

log = logging.getLogger(__name__)
T = TypeVar("T")

Bundle = tuple[dict[str, torch.Tensor], Transcript]          # (the stage's state at the step's start, transcript)
Fetch = Callable[[Claim, bytes], Awaitable[Bundle]]          # (claim, the checker's seed) -> the stage's bundle
Stamps = Callable[[Claim], Awaitable[Sequence[Stamp]]]     # claim -> its neighbours' stamps of its micro-batch


class StepHooks(Protocol):
    """What the stage worker calls around each training step (``StageContext.spot``; a :class:`Ledger`)."""

    async def before(self, step: int) -> None: ...
    async def after(self, step: int) -> None: ...


class TappedExecutor(StageExecutor):
    """A stage executor that records what it received and sent in ``tap`` (for the step ``step``), as
    the wire carries it (a lying subclass's lies included)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tap = Tap()
        self.step = 0

    def forward(self, micro: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rng = torch.get_rng_state()
        out = super().forward(micro, inputs)
        self.tap.forward(self.step, micro, inputs, out, rng)
        return out

    def backward(self, micro: int, grad_outputs: Mapping[str, torch.Tensor], *,
                 loss_scale: float = 1.0) -> dict[str, torch.Tensor]:
        out = super().backward(micro, grad_outputs, loss_scale=loss_scale)
        self.tap.backward(self.step, micro, grad_outputs, out, loss_scale)
        return out


class Refused(ValueError):
    """A bundle asked for by a peer that is not the stage's checker, or for a micro-batch its seed does
    not sample, or of a step the ledger no longer keeps."""


class Ledger:
    """One stage replica's side (see the module docstring): its state per step, its signed claims, and
    the bundles it serves to its *checkers* (peer ids). ``publish`` receives each step's claims."""

    def __init__(self, me: Signer, executor: TappedExecutor, *, job: str, epoch: int, replica: int,
                 checkers: Collection[str], cfg: VerifyConfig,
                 publish: Callable[[list[Claim]], Awaitable[None]], keep: int = 3,
                 memo: TensorDigests | None = None) -> None:
        if keep < 2:
            raise ValueError("Ledger.keep must be >= 2 (a checker fetches a step's bundles after the step)")
        self.me, self.ex, self.job, self.epoch, self.replica = me, executor, job, epoch, replica
        self.stage = executor.program.stage
        self.checkers = frozenset(checkers)
        self.cfg, self.publish, self.keep = cfg, publish, keep
        self.memo = memo      # the node's stamp book's (train/receipts.py): boundary tensors digested once
        executor.tap.keep = keep
        self._states: dict[int, tuple[dict[str, torch.Tensor], bytes]] = {}
        self.cpu_s = 0.0          # thread CPU seconds of the commitments (state copies, digests, claims)

    def _commit(self, step: int) -> None:
        t0 = _cpu()
        live = self.ex.state_dict()
        old = sorted(s for s in self._states if s > step or s <= step - self.keep)   # forgotten (or a step re-run)
        # the copy goes into the buffers of the copy it replaces: a fresh clone every step cost 5x the copy
        # itself (the new pages' faults; 44 ms against 8 ms for 64 MiB on the reference VM)
        slot = self._states.pop(old[0])[0] if old else {}
        for s in old[1:]:
            del self._states[s]
        if slot.keys() != live.keys() or any(slot[n].shape != v.shape or slot[n].dtype != v.dtype
                                             for n, v in live.items()):
            slot = {n: torch.empty(v.shape, dtype=v.dtype) for n, v in live.items()}   # host memory
        with torch.no_grad():
            for n, v in live.items():
                slot[n].copy_(v.detach())
        self._states[step] = (slot, digest(slot))
        self.cpu_s += _cpu() - t0

    async def before(self, step: int) -> None:
        """The state *step* starts from, kept and digested (in a worker thread: it reads the whole state)."""
        self.ex.step = step
        await trio.to_thread.run_sync(self._commit, step)

    def _claims(self, step: int) -> list[Claim]:
        t0 = _cpu()
        _, params = self._states[step]
        out = [claim(self.me, job=self.job, epoch=self.epoch, stage=self.stage, replica=self.replica, params=params,
                     t=t, memo=self.memo) for t in self.ex.tap.of(step)]
        self.cpu_s += _cpu() - t0
        return out

    async def after(self, step: int) -> None:
        """*step*'s signed claims, one per micro-batch it ran, to the checkers."""
        claims = await trio.to_thread.run_sync(self._claims, step)
        if claims:
            await self.publish(claims)

    def bundle(self, checker: str, seed: bytes, step: int, micro: int) -> Bundle:
        """What *checker* needs to recompute micro-batch *micro* of *step*: :class:`Refused` unless it is
        one of this stage's checkers, *seed* is its seed of *step* and samples the micro-batch."""
        if checker not in self.checkers:
            raise Refused(f"{short_peer(checker)} is not a checker of stage {self.stage}")
        if not challenge_ok(checker, self.job, self.epoch, step, seed):
            raise Refused(f"{short_peer(checker)}'s seed of step {step} does not verify")
        if not sampled(seed, self.stage, self.replica, micro, self.cfg.rate):
            raise Refused(f"micro-batch {micro} of step {step} is not in {short_peer(checker)}'s sample")
        kept, t = self._states.get(step), self.ex.tap.take(step, micro)
        if kept is None or t is None:
            raise Refused(f"step {step} micro-batch {micro} is no longer kept (the ledger keeps {self.keep} steps)")
        return {k: v.clone() for k, v in kept[0].items()}, t    # a copy: the kept buffers are reused later


class Checker:
    """A checker of one stage (see the module docstring): it draws its sample of each step's claims,
    fetches and recomputes the sampled micro-batches, and hands a mismatch to ``on_verdict``."""

    def __init__(self, me: Signer, program: StageProgram, cfg: VerifyConfig, *, job: str, epoch: int,
                 on_verdict: Callable[[Verdict], Awaitable[None]], limiter: trio.CapacityLimiter | None = None,
                 timeout: float = math.inf) -> None:
        self.me, self.program, self.cfg, self.job, self.epoch = me, program, cfg, job, epoch
        self.on_verdict = on_verdict
        # each recomputation runs in a worker thread, one at a time (*limiter*, shared with the node's bundle
        # coding: a stage-sized job each), within *timeout* seconds: past it the check is abandoned (no
        # evidence) and its thread keeps the limiter until it ends, so that no second one starts beside it
        self.limiter = limiter if limiter is not None else trio.CapacityLimiter(1)
        self.timeout = timeout
        self._ex = StageExecutor(program)   # the checker's own copy of the stage, reused for every check
        self.checks = 0          # micro-batches recomputed
        self.unverifiable = 0    # bundles refused or not matching their claim (no evidence either way)
        self.verdicts: list[Verdict] = []
        self.cpu_s = 0.0         # thread CPU seconds of the checks (digests, recomputation)

    def sample(self, claims: Sequence[Claim]) -> tuple[bytes, list[Claim]]:
        """This checker's seed of the claims' step and the claims it samples (claims of another job, epoch
        or stage, or not signed by their stage, are dropped)."""
        if not claims:
            return b"", []
        step = claims[0].step
        seed = challenge(self.me, self.job, self.epoch, step)
        return seed, [c for c in claims if (c.job, c.epoch, c.stage, c.step) == (self.job, self.epoch,
                      self.program.stage, step) and sampled(seed, c.stage, c.replica, c.micro, self.cfg.rate)
                      and c.valid()]

    def _check(self, c: Claim, b: Bundle, stamps: Sequence[Stamp] = ()) -> Verdict | None:
        t0 = _cpu()
        try:
            return check(c, self.program, b[0], b[1], self.cfg, self.me, executor=self._ex, stamps=stamps)
        except Unverifiable:
            raise
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
            # a bundle from another node that matches its claim's digests, yet does not run through the
            # stage's program (names or shapes it does not take): the stage signed nonsense, which no
            # recomputation can judge; no evidence, and never the checker's crash
            raise Unverifiable(f"the bundle does not run through the stage's program: {exc}"[:200]) from None
        finally:
            self.cpu_s += _cpu() - t0

    async def step(self, claims: Sequence[Claim], fetch: Fetch, stamps: Stamps | None = None) -> list[Verdict]:
        """Check one step's *claims* of one stage replica, fetching each sampled bundle with *fetch* and,
        with *stamps*, its neighbours' stamps of the micro-batch (train/receipts.py)."""
        seed, chosen = self.sample(claims)
        found: list[Verdict] = []
        for c in chosen:
            try:
                bundle = await fetch(c, seed)
                got = await stamps(c) if stamps is not None else ()
                with trio.fail_after(self.timeout):
                    v = await in_thread(partial(self._check, c, bundle, got), self.limiter)
            except (Refused, Unverifiable, trio.TooSlowError) as exc:
                self.unverifiable += 1
                log.info("spot-check of %s's stage %d step %d micro %d: %s", short_peer(c.peer), c.stage, c.step,
                         c.micro, exc)
                continue
            self.checks += 1
            if v is not None:
                log.warning("spot-check: %s's stage %d lied: %s", short_peer(c.peer), c.stage, v.reason)
                self.verdicts.append(v)
                found.append(v)
                await self.on_verdict(v)
        return found


async def in_thread(fn: Callable[[], T], limiter: trio.CapacityLimiter) -> T:
    """*fn* in a worker thread under *limiter*. A cancelled wait (a deadline) abandons the thread, which keeps
    its token until it ends: the next stage-sized job waits for it rather than run beside it."""
    return await run_abandonable(fn, limiter=limiter)   # the process's exit waits for it (fusionp2p/threads.py)


def _cpu() -> float:
    return time.thread_time()   # the work runs in worker threads: their own CPU, not the process's


__all__ = ["Bundle", "Checker", "Fetch", "Ledger", "Refused", "Stamps", "StepHooks", "TappedExecutor",
           "in_thread"]
