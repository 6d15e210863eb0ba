"""The publisher's first plan on measured links where they exist, estimates elsewhere, and the estimated
pairs measured before it is adopted when their estimate decides the layout (issue 40; ``plan/verify.py``).

Publisher side (:func:`verified_plan`): the snapshot of the accepting members takes the view's measured
links and, for the other pairs whose two ends both have measured links, the bandwidth table's estimate
(``BandwidthTable.estimate``: the two ends' announced capacities, checked against what others measured of
them), as a job leader's snapshot does (``jobs/lead.py``). The plan is made; if it runs on estimated pairs
whose low end gives another layout (``plan.verify.check``; the low end no lower than what others measured of
the two ends guarantees: :func:`floors`), at most ``MAX_PAIRS`` of them are measured
within ``MEASURE_TIMEOUT`` seconds: one end of each is asked (``measure`` on the JOB protocol) to probe the
other now and answer its figure, the end that announced less first (an inflated announcement is the
likeliest lie; the other end is asked if the first cannot), and the plan is made again with the measured
figures and adopted. A pair not measured in time keeps its estimate, and the log says which.

Leader side: a job leader's re-plan (``jobs/lead.py _checked_plan``) is checked the same way
(:func:`checked_plan`, on the snapshot of the members that answered its halt, :func:`member_links`: one
routine estimates the pairs of both snapshots, :func:`estimated_links`).

Node side (:class:`MeasureDesk`): a node answers ``measure`` only from the publisher of a job it accepted
(at most ``MAX_PAIRS`` times per job) or from the leader of the job's plan as the node sees it (at most
``MAX_PAIRS`` times per epoch of the node's), for a live member other than itself, one probe at a time
(``LinkProber.measure_now``: an existing figure is answered without a probe), each within
``MEASURE_TIMEOUT``. So neither can make a node probe more than a plan's bound, and a lying node's
absurd capacity makes at most ``MAX_PAIRS`` pairs measured once, before one plan.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import trio

from fusionp2p.errors import FusionError, PeerUnavailable, RemoteProtocolError
from fusionp2p.graph import OpDAG, coarsen, to_workload
from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs.build import BuiltJob, plan_for_snapshot, planner_config
from fusionp2p.jobs.plan_thread import off_loop
from fusionp2p.jobs.spec import JobSpec
from fusionp2p.net.transport import Transport
from fusionp2p.plan.plan import Plan
from fusionp2p.plan.predict import predict
from fusionp2p.plan.snapshot import Link, Snapshot, snapshot_from_records
from fusionp2p.plan.verify import MAX_PAIRS, Pair, PairCheck, check, pair, with_measured
from fusionp2p.swarm.membership import BandwidthTable, LinkEstimate, judged_links
from fusionp2p.types import DeviceProfile, short_peer
from fusionp2p.wire.records import BandwidthReport

log = logging.getLogger(__name__)

MEASURE_TIMEOUT = 10.0    # seconds the publisher waits for the pairs it asked for, all together
MAX_JOBS = 256            # jobs a node keeps its measure counts of (the oldest forgotten first)

# (end asked, other end, seconds) -> the asked end's figure of their link, None when it could not measure it
Ask = Callable[[str, str, float], Awaitable[Link | None]]


def estimate_table(reports: Iterable[BandwidthReport], distrusted: Iterable[str] = ()) -> BandwidthTable:
    """A bandwidth table of the view's reports, judged as ``membership.judged_links`` judges them."""
    table = BandwidthTable()
    table.trust.assume(distrusted)
    for r in reports:
        table.on_report(r)
    return table


def judged_view(view: Mapping[str, Any]) -> tuple[list[tuple[str, str, Link]], BandwidthTable]:
    """A bootstrap's view's measured links (``membership.judged_links``: a node whose capacity claims the
    bootstrap distrusts is planned from others' measurements of it) and its reports' table (the estimates)."""
    reports = [r for r in view["bw"] if isinstance(r, BandwidthReport)]
    judged = judged_links(reports, view.get("distrusted", ()))
    links = [(a, b, Link(bandwidth_bps=e.bandwidth, latency_s=max(0.0, e.rtt / 2))) for a, b, e in judged]
    return links, estimate_table(reports, view.get("distrusted", ()))


def usable(e: LinkEstimate) -> bool:
    """Whether a table's figure can be planned with: a positive finite rate and a finite RTT."""
    return e.bandwidth > 0 and math.isfinite(e.bandwidth) and math.isfinite(e.rtt)


def estimated_links(table: BandwidthTable, members: Sequence[str],
                    measured: Iterable[tuple[str, str, Any]]) -> dict[Pair, Link]:
    """Estimates for the pairs of *members* without a figure in *measured*, where both ends have measured links
    (an estimate's latency is the two ends' measured ones: 0 means one end has none). A pair (a, b) with a
    before b in *members* is estimated from a's uplink and b's downlink (``BandwidthTable.estimate``): the
    order of *members* is part of the input (the publisher's is sorted, a leader's its sorted members), so
    that every node that computes a snapshot from the same inputs computes the same one. The one routine of
    the publisher's snapshot (:func:`verified_plan`) and a job leader's (:func:`member_links`)."""
    have = {pair(a, b) for a, b, _ in measured}
    out: dict[Pair, Link] = {}
    for i, a in enumerate(members):
        for b in members[i + 1:]:
            if pair(a, b) in have:
                continue
            e = table.estimate(a, b)
            if e is not None and not e.measured and e.rtt > 0 and usable(e):
                out[pair(a, b)] = Link(bandwidth_bps=e.bandwidth, latency_s=e.rtt / 2)
    return out


def member_links(table: BandwidthTable, members: Sequence[str]) -> tuple[list[tuple[str, str, Link]], dict[Pair, Link]]:
    """A job leader's links of *members* (``jobs/lead.py _snapshot``): each pair's measurement
    (``BandwidthTable.direct``; one without a usable figure is left out, not estimated) and, for the pairs
    without one, :func:`estimated_links`; with the estimated ones apart (the pairs the re-plan's check may
    have measured)."""
    direct = [(a, b, e) for i, a in enumerate(members) for b in members[i + 1:] if (e := table.direct(a, b)) is not None]
    estimated = estimated_links(table, members, direct)
    links = [(a, b, Link(bandwidth_bps=e.bandwidth, latency_s=max(0.0, e.rtt / 2))) for a, b, e in direct if usable(e)]
    links += [(a, b, lk) for (a, b), lk in estimated.items()]
    return links, estimated


def floors(table: BandwidthTable, pairs: Iterable[Pair]) -> dict[Pair, float]:
    """A rate each of *pairs* is known to reach: the smaller of the best rates other (trusted) nodes measured on
    a link of each end (``BandwidthTable.measured_of``). Where a pair's rate is its two ends' access links
    (the model the estimates assume: docs/swarm.md), a measured link of a node is at most its smaller
    capacity, so the pair reaches both ends' figures; a pair with an end nobody measured has none."""
    out: dict[Pair, float] = {}
    for a, b in pairs:
        fa, fb = table.measured_of(a), table.measured_of(b)
        if fa and fb:
            out[(a, b)] = min(fa, fb)
    return out


def ask_order(p: Pair, table: BandwidthTable) -> tuple[str, str]:
    """Which end of *p* is asked first: the one that announced less (ties: the smaller id)."""
    a, b = p
    ca, cb = (max(table.capacity(x)[:2]) for x in (a, b))
    return (a, b) if (ca, a) <= (cb, b) else (b, a)


async def measure_pairs(pairs: Iterable[Pair], ask: Ask, order: Callable[[Pair], tuple[str, str]], *,
                        timeout: float = MEASURE_TIMEOUT) -> dict[Pair, Link]:
    """The figures of *pairs* measured within *timeout* seconds (all at once; each end probes one at a time):
    the first end (*order*) is asked, then, if it could not, the other. Pairs not measured are left out."""
    out: dict[Pair, Link] = {}
    deadline = trio.current_time() + timeout

    async def one(p: Pair) -> None:
        first, second = order(p)
        for asked, other in ((first, second), (second, first)):
            left = deadline - trio.current_time()
            if left <= 0:
                return
            link = await ask(asked, other, left)
            if link is not None:
                out[p] = link
                return

    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:
            for p in pairs:
                nursery.start_soon(one, p)
    return out


# (peer, request, seconds) -> its answer; PeerUnavailable or RemoteProtocolError when none came
Send = Callable[[str, dict[str, Any], float], Awaitable[dict[str, Any]]]


def member_ask(t: Transport | None, job: str, send: Send | None = None) -> Ask:
    """Ask a member of *job* over the JOB protocol (``measure``) to measure its link to another (through *t*,
    or *send*: a leader asks itself through its own handler)."""

    async def over(peer: str, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert t is not None
        return await job_proto.request(t, peer, msg, timeout=timeout)

    sender = send if send is not None else over

    async def ask(asked: str, other: str, timeout: float) -> Link | None:
        try:
            reply = await sender(asked, {"op": "measure", "job": job, "peer": other, "within": timeout}, timeout)
            if not reply.get("ok"):
                log.info("job %s: %s did not measure its link to %s: %s", job, short_peer(asked), short_peer(other),
                         str(reply.get("error"))[:200])
                return None
            return decode_figure(reply)
        except (PeerUnavailable, RemoteProtocolError) as exc:
            log.info("job %s: %s did not measure its link to %s: %s", job, short_peer(asked), short_peer(other), exc)
            return None

    return ask


def decode_figure(reply: dict[str, Any]) -> Link:
    """A measure answer's figure; RemoteProtocolError unless a positive finite rate and a finite RTT >= 0."""
    bw, rtt = reply.get("bandwidth"), reply.get("rtt")
    if not (isinstance(bw, float | int) and not isinstance(bw, bool) and math.isfinite(bw) and bw > 0
            and isinstance(rtt, float | int) and not isinstance(rtt, bool) and math.isfinite(rtt) and rtt >= 0):
        raise RemoteProtocolError("measure: the answer needs a positive finite bandwidth and a finite rtt >= 0")
    return Link(bandwidth_bps=float(bw), latency_s=float(rtt) / 2)


async def verified_plan(job: str, profiles: Iterable[tuple[str, DeviceProfile]],
                        measured: list[tuple[str, str, Link]], table: BandwidthTable | None,
                        planner: Callable[[Snapshot], Plan], ask: Ask, *,
                        score: Callable[[Plan, Snapshot], float] | None = None,
                        timeout: float = MEASURE_TIMEOUT, limiter: trio.CapacityLimiter | None = None,
                        ) -> tuple[Snapshot, Plan, PairCheck]:
    """The epoch-0 snapshot and plan of *job* (module docstring): measured links, estimates elsewhere, and the
    estimated pairs the plan's layout depends on measured (within *timeout*) before it is adopted. The plans
    and the check are made in a worker thread under *limiter* (``jobs/plan_thread.py``; None: one of its own)."""
    profiles = list(profiles)
    table = table if table is not None else BandwidthTable()
    estimated = estimated_links(table, sorted(p for p, _ in profiles), measured)
    snap = snapshot_from_records(job, 0, profiles, [*measured, *((a, b, lk) for (a, b), lk in estimated.items())])
    return await checked_plan(job, snap, estimated, table, planner, ask, score=score, timeout=timeout, limiter=limiter)


async def checked_plan(job: str, snap: Snapshot, estimated: Mapping[Pair, Link], table: BandwidthTable,
                       planner: Callable[[Snapshot], Plan], ask: Ask, *,
                       score: Callable[[Plan, Snapshot], float] | None = None,
                       timeout: float = MEASURE_TIMEOUT, limiter: trio.CapacityLimiter | None = None,
                       ) -> tuple[Snapshot, Plan, PairCheck]:
    """*snap*'s plan, with the pairs of *estimated* (its links that are *table*'s estimates) that decide its
    layout measured within *timeout* and the plan made again on them (:func:`verified_plan`; a job leader's
    re-plan, ``jobs/lead.py``). The snapshot adopted (*snap*, or it with the measured figures), its plan,
    and what the check found."""
    limiter = limiter if limiter is not None else trio.CapacityLimiter(1)
    bounds = floors(table, estimated)

    def plan_and_check() -> tuple[Plan, PairCheck]:
        made = planner(snap)
        try:
            return made, check(made, snap, estimated, planner, score=score, floors=bounds)
        except (FusionError, ValueError) as exc:   # no plan at the estimates' low end: the plan stands unchecked
            log.info("job %s: the estimated pairs not checked: %s", job, exc)
            return made, PairCheck()

    plan, chk = await off_loop(plan_and_check, limiter)
    if not chk.ask:
        if chk.depends:
            log.info("job %s: %s", job, chk.explain())
        return snap, plan, chk
    log.info("job %s: %s", job, chk.explain())
    got = await measure_pairs(chk.ask, ask, lambda p: ask_order(p, table), timeout=timeout)
    if late := [p for p in chk.ask if p not in got]:
        log.info("job %s: %d of %d pair(s) not measured within %.0f s keep their estimate: %s", job, len(late),
                 len(chk.ask), timeout, ", ".join(f"{short_peer(a)}-{short_peer(b)}" for a, b in late))
    if not got:
        return snap, plan, chk
    snap = with_measured(snap, got)
    plan = await off_loop(functools.partial(planner, snap), limiter)
    log.info("job %s: planned again with %d measured pair(s): %s", job, len(got), ", ".join(
        f"{short_peer(a)}-{short_peer(b)} {lk.bandwidth_bps / 1e6:.2f} MB/s (estimated {estimated[(a, b)].bandwidth_bps / 1e6:.2f})"
        for (a, b), lk in sorted(got.items())))
    return snap, plan, chk


def job_score(spec: JobSpec, dag: OpDAG) -> Callable[[Plan, Snapshot], float]:
    """A plan's predicted step time on a snapshot, as the job's planner prices it (``plan.verify.check``)."""
    cfgs = (planner_config(spec.config), planner_config(spec.config, recompute=True))

    @functools.cache
    def workload() -> Any:   # built on the first score, in the planning thread (the check), not on the loop
        return to_workload(coarsen(dag), micro_batch=spec.config.micro_batch)

    def score(plan: Plan, snap: Snapshot) -> float:
        wl = workload()
        for cfg in cfgs:   # made with activation recomputation where nothing fit without it (choose_plan)
            try:
                return predict(plan, wl, snap, cfg).step_time_s
            except ValueError:
                continue
        raise ValueError("the plan fits neither with nor without recomputation")

    return score


async def first_plan(t: Transport, built: BuiltJob, profiles: Iterable[tuple[str, DeviceProfile]],
                     measured: list[tuple[str, str, Link]], table: BandwidthTable | None,
                     limiter: trio.CapacityLimiter | None = None) -> tuple[Snapshot, Plan]:
    """The publisher's epoch-0 snapshot and plan of *built* (:func:`verified_plan`, the members asked over JOB,
    the planning in a worker thread under *limiter*)."""
    spec, dag = built.spec, built.dag
    snap, plan, _ = await verified_plan(spec.job_id, profiles, measured, table,
                                        lambda s: plan_for_snapshot(spec, dag, s), member_ask(t, spec.job_id),
                                        score=job_score(spec, dag), limiter=limiter)
    return snap, plan


class _Prober(Protocol):
    async def measure_now(self, peer: str, *, timeout: float) -> LinkEstimate | None: ...


class _Alive(Protocol):
    def is_alive(self, peer: str) -> bool: ...


class MeasureDesk:
    """A node's side of ``measure`` (module docstring): the asks it answered, per job."""

    def __init__(self, me: str, prober: _Prober, view: _Alive) -> None:
        self.me = me
        self.prober = prober
        self.view = view
        self.asked: dict[str, int] = {}

    async def answer(self, peer: str, job: str, publisher: str, req: Mapping[str, Any], *,
                     leader: bool = False, epoch: int = 0) -> dict[str, Any]:
        """*leader*: *peer* leads the job's plan as this node sees it (a re-plan's check, ``jobs/lead.py``), whose
        asks count per *epoch* of this node's (the epoch it leads the re-plan of)."""
        if peer == publisher:
            key = job
        elif leader:
            key = f"{job}@{epoch}"
        else:
            return {"ok": False, "error": "only the job's publisher or its leader asks for its links to be measured"}
        other = job_proto.str_field(dict(req), "peer", "measure", limit=128)
        within = req.get("within", MEASURE_TIMEOUT)
        if isinstance(within, bool) or not isinstance(within, float | int) or not math.isfinite(within) or within <= 0:
            raise RemoteProtocolError("measure: 'within' must be a positive number of seconds")
        n = self.asked.pop(key, 0)   # re-inserted: the most recent jobs are kept
        self.asked[key] = n + 1
        while len(self.asked) > MAX_JOBS:
            del self.asked[next(iter(self.asked))]
        if n >= MAX_PAIRS:
            return {"ok": False, "error": f"at most {MAX_PAIRS} links measured per job"}
        if other == self.me or not self.view.is_alive(other):
            return {"ok": False, "error": "not a live member"}
        e = await self.prober.measure_now(other, timeout=min(float(within), MEASURE_TIMEOUT))
        if e is None:
            return {"ok": False, "error": "not measured in time"}
        return {"ok": True, "bandwidth": float(e.bandwidth), "rtt": float(e.rtt)}


__all__ = ["MAX_PAIRS", "BandwidthTable", "MEASURE_TIMEOUT", "MeasureDesk", "checked_plan", "decode_figure", "estimate_table",
           "estimated_links", "first_plan", "floors", "job_score", "judged_view", "measure_pairs", "member_ask",
           "member_links", "usable", "verified_plan"]
