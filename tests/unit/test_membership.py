"""Membership and bandwidth views with a fake clock."""

import pytest

from fusionp2p.net.identity import Identity
from fusionp2p.swarm.membership import BandwidthTable, Change, MembershipView, ema, prober_of
from fusionp2p.wire.records import BandwidthReport, Measurement, NodeRecord

P = [Identity(bytes([i + 1]) * 32).peer_id for i in range(3)]


def rec(peer: str, seq: int, *, leaving: bool = False, started: float = 0.0) -> NodeRecord:
    return NodeRecord(peer=peer, role="node", addrs=(), profile=None, started=started, seq=seq, leaving=leaving)


def test_join_update_dead_revive() -> None:
    v = MembershipView(self_peer=P[0], timeout=5.0)
    assert [e.change for e in v.on_record(rec(P[1], 1), now=0.0)] == [Change.JOINED]
    assert [e.change for e in v.on_record(rec(P[1], 2), now=1.0)] == [Change.UPDATED]
    assert v.on_record(rec(P[1], 2), now=1.5) == []           # replay ignored
    assert v.rejected == 1
    assert v.tick(5.9) == []
    assert [(e.change, e.peer) for e in v.tick(6.1)] == [(Change.DEAD, P[1])]
    assert v.alive() == []
    assert [e.change for e in v.on_record(rec(P[1], 3), now=7.0)] == [Change.REVIVED]
    assert v.alive() == [P[1]]


def test_time_the_node_did_not_listen_is_excused() -> None:
    v = MembershipView(self_peer=P[0], timeout=5.0)
    v.on_record(rec(P[1], 1), now=0.0)
    v.excuse(10.0)                  # held up from 1.0 to 11.0: P[1]'s heartbeats of that time are unread
    assert v.tick(11.0) == []
    assert [(e.change, e.peer) for e in v.tick(15.1)] == [(Change.DEAD, P[1])]   # 5 s of its own silence


def test_leave_removes_at_once() -> None:
    v = MembershipView(self_peer=P[0], timeout=5.0)
    v.on_record(rec(P[1], 1), now=0.0)
    assert [e.change for e in v.on_record(rec(P[1], 2, leaving=True), now=0.1)] == [Change.LEFT]
    assert v.alive() == []
    assert v.tick(100.0) == []


def test_restart_with_lower_seq_accepted_when_started_later() -> None:
    v = MembershipView(self_peer=P[0], timeout=5.0)
    v.on_record(rec(P[1], 50, started=1.0), now=0.0)
    assert v.on_record(rec(P[1], 1, started=2.0), now=1.0) != []


def test_self_never_dies() -> None:
    v = MembershipView(self_peer=P[0], timeout=1.0)
    v.on_record(rec(P[0], 1), now=0.0)
    assert v.tick(100.0) == []


def test_ema() -> None:
    assert ema(None, 10.0, 0.5) == 10.0
    assert ema(10.0, 20.0, 0.5) == 15.0
    with pytest.raises(ValueError):
        ema(1.0, 1.0, 0.0)


def test_bandwidth_table_direct_estimate_complete() -> None:
    t = BandwidthTable()
    t.on_report(BandwidthReport(peer=P[0], seq=1, uplink=100.0, downlink=100.0,
                                measurements=(Measurement(src=P[0], dst=P[1], bandwidth=50.0, rtt=0.01, samples=1),)))
    assert t.direct(P[1], P[0]) is not None and t.direct(P[1], P[0]).bandwidth == 50.0
    assert not t.complete(P)
    est = t.estimate(P[0], P[2])
    assert est is not None and not est.measured and est.bandwidth == 100.0
    # an older report is ignored
    assert not t.on_report(BandwidthReport(peer=P[0], seq=1, uplink=1.0, downlink=1.0, measurements=()))
    t.on_report(BandwidthReport(peer=P[2], seq=1, uplink=10.0, downlink=10.0,
                                measurements=(Measurement(src=P[2], dst=P[0], bandwidth=9.0, rtt=0.0, samples=1),
                                              Measurement(src=P[2], dst=P[1], bandwidth=8.0, rtt=0.0, samples=1))))
    assert t.complete(P)
    assert len(t.matrix(P)) == 6


def test_dead_timeout_follows_the_announced_heartbeat_period() -> None:
    v = MembershipView(self_peer=P[0], timeout=5.0, beats=5.0)
    slow = NodeRecord(peer=P[1], role="node", addrs=(), profile=None, started=0.0, seq=1, period=3.0)
    v.on_record(slow, now=0.0)
    v.on_record(rec(P[2], 1), now=0.0)                  # no period announced: the configured timeout
    assert v.timeout_of(P[1]) == 15.0 and v.timeout_of(P[2]) == 5.0
    assert [e.peer for e in v.tick(6.0)] == [P[2]]
    assert v.tick(14.9) == []
    assert [e.peer for e in v.tick(15.1)] == [P[1]]


def test_each_pair_is_probed_from_one_side_and_the_work_is_shared() -> None:
    ids = [Identity(bytes([i + 1]) * 32).peer_id for i in range(20)]   # fixed identities: a deterministic split
    counts = dict.fromkeys(ids, 0)
    for i, a in enumerate(ids):
        for b in ids[i + 1 :]:
            p = prober_of(a, b)
            assert p in (a, b) and prober_of(b, a) == p   # both ends agree
            counts[p] += 1
    assert sum(counts.values()) == 20 * 19 // 2        # every pair once: half the probes of probing both ways
    assert min(counts.values()) >= 5 and max(counts.values()) <= 14   # about half each, not "the smaller id probes"
    with pytest.raises(ValueError):
        prober_of(ids[0], ids[0])
