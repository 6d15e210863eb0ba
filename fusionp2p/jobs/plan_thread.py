"""A job's plans computed off the node's event loop (issue 40).

:func:`~fusionp2p.jobs.build.plan_for_snapshot` is pure CPU: 0.04 CPU-s for 8 members, 0.24 for 32 and 0.8-1.0
for 64 (a 12-layer GPT-2, every pair measured; the publisher's verified planning may plan three times). Made
on the trio loop it served nothing meanwhile: a 64-member plan held the loop for 4.1 s under a load of 8.5 on
two cores (``benchmarks/plan_lag.py``), in which heartbeats, pings, probes and streams stalled and members
looked dead. In a worker thread the loop runs at every switch of the GIL (5 ms): the same plan's worst loop
lag was 0.19 s, 32 members' 0.09 s.

Every caller of the planner in ``jobs/`` (the publisher's first plan, ``jobs/verify_links.py``; a member's
plan of each epoch, ``jobs/run.py``; the leader's re-plans and trial plans, ``jobs/lead.py``; a re-balance,
``jobs/rebalance.py``) plans through :func:`off_loop`, under the node's planning limiter
(``NodeJobService.planning``, one plan at a time per node: a second waits rather than halve the first's
CPU). The planner keeps no state between calls (no cache, no global RNG: its seeds are the job's, its
NumPy generators local; neither ``plan/`` nor the DAG's coarsening imports torch), so a plan made in a
thread is the plan made on the loop, bit for bit, and its hash the one the members elect by. A cancelled wait (the job's end, a deadline around
the planning) abandons the thread: its result is dropped, and the thread holds the limiter until it ends, so
the node's next plan waits for it rather than run beside it.

A thread does not take every stall off the loop: a collection of the cyclic garbage collector's oldest
generation holds the GIL for as long as it walks the process's heap (0.53 s and 0.54 s each in a node-sized
process under a load of 8, the lags the loop then saw), and a plan's allocations set one off about every
other plan. So the collector is paused while a plan is made (:func:`collector_paused`): the plan's garbage
is freed by reference counts as before, what it leaves in cycles is collected once it ended.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import trio

from fusionp2p.graph import OpDAG
from fusionp2p.jobs.build import plan_for_snapshot
from fusionp2p.jobs.spec import JobSpec
from fusionp2p.plan.plan import Plan
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.swarm.gcfreeze import collector_paused
from fusionp2p.train.spot import in_thread

T = TypeVar("T")

def _paused_call(fn: Callable[[], T]) -> T:
    with collector_paused():
        return fn()


async def off_loop(fn: Callable[[], T], limiter: trio.CapacityLimiter) -> T:
    """*fn* (a plan, or work around plans) in a worker thread under *limiter*, the collector paused while it
    runs; a cancelled wait abandons the thread, which keeps its token until it ends (``train/spot.in_thread``)."""
    return await in_thread(functools.partial(_paused_call, fn), limiter)


async def planned(spec: JobSpec, dag: OpDAG, snap: Snapshot, limiter: trio.CapacityLimiter, *,
                  previous: Plan | None = None) -> Plan:
    """:func:`plan_for_snapshot` in a worker thread under *limiter* (the module docstring)."""
    return await off_loop(functools.partial(plan_for_snapshot, spec, dag, snap, previous=previous), limiter)


__all__ = ["collector_paused", "off_loop", "planned"]
