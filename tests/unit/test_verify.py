"""Verified stages (train/verify.py): sampling, claims, recomputation, verdicts and the leader's exclusion,
against the lying stages of fusionp2p.testing.lying_stages."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence

import pytest
import torch

from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.graph import OpDAG, coarsen, partition, stages_from_fences, trace
from fusionp2p.graph.program import StageProgram
from fusionp2p.jobs.events import StageConvicted, decode_event, encode_event
from fusionp2p.jobs.suspects import Suspects
from fusionp2p.models import GPT2, GPT2Config
from fusionp2p.net.identity import Identity
from fusionp2p.plan.plan import Fence, Plan, Stage
from fusionp2p.testing.lying_stages import spot_checked_run
from fusionp2p.train.verify import (
    Transcript,
    Unverifiable,
    Verdict,
    VerifyConfig,
    arbitrate,
    challenge,
    challenge_ok,
    check,
    claim,
    decode_verdict,
    digest,
    encode_verdict,
    p_catch,
    recompute,
    sampled,
)

torch.set_num_threads(1)
STAGE, CHECKER, LEADER = Identity(b"\x01" * 32), Identity(b"\x02" * 32), Identity(b"\x03" * 32)
Pipe = tuple[OpDAG, list[StageProgram]]


@pytest.fixture(scope="module")
def gpt2() -> Pipe:
    """GPT-2 tiny in two stages, with dropout (the recomputation must replay its random state)."""
    torch.manual_seed(1)
    m = GPT2(dataclasses.replace(GPT2Config.tiny(n_layer=2, n_embd=32), dropout=0.1))
    m.train()
    ex = (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    dag = trace(m, ex, count_flops=False)
    coarse = coarsen(dag)
    return dag, partition(coarse, stages_from_fences(len(coarse.units), [2]))


def _data(dag: OpDAG, seed: int = 5, micros: int = 4) -> Callable[[int], Sequence[Mapping[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)

    def data(step: int) -> Sequence[Mapping[str, torch.Tensor]]:
        return [dict(zip(dag.data_inputs, (torch.randint(0, 256, (2, 16), generator=g),
                                           torch.randint(0, 256, (2, 16), generator=g)))) for _ in range(micros)]
    return data


def _plan() -> Plan:
    return Plan(job="j", epoch=0, snapshot_hash="s", algorithm="t", seed=0, n_units=2, micro_batches=1,
                stages=(Stage(start=0, end=1, replicas=tuple(sorted((STAGE.peer_id, CHECKER.peer_id)))),
                        Stage(start=1, end=2, replicas=("x",))),
                fences=(Fence(index=0, unit=1, dense_bytes=1.0, rho=1.0),))


def _transcript(prog: StageProgram, inputs: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Transcript]:
    """An honest stage-0 micro-batch: its state and transcript (forward, and a backward from a made-up
    upstream gradient)."""
    state = {k: v.clone() for k, v in prog.tensors.items()}
    t0 = Transcript(step=3, micro=1, inputs=inputs, outputs={}, rng=torch.get_rng_state(),
                    grad_outputs={o.name: torch.randn(o.meta.shape) for o in prog.send if o.needs_grad})
    return state, recompute(prog, state, t0)


def test_p_catch_matches_sampling() -> None:
    """The stated probability against sampled(): a stage lying on f of its micro-batches, n of them."""
    p, f, n, trials = 0.1, 0.3, 20, 1500
    rnd = random.Random(0)
    caught = 0
    for k in range(trials):
        seed = rnd.randbytes(64)
        caught += any(rnd.random() < f and sampled(seed, 0, 0, k * n + m, p) for m in range(n))
    assert caught / trials == pytest.approx(p_catch(p, f, n), abs=0.04)
    assert p_catch(0.05, 0.1, 400) == pytest.approx(0.865, abs=1e-3)


def test_the_seed_is_the_leaders_and_the_sample_has_its_rate() -> None:
    s = challenge(LEADER, "j", 0, 7)
    assert s == challenge(LEADER, "j", 0, 7)                          # every member derives the same sample
    assert challenge_ok(LEADER.peer_id, "j", 0, 7, s)
    assert not challenge_ok(STAGE.peer_id, "j", 0, 7, s)              # nobody else chose it
    assert not challenge_ok(LEADER.peer_id, "j", 0, 8, s)
    picked = sum(sampled(s, 1, 0, m, 0.05) for m in range(20000))
    assert 850 < picked < 1150
    assert not any(sampled(s, 1, 0, m, 0.0) for m in range(100))


def test_an_honest_micro_batch_with_dropout_is_confirmed(gpt2: Pipe) -> None:
    dag, progs = gpt2
    inputs = {r.name: v for r, v in zip(progs[0].recv, _data(dag)(0)[0].values())}
    state, t = _transcript(progs[0], inputs)
    c = claim(STAGE, job="j", epoch=0, stage=0, replica=0, params=digest(state), t=t)
    assert check(c, progs[0], state, t, VerifyConfig(), CHECKER) is None
    with torch.random.fork_rng():
        torch.manual_seed(99)                 # another random state: other dropout masks, a mismatch
        t2 = recompute(progs[0], state, dataclasses.replace(t, rng=torch.get_rng_state()))
    assert t2.outputs.keys() == t.outputs.keys() and any(not torch.equal(t2.outputs[k], t.outputs[k]) for k in t.outputs)


def test_a_lie_is_evidence_signed_by_both_and_the_leader_excludes(gpt2: Pipe) -> None:
    dag, progs = gpt2
    inputs = {r.name: v for r, v in zip(progs[0].recv, _data(dag)(0)[0].values())}
    state, t = _transcript(progs[0], inputs)
    out = next(iter(t.outputs))
    lie = dataclasses.replace(t, outputs={out: t.outputs[out] + 0.05 * t.outputs[out].std()})
    c = claim(STAGE, job="j", epoch=0, stage=0, replica=0, params=digest(state), t=lie)
    v = check(c, progs[0], state, lie, VerifyConfig(), CHECKER)
    assert v is not None and v.valid() and "differs by 0.0499 of its norm" in v.reason
    assert arbitrate(v, progs[0], state, lie, VerifyConfig()) == STAGE.peer_id
    # the evidence travels (and a tampered one does not verify)
    back = decode_verdict(encode_verdict(v))
    assert back == v and back.valid()
    assert not dataclasses.replace(v, reason="other").valid()
    assert not dataclasses.replace(v, claim=dataclasses.replace(c, micro=2)).valid()
    # the leader acts on it: both parties members of the plan in force, the stage replica of its stage
    s = Suspects()
    assert not s.convict(v, dataclasses.replace(_plan(), epoch=1))      # another epoch's plan
    assert not s.convict(dataclasses.replace(v, signature=b"x" * 64), _plan())
    assert s.convict(v, _plan()) and s.excluded == {STAGE.peer_id}
    assert not s.admits(STAGE.peer_id)
    # over gossip: the checker's event, decoded by every node, excludes the stage replica there too
    ev = Suspects().verdict(v, _plan())
    assert ev is not None and ev.peer == CHECKER.peer_id and ev.suspect == STAGE.peer_id
    got = decode_event(encode_event(ev))
    assert isinstance(got, StageConvicted) and got == ev
    other = Suspects()
    other.observe(STAGE.peer_id, got, _plan())                            # not the checker's own event
    other.observe(CHECKER.peer_id, dataclasses.replace(got, evidence=b"\xc1"), _plan())   # malformed evidence
    other.observe(CHECKER.peer_id, dataclasses.replace(got, suspect=CHECKER.peer_id), _plan())
    assert other.excluded == set()
    other.observe(CHECKER.peer_id, got, _plan())
    assert other.excluded == {STAGE.peer_id}


def test_a_framing_checker_is_named_and_a_wrong_bundle_is_nobodys_evidence(gpt2: Pipe) -> None:
    dag, progs = gpt2
    inputs = {r.name: v for r, v in zip(progs[0].recv, _data(dag)(0)[0].values())}
    state, t = _transcript(progs[0], inputs)
    c = claim(STAGE, job="j", epoch=0, stage=0, replica=0, params=digest(state), t=t)
    framed = Verdict(claim=c, checker=CHECKER.peer_id, reason="made up")
    framed = dataclasses.replace(framed, signature=CHECKER.sign(framed.body()))
    assert framed.valid()
    assert arbitrate(framed, progs[0], state, t, VerifyConfig()) == CHECKER.peer_id
    other = {k: v + 1e-3 for k, v in state.items()}
    with pytest.raises(Unverifiable):
        check(c, progs[0], other, t, VerifyConfig(), CHECKER)            # not the claimed parameters
    with pytest.raises(Unverifiable):
        check(c, progs[0], state, dataclasses.replace(t, micro=2), VerifyConfig(), CHECKER)
    with pytest.raises(Unverifiable):
        check(dataclasses.replace(c, signature=b""), progs[0], state, t, VerifyConfig(), CHECKER)
    s = Suspects()
    assert not s.convict(dataclasses.replace(framed, checker=STAGE.peer_id), _plan())   # a stage judging itself


def test_malformed_verdicts_raise_remote_protocol_error() -> None:
    c = claim(STAGE, job="j", epoch=0, stage=0, replica=0, params=b"\0" * 32,
              t=Transcript(step=0, micro=0, inputs={}, outputs={}, rng=torch.zeros(1, dtype=torch.uint8)))
    good = encode_verdict(Verdict(claim=c, checker=CHECKER.peer_id, reason="r", signature=b"s" * 64))
    rnd = random.Random(3)
    for k in range(300):
        b = bytearray(good)
        for _ in range(1 + k % 4):
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        with contextlib.suppress(RemoteProtocolError):    # decodes, or RemoteProtocolError, nothing else
            decode_verdict(bytes(b[: rnd.randrange(len(b) + 1)] if k % 5 == 0 else b))
    for bad in (b"", b"\x80", b"\xc1", bytes(5000)):
        with pytest.raises(RemoteProtocolError):
            decode_verdict(bad)


@pytest.mark.parametrize(("attack", "liar"), [("bias", 0), ("zeros", 1)])
def test_a_lying_stage_is_caught_and_excluded(gpt2: Pipe, attack: str, liar: int) -> None:
    """Stage 0 adds 5% of its activations' spread to them, or stage 1 sends zeros for its backward, on
    half its micro-batches: spot checks at 25% exclude it within a few steps (every verdict a real
    mismatch, signed by both). Without them (rate 0) it lies through every step and nobody notices: this
    test fails without the defence."""
    dag, progs = gpt2
    on = spot_checked_run(progs, _data(dag), steps=12, liar=liar, attack=attack, lie_rate=0.5,
                          cfg=VerifyConfig(rate=0.25))
    assert on.excluded_at is not None and on.excluded_at < 12
    assert all(v.claim.stage == liar and v.valid() for v in on.verdicts)
    off = spot_checked_run(progs, _data(dag), steps=12, liar=liar, attack=attack, lie_rate=0.5,
                           cfg=VerifyConfig(rate=0.0))
    assert off.excluded_at is None and off.lies >= 3
    if attack == "zeros":     # its bite on the loss (a 5% bias on GPT-2's residual stream hardly moves it)
        honest = spot_checked_run(progs, _data(dag), steps=12, cfg=VerifyConfig(rate=0.0)).losses
        assert max(abs(a - b) for a, b in zip(off.losses, honest, strict=True)) > 1e-3


def test_a_conviction_rolls_back_to_the_checkpoint_before_it(gpt2: Pipe) -> None:
    """After the conviction an honest holder takes the stage over from the newest checkpoint no later than
    it (as a job's leader rolls back): with the only checkpoint at step 0 the run then trains exactly the
    honest run's course, none of the lies left in its state."""
    dag, progs = gpt2

    def data(step: int) -> Sequence[Mapping[str, torch.Tensor]]:   # a step's batches are a function of the step
        return _data(dag, seed=100 + step)(step)

    honest = spot_checked_run(progs, data, steps=8, cfg=VerifyConfig(rate=0.0))
    run = spot_checked_run(progs, data, steps=8, liar=1, attack="zeros", lie_rate=1.0,
                           cfg=VerifyConfig(rate=0.5), stop_when_excluded=False, checkpoint_every=100)
    assert run.excluded_at is not None and run.lies > 0 and run.rolled_back_to == 0
    assert run.losses == pytest.approx(honest.losses, rel=1e-6)
    assert all(torch.equal(run.state[k], v) for k, v in honest.state.items())


def test_honest_stages_are_never_convicted(gpt2: Pipe) -> None:
    dag, progs = gpt2
    run = spot_checked_run(progs, _data(dag), steps=6, cfg=VerifyConfig(rate=0.5))
    assert run.checks >= 6 and run.verdicts == [] and run.excluded_at is None


def test_digest_binds_names_dtypes_shapes_and_bytes() -> None:
    a = torch.randn(5, 7)
    b = a.clone()
    b[2, 3] += 1e-6
    d = digest({"x": a})
    assert d == digest({"x": a.clone()}) and len(d) == 32
    assert len({d, digest({"x": b}), digest({"y": a}), digest({"x": a.double()}), digest({"x": a.reshape(7, 5)}),
                digest({"x": a, "z": torch.zeros(0)})}) == 6


def test_config_is_validated() -> None:
    for bad in ({"rate": 1.5}, {"rate": -0.1}, {"rtol": -1.0}, {"atol": float("nan")}):
        with pytest.raises(ConfigError):
            VerifyConfig(**bad)
