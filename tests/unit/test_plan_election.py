"""The election's sans-IO core: quorum, tie-break, forged and stray votes, order independence."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs.election import (
    Adopted,
    Election,
    Failed,
    Vote,
    parse_adopted,
    rank_plan_record,
)
from fusionp2p.net.identity import Identity
from fusionp2p.plan.opfence import make_plan
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.wire.msg import packb
from tests.unit.test_plan_helpers import chain, profile, snapshot

IDS = [Identity(bytes([i + 1]) * 32) for i in range(7)]
MEMBERS = sorted(i.peer_id for i in IDS[:6])
BY_PEER = {i.peer_id: i for i in IDS}
OUTSIDER = IDS[6]
H_A, H_B, S_A, S_B = "a" * 64, "b" * 64, "1" * 64, "2" * 64


def vote(peer: str, plan_hash: str = H_A, snap: str = S_A, *, epoch: int = 3, job: str = "job") -> Vote:
    return Vote.make(job=job, epoch=epoch, plan_hash=plan_hash, snapshot_hash=snap, peer=peer, sign=BY_PEER[peer].sign)


def election() -> Election:
    return Election(job="job", epoch=3, members=MEMBERS)


def test_quorum_adopts_on_the_fourth_of_six() -> None:
    e = election()
    assert e.quorum == 4
    decisions = [e.on_vote(vote(p)) for p in MEMBERS[:4]]
    assert decisions[:3] == [None, None, None]
    d = decisions[3]
    assert isinstance(d, Adopted)
    assert d.plan_hash == H_A
    assert d.by == "quorum"
    assert d.voters == tuple(MEMBERS[:4])
    assert e.on_vote(vote(MEMBERS[4])) is None  # decided once
    assert e.on_deadline() == d


@settings(max_examples=40, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(0, 6))
def test_decision_does_not_depend_on_arrival_order(rnd: random.Random, n_b: int) -> None:
    votes = [vote(p, H_B if k < n_b else H_A, S_B if k < n_b else S_A) for k, p in enumerate(MEMBERS)]
    outcomes = set()
    for _ in range(3):
        rnd.shuffle(votes)
        e = election()
        for v in votes:
            e.on_vote(v)
        d = e.on_deadline()
        assert isinstance(d, Adopted)
        outcomes.add((d.plan_hash, d.by))
    assert len(outcomes) == 1
    (h, by), = outcomes
    if n_b == 3:
        assert by == "tiebreak"
        assert h == H_B
    else:
        assert by == "quorum"
        assert h == (H_B if n_b > 3 else H_A)


def test_tiebreak_needs_every_vote_else_fails_at_deadline() -> None:
    e = election()
    for k, p in enumerate(MEMBERS[:5]):
        assert e.on_vote(vote(p, H_A if k % 2 else H_B)) is None
    d = e.on_deadline()
    assert isinstance(d, Failed)
    assert "no quorum" in d.reason


def test_forged_unsigned_stray_and_equivocating_votes_are_dropped_and_counted() -> None:
    e = election()
    good = vote(MEMBERS[0])
    forged = Vote.make(job="job", epoch=3, plan_hash=H_B, snapshot_hash=S_A, peer=MEMBERS[1], sign=OUTSIDER.sign)
    unsigned = Vote(job="job", epoch=3, plan_hash=H_B, snapshot_hash=S_A, peer=MEMBERS[2])
    outsider = Vote.make(job="job", epoch=3, plan_hash=H_B, snapshot_hash=S_A, peer=OUTSIDER.peer_id, sign=OUTSIDER.sign)
    for v in (good, forged, unsigned, outsider, vote(MEMBERS[3], epoch=4), vote(MEMBERS[3], job="other"),
              good, vote(MEMBERS[0], H_B)):
        assert e.on_vote(v) is None
    st_ = e.stats
    assert (st_.accepted, st_.forged, st_.non_member, st_.other_election, st_.duplicates, st_.equivocations) == (1, 2, 1, 2, 1, 1)
    assert e.votes[MEMBERS[0]].plan_hash == H_A


def test_attached_plan_must_match_the_signed_hash() -> None:
    snap = snapshot(6, job="job", epoch=3)
    plan = make_plan(chain(6), snap)
    other = make_plan(chain(6), snap, seed=1)
    e = election()
    ok = Vote.make(job="job", epoch=3, plan_hash=plan.plan_hash(), snapshot_hash=S_A, peer=MEMBERS[0],
                   sign=BY_PEER[MEMBERS[0]].sign, plan=plan.to_wire())
    bad = Vote.make(job="job", epoch=3, plan_hash=plan.plan_hash(), snapshot_hash=S_A, peer=MEMBERS[1],
                    sign=BY_PEER[MEMBERS[1]].sign, plan=other.to_wire())
    e.on_vote(ok)
    e.on_vote(bad)
    assert e.stats.forged == 1
    assert e.plans == {plan.plan_hash(): plan.to_wire()}


def test_disagreement_is_logged_with_snapshot_hashes(caplog: pytest.LogCaptureFixture) -> None:
    e = election()
    e.on_vote(vote(MEMBERS[5], H_B, S_B))
    with caplog.at_level(logging.WARNING, logger="fusionp2p.jobs.election"):
        for p in MEMBERS[:4]:
            d = e.on_vote(vote(p))
    assert isinstance(d, Adopted)
    assert d.dissent == ((H_B, S_B, (MEMBERS[5],)),)
    assert S_B[:12] in caplog.text
    assert S_A[:12] in caplog.text


def test_vote_codec() -> None:
    v = vote(MEMBERS[0])
    assert Vote.decode(v.encode()) == v
    assert Vote.decode(packb({"t": "job-announce", "x": 1})) is None
    with pytest.raises(RemoteProtocolError):
        Vote.decode(packb({"t": "plan-vote", "job": "j"}))
    with pytest.raises(RemoteProtocolError):
        Vote.decode(packb([1, 2]))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_vote_decode_never_crashes(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        Vote.decode(data)


def _members_snapshot(peers: list[str], *, epoch: int = 3) -> Snapshot:
    return Snapshot(job="job", epoch=epoch, members={p: profile() for p in peers}, links={})


def test_parse_adopted_replays_the_votes() -> None:
    snap = _members_snapshot(MEMBERS)
    plan = make_plan(chain(6), snap)
    votes = [Vote.make(job="job", epoch=3, plan_hash=plan.plan_hash(), snapshot_hash=S_A, peer=p, sign=BY_PEER[p].sign).encode()
             for p in MEMBERS[:4]]
    rec = {"job": "job", "epoch": 3, "members": MEMBERS, "plan": plan.to_wire(), "votes": votes}
    assert parse_adopted(packb(rec), snap) == (3, plan)
    with pytest.raises(RemoteProtocolError, match="do not elect"):
        parse_adopted(packb({**rec, "votes": votes[:3]}), snap)
    with pytest.raises(RemoteProtocolError):
        parse_adopted(packb({**rec, "plan": make_plan(chain(6), snap, seed=5).to_wire()}), snap)
    with pytest.raises(RemoteProtocolError):
        parse_adopted(packb({**rec, "members": []}), snap)
    with pytest.raises(RemoteProtocolError, match="another snapshot"):   # the same record, read in another epoch's view
        parse_adopted(packb(rec), _members_snapshot(MEMBERS[:5]))


def _forged(members: list[str], plan_snapshot: str, epoch: int = 3) -> bytes:
    """The attacker's record: a plan giving it every stage, its own signed vote, and the member list it likes."""
    own = make_plan(chain(6), Snapshot(job="job", epoch=epoch, members={OUTSIDER.peer_id: profile()}, links={}))
    own = dataclasses.replace(own, snapshot_hash=plan_snapshot)
    v = Vote.make(job="job", epoch=epoch, plan_hash=own.plan_hash(), snapshot_hash=plan_snapshot, peer=OUTSIDER.peer_id,
                  sign=OUTSIDER.sign)
    return packb({"job": "job", "epoch": epoch, "members": members, "plan": own.to_wire(), "votes": [v.encode()]})


def test_a_forged_record_naming_only_its_author_is_refused() -> None:
    """Before: parse_adopted trusted the record's member list, so a record naming only the attacker, with
    one self-signed vote and a plan giving it every stage, was adopted by a node whose election failed."""
    snap = _members_snapshot(MEMBERS)
    honest = snap.snapshot_hash()
    with pytest.raises(RemoteProtocolError, match="member list"):
        parse_adopted(_forged([OUTSIDER.peer_id], honest), snap)
    with pytest.raises(RemoteProtocolError, match="another snapshot"):
        parse_adopted(_forged([OUTSIDER.peer_id], "0" * 64), snap)
    with pytest.raises(RemoteProtocolError, match="do not elect"):   # the real members listed, but only its vote
        parse_adopted(_forged(MEMBERS, honest), snap)


def test_the_dht_ranks_plan_records_by_voters_before_epochs() -> None:
    snap = _members_snapshot(MEMBERS)
    plan = make_plan(chain(6), snap)
    votes = [Vote.make(job="job", epoch=3, plan_hash=plan.plan_hash(), snapshot_hash=S_A, peer=p, sign=BY_PEER[p].sign).encode()
             for p in MEMBERS[:4]]
    honest = packb({"job": "job", "epoch": 3, "members": MEMBERS, "plan": plan.to_wire(), "votes": votes})
    forged = _forged([OUTSIDER.peer_id], snap.snapshot_hash())   # self-consistent: one member, its own vote
    huge = _forged([OUTSIDER.peer_id], snap.snapshot_hash(), epoch=2**62)
    assert rank_plan_record(honest) == (1, 3, 4)
    assert rank_plan_record(forged) == (0, 3, 1)
    # the "newest" record a single identity can forge still ranks below any record with two voters
    assert rank_plan_record(honest) > rank_plan_record(huge) == (0, 2**62, 1)  # type: ignore[operator]
    assert rank_plan_record(packb({"job": "job", "epoch": 3, "members": MEMBERS, "plan": plan.to_wire(),
                                   "votes": votes[:3]})) is None   # 3 of 6: no quorum
    assert rank_plan_record(b"\xc1") is None
