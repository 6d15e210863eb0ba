"""Reputation-based admission on an embedded swarm (issue 46, ``jobs/reputation.py``): three nodes; a first
job (on two of them, by allow-list) ends DONE and its publisher hands each member a signed work receipt. A
Sybil identity mints the third node a receipt of far more work. A second job of the same publisher that
requires the first job's work (``TrainConfig.min_work``) is offered to the two that did it only: the Sybil's
receipt counts for nothing (its issuer is not trusted), and the third node is refused with the reason."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
import trio

from fusionp2p.jobs import proto as job_proto
from fusionp2p.jobs import reputation
from fusionp2p.jobs.events import JobStateChanged, PlanChanged, ProgressEvent
from fusionp2p.net.identity import Identity
from fusionp2p.train.config import TrainConfig
from tests.integration.test_elastic import _built, _publish, _swarm


def _signed(issuer: Identity, *, job: str, member: str, work: int) -> reputation.WorkReceipt:
    r = reputation.WorkReceipt(job=job, member=member, issuer=issuer.peer_id, steps=1, work=work, at=time.time())
    return dataclasses.replace(r, signature=issuer.sign(r.body()))


def test_a_node_shows_its_receipts_and_only_trusted_issuers_count(tmp_path: Path) -> None:
    """Over the JOB protocol of in-process nodes: a node shows the receipts it keeps; a publisher counts
    those of itself and of the issuers it trusts (``trust_issuers``), never a Sybil's; a receipt handed to
    a node by anyone but the publisher of a job it ran is refused."""
    async def main() -> None:
        with trio.fail_after(30):
            async with _swarm(2, tmp_path) as (emb, _pub, client):
                a, b = emb.nodes
                friend, sybil = Identity.generate(), Identity.generate()
                assert a.jobs.receipts.add(_signed(friend, job="j1", member=a.peer_id, work=30))
                assert a.jobs.receipts.add(_signed(sybil, job="j2", member=a.peer_id, work=10**6))
                assert b.jobs.receipts.add(_signed(sybil, job="j3", member=b.peer_id, work=10**6))
                mine = reputation.Admission(min_work=20, trusted=frozenset({client.peer_id}))
                trusting = reputation.Admission(min_work=20, trusted=frozenset({client.peer_id, friend.peer_id}))
                assert await reputation.ask_standing(client, a.peer_id, "j", mine, timeout=10) == 0
                assert await reputation.ask_standing(client, a.peer_id, "j", trusting, timeout=10) == 30
                assert await reputation.ask_standing(client, b.peer_id, "j", trusting, timeout=10) == 0
                r = _signed(sybil, job="j4", member=b.peer_id, work=5)
                reply = await job_proto.request(client, b.peer_id, {"op": "receipt", "job": "j4", "receipt": r.encode()},
                                                timeout=10)
                assert not reply["ok"]   # no job j4 here: nobody hands a node receipts of jobs it did not run

    trio.run(main)


@pytest.mark.slow   # two tiny jobs: 20-40 s on the shared 2-core VM
def test_a_job_that_requires_work_is_offered_to_the_nodes_that_did_it(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    first = TrainConfig(steps=2, micro_batch=4, micro_batches=2, lr=3e-3, averaging=None)

    async def main() -> None:
        with trio.fail_after(150):
            async with _swarm(3, tmp_path) as (emb, pub, client):
                nodes = sorted(n.peer_id for n in emb.nodes)
                did = tuple(nodes[:2])
                cfg1 = TrainConfig(steps=2, micro_batch=4, micro_batches=2, lr=3e-3, averaging=None, allow_members=did)
                ev1 = await _publish(pub, await _built(client, cfg1, b"a"), tmp_path / "1", lambda ev: None)
                assert [e.state for e in ev1 if isinstance(e, JobStateChanged)][-1] == "done"
                for n in emb.nodes:   # the publisher paid the members that finished the job
                    assert len(n.jobs.receipts.shown()) == (1 if n.peer_id in did else 0)
                sybil = Identity.generate()
                lone = next(n for n in emb.nodes if n.peer_id not in did)
                fake = _signed(sybil, job="sybil-job", member=lone.peer_id, work=10**9)
                assert lone.jobs.receipts.add(fake)   # kept (it is about the node), never counted by this publisher
                cfg2 = TrainConfig(steps=2, micro_batch=4, micro_batches=2, lr=3e-3, averaging=None,
                                   min_work=first.steps * first.micro_batches)
                events: list[ProgressEvent] = []
                ev2 = await _publish(pub, await _built(client, cfg2, b"b"), tmp_path / "2", events.append)
                assert [e.state for e in ev2 if isinstance(e, JobStateChanged)][-1] == "done"
                plans = [e for e in ev2 if isinstance(e, PlanChanged)]
                assert plans and all(set(p.members) <= set(did) for p in plans), [p.members for p in plans]
                spec2 = (await _built(client, cfg2, b"b")).spec
                why = await reputation.admitted(client, lone.peer_id, spec2, timeout=10)
                assert "under TrainConfig.min_work" in why, why
                assert await reputation.admitted(client, did[0], spec2, timeout=10) == ""

    trio.run(main)
