"""Verified stages between nodes (jobs/verified.py, train/spot_wire.py): the bounded codecs of a step's claims, a
micro-batch's stamps and a stage's bundle; who checks whom; where a re-plan after a conviction resumes. The
job itself runs in tests/integration/test_verified_job.py (slow); the decoders are fuzzed in tests/unit/fuzz."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import trio

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs.verified import checker_of, rollback
from fusionp2p.net.identity import Identity
from fusionp2p.plan.plan import Fence, Plan, Stage
from fusionp2p.train.receipts import Stamp
from fusionp2p.train.spot_wire import (
    MAX_CLAIMS,
    decode_bundle,
    decode_claims,
    decode_stamps,
    encode_bundle,
    encode_claims,
    encode_stamps,
)
from fusionp2p.train.verify import Claim, Transcript, Verdict, claim, digest, encode_verdict
from fusionp2p.wire.msg import packb

ME = Identity(bytes([7]) * 32)


def _transcript() -> Transcript:
    return Transcript(step=4, micro=1, inputs={"x": torch.randn(2, 3)}, outputs={"y": torch.randn(2, 3)},
                      rng=torch.get_rng_state(), grad_outputs={"y": torch.randn(2, 3)},
                      grad_inputs={"x": torch.randn(2, 3)}, loss_scale=0.25)


def _claim() -> Claim:
    return claim(ME, job="j", epoch=2, stage=1, replica=0, params=bytes(32), t=_transcript())


def test_a_bundle_round_trips_to_the_digests_its_claim_names() -> None:
    state, t = {"w": torch.randn(4, 4), "n": torch.tensor([3])}, _transcript()
    got_state, got = decode_bundle(encode_bundle((state, t)), max_size=1 << 20)
    assert digest(got_state) == digest(state) and got.digests() == t.digests()
    assert (got.step, got.micro, got.loss_scale) == (4, 1, 0.25)


def test_a_malformed_bundle_is_a_remote_protocol_error() -> None:
    blob = encode_bundle(({"w": torch.ones(2)}, _transcript()))
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    bad_rng = dict(header, rng={**header["rng"], "dtype": "I8"})
    stray = dict(header, **{"other/x": header["state/w"]})
    cases = [blob[:-1], blob + b"\0", b"", blob[:7], b"\xff" * 8 + blob[8:],
             *(len(h).to_bytes(8, "little") + h + blob[8 + n:] for h in (
                 json.dumps(bad_rng).encode(), json.dumps(stray).encode(),
                 json.dumps(dict(header, __metadata__={**header["__metadata__"], "step": "-1"})).encode(),
                 json.dumps(dict(header, __metadata__={**header["__metadata__"], "loss_scale": "nan"})).encode(),
                 json.dumps(dict(header, __metadata__={"format": "other"})).encode()))]
    for data in cases:
        with pytest.raises(RemoteProtocolError):
            decode_bundle(data, max_size=1 << 20)
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        decode_bundle(blob, max_size=len(blob) - 1)


def test_claims_and_stamps_round_trip_and_their_lists_are_bounded() -> None:
    c = _claim()
    assert decode_claims(encode_claims([c, c])) == [c, c] and c.valid()
    st = Stamp(job="j", epoch=2, kind="act", step=4, micro=1, name="y", dst=2, coded=False, digest=bytes(32),
               signer=ME.peer_id, signature=bytes(64))
    assert decode_stamps(encode_stamps([st])) == [st]
    for data in (encode_claims([c])[:-1], encode_claims([c]) + b"\0", packb([[1, 2]]), packb({"c": 1}),
                 packb([0] * (MAX_CLAIMS + 1))):
        with pytest.raises(RemoteProtocolError):
            decode_claims(data)
    with pytest.raises(RemoteProtocolError):
        decode_stamps(encode_claims([c]))


def _plan(replicas: tuple[int, ...]) -> Plan:
    return Plan(job="j", epoch=0, snapshot_hash="h", algorithm="test", seed=0, n_units=len(replicas),
                micro_batches=2, stages=tuple(Stage(start=s, end=s + 1, replicas=tuple(f"p{s}{r}" for r in range(n)))
                                              for s, n in enumerate(replicas)),
                fences=tuple(Fence(index=s, unit=s + 1, dense_bytes=1.0, rho=1.0) for s in range(len(replicas) - 1)))


def test_the_next_replica_of_a_stage_checks_it_and_a_lone_replica_has_no_checker() -> None:
    plan = _plan((3, 1))
    assert [checker_of(plan, 0, r) for r in range(3)] == ["p01", "p02", "p00"]
    assert checker_of(plan, 1, 0) is None


def test_a_conviction_rolls_back_to_the_newest_complete_checkpoint_before_the_lie() -> None:
    ck = {2: {(0, 1): ("a2", ["p00"]), (1, 2): ("b2", ["p10"])},
          4: {(0, 1): ("a4", ["p00"]), (1, 2): ("b4", ["p10"])},
          6: {(0, 1): ("a6", ["p00"]), (1, 2): ("b6", ["p10"])}}
    alive = lambda p: True   # noqa: E731
    rb = rollback(ck, 2, alive, before=5, reached=9)
    assert rb is not None and rb.step == 4 and rb.from_checkpoint and rb.lost_steps == 5
    assert {s.state for s in rb.sources} == {"a4", "b4"}
    assert rollback(ck, 2, alive, before=1, reached=9) is None                  # nothing before the lie: say so
    rb = rollback(ck, 2, lambda p: p != "p10", before=9, reached=9)             # files only the convicted holds
    assert rb is None


@pytest.mark.slow   # 26 s at a load of 20 on the 2-core VM, most of it tracing the model (torch.export)
def test_the_epoch_checks_refuse_strangers_and_malformed_requests() -> None:
    """EpochChecks.on_request, the JOB operations' handler (jobs/verified.py), without the network: claims only from
    the replica this node checks, a bundle only to the stage's checker with its seed, malformed fields a
    RemoteProtocolError (the JOB server answers ok: False and counts the refusal)."""
    from fusionp2p.graph import coarsen, partition, stages_from_fences, trace
    from fusionp2p.jobs.content import ContentService, ContentStore
    from fusionp2p.jobs.suspects import Suspects
    from fusionp2p.jobs.verified import EpochChecks
    from fusionp2p.net.memory import memory_network
    from tests.integration.test_hostile_training import _Net

    torch.manual_seed(0)
    dag = trace(_Net(), (torch.randn(2, 4), torch.tensor([0, 2])))
    progs = partition(coarsen(dag), stages_from_fences(len(coarsen(dag).units), [1]))

    async def main() -> None:
        async with memory_network() as net:
            hosts = [net.add_host(Identity(bytes([i + 1]) * 32)) for i in range(4)]
            ids = [h.peer_id for h in hosts]
            plan = Plan(job="j", epoch=1, snapshot_hash="h", algorithm="test", seed=0, n_units=2, micro_batches=2,
                        stages=(Stage(start=0, end=1, replicas=(ids[0], ids[1])),
                                Stage(start=1, end=2, replicas=(ids[2], ids[3]))),
                        fences=(Fence(index=0, unit=1, dense_bytes=1.0, rho=1.0),))

            async def gossip(ev: object) -> None:
                return None

            ec = EpochChecks(transport=hosts[0], content=ContentService(hosts[0], ContentStore()), job="j", plan=plan,
                             stage=0, replica=0, programs=progs, rate=1.0, micro_batches=2, timeout=5.0,
                             max_bundle=1 << 30, suspects=Suspects(), gossip=gossip, leader=lambda: ids[0])
            assert ec.checked == ids[1] and ec.checker is not None
            c = claim(hosts[1], job="j", epoch=1, stage=0, replica=1, params=bytes(32), t=_transcript())
            ok = {"op": "claims", "job": "j", "epoch": 1, "claims": encode_claims([c])}
            assert (await ec.on_request(ids[1], ok))["ok"]
            assert not (await ec.on_request(ids[2], ok))["ok"]                          # not the replica it checks
            assert not (await ec.on_request(ids[1], {**ok, "epoch": 2}))["ok"]         # another epoch
            bundle = {"op": "bundle", "job": "j", "epoch": 1, "step": 0, "micro": 0, "seed": bytes(64)}
            assert "no ledger" in (await ec.on_request(ids[1], bundle))["error"]
            stamps = await ec.on_request(ids[1], {"op": "stamps", "job": "j", "epoch": 1, "peer": ids[1], "step": 0,
                                                  "micro": 0})
            assert stamps["ok"] and decode_stamps(stamps["stamps"]) == []
            for bad in ({**ok, "claims": "x"}, {**ok, "claims": b"\xc1"}, {**ok, "epoch": "1"},
                        {**bundle, "seed": 7}, {**bundle, "step": True}, {"op": "stamps", "job": "j", "epoch": 1}):
                with pytest.raises(RemoteProtocolError):
                    await ec.on_request(ids[1], bad)
            # a verdict for this node, the leader, to re-judge (jobs/verified.py Arbiter): only from the checker
            # that signed it, with a bundle's hash; none while the epoch's checks do not run
            v = Verdict(claim=c, checker=ids[2], reason="r")
            v = dataclasses.replace(v, signature=hosts[2].sign(v.body()))
            req = {"op": "verdict", "job": "j", "evidence": encode_verdict(v), "bundle": "0" * 64}
            assert "no spot-checks now" in ec.on_verdict(ids[2], req)["error"]
            other = dataclasses.replace(v, claim=dataclasses.replace(c, epoch=2))      # another epoch: not evidence
            assert ec.on_verdict(ids[2], {**req, "evidence": encode_verdict(other)}) == {"ok": True, "new": False}
            for who, wrong in ((ids[3], req), (ids[2], {**req, "bundle": 7}), (ids[2], {**req, "evidence": b"\xc1"})):
                with pytest.raises(RemoteProtocolError):
                    ec.on_verdict(who, wrong)

    trio.run(main)
