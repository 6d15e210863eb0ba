"""The leader's re-judgement of a spot-check verdict (jobs/verified.py ``Arbiter``, issue 46): from the bundle the
checker serves, the leader recomputes the disputed micro-batch and convicts the stage replica only when it agrees
with the checker; a checker that framed an honest replica, or whose evidence is not the stage's claim, is struck.
What a verdict can make the leader do is bounded (one at a time, one per checker per interval, a deadline)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Awaitable, Callable

import pytest
import torch
import trio

from fusionp2p.errors import PeerUnavailable
from fusionp2p.graph import coarsen, partition, stages_from_fences, trace
from fusionp2p.graph.program import StageProgram
from fusionp2p.jobs.events import StageConvicted, decode_event, encode_event
from fusionp2p.jobs.suspects import Suspects, judge_of
from fusionp2p.jobs.verified import Arbiter
from fusionp2p.models import GPT2, GPT2Config
from fusionp2p.net.identity import Identity
from fusionp2p.plan.plan import Fence, Plan, Stage
from fusionp2p.train.spot import Checker
from fusionp2p.train.spot_wire import encode_bundle
from fusionp2p.train.verify import Transcript, Verdict, VerifyConfig, check, claim, digest, recompute

torch.set_num_threads(1)
STAGE, CHECKER, LEADER = Identity(b"\x11" * 32), Identity(b"\x12" * 32), Identity(b"\x13" * 32)
CFG = VerifyConfig(rate=1.0)
MAX = 1 << 26


@pytest.fixture(scope="module")
def stage0() -> tuple[StageProgram, dict[str, torch.Tensor], Transcript]:
    """Stage 0 of a tiny GPT-2 with dropout and one honest micro-batch of it: (program, state, transcript)."""
    torch.manual_seed(1)
    m = GPT2(dataclasses.replace(GPT2Config.tiny(n_layer=2, n_embd=32), dropout=0.1))
    m.train()
    dag = trace(m, (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))), count_flops=False)
    coarse = coarsen(dag)
    prog = partition(coarse, stages_from_fences(len(coarse.units), [2]))[0]
    inputs = {r.name: torch.randint(0, 256, (2, 16)) for r in prog.recv}
    state = {k: v.clone() for k, v in prog.tensors.items()}
    t0 = Transcript(step=3, micro=1, inputs=inputs, outputs={}, rng=torch.get_rng_state(),
                    grad_outputs={o.name: torch.randn(o.meta.shape) for o in prog.send if o.needs_grad})
    return prog, state, recompute(prog, state, t0)


def _plan() -> Plan:
    return Plan(job="j", epoch=0, snapshot_hash="s", algorithm="t", seed=0, n_units=2, micro_batches=1,
                stages=(Stage(start=0, end=1, replicas=tuple(sorted((STAGE.peer_id, CHECKER.peer_id)))),
                        Stage(start=1, end=2, replicas=(LEADER.peer_id,))),
                fences=(Fence(index=0, unit=1, dense_bytes=1.0, rho=1.0),))


def _framed(state: dict[str, torch.Tensor], t: Transcript) -> Verdict:
    """A lying checker's verdict against an honest micro-batch."""
    c = claim(STAGE, job="j", epoch=0, stage=0, replica=0, params=digest(state), t=t)
    v = Verdict(claim=c, checker=CHECKER.peer_id, reason="made up")
    return dataclasses.replace(v, signature=CHECKER.sign(v.body()))


def _served(blob: bytes) -> Callable[[int], Awaitable[bytes]]:
    async def fetch(max_size: int) -> bytes:
        assert len(blob) <= max_size
        return blob
    return fetch


def _judge(a: Arbiter, v: Verdict, prog: StageProgram, fetch: Callable[[int], Awaitable[bytes]]) -> str | None:
    async def main() -> str | None:
        return await a.judge(v, prog, fetch, max_bundle=MAX, cfg=CFG)
    return trio.run(main)


def test_a_framed_honest_replica_stays_and_its_checker_is_struck(stage0: tuple[StageProgram, dict[str, torch.Tensor],
                                                                                 Transcript]) -> None:
    prog, state, t = stage0
    v = _framed(state, t)
    s, a = Suspects(), Arbiter()
    assert s.admissible(v, _plan())            # signed by both, members of the plan: only a recomputation tells
    liar = _judge(a, v, prog, _served(encode_bundle((state, t))))
    assert liar == CHECKER.peer_id and a.rulings == [(v, CHECKER.peer_id)]
    assert s.strike(liar, "framed") and not s.strike(liar, "again")
    assert s.admits(STAGE.peer_id) and not s.admits(CHECKER.peer_id) and STAGE.peer_id not in s.convicted


def test_a_real_liar_is_still_convicted(stage0: tuple[StageProgram, dict[str, torch.Tensor], Transcript]) -> None:
    prog, state, t = stage0
    lied = dataclasses.replace(t, outputs={k: v + 0.05 * v.std() for k, v in t.outputs.items()})
    c = claim(STAGE, job="j", epoch=0, stage=0, replica=0, params=digest(state), t=lied)
    v = check(c, prog, state, lied, CFG, CHECKER)
    assert v is not None
    assert _judge(Arbiter(), v, prog, _served(encode_bundle((state, lied)))) == STAGE.peer_id
    # the leader's ruling, gossiped by the leader, convicts everywhere; a checker's own word does not
    leader = Suspects()
    ev = leader.verdict(v, _plan(), by=LEADER.peer_id)
    assert ev is not None and ev.peer == LEADER.peer_id and leader.convicted == {STAGE.peer_id: 3}
    got = decode_event(encode_event(ev))
    assert isinstance(got, StageConvicted)
    other = Suspects()
    assert not other.observe(CHECKER.peer_id, dataclasses.replace(got, peer=CHECKER.peer_id), _plan(),
                             LEADER.peer_id)                                     # the checker's word
    assert not other.observe(LEADER.peer_id, got, _plan(), CHECKER.peer_id)      # not the leader's view of the leader
    assert other.observe(LEADER.peer_id, got, _plan(), LEADER.peer_id) and not other.admits(STAGE.peer_id)
    # a verdict against the leader itself (here STAGE leads): its deputy re-judges it, the lowest other member
    # that is not the checker (LEADER here), and only the deputy's ruling convicts; not the checker's own word
    assert judge_of(_plan().peers, STAGE.peer_id, STAGE.peer_id, CHECKER.peer_id) == LEADER.peer_id
    third = Suspects()
    assert not third.observe(CHECKER.peer_id, dataclasses.replace(got, peer=CHECKER.peer_id), _plan(), STAGE.peer_id)
    assert third.admits(STAGE.peer_id)
    assert third.observe(LEADER.peer_id, got, _plan(), STAGE.peer_id) and not third.admits(STAGE.peer_id)
    # with no third member to re-judge, the checker's word is taken as before
    pair = dataclasses.replace(_plan(), stages=_plan().stages[:1], fences=(), n_units=1)
    assert judge_of(pair.peers, STAGE.peer_id, STAGE.peer_id, CHECKER.peer_id) is None
    assert Suspects().observe(CHECKER.peer_id, dataclasses.replace(got, peer=CHECKER.peer_id), pair, STAGE.peer_id)


def test_a_verdict_against_the_leader_goes_to_its_deputy() -> None:
    """Who re-judges a verdict (``suspects.judge_of``): the leader, unless it is the accused; then the lowest
    other member that is not the checker; every node computes the same."""
    a, b, c, d = "a", "b", "c", "d"
    assert judge_of((a, b, c, d), a, c, b) == a                     # the leader judges others
    assert judge_of((a, b, c, d), a, a, b) == c                     # the accused leader: its deputy, not the checker
    assert judge_of((a, b, c, d), a, a, c) == b
    assert judge_of((a, b), a, a, b) is None                        # nobody else: the checker's word
    assert judge_of((a, b, c), None, b, c) is None                  # no leader (an in-process pipeline)


def test_evidence_that_is_not_the_claims_is_refused(stage0: tuple[StageProgram, dict[str, torch.Tensor],
                                                                  Transcript]) -> None:
    prog, state, t = stage0
    v = _framed(state, t)
    a = Arbiter()
    other = {k: x + 1e-3 for k, x in state.items()}
    for blob in (encode_bundle((other, t)),                                      # other parameters than claimed
                 encode_bundle((state, dataclasses.replace(t, inputs={k: x.flip(0) for k, x in t.inputs.items()}))),
                 b"not a bundle", encode_bundle((state, t))[:-7]):               # malformed
        assert _judge(a, v, prog, _served(blob)) == CHECKER.peer_id
    assert a.refused == {CHECKER.peer_id: 4}

    async def gone(max_size: int) -> bytes:
        raise PeerUnavailable("cut off")
    assert _judge(a, v, prog, gone) is None and a.refused[CHECKER.peer_id] == 5   # no evidence: nobody is blamed


def test_what_a_verdict_makes_the_leader_do_is_bounded(stage0: tuple[StageProgram, dict[str, torch.Tensor],
                                                                     Transcript]) -> None:
    prog, state, t = stage0
    v = _framed(state, t)
    blob = encode_bundle((state, t))
    a = Arbiter(every=30.0, timeout=60.0)
    assert a.admit("c1", 0.0) == "" and a.admit("c1", 10.0) != "" and a.admit("c2", 10.0) == ""
    assert a.admit("c1", 31.0) == ""                                              # one per checker per interval
    inside, most = 0, 0

    async def slow(max_size: int) -> bytes:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        await trio.sleep(0.05)
        inside -= 1
        return blob

    async def main() -> list[str | None]:
        out: list[str | None] = []

        async def one() -> None:
            out.append(await a.judge(v, prog, slow, max_bundle=len(blob), cfg=CFG))
        async with trio.open_nursery() as n:
            for _ in range(3):
                n.start_soon(one)
        return out

    assert trio.run(main) == [CHECKER.peer_id] * 3 and most == 1                 # one arbitration at a time

    async def never(max_size: int) -> bytes:
        await trio.sleep_forever()
        raise AssertionError

    async def late() -> str | None:
        with trio.fail_after(10):
            return await Arbiter(timeout=0.1).judge(v, prog, never, max_bundle=len(blob), cfg=CFG)
    assert trio.run(late) is None                                                 # the deadline: no evidence


def test_a_checkers_recomputation_past_its_deadline_is_no_evidence(
        stage0: tuple[StageProgram, dict[str, torch.Tensor], Transcript], monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker's recomputation runs in a worker thread within its deadline (train/spot.py): past it the
    check is abandoned (no evidence either way), and the thread keeps the limiter until it ends."""
    prog, state, t = stage0
    c = claim(STAGE, job="j", epoch=0, stage=0, replica=0, params=digest(state), t=t)
    release = threading.Event()

    def stuck(self: Checker, *args: object) -> None:
        release.wait(10)
        return None

    monkeypatch.setattr(Checker, "_check", stuck)

    async def on_verdict(v: Verdict) -> None:
        raise AssertionError(v)

    ch = Checker(CHECKER, prog, CFG, job="j", epoch=0, on_verdict=on_verdict, timeout=0.05)

    async def fetch(c: object, seed: bytes) -> tuple[dict[str, torch.Tensor], Transcript]:
        return state, t

    async def main() -> None:
        with trio.fail_after(10):
            assert await ch.step([c], fetch) == []
            assert (ch.unverifiable, ch.checks, ch.limiter.borrowed_tokens) == (1, 0, 1)
            release.set()
            async with ch.limiter:       # free once the abandoned thread ended
                pass
    trio.run(main)
