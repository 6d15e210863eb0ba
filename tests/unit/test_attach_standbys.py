"""A `job attach` that knows a job only from its status record must learn its standbys: when the plan's only
member dies one of them leads the job on, and the attach believes plans and status records only from members
it knows. Before, it learned them only from the epoch's plan record, believed when one of the record's voters
was a member the status named, and that was often not so (tests/integration/test_attach_standby.py failed "no
progress from the swarm for 60 s" in 5 of 10 runs at load 17-58):

* the record holds the first quorum of votes its writer got, often the two standbys' alone (so in all 5 failures);
* and a second way to the same refusal: the record's voters were the replay's quorum in peer-id order, so with
  every member's vote in it the highest id (the test's only member) was never one of them.

Now the leader's status record names the standbys, and every valid vote for the record's plan counts."""

from __future__ import annotations

import dataclasses

import pytest
import trio

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs.election import Vote, fetch_latest_record, rank_plan_record
from fusionp2p.net.identity import Identity, verify
from fusionp2p.plan.opfence import make_plan
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.wire.jobrecords import MAX_MEMBERS, JobStatus, decode_record, encode_record
from fusionp2p.wire.msg import packb, unpackb
from tests.unit.test_plan_helpers import chain, profile

IDS = sorted((Identity(bytes([i + 1]) * 32) for i in range(3)), key=lambda i: i.peer_id)
PEERS = [i.peer_id for i in IDS]
LEADER = IDS[-1]   # the highest id: the plan's only member in the integration test


def _status(**kw: object) -> JobStatus:
    base = JobStatus(job="j", peer=LEADER.peer_id, publisher="p", state="running", epoch=0, step=6, steps=24,
                     members=(LEADER.peer_id,), stage_sizes=(1,), at=1.7e9)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_the_status_record_names_the_standbys_signed_by_its_leader() -> None:
    st = _status(standbys=tuple(PEERS[:2]))
    back = decode_record(encode_record(st, LEADER.sign), verify)
    assert isinstance(back, JobStatus) and back.standbys == tuple(PEERS[:2]) and back == st


def test_a_status_record_without_standbys_still_decodes_and_omits_the_field() -> None:
    """An older leader writes no ``standbys``; a record with none is the bytes it was before (the golden test)."""
    data = encode_record(_status(), LEADER.sign)
    assert b"standbys" not in data
    back = decode_record(data, verify)
    assert isinstance(back, JobStatus) and back.standbys == ()


def _signed_body(body: dict[str, object]) -> bytes:
    raw = packb(body)
    return packb({"v": 1, "t": "job-status", "b": raw, "s": LEADER.sign(b"job-status\x00" + raw)})


@pytest.mark.parametrize("bad", [["x" * 257], [7], "ab", ["a"] * (MAX_MEMBERS + 1)])
def test_bad_standbys_raise_remote_protocol_error(bad: object) -> None:
    body = unpackb(unpackb(encode_record(_status(standbys=("a",)), LEADER.sign))["b"])
    body["standbys"] = bad
    with pytest.raises(RemoteProtocolError):
        decode_record(_signed_body(body), verify)


def _record(voters: list[Identity]) -> bytes:
    snap = Snapshot(job="j", epoch=0, members={p: profile() for p in PEERS}, links={})
    plan = make_plan(chain(3), snap)
    votes = [Vote.make(job="j", epoch=0, plan_hash=plan.plan_hash(), snapshot_hash=snap.snapshot_hash(), peer=i.peer_id,
                       sign=i.sign).encode() for i in sorted(voters, key=lambda i: i.peer_id)]
    return packb({"job": "j", "epoch": 0, "members": PEERS, "plan": plan.to_wire(), "votes": votes})


class _Dht:
    def __init__(self, value: bytes) -> None:
        self.value = value

    async def dht_get(self, key: str) -> bytes:
        return self.value


def test_every_vote_for_the_plan_counts_not_only_the_first_quorum_in_peer_id_order() -> None:
    """A record with all three members' votes: its highest id is a voter (before, the replay decided at the
    second vote in peer-id order, and a reader that knew only the highest id refused the record)."""
    async def main() -> None:
        with trio.fail_after(10):
            rec = await fetch_latest_record(_Dht(_record(IDS)), "j", known=[LEADER.peer_id], epoch=0)  # type: ignore[arg-type]
            assert rec is not None and set(rec[2]) == set(PEERS)
            # the standbys' votes alone elect the plan, but vouch for nothing to a reader that knows only the leader
            alone = await fetch_latest_record(_Dht(_record(IDS[:2])), "j", known=[LEADER.peer_id], epoch=0)  # type: ignore[arg-type]
            assert alone is None

    trio.run(main)
    assert rank_plan_record(_record(IDS)) == (1, 0, 3)   # more voters outrank fewer, whatever their ids
    assert rank_plan_record(_record(IDS[:2])) == (1, 0, 2)
