"""The publisher's first plan has its estimated pairs measured before it is adopted when their estimate decides
the layout (issue 40, deliverable 2; ``plan/verify.py``, ``jobs/verify_links.py``).

The swarm: four members whose memory holds half the model each, so the plan is a two-stage pipeline (or two of
them). c-d and the cross pairs are measured; a-b is not, and a and b each announce 100 MB/s (nobody has
measured a link of either yet, so nothing contradicts them): a-b is estimated at 100 MB/s and the plan runs on
it. Its true rate is 0.5 MB/s."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.node import NodeJobConfig, NodeJobService
from fusionp2p.jobs.verify_links import (
    MAX_PAIRS,
    MEASURE_TIMEOUT,
    MeasureDesk,
    decode_figure,
    estimate_table,
    floors,
    measure_pairs,
    member_ask,
    verified_plan,
)
from fusionp2p.plan.config import PlannerConfig
from fusionp2p.plan.joint import plan_joint
from fusionp2p.plan.plan import Plan
from fusionp2p.plan.predict import predict
from fusionp2p.plan.snapshot import Link, Snapshot
from fusionp2p.plan.verify import MARGIN, check, layout, plan_pairs
from fusionp2p.swarm.membership import LinkEstimate
from fusionp2p.swarm.node import SwarmConfig
from fusionp2p.testing.swarm import converge, local_swarm
from fusionp2p.wire.protocols import JOB
from fusionp2p.wire.records import BandwidthReport, Measurement
from tests.unit.test_plan_helpers import chain, profile

A, B, C, D = "peer-a", "peer-b", "peer-c", "peer-d"
TRUE_AB = 0.5e6      # bytes/s: what measuring a-b finds
WORKLOAD = chain(8, flops=1e8, act=1_000_000, params=2_000_000)
PROFILES = [(p, profile(1e10, memory=90_000_000)) for p in (A, B, C, D)]   # each holds 5 of the 8 units


def _planner(snap: Snapshot) -> Plan:
    return plan_joint(WORKLOAD, snap, PlannerConfig(micro_batches=8))


def _score(plan: Plan, snap: Snapshot) -> float:
    return predict(plan, WORKLOAD, snap, PlannerConfig(micro_batches=8)).step_time_s


def _report(peer: str, cap: float, *links: tuple[str, float]) -> BandwidthReport:
    return BandwidthReport(peer=peer, seq=1, uplink=cap, downlink=cap, measurements=tuple(
        Measurement(src=peer, dst=d, bandwidth=bw, rtt=0.02, samples=3) for d, bw in links))


def _swarm(ab: float | None = None) -> tuple[list[tuple[str, str, Link]], Any]:
    """The view's measured links and its table; *ab*: a-b measured too, at that rate."""
    reports = [_report(A, 100e6, (C, 1e6), (D, 1e6), *(((B, ab),) if ab else ())), _report(B, 100e6, (C, 1e6), (D, 1e6)),
               _report(C, 5e6, (D, 5e6)), _report(D, 5e6)]
    links = [(m.src, m.dst, Link(bandwidth_bps=m.bandwidth, latency_s=m.rtt / 2)) for r in reports for m in r.measurements]
    return links, estimate_table(reports)


def _run(links: list[tuple[str, str, Link]], table: Any, ask: Any, **kw: Any) -> tuple[Snapshot, Plan, Any, float]:
    out: list[Any] = []

    async def main() -> None:
        t0 = trio.current_time()
        out.extend(await verified_plan("job", PROFILES, links, table, _planner, ask, score=_score, **kw))
        out.append(trio.current_time() - t0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return out[0], out[1], out[2], out[3]


def test_an_inflated_estimate_is_measured_and_the_measurement_overturns_the_layout(caplog: Any) -> None:
    links, table = _swarm()
    asked: list[tuple[str, str]] = []

    async def ask(asked_end: str, other: str, timeout: float) -> Link | None:
        asked.append((asked_end, other))
        await trio.sleep(1.0)   # a probe takes a moment
        return Link(bandwidth_bps=TRUE_AB, latency_s=0.01)

    with caplog.at_level(logging.INFO, logger="fusionp2p.jobs.verify_links"):
        snap, plan, chk, took = _run(links, table, ask)
    # what the old code adopted: the plan on the estimate, a pipeline over a-b
    on_estimate = _planner(Snapshot(job="job", epoch=0, members=dict(PROFILES), links={
        **{(min(a, b), max(a, b)): lk for a, b, lk in links}, (A, B): Link(bandwidth_bps=100e6, latency_s=0.01)}))
    assert (A, B) in plan_pairs(on_estimate)
    assert chk.decides and chk.ask == ((A, B),) and len(asked) == 1
    # the adopted plan is made on the measured rate and no longer runs over a-b
    assert snap.link(A, B) == Link(bandwidth_bps=TRUE_AB, latency_s=0.01)
    assert (A, B) not in plan_pairs(plan) and layout(plan) != layout(on_estimate)
    assert layout(plan) == layout(_planner(snap))
    assert 1.0 <= took < 2.0
    assert "decide the plan" in caplog.text and "planned again with 1 measured pair" in caplog.text


def test_a_plan_on_measured_pairs_asks_nothing() -> None:
    links, table = _swarm(ab=TRUE_AB)

    async def ask(asked_end: str, other: str, timeout: float) -> Link | None:
        raise AssertionError("nothing is to be measured")

    snap, plan, chk, took = _run(links, table, ask)
    assert chk.depends == () and not chk.decides and took == 0
    assert snap.link(A, B) == Link(bandwidth_bps=TRUE_AB, latency_s=0.01)
    # an estimate the layout does not hinge on is not measured either: every member announces 100 MB/s and
    # the measured pairs run at 5 MB/s; at its low end (5 MB/s, the measured median) a-b still carries the
    # plan's replicas
    reports = [_report(A, 100e6, (C, 5e6), (D, 5e6)), _report(B, 100e6, (C, 5e6), (D, 5e6)), _report(C, 100e6, (D, 5e6)),
               _report(D, 100e6)]
    links = [(m.src, m.dst, Link(bandwidth_bps=m.bandwidth, latency_s=m.rtt / 2)) for r in reports for m in r.measurements]
    snap, plan, chk, took = _run(links, estimate_table(reports), ask)
    assert chk.depends == ((A, B),) and (A, B) in plan_pairs(plan) and not chk.decides and not chk.ask
    assert snap.link(A, B) == Link(bandwidth_bps=100e6, latency_s=0.01) and took == 0


def test_ends_that_others_measured_fast_are_checked_at_that_rate_and_nothing_is_asked() -> None:
    # a fifth node (no member of the job) measured links of a and of b at 80 MB/s: the pair reaches that rate
    # where a pair's rate is its ends' access links, so the estimate is checked there, not at the swarm's median
    links, _ = _swarm()
    reports = [_report(A, 100e6, (C, 1e6), (D, 1e6)), _report(B, 100e6, (C, 1e6), (D, 1e6)), _report(C, 5e6, (D, 5e6)),
               _report(D, 5e6), _report("peer-e", 100e6, (A, 80e6), (B, 80e6))]

    async def ask(asked_end: str, other: str, timeout: float) -> Link | None:
        raise AssertionError("nothing is to be measured")

    snap, plan, chk, took = _run(links, estimate_table(reports), ask)
    assert chk.depends == ((A, B),) and not chk.decides and (A, B) in plan_pairs(plan) and took == 0
    assert check(plan, snap, [(A, B)], _planner).decides   # at the median's rate alone it would ask
    # measured at the estimate itself: no link of the plan's is slower at its low end, so no extra plan is made
    plans: list[Snapshot] = []

    def counted(s: Snapshot) -> Plan:
        plans.append(s)
        return _planner(s)

    table = estimate_table([*reports[:-1], _report("peer-e", 100e6, (A, 100e6), (B, 100e6))])
    chk2 = check(plan, snap, [(A, B)], counted, score=_score, floors=floors(table, [(A, B)]))
    assert chk2.depends == ((A, B),) and not chk2.decides and plans == []


def test_a_layout_that_wins_by_less_than_the_margin_at_the_low_end_asks_nothing() -> None:
    # the measured pairs at 50 MB/s: at its low end (25 MB/s) a-b no longer pairs the replicas (the layout's
    # members change), but the plan priced there is within MARGIN of the one that wins there
    r = 50e6
    reports = [_report(A, 100e6, (C, r), (D, r)), _report(B, 100e6, (C, r), (D, r)), _report(C, 100e6, (D, r)),
               _report(D, 100e6)]
    links = [(m.src, m.dst, Link(bandwidth_bps=m.bandwidth, latency_s=m.rtt / 2)) for x in reports for m in x.measurements]

    async def ask(asked_end: str, other: str, timeout: float) -> Link | None:
        raise AssertionError("nothing is to be measured")

    snap, plan, chk, took = _run(links, estimate_table(reports), ask)
    assert chk.depends == ((A, B),) and not chk.decides and f"within {MARGIN:.0%}" in chk.alternative and took == 0
    assert check(plan, snap, [(A, B)], _planner).decides   # without the margin, the layout alone, it would ask


def test_a_pair_that_does_not_answer_keeps_its_estimate_and_the_deadline_holds(caplog: Any) -> None:
    links, table = _swarm()
    asked: list[str] = []

    async def ask(asked_end: str, other: str, timeout: float) -> Link | None:
        asked.append(asked_end)
        await trio.sleep_forever()
        return None

    with caplog.at_level(logging.INFO, logger="fusionp2p.jobs.verify_links"):
        snap, plan, chk, took = _run(links, table, ask, timeout=MEASURE_TIMEOUT)
    assert took == pytest.approx(MEASURE_TIMEOUT)
    assert chk.ask == ((A, B),) and asked == [A]   # the end that announced less (a tie: the smaller id)
    assert snap.link(A, B) == Link(bandwidth_bps=100e6, latency_s=0.01)     # its estimate, as planned before
    assert (A, B) in plan_pairs(plan)
    assert "1 of 1 pair(s) not measured within 10 s keep their estimate" in caplog.text


def test_the_other_end_is_asked_when_the_first_cannot() -> None:
    async def main() -> None:
        async def ask(asked_end: str, other: str, timeout: float) -> Link | None:
            await trio.sleep(0.5)
            return None if asked_end == A else Link(bandwidth_bps=TRUE_AB)

        got = await measure_pairs([(A, B)], ask, lambda p: p, timeout=5)
        assert got == {(A, B): Link(bandwidth_bps=TRUE_AB)}
        assert trio.current_time() == pytest.approx(1.0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_absurd_announcement_makes_at_most_max_pairs_measured() -> None:
    # twenty members, each pair estimated at a liar's rate, measured ones at 1 MB/s: the plan runs on many
    # estimated pairs; at most MAX_PAIRS are asked for, the highest estimates first
    peers = [f"p{i:02d}" for i in range(20)]
    links = {(a, b): Link(bandwidth_bps=1e6, latency_s=0.01) for i, a in enumerate(peers) for b in peers[i + 1:]}
    est = {(a, b) for (a, b) in links if (int(a[1:]) + int(b[1:])) % 2}
    for k in est:
        links[k] = Link(bandwidth_bps=1e12, latency_s=0.01)
    snap = Snapshot(job="j", epoch=0, members={p: profile(1e10, memory=90_000_000) for p in peers}, links=links)
    w = chain(16, flops=1e8, act=1_000_000, params=2_000_000)
    planner = lambda s: plan_joint(w, s, PlannerConfig(micro_batches=8))   # noqa: E731
    plan = planner(snap)
    chk = check(plan, snap, est, planner)
    assert chk.decides and len(chk.depends) > MAX_PAIRS and len(chk.ask) == MAX_PAIRS
    assert "keep their estimate" in chk.explain()


class _Prober:
    def __init__(self) -> None:
        self.asked: list[str] = []

    async def measure_now(self, peer: str, *, timeout: float) -> LinkEstimate | None:
        self.asked.append(peer)
        return LinkEstimate(TRUE_AB, 0.02, True)


class _View:
    def is_alive(self, peer: str) -> bool:
        return peer != "gone"


def test_a_node_measures_only_for_the_publisher_and_at_most_max_pairs_a_job() -> None:
    async def main() -> None:
        prober = _Prober()
        desk = MeasureDesk("me", prober, _View())
        ok = await desk.answer("pub", "job", "pub", {"peer": "x"})
        assert ok == {"ok": True, "bandwidth": TRUE_AB, "rtt": 0.02}
        assert decode_figure(ok) == Link(bandwidth_bps=TRUE_AB, latency_s=0.01)
        assert not (await desk.answer("stranger", "job", "pub", {"peer": "x"}))["ok"]
        assert not (await desk.answer("pub", "job", "pub", {"peer": "me"}))["ok"]
        assert not (await desk.answer("pub", "job", "pub", {"peer": "gone"}))["ok"]
        for bad in ({"peer": 3}, {"peer": "x", "within": -1}, {"peer": "x", "within": math.inf}, {"peer": "x", "within": True}):
            with pytest.raises(RemoteProtocolError):
                await desk.answer("pub", "job", "pub", bad)
        while (await desk.answer("pub", "job", "pub", {"peer": "x"}))["ok"]:
            pass
        assert len(prober.asked) == MAX_PAIRS - 2   # every ask counts (the two refused above too); the rest: no probe
        assert (await desk.answer("pub", "job2", "pub", {"peer": "x"}))["ok"]   # another job, its own count

    trio.run(main)
    for bad in ({"bandwidth": 0, "rtt": 0.1}, {"bandwidth": math.inf, "rtt": 0.1}, {"bandwidth": 1e6, "rtt": -1},
                {"bandwidth": "1", "rtt": 0.1}, {"bandwidth": 1e6}):
        with pytest.raises(RemoteProtocolError):
            decode_figure(bad)


def test_a_node_probes_the_pair_it_is_asked_for_over_the_probe_protocol(tmp_path: Path) -> None:
    """Real nodes (in-memory transport), probing off: the publisher (here the bootstrap's host) asks a node over
    JOB (``measure``, the node's job service) for its link to another; the node measures it on demand over the
    probe protocol, answers the figure and keeps it (its next report carries it); asked again, it answers
    without a probe; another peer is refused."""
    async def main() -> None:
        with trio.fail_after(60):
            async with local_swarm(2, libp2p=False, config=SwarmConfig(probing=False)) as (boot, nodes):
                await converge(nodes, bandwidth=False, timeout=20)
                a, b = nodes
                svc = NodeJobService(a, tmp_path, NodeJobConfig())
                svc.jobs["j1"] = SimpleNamespace(job_id="j1", publisher=boot.peer_id, members=None,  # type: ignore[assignment]
                                                 offerers=set())
                a.transport.set_stream_handler(JOB, job_proto.serve(svc.handle))
                assert b.peer_id not in a.prober.links
                ask = member_ask(boot.transport, "j1")
                got = await ask(a.peer_id, b.peer_id, 10.0)
                assert got is not None and got.bandwidth_bps > 0 and got.latency_s > 0, got
                assert a.prober.links[b.peer_id].samples == 1 and a.prober.dirty
                assert await ask(a.peer_id, b.peer_id, 10.0) == got and a.prober.links[b.peer_id].samples == 1
                assert await member_ask(b.transport, "j1")(a.peer_id, b.peer_id, 10.0) is None   # not the publisher
                assert await member_ask(boot.transport, "j2")(a.peer_id, b.peer_id, 10.0) is None   # no such job here

    trio.run(main)
