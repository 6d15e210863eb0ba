"""A judge's strike is a gossiped fact (issue 46): the deputy that found a checker's verdict against the leader
false gossips a ``CheckerStruck``; every member of the job, the accused leader first, leaves the checker out of
its next plan. Nodes in one process on the in-memory network, each feeding the jobs topic to its ``Suspects``
as ``JobService``/``JobRun.on_event`` do; hostile strikes (another member's, the checker's own, a forged or
malformed one) strike nobody and crash nobody."""

from __future__ import annotations

import dataclasses

import torch
import trio

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs.events import CheckerStruck, decode_event, encode_event
from fusionp2p.jobs.suspects import Suspects, judge_of
from fusionp2p.net.identity import Identity
from fusionp2p.net.memory import MemoryTransport, memory_network
from fusionp2p.plan.plan import Fence, Plan, Stage
from fusionp2p.train.verify import Transcript, Verdict, claim, digest, encode_verdict
from fusionp2p.wire.msg import packb
from fusionp2p.wire.protocols import TOPIC_JOBS

IDS = [Identity(bytes([0x21 + i]) * 32) for i in range(4)]


def _plan(leader: str, checker: str, others: list[str]) -> Plan:
    """Stage 0 replicated on the leader and its checker; stage 1 on the two others."""
    return Plan(job="j", epoch=2, snapshot_hash="s", algorithm="t", seed=0, n_units=2, micro_batches=1,
                stages=(Stage(start=0, end=1, replicas=tuple(sorted((leader, checker)))),
                        Stage(start=1, end=2, replicas=tuple(sorted(others)))),
                fences=(Fence(index=0, unit=1, dense_bytes=1.0, rho=1.0),))


def _verdict(stage: Identity, checker: Identity, *, epoch: int = 2) -> Verdict:
    """*checker*'s (false) verdict against *stage*'s claim of one micro-batch."""
    t = Transcript(step=5, micro=0, inputs={"x": torch.zeros(4)}, outputs={"y": torch.ones(4)},
                   rng=torch.zeros(8, dtype=torch.uint8))
    c = claim(stage, job="j", epoch=epoch, stage=0, replica=0, params=digest({"w": torch.ones(3)}), t=t)
    v = Verdict(claim=c, checker=checker.peer_id, reason="made up")
    return dataclasses.replace(v, signature=checker.sign(v.body()))


def test_a_deputys_strike_reaches_every_member_and_forged_ones_strike_nobody() -> None:
    leader, checker = IDS[0], IDS[1]
    plan = _plan(leader.peer_id, checker.peer_id, [IDS[2].peer_id, IDS[3].peer_id])
    deputy_id = judge_of(plan.peers, leader.peer_id, leader.peer_id, checker.peer_id)
    assert deputy_id is not None
    deputy = next(i for i in IDS if i.peer_id == deputy_id)
    bystander = next(i for i in IDS[2:] if i is not deputy)
    v = _verdict(leader, checker)
    forged = dataclasses.replace(v, reason="edited")                    # the checker's signature no longer holds
    other_epoch = _verdict(leader, checker, epoch=1)
    not_the_checkers = _verdict(leader, bystander)                      # bystander's verdict, to strike checker

    async def main() -> None:
        with trio.fail_after(20):
            async with memory_network() as net:
                hosts = {i.peer_id: net.add_host(i) for i in IDS}
                suspects = {p: Suspects() for p in hosts}
                seen = {p: trio.Event() for p in hosts}
                results: dict[str, list[bool]] = {p: [] for p in hosts}

                async def listen(me: str, ch: trio.MemoryReceiveChannel[object], n: int) -> None:
                    async for msg in ch:   # as JobService._dispatch_gossip, then JobRun.on_event
                        try:
                            ev = decode_event(msg.data)  # type: ignore[attr-defined]
                        except RemoteProtocolError:
                            results[me].append(False)
                        else:
                            results[me].append(suspects[me].observe(msg.sender, ev, plan,  # type: ignore[attr-defined]
                                                                    leader.peer_id))
                        if len(results[me]) == n:
                            seen[me].set()

                def struck(by: str, ver: Verdict, *, evidence: bytes | None = None) -> bytes:
                    return encode_event(CheckerStruck(job="j", step=5, stage=0, peer=by, suspect=checker.peer_id,
                                                      evidence=encode_verdict(ver) if evidence is None else evidence,
                                                      at=1.0))

                sends: list[tuple[MemoryTransport, bytes]] = [
                    (hosts[checker.peer_id], packb({"type": "struck", "job": "j", "step": "x"})),  # malformed
                    (hosts[deputy_id], struck(deputy_id, v, evidence=b"\x92\x01")),    # malformed evidence
                    (hosts[checker.peer_id], struck(deputy_id, v)),                    # the deputy's name, not sender
                    (hosts[bystander.peer_id], struck(bystander.peer_id, v)),          # not the verdict's judge
                    (hosts[leader.peer_id], struck(leader.peer_id, v)),                # the accused leader: no judge
                    (hosts[deputy_id], struck(deputy_id, forged)),                     # signature broken
                    (hosts[deputy_id], struck(deputy_id, other_epoch)),                # not the plan in force
                    (hosts[deputy_id], struck(deputy_id, not_the_checkers)),
                    (hosts[deputy_id], struck(deputy_id, v)),                          # the deputy's ruling
                    (hosts[deputy_id], struck(deputy_id, v)),                          # again: one strike
                ]
                async with trio.open_nursery() as nursery:
                    for p, h in hosts.items():
                        ch = await h.subscribe(TOPIC_JOBS)
                        nursery.start_soon(listen, p, ch, len(sends))   # in memory, gossip comes back too
                    for sender, data in sends:
                        await sender.publish(TOPIC_JOBS, data)
                    for p in hosts:
                        await seen[p].wait()
                    nursery.cancel_scope.cancel()
                for p, got in results.items():
                    # every node strikes on the deputy's ruling alone, exactly once
                    assert got.count(True) == 1 and got[-2:] == [True, False], (p, got)
                    assert not suspects[p].admits(checker.peer_id) and checker.peer_id in suspects[p].struck
                    assert suspects[p].admits(leader.peer_id) and suspects[p].admits(bystander.peer_id)
                    assert not suspects[p].convicted

    trio.run(main)
