"""Verified stages wired into the stage worker (issue 46, train/spot.py): a job of 2 stages x 2 replicas runs on
real StageWorkers over in-memory channels (``fusionp2p.testing.lying_stages.verified_job``), each replica
keeping a Ledger (its state per step, a signed claim per micro-batch) and checked by the other replica of its
stage, which draws its sample from its own signed seed, fetches the bundles and recomputes them. A stage that
adds a bias to its activations (or sends zeros for its backward) is convicted and left out of the next plan
by every node's Suspects; an honest run with every micro-batch checked is never convicted."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import pytest
import torch

from fusionp2p.graph import coarsen, partition, stages_from_fences, trace
from fusionp2p.graph.program import StageProgram
from fusionp2p.jobs.verified import KEEP, SPOT_BOUNDARY_STEPS, SPOT_STATE_COPIES
from fusionp2p.testing.lying_stages import LyingStage, VerifiedJob, verified_job
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.spot import Ledger, Refused
from fusionp2p.train.verify import challenge, sampled
from tests.integration.test_hostile_training import _Net

S = R = 2
STEPS, MICROS = 4, 2


def _nbytes(ts: Iterable[object]) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


@pytest.fixture(scope="module")
def job() -> tuple[list[StageProgram], list[str]]:
    torch.manual_seed(0)
    dag = trace(_Net(), (torch.randn(2, 4), torch.tensor([0, 2])))
    c = coarsen(dag)
    return partition(c, stages_from_fences(len(c.units), [1])), list(dag.data_inputs)


def _run(job: tuple[list[StageProgram], list[str]], rate: float | None, liar: tuple[int, int] | None = None,
         attack: str | None = None, stamped: bool = True) -> VerifiedJob:
    progs, names = job

    def data(sstep: int, mu: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(sstep * 10 + mu)
        return dict(zip(names, (torch.randn(2, 4, generator=g), torch.randint(0, 3, (2,), generator=g)), strict=True))

    cfg = TrainConfig(steps=STEPS, micro_batch=2, micro_batches=MICROS, lr=0.05, replicas=R, averaging=CO2(tau=1))
    return verified_job(progs, data, cfg, rate=rate, liar=liar, attack=attack, timeout=60.0, stamped=stamped)


def test_honest_job_with_every_micro_batch_checked_is_never_convicted(job: tuple[list[StageProgram], list[str]]) -> None:
    got = _run(job, rate=1.0)
    ch = got.checkers.values()
    assert sum(c.checks for c in ch) == S * R * STEPS * MICROS   # every micro-batch recomputed
    assert sum(c.unverifiable for c in ch) == 0
    assert not got.events and not got.leader.excluded and not got.others.excluded
    assert all(led.cpu_s > 0 for led in got.ledgers.values())
    # every boundary message was stamped, and each end of a link holds its stamps: a micro-batch's act and
    # grad on each of the R links, at both ends (of the steps the books keep)
    assert all(len(got.books[0, r].of(got.ids[1, r].peer_id, STEPS - 1, m)) == 2 for r in range(R)
               for m in range(MICROS))
    assert all(len(got.books[1, r].of(got.ids[0, r].peer_id, STEPS - 1, m)) == 2 for r in range(R)
               for m in range(MICROS))
    # what the checks hold is within what the planner prices (jobs/verified.py: SPOT_STATE_COPIES copies of the
    # state, SPOT_BOUNDARY_STEPS steps of every micro-batch's boundary tensors and their gradients): the ledger
    # keeps exactly KEEP states, the checker one copy of its stage; the random states (5 KB a transcript) apart
    progs = job[0]
    for (s, r), led in got.ledgers.items():
        state = sum(v.numel() * v.element_size() for v in led.ex.state_dict().values())
        kept = [sum(v.numel() * v.element_size() for v in st.values()) for st, _ in led._states.values()]
        assert kept == [state] * KEEP
        ex = got.checkers[s, r]._ex
        assert sum(_nbytes(d.values()) for d in (ex.parameters(), ex.buffers())) == state
        boundary = sum(b.meta.nbytes for b in progs[s].recv) + sum(o.meta.nbytes for o in progs[s].send)
        held = sum(_nbytes(d.values()) for t in led.ex.tap._fwd.values()
                   for d in (t.inputs, t.outputs, t.grad_outputs, t.grad_inputs))
        assert 0 < held <= SPOT_BOUNDARY_STEPS * MICROS * 2 * boundary
        assert KEEP + 1 <= SPOT_STATE_COPIES
    # the checks change nothing in the training: the losses of the run without them, to the bit
    base = _run(job, rate=None)
    assert sorted((r.step, r.replica, r.loss) for r in got.reports if r.loss is not None) == sorted(
        (r.step, r.replica, r.loss) for r in base.reports if r.loss is not None)


@pytest.mark.parametrize(("liar", "attack"), [((0, 1), "bias"), ((1, 0), "zeros")])
def test_lying_stage_is_convicted_and_left_out_of_the_next_plan(job: tuple[list[StageProgram], list[str]],
                                                                liar: tuple[int, int], attack: str) -> None:
    got = _run(job, rate=0.5, liar=liar, attack=attack)
    bad = got.ids[liar].peer_id
    ex = got.workers[liar].ex
    assert isinstance(ex, LyingStage) and ex.lying      # it did lie
    assert {ev.suspect for ev in got.events} == {bad}
    assert got.leader.excluded == {bad} and got.others.excluded == {bad}
    assert not got.leader.admits(bad)                    # Leading._alive: no member of the next re-plan
    verdicts = [v for c in got.checkers.values() for v in c.verdicts]
    assert verdicts and all(v.claim.peer == bad and v.valid() for v in verdicts)
    # without the checks the same liar goes unnoticed
    off = _run(job, rate=None, liar=liar, attack=attack)
    assert not off.events and not off.leader.excluded


@pytest.mark.parametrize(("liar", "attack"), [((0, 1), "bias-hidden"), ((1, 0), "zeros-hidden")])
def test_stage_that_claims_other_tensors_than_it_sent_is_convicted_by_its_stamps(
        job: tuple[list[StageProgram], list[str]], liar: tuple[int, int], attack: str) -> None:
    """A stage that sends a lie and claims (and serves) the honest tensors: the recomputation agrees with
    its claim, and only its neighbour's stamps of what it received give it away."""
    got = _run(job, rate=0.5, liar=liar, attack=attack)
    bad = got.ids[liar].peer_id
    ex = got.workers[liar].ex
    assert isinstance(ex, LyingStage) and ex.lying
    assert got.leader.excluded == {bad} and got.others.excluded == {bad}
    verdicts = [v for c in got.checkers.values() for v in c.verdicts]
    assert verdicts and all(v.claim.peer == bad and v.valid() for v in verdicts)
    # the evidence is the stage's own signature over what it sent, contradicting its signed claim
    assert all(v.stamp is not None and v.stamp.signer == bad and "other than the" in v.reason for v in verdicts)
    # without the stamps the same liar passes every recomputation
    off = _run(job, rate=0.5, liar=liar, attack=attack, stamped=False)
    assert not off.events and not off.leader.excluded
    assert sum(c.checks for c in off.checkers.values()) > 0


def test_ledger_serves_only_its_checkers_sample(job: tuple[list[StageProgram], list[str]]) -> None:
    got = _run(job, rate=0.5)
    led = got.ledgers[0, 0]
    checker, stranger = got.ids[0, 1], got.ids[1, 1]
    step = STEPS - 1
    seed = challenge(checker, "j", 0, step)
    inside = [m for m in range(MICROS) if sampled(seed, 0, 0, m, 0.5)]
    for m in range(MICROS):
        if m in inside:
            state, t = led.bundle(checker.peer_id, seed, step, m)
            assert (t.step, t.micro) == (step, m) and state
        else:
            with pytest.raises(Refused, match="not in"):
                led.bundle(checker.peer_id, seed, step, m)
    with pytest.raises(Refused, match="not a checker"):
        led.bundle(stranger.peer_id, challenge(stranger, "j", 0, step), step, 0)
    with pytest.raises(Refused, match="does not verify"):
        led.bundle(checker.peer_id, challenge(stranger, "j", 0, step), step, 0)
    old = challenge(checker, "j", 0, 0)
    m = next(m for m in range(64) if sampled(old, 0, 0, m, 0.5))
    with pytest.raises(Refused, match="no longer kept"):
        led.bundle(checker.peer_id, old, 0, m)


def test_checker_samples_only_valid_claims_of_its_stage(job: tuple[list[StageProgram], list[str]]) -> None:
    got = _run(job, rate=1.0)
    led, chk = got.ledgers[0, 0], got.checkers[0, 0]
    step = STEPS - 1
    claims = led._claims(step)
    assert len(claims) == MICROS and all(c.valid() for c in claims)
    seed, chosen = chk.sample(claims)
    assert chosen == claims and seed == challenge(chk.me, "j", 0, step)
    forged = dataclasses.replace(claims[0], micro=7)                  # the signature no longer holds
    other_stage = got.ledgers[1, 0]._claims(step)[0]
    other_job = dataclasses.replace(claims[1], job="k")
    assert chk.sample([claims[0], forged, other_stage, other_job])[1] == [claims[0]]
    with pytest.raises(ValueError, match="keep"):
        Ledger(got.ids[0, 0], led.ex, job="j", epoch=0, replica=0, checkers=[], cfg=led.cfg, publish=led.publish, keep=1)
