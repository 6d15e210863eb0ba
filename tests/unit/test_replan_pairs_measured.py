"""A job leader's re-plan measures the estimated pairs that decide its layout before it adopts it, as the
publisher's first plan does (issue 40; ``jobs/lead.py _checked_plan``, ``jobs/verify_links.checked_plan``), and
its snapshot's estimates come from the routine the publisher's use (``verify_links.member_links`` and
``estimated_links``), computing the very snapshot, and so plan, the leader's own loop computed.

The swarm of ``test_plan_pairs_measured``: four members whose memory holds half the model each; a-b is estimated
at 100 MB/s (both announce it, nobody measured a link of either), its true rate 0.5 MB/s."""

from __future__ import annotations

import math
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from fusionp2p.jobs import lead, plan_thread
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.node import NodeJobConfig, NodeJobService
from fusionp2p.jobs.replan import Halted, fill_unmeasured
from fusionp2p.jobs.run import JobRun
from fusionp2p.jobs.verify_links import (
    MAX_PAIRS,
    MEASURE_TIMEOUT,
    MeasureDesk,
    estimate_table,
    estimated_links,
    member_ask,
    member_links,
)
from fusionp2p.plan.plan import Plan
from fusionp2p.plan.snapshot import Link, Snapshot, snapshot_from_records
from fusionp2p.plan.verify import layout, plan_pairs
from fusionp2p.swarm.membership import BandwidthTable, LinkEstimate
from fusionp2p.swarm.node import SwarmConfig
from fusionp2p.testing.swarm import converge, local_swarm
from fusionp2p.wire.protocols import JOB
from fusionp2p.wire.records import BandwidthReport, Measurement
from tests.unit.test_plan_helpers import profile
from tests.unit.test_plan_pairs_measured import (
    PROFILES,
    TRUE_AB,
    A,
    B,
    C,
    D,
    _planner,
    _score,
    _swarm,
)


# ------------------------------------------------------------------ one estimating routine, the same snapshot
def _old_lead_links(bw: BandwidthTable, members: list[str]) -> list[tuple[str, str, Link]]:
    """``Leading._snapshot``'s own loop before it used ``member_links`` (main e6f8e2a), verbatim."""
    links = []
    for i, a in enumerate(members):
        for b in members[i + 1:]:
            e = bw.direct(a, b)
            if e is None and (est := bw.estimate(a, b)) is not None and est.rtt > 0:
                e = est
            if e is not None and e.bandwidth > 0 and math.isfinite(e.bandwidth) and math.isfinite(e.rtt):
                links.append((a, b, Link(bandwidth_bps=e.bandwidth, latency_s=max(0.0, e.rtt / 2))))
    return links


def _old_estimated_links(table: BandwidthTable, members: list[str],
                         measured: list[tuple[str, str, Link]]) -> dict[tuple[str, str], Link]:
    """``verify_links.estimated_links`` before (main e6f8e2a), verbatim."""
    have = {(min(a, b), max(a, b)) for a, b, _ in measured}
    ms = sorted(members)
    out: dict[tuple[str, str], Link] = {}
    for i, a in enumerate(ms):
        for b in ms[i + 1:]:
            if (a, b) in have:
                continue
            e = table.estimate(a, b)
            if e is not None and not e.measured and e.rtt > 0 and e.bandwidth > 0 and math.isfinite(e.bandwidth) \
                    and math.isfinite(e.rtt):
                out[(a, b)] = Link(bandwidth_bps=e.bandwidth, latency_s=e.rtt / 2)
    return out


def _random_table(rng: random.Random) -> tuple[BandwidthTable, list[str]]:
    """Random reports: capacities asymmetric, some unknown, some absurd; measurements of random pairs, some of
    zero samples or RTT, some inflated; sometimes a distrusted node."""
    peers = [f"p{i:02d}" for i in range(rng.randint(2, 9))]
    reports = []
    for p in peers:
        def cap() -> float:
            return rng.choice([0.0, 10 ** rng.uniform(4, 9), 10 ** rng.uniform(9, 12)])

        ms = tuple(Measurement(src=p, dst=d, bandwidth=rng.choice([0.0, *[10 ** rng.uniform(4, 9)] * 9]),
                               rtt=rng.choice([0.0, rng.uniform(1e-4, 0.2)]), samples=rng.choice([0, 1, 3]))
                   for d in rng.sample(peers, rng.randint(0, len(peers))) if d != p)
        reports.append(BandwidthReport(peer=p, seq=1, uplink=cap(), downlink=cap(), measurements=ms))
    table = estimate_table(reports, rng.sample(peers, rng.choice([0, 0, 1])))
    return table, peers


def test_the_leader_snapshot_and_the_publisher_estimates_are_what_the_old_loops_computed() -> None:
    """A property over 400 random tables: the leader's links (in sorted and in shuffled member order) give
    the snapshot, with and without ``fill``, that the old loop gave, bit for bit (the snapshot hash); the
    publisher's estimates are the old ones; and the plans of a few hash alike."""
    rng = random.Random(40)
    planned = 0
    for case in range(400):
        table, peers = _random_table(rng)
        members = sorted(peers) if case % 2 else rng.sample(peers, len(peers))
        profiles = [(p, profile(1e10, memory=90_000_000)) for p in members]
        old, (new, est) = _old_lead_links(table, members), member_links(table, members)
        assert {(min(a, b), max(a, b)) for a, b, _ in new} >= set(est)
        for fill in (False, True):
            o, n = (fill_unmeasured(members, x)[0] if fill else x for x in (old, new))
            s_old, s_new = (snapshot_from_records("job", 3, profiles, x) for x in (o, n))
            assert s_old.snapshot_hash() == s_new.snapshot_hash(), (case, fill)
            if fill and len(members) >= 4 and planned < 12:
                planned += 1
                assert _planner(s_old).plan_hash() == _planner(s_new).plan_hash()
        measured = [lk for lk in new if (min(lk[0], lk[1]), max(lk[0], lk[1])) not in est]
        assert estimated_links(table, sorted(members), measured) == _old_estimated_links(table, members, measured)
    assert planned == 12


# ------------------------------------------------------------------ the leader's re-plan measures first
def _job_run(me: str, table: BandwidthTable, plan: Plan, ops: list[tuple[str, Any]], *, answer: float | None) -> JobRun:
    """A JobRun leading *plan*'s members (the four of PROFILES) with *table*; its JOB requests recorded in *ops*:
    each member halts, a ``measure`` is answered at *answer* (None: refused), a ``start`` is accepted."""
    svc = SimpleNamespace(transport=SimpleNamespace(peer_id=me), config=NodeJobConfig(report_timeout=1.0),
                          drop_arrived=lambda *a, **k: None, planning=trio.CapacityLimiter(1),
                          confirmed_dead=lambda p: False)
    spec = SimpleNamespace(job_id="j1", publisher="pub", model_hash="m", config=SimpleNamespace(
        steps=10, allow_members=(), min_work=0, trust_issuers=()))
    run = JobRun(svc, SimpleNamespace(spec=spec, dag=None), "pub")  # type: ignore[arg-type]
    records = {p: SimpleNamespace(profile=prof, leaving=False, speed_on=lambda h: 0.0) for p, prof in PROFILES}
    svc.swarm = SimpleNamespace(view=SimpleNamespace(is_alive=lambda p: p in records, left=set(), records=records),
                                profile=records[me].profile, speed_on=lambda h: 0.0, bandwidth=table)
    run.plan, run.epoch = plan, plan.epoch

    async def ask_all(peers: list[str], msg: dict[str, Any], *, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        ops.append((msg["op"], msg))
        if msg["op"] == "halt":
            return {p: {"ok": True, "halted": Halted(peer=p, epoch=plan.epoch, stage=-1, replica=-1, step=0).to_wire()}
                    for p in peers}
        if msg["op"] == "measure":
            assert timeout is not None and timeout <= MEASURE_TIMEOUT and msg["within"] <= MEASURE_TIMEOUT
            await trio.sleep(1.0)   # a probe takes a moment
            return {p: {"ok": True, "bandwidth": answer, "rtt": 0.02} if answer else {"ok": False, "error": "no"}
                    for p in peers}
        return {p: {"ok": True} for p in peers}

    run._ask_all = ask_all  # type: ignore[method-assign]
    return run


@pytest.fixture
def toy_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's planner and its pricing: the toy chain of test_plan_pairs_measured (old code: plan_thread's)."""
    monkeypatch.setattr(plan_thread, "plan_for_snapshot", lambda spec, dag, s, previous=None: _planner(s))
    monkeypatch.setattr(lead, "plan_for_snapshot", lambda spec, dag, s, previous=None: _planner(s), raising=False)
    monkeypatch.setattr(lead, "job_score", lambda spec, dag: _score, raising=False)


def _lead(table: BandwidthTable, *, answer: float | None = TRUE_AB) -> tuple[list[tuple[str, Any]], float]:
    # the epoch in force: planned on a-b measured fast (it ran over a-b), now re-planned after a break
    previous = _planner(Snapshot(job="j1", epoch=2, members=dict(PROFILES), links={
        (min(a, b), max(a, b)): Link(bandwidth_bps=5e6, latency_s=0.01) for a in (A, B, C, D) for b in (A, B, C, D) if a < b}))
    ops: list[tuple[str, Any]] = []
    took: list[float] = []

    async def main() -> None:
        run = _job_run(A, table, previous, ops, answer=answer)
        t0 = trio.current_time()
        await run._lead(previous, at=None, why="pipeline broken")
        took.append(trio.current_time() - t0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return ops, took[0]


def test_a_replan_whose_estimate_decides_measures_the_pair_before_it_starts_the_epoch(toy_planner: None) -> None:
    """Fails on main e6f8e2a: the leader started the epoch on a-b's estimate, a plan over a 0.5 MB/s link."""
    _, table = _swarm()
    ops, took = _lead(table)
    assert [op for op, _ in ops] == ["halt", "measure", "start"]
    measure = ops[1][1]
    assert measure["peer"] in (A, B) and measure["job"] == "j1"
    start = ops[2][1]
    snap = Snapshot.from_wire(start["snapshot"])
    assert snap.epoch == 3 and snap.link(A, B) == Link(bandwidth_bps=TRUE_AB, latency_s=0.01)
    mine = _planner(snap)   # what every member computes from the start's snapshot: the plan its hash names
    assert start["plan"] == mine.plan_hash() and (A, B) not in plan_pairs(mine)
    on_estimate = _planner(snap.__class__(job=snap.job, epoch=snap.epoch, members=snap.members, links={
        **snap.links, (A, B): Link(bandwidth_bps=100e6, latency_s=0.01)}))
    assert (A, B) in plan_pairs(on_estimate) and layout(on_estimate) != layout(mine)
    assert 1.0 <= took < 2.0   # stopped for the probe, not for MEASURE_TIMEOUT


def test_a_replan_on_measured_pairs_asks_nothing_and_an_unanswered_ask_keeps_the_estimate(toy_planner: None) -> None:
    _, table = _swarm(ab=TRUE_AB)
    ops, took = _lead(table)
    assert [op for op, _ in ops] == ["halt", "start"] and took == 0
    _, table = _swarm()
    ops, took = _lead(table, answer=None)   # both ends refuse: the estimate stands, the epoch starts on it
    assert [op for op, _ in ops] == ["halt", "measure", "measure", "start"] and took <= MEASURE_TIMEOUT
    snap = Snapshot.from_wire(ops[-1][1]["snapshot"])
    assert snap.link(A, B) == Link(bandwidth_bps=100e6, latency_s=0.01)
    assert ops[-1][1]["plan"] == _planner(snap).plan_hash()


def test_a_node_measures_for_the_leader_it_sees_at_most_max_pairs_per_epoch() -> None:
    class _Prober:
        async def measure_now(self, peer: str, *, timeout: float) -> LinkEstimate | None:
            return LinkEstimate(2e6, 0.02, True)

    async def main() -> None:
        desk = MeasureDesk("me", _Prober(), SimpleNamespace(is_alive=lambda p: True))  # type: ignore[arg-type]
        refused = await desk.answer("member", "job", "pub", {"peer": "x"}, leader=False, epoch=3)
        assert not refused["ok"] and "leader" in refused["error"]
        for _ in range(MAX_PAIRS):
            assert (await desk.answer("lead", "job", "pub", {"peer": "x"}, leader=True, epoch=3))["ok"]
        assert not (await desk.answer("lead", "job", "pub", {"peer": "x"}, leader=True, epoch=3))["ok"]
        assert (await desk.answer("lead", "job", "pub", {"peer": "x"}, leader=True, epoch=4))["ok"]  # the next epoch's
        assert (await desk.answer("pub", "job", "pub", {"peer": "x"}))["ok"]   # the publisher's count is its own

    trio.run(main)


def test_a_node_measures_over_the_job_protocol_for_the_leader_it_sees_not_for_another_member(tmp_path: Path) -> None:
    """Real nodes (in-memory transport), probing off: the job's leader as node a sees it (here the bootstrap's
    host; the publisher is elsewhere) asks a over JOB (``measure``) for its link to b: a probes it and answers;
    b, a member a does not see lead, is refused. Fails on main e6f8e2a: only the publisher was answered."""
    async def main() -> None:
        with trio.fail_after(60):
            async with local_swarm(2, libp2p=False, config=SwarmConfig(probing=False)) as (boot, nodes):
                await converge(nodes, bandwidth=False, timeout=20)
                a, b = nodes
                svc = NodeJobService(a, tmp_path, NodeJobConfig())
                svc.jobs["j1"] = SimpleNamespace(job_id="j1", publisher="pub", members=None,  # type: ignore[assignment]
                                                 offerers=set(), epoch=4, leads=lambda p: p == boot.peer_id)
                a.transport.set_stream_handler(JOB, job_proto.serve(svc.handle))
                assert await member_ask(b.transport, "j1")(a.peer_id, b.peer_id, 10.0) is None   # not its leader
                got = await member_ask(boot.transport, "j1")(a.peer_id, b.peer_id, 10.0)
                assert got is not None and got.bandwidth_bps > 0 and a.prober.links[b.peer_id].samples == 1
                desk = svc._measure
                assert desk is not None and desk.asked == {"j1@4": 1}   # counted against the epoch it leads from

    trio.run(main)


def test_leads_names_the_leader_this_node_sees() -> None:
    _, table = _swarm()
    plan = _planner(Snapshot(job="j1", epoch=2, members=dict(PROFILES)))

    async def main() -> None:
        run = _job_run(B, table, plan, [], answer=None)
        assert run.leads(A) and not run.leads(B) and not run.leads("pub")
        run.svc.confirmed_dead = lambda p: p == A  # type: ignore[method-assign, assignment]
        assert run.leads(B) and not run.leads(A)   # a member whose death a direct question confirmed is passed over
        run.plan = None
        assert not run.leads(B)

    trio.run(main)
