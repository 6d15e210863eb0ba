"""Verified stages wired into the stage worker (issue 46, train/spot.py): a job of 2 stages x 2 replicas runs on
real StageWorkers over in-memory channels, each replica keeping a Ledger (its state per step, a signed claim
per micro-batch) and checked by the other replica of its stage, which draws its sample from its own signed
seed, fetches the bundles and recomputes them. A stage that adds a bias to its activations (or sends zeros
for its backward) is convicted and left out of the next plan by every node's Suspects; an honest run with
every micro-batch checked is never convicted."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio

from fusionp2p.graph import coarsen, partition, stages_from_fences, trace
from fusionp2p.jobs.events import StageConvicted, decode_event, encode_event
from fusionp2p.jobs.suspects import Suspects
from fusionp2p.net.identity import Identity
from fusionp2p.plan.plan import Fence, Plan, Stage
from fusionp2p.testing.channels import memory_channel_pair
from fusionp2p.testing.lying_stages import LyingStage
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.train.spot import Bundle, Checker, Ledger, Refused
from fusionp2p.train.verify import Claim, Verdict, VerifyConfig, challenge, sampled
from fusionp2p.train.worker import StageContext, StageReport, StageWorker
from tests.integration.test_hostile_training import _Net

S = R = 2
STEPS, MICROS = 4, 2


def _job(rate: float, liar: tuple[int, int] | None = None, attack: str | None = None) -> dict[str, Any]:
    """Run the job; what the checkers and the nodes' Suspects saw."""
    torch.manual_seed(0)
    dag = trace(_Net(), (torch.randn(2, 4), torch.tensor([0, 2])))
    c = coarsen(dag)
    progs = partition(c, stages_from_fences(len(c.units), [1]))
    ids = {(s, r): Identity(bytes([10 * s + r + 1]) * 32) for s in range(S) for r in range(R)}
    n = len(c.units)
    plan = Plan(job="j", epoch=0, snapshot_hash="h", algorithm="t", seed=0, n_units=n, micro_batches=MICROS,
                stages=tuple(Stage(start=lo, end=hi, replicas=tuple(sorted(ids[s, r].peer_id for r in range(R))))
                             for s, (lo, hi) in enumerate(((0, 1), (1, n)))),
                fences=(Fence(index=0, unit=1, dense_bytes=1.0, rho=1.0),))
    cfg = TrainConfig(steps=STEPS, micro_batch=2, micro_batches=MICROS, lr=0.05, replicas=R, averaging=CO2(tau=1))
    vcfg = VerifyConfig(rate=rate)
    leader, others = Suspects(), Suspects()      # the leader's, and another node's that only hears the gossip
    events: list[StageConvicted] = []

    def data(sstep: int, mu: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(sstep * 10 + mu)
        return dict(zip(dag.data_inputs, (torch.randn(2, 4, generator=g), torch.randint(0, 3, (2,), generator=g)),
                        strict=True))

    async def report(rep: StageReport) -> None:
        pass

    async def on_verdict(v: Verdict) -> None:
        ev = leader.verdict(v, plan)                 # the checker's node gossips the evidence ...
        if ev is not None:
            events.append(ev)
            got = decode_event(encode_event(ev))     # ... every other node judges it itself
            others.observe(ev.peer, got, plan)

    inbox = {k: trio.open_memory_channel[list[Claim]](100) for k in ids}   # claims for the checker of (s, r)
    ledgers: dict[tuple[int, int], Ledger] = {}
    checkers = {k: Checker(ids[k[0], 1 - k[1]], progs[k[0]], vcfg, job="j", epoch=0, on_verdict=on_verdict) for k in ids}
    execs = {(s, r): LyingStage(progs[s], attack=attack if (s, r) == liar else None) for s in range(S) for r in range(R)}
    pipe = {r: memory_channel_pair(f"s0r{r}", f"s1r{r}", window=8) for r in range(R)}
    peers = {s: memory_channel_pair(f"s{s}r0", f"s{s}r1", window=8) for s in range(S)}
    workers = []
    for (s, r), ex in execs.items():
        ledgers[s, r] = Ledger(ids[s, r], ex, job="j", epoch=0, replica=r, checkers=[ids[s, 1 - r].peer_id], cfg=vcfg,
                               publish=inbox[s, r][0].send)
        workers.append(StageWorker(StageContext(
            job="j", executor=ex, config=cfg, replica=r, replicas=R, links={1 - s: pipe[r][s]}, peers=[peers[s][r]],
            data=data, tokens_per_micro=2, report=report, recv_timeout=10.0, spot=ledgers[s, r])))

    async def check_loop(k: tuple[int, int]) -> None:
        async def fetch(c: Claim, seed: bytes) -> Bundle:   # the in-process stand-in of the request to the stage
            return ledgers[k].bundle(checkers[k].me.peer_id, seed, c.step, c.micro)
        async for claims in inbox[k][1]:
            await checkers[k].step(claims, fetch)

    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                for k in ids:
                    n.start_soon(check_loop, k)
                async with trio.open_nursery() as w:
                    for wk in workers:
                        w.start_soon(wk.run)
                for send, _ in inbox.values():
                    await send.aclose()

    trio.run(main)
    return {"ids": ids, "leader": leader, "others": others, "events": events, "checkers": checkers,
            "ledgers": ledgers, "execs": execs}


def test_honest_job_with_every_micro_batch_checked_is_never_convicted() -> None:
    got = _job(rate=1.0)
    ch = got["checkers"]
    assert sum(c.checks for c in ch.values()) == S * R * STEPS * MICROS   # every micro-batch recomputed
    assert sum(c.unverifiable for c in ch.values()) == 0
    assert not got["events"] and not got["leader"].excluded and not got["others"].excluded
    assert all(led.cpu_s > 0 for led in got["ledgers"].values())


@pytest.mark.parametrize(("liar", "attack"), [((0, 1), "bias"), ((1, 0), "zeros")])
def test_lying_stage_is_convicted_and_left_out_of_the_next_plan(liar: tuple[int, int], attack: str) -> None:
    got = _job(rate=0.5, liar=liar, attack=attack)
    bad = got["ids"][liar].peer_id
    assert got["execs"][liar].lying                   # it did lie
    assert {ev.suspect for ev in got["events"]} == {bad}
    assert got["leader"].excluded == {bad} and got["others"].excluded == {bad}
    assert not got["leader"].admits(bad)              # Leading._alive: no member of the next re-plan
    verdicts = [v for c in got["checkers"].values() for v in c.verdicts]
    assert verdicts and all(v.claim.peer == bad and v.valid() for v in verdicts)


def test_ledger_serves_only_its_checkers_sample() -> None:
    got = _job(rate=0.5)
    ids, led = got["ids"], got["ledgers"][0, 0]
    checker, stranger = ids[0, 1], ids[1, 1]
    step = STEPS - 1
    seed = challenge(checker, "j", 0, step)
    inside = [m for m in range(MICROS) if sampled(seed, 0, 0, m, 0.5)]
    outside = [m for m in range(MICROS) if m not in inside]
    for m in inside:
        state, t = led.bundle(checker.peer_id, seed, step, m)
        assert (t.step, t.micro) == (step, m) and state
    for m in outside:
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
