"""Many nodes in one trio.run elect a plan over the in-memory transport."""

from __future__ import annotations

import dataclasses
import random
from contextlib import AsyncExitStack

import trio
import trio.testing

from fusionp2p.jobs.election import (
    Adopted,
    ElectionConfig,
    Failed,
    Outcome,
    PlanElector,
    Vote,
    fetch_adopted,
    fetch_latest,
    fetch_latest_record,
    latest_key,
    open_elector,
    plan_key,
)
from fusionp2p.jobs.records import register_rankers
from fusionp2p.net.identity import Identity
from fusionp2p.net.memory import MemoryNetwork, memory_network
from fusionp2p.net.transport import Transport
from fusionp2p.plan.opfence import make_plan
from fusionp2p.plan.plan import Plan
from fusionp2p.plan.snapshot import Link, Snapshot, snapshot_from_records
from fusionp2p.types import DeviceProfile
from fusionp2p.wire.msg import packb
from tests.unit.test_plan_helpers import chain, profile

WORKLOAD = chain(24, act=2_000_000)
JOB = "job-e"


def records(peers: list[str]) -> tuple[list[tuple[str, DeviceProfile]], list[tuple[str, str, Link]]]:
    """Signed-record stand-ins: one profile per peer, two measurements per pair (one each way)."""
    profs = [(p, profile(flops=1e10 * (1 + k % 3))) for k, p in enumerate(peers)]
    meas = []
    for a in range(len(peers)):
        for b in range(len(peers)):
            if a != b:
                fast = (a < len(peers) // 2) == (b < len(peers) // 2)
                meas.append((peers[a], peers[b], Link(bandwidth_bps=(1.25e8 if fast else 1.25e6) * (1 + (a + b) % 2), latency_s=1e-3)))
    return profs, meas


def local_snapshot(rnd: random.Random, epoch: int, peers: list[str]) -> Snapshot:
    """What one node assembles from records arriving in its own (shuffled) order."""
    profs, meas = records(peers)
    rnd.shuffle(profs)
    rnd.shuffle(meas)
    return snapshot_from_records(JOB, epoch, profs, meas)


async def run_round(electors: dict[str, PlanElector], snaps: dict[str, Snapshot]) -> dict[str, Outcome]:
    out: dict[str, Outcome] = {}

    async def one(peer: str) -> None:
        snap = snaps[peer]
        out[peer] = await electors[peer].elect(snap, make_plan(WORKLOAD, snap, seed=7))

    async with trio.open_nursery() as n:
        for p in electors:
            n.start_soon(one, p)
    return out


async def start(net: MemoryNetwork, stack: AsyncExitStack, n: int, cfg: ElectionConfig) -> tuple[dict[str, Transport], dict[str, PlanElector]]:
    hosts = {t.peer_id: t for t in (net.add_host(Identity(bytes([k + 1]) * 32)) for k in range(n))}
    electors = {p: await stack.enter_async_context(open_elector(t, cfg)) for p, t in hosts.items()}
    return dict(hosts), electors


def test_six_nodes_shuffled_records_adopt_the_same_plan_then_one_dies() -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net, AsyncExitStack() as stack:
                hosts, electors = await start(net, stack, 6, ElectionConfig(timeout_s=10))
                peers = sorted(hosts)
                rnd = random.Random(1)
                snaps = {p: local_snapshot(rnd, 0, peers) for p in peers}
                assert len({s.snapshot_hash() for s in snaps.values()}) == 1
                out = await run_round(electors, snaps)
                hashes = {o.decision.plan_hash for o in out.values() if isinstance(o.decision, Adopted)}
                assert len(hashes) == 1
                assert len(out) == 6
                (h0,) = hashes
                assert h0 == make_plan(WORKLOAD, snaps[peers[0]], seed=7).plan_hash()
                assert all(o.plan is not None and o.plan.plan_hash() == h0 for o in out.values())

                # A member dies: the survivors open epoch 1 without it and agree on a new plan.
                dead = peers[2]
                net.kill(dead)
                alive = [p for p in peers if p != dead]
                snaps = {p: local_snapshot(rnd, 1, alive) for p in alive}
                out = await run_round({p: electors[p] for p in alive}, snaps)
                hashes = {o.decision.plan_hash for o in out.values() if isinstance(o.decision, Adopted)}
                assert len(hashes) == 1
                assert len(out) == 5
                (h1,) = hashes
                assert h1 != h0
                plan1 = out[alive[0]].plan
                assert isinstance(plan1, Plan)
                assert plan1.epoch == 1
                assert dead not in plan1.peers

                # A node that joins late adopts the current plan from the DHT.
                late = net.add_host(Identity(bytes([99]) * 32))
                got = await fetch_adopted(late, snaps[alive[0]])
                assert got is not None
                assert got[0] == 1
                assert got[1].plan_hash() == h1

                # One who knows only the dead member (a `job attach` from a status record of epoch 0) does not
                # believe the latest record (epoch 1: none of its voters is known); epoch 0's record, read by its
                # epoch, names every member of that epoch
                assert await fetch_latest_record(late, JOB, known=[dead]) is None
                rec0 = await fetch_latest_record(late, JOB, epoch=0)
                assert rec0 is not None and rec0[0] == 0 and rec0[1].plan_hash() == h0 and set(rec0[2]) == set(peers)
                assert await fetch_latest_record(late, JOB, epoch=5) is None   # no such epoch

    trio.run(main)


def test_stale_membership_still_reaches_quorum_and_a_minority_fails_at_the_deadline() -> None:
    async def main() -> None:
        with trio.fail_after(120):  # virtual seconds under the autojump clock
            async with memory_network() as net, AsyncExitStack() as stack:
                hosts, electors = await start(net, stack, 6, ElectionConfig(timeout_s=20, republish_s=3))
                peers = sorted(hosts)
                rnd = random.Random(2)
                # Epoch 0 still lists a dead member: 5 of 6 votes exceed the quorum of 4.
                net.kill(peers[0])
                snaps = {p: local_snapshot(rnd, 0, peers) for p in peers[1:]}
                out = await run_round({p: electors[p] for p in peers[1:]}, snaps)
                assert len({o.decision.plan_hash for o in out.values() if isinstance(o.decision, Adopted)}) == 1
                assert len(out) == 5
                # Only 3 of 6 members are alive: no quorum, every survivor reports Failed at the deadline.
                net.kill(peers[1])
                net.kill(peers[2])
                snaps = {p: local_snapshot(rnd, 1, peers) for p in peers[3:]}
                t0 = trio.current_time()
                out = await run_round({p: electors[p] for p in peers[3:]}, snaps)
                assert all(isinstance(o.decision, Failed) for o in out.values())
                assert trio.current_time() - t0 >= 20

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_node_with_a_diverging_snapshot_adopts_the_majority_plan() -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net, AsyncExitStack() as stack:
                hosts, electors = await start(net, stack, 6, ElectionConfig(timeout_s=10))
                peers = sorted(hosts)
                rnd = random.Random(3)
                snaps = {p: local_snapshot(rnd, 0, peers) for p in peers}
                # One node missed a record: its snapshot (and so its plan) differ.
                profs, meas = records(peers)
                snaps[peers[4]] = snapshot_from_records(JOB, 0, profs, [m for m in meas if m[:2] != (peers[0], peers[5]) and m[:2] != (peers[5], peers[0])])
                out = await run_round(electors, snaps)
                majority = make_plan(WORKLOAD, snaps[peers[0]], seed=7).plan_hash()
                assert make_plan(WORKLOAD, snaps[peers[4]], seed=7).plan_hash() != majority
                for o in out.values():
                    assert isinstance(o.decision, Adopted)
                    assert o.decision.plan_hash == majority
                    assert o.plan is not None
                    assert o.plan.plan_hash() == majority

    trio.run(main)


def test_a_member_that_missed_the_votes_decides_from_the_plan_record_before_the_deadline() -> None:
    """Four of five members decide and stop republishing; the fifth subscribes only afterwards, so
    gossip gives it none of their votes (py-libp2p's gossipsub did this to one node in about half of the
    4-process e2e runs). It decides from the record the winners stored, within a poll interval, instead
    of failing at the deadline (30 s here: before the record poll it waited that long)."""

    async def main() -> None:
        with trio.fail_after(60):
            async with memory_network() as net, AsyncExitStack() as stack:
                cfg = ElectionConfig(timeout_s=30, record_poll_s=1.0)
                hosts = [net.add_host(Identity(bytes([k + 1]) * 32)) for k in range(5)]
                peers = sorted(h.peer_id for h in hosts)
                snap = local_snapshot(random.Random(2), 0, peers)
                early = {h.peer_id: await stack.enter_async_context(open_elector(h, cfg)) for h in hosts[:4]}
                out = await run_round(early, dict.fromkeys(early, snap))
                (h0,) = {o.decision.plan_hash for o in out.values() if isinstance(o.decision, Adopted)}
                late = await stack.enter_async_context(open_elector(hosts[4], cfg))
                t0 = trio.current_time()
                got = await late.elect(snap, make_plan(WORKLOAD, snap, seed=7))
                assert isinstance(got.decision, Adopted)
                assert got.decision.plan_hash == h0
                assert got.plan is not None and got.plan.plan_hash() == h0
                assert trio.current_time() - t0 <= 2 * cfg.record_poll_s

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_malformed_plan_record_is_ignored_by_the_record_poll() -> None:
    """A record whose vote does not decode (or is not bytes) is skipped as a whole: the lone member's
    election ends at its deadline, it does not crash on the record."""

    async def main() -> None:
        with trio.fail_after(60):
            async with memory_network() as net, AsyncExitStack() as stack:
                hosts = [net.add_host(Identity(bytes([k + 1]) * 32)) for k in range(3)]
                peers = sorted(h.peer_id for h in hosts)
                snap = local_snapshot(random.Random(3), 0, peers)
                plan = make_plan(WORKLOAD, snap, seed=7)
                for votes in ([b"\xc1"], [packb({"t": "plan-vote", "epoch": -1})], [7]):
                    await hosts[1].dht_put(plan_key(JOB, 0), packb({"job": JOB, "epoch": 0, "members": peers,
                                                                 "plan": plan.to_wire(), "votes": votes}))
                    el = await stack.enter_async_context(open_elector(hosts[0], ElectionConfig(timeout_s=5)))
                    got = await el.elect(snap, plan)
                    assert isinstance(got.decision, Failed)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _forged_record(attacker: Identity, snap: Snapshot, *, epoch: int) -> bytes:
    """A record naming only its author: one self-signed vote, a plan that gives it every stage."""
    own = make_plan(WORKLOAD, Snapshot(job=JOB, epoch=epoch, members={attacker.peer_id: profile()}, links={}), seed=7)
    own = dataclasses.replace(own, snapshot_hash=snap.snapshot_hash())
    vote = Vote.make(job=JOB, epoch=epoch, plan_hash=own.plan_hash(), snapshot_hash=snap.snapshot_hash(),
                     peer=attacker.peer_id, sign=attacker.sign)
    return packb({"job": JOB, "epoch": epoch, "members": [attacker.peer_id], "plan": own.to_wire(),
                  "votes": [vote.encode()]})


def test_a_forged_plan_record_is_not_adopted_and_does_not_block_the_honest_one() -> None:
    """Issue 15, item 6. A member whose election fails reads the epoch's DHT record: the attacker's
    (only itself as member) must not be adopted. And a record claiming a huge epoch used to stop the
    honest winners from storing theirs (they kept the "newest"); now they replace anything that does
    not verify against their own election."""

    async def main() -> None:
        with trio.fail_after(60):
            async with memory_network() as net, AsyncExitStack() as stack:
                cfg = ElectionConfig(timeout_s=5, record_poll_s=1.0)
                attacker = Identity(bytes([77]) * 32)
                evil = net.add_host(attacker)
                hosts = [net.add_host(Identity(bytes([k + 1]) * 32)) for k in range(3)]
                for h in hosts:
                    register_rankers(h)   # as every node, client and bootstrap does
                peers = sorted(h.peer_id for h in hosts)
                snap = local_snapshot(random.Random(4), 0, peers)
                await evil.dht_put(plan_key(JOB, 0), _forged_record(attacker, snap, epoch=0))
                # alone, the first member cannot reach a quorum (2 of 3); the forged record must not help it
                lone = await stack.enter_async_context(open_elector(hosts[0], cfg))
                got = await lone.elect(snap, make_plan(WORKLOAD, snap, seed=7))
                assert isinstance(got.decision, Failed)
                assert await fetch_adopted(hosts[0], snap) is None
                # a record with a huge epoch under the key: the honest winners still store theirs
                await evil.dht_put(plan_key(JOB, 0), _forged_record(attacker, snap, epoch=2**62))
                electors = {h.peer_id: await stack.enter_async_context(open_elector(h, cfg)) for h in hosts}
                out = await run_round(electors, dict.fromkeys(electors, snap))
                (h0,) = {o.decision.plan_hash for o in out.values() if isinstance(o.decision, Adopted)}
                stored = await fetch_adopted(hosts[2], snap)
                assert stored is not None and stored[1].plan_hash() == h0
                assert attacker.peer_id not in stored[1].peers
                # written again after the winners: the DHT keeps the record with more voters (jobs/records.py)
                await evil.dht_put(plan_key(JOB, 0), _forged_record(attacker, snap, epoch=0))
                again = await fetch_adopted(hosts[0], snap)
                assert again is not None and again[1].plan_hash() == h0
                # the job-level record (readers without a snapshot): a forgery with one voter ranks below
                # the winners' record whatever epoch it claims, and a reader that knows a member refuses it
                await evil.dht_put(latest_key(JOB), _forged_record(attacker, snap, epoch=2**62))
                latest = await fetch_latest(hosts[1], JOB)
                assert latest is not None and latest[1].plan_hash() == h0
                net.dht[latest_key(JOB)] = _forged_record(attacker, snap, epoch=2**62)   # as on a DHT node that kept it
                assert await fetch_latest(hosts[1], JOB, known=peers[:1]) is None

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
