"""Refusal counting and the decaying penalty: a flood bans its sender, time forgives it, the table stays bounded."""

from fusionp2p.net.refusals import RefusalConfig, Refusals


def test_counts_by_peer_and_reason() -> None:
    r = Refusals()
    r.refuse("A", "gossip/decode", now=0.0)
    r.refuse("A", "gossip/decode", now=0.0)
    r.refuse("B", "view/limit", now=0.0)
    assert r.by_reason == {"gossip/decode": 2, "view/limit": 1}
    assert r.by_peer[("A", "gossip/decode")] == 2
    assert r.total() == 3


def test_flood_bans_and_time_unbans() -> None:
    r = Refusals(RefusalConfig(half_life=10.0, ban_score=5.0))
    for _ in range(4):
        r.refuse("A", "x", now=0.0)
    assert not r.banned("A", now=0.0)
    r.refuse("A", "x", now=0.0)
    assert r.banned("A", now=0.0)
    assert r.banned("A", now=5.0)          # 5 * 2^-0.5 = 3.5 > 2.5
    assert not r.banned("A", now=11.0)     # 5 * 2^-1.1 < 2.5
    assert not r.banned("B", now=0.0)


def test_an_honest_peer_with_one_bad_message_is_not_banned() -> None:
    r = Refusals(RefusalConfig(half_life=1.0, ban_score=3.0))
    for t in range(100):
        r.refuse("A", "x", now=float(t))   # one a second decays faster than it accumulates
    assert not r.banned("A", now=100.0)


def test_table_is_bounded() -> None:
    r = Refusals(RefusalConfig(max_peers=10))
    for i in range(1000):
        r.refuse(f"P{i}", "x", now=0.0)
    assert len(r._scores) <= 10
