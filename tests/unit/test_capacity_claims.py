"""Capacity claims checked against measurements (swarm/membership.py ``BandwidthTable``): a node's announced
uplink or downlink that its peers' measurements contradict by more than ``CAPACITY_SLACK`` is estimated at the
measured figure and counted against it; a measurement is never overridden by an announcement."""

from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.net.identity import Identity
from fusionp2p.swarm.membership import CAPACITY_SLACK, BandwidthTable
from fusionp2p.wire.records import BandwidthReport, Measurement

P = [Identity(bytes([i + 1]) * 32).peer_id for i in range(4)]
MEASURED = 1e6     # bytes/s


def _report(peer: str, seq: int, up: float, down: float, *links: tuple[str, float]) -> BandwidthReport:
    return BandwidthReport(peer=peer, seq=seq, uplink=up, downlink=down, measurements=tuple(
        Measurement(src=peer, dst=d, bandwidth=bw, rtt=0.01, samples=3) for d, bw in links))


def test_a_node_announcing_ten_times_its_measured_upload_is_planned_at_the_measured_figure() -> None:
    liar, witness, other = P[0], P[1], P[2]
    t = BandwidthTable()
    t.on_report(_report(other, 1, 100e6, 100e6))                              # fast, measured by nobody yet
    t.on_report(_report(liar, 1, 10 * MEASURED, 10 * MEASURED))
    e = t.estimate(liar, other)
    assert t.strikes == {} and e is not None and e.bandwidth == 10 * MEASURED      # nothing measured: trusted
    t.on_report(_report(witness, 1, 50e6, 50e6, (liar, MEASURED)))            # the witness measures the liar
    assert t.contradicted(liar) and t.strikes == {liar: 1}
    e = t.estimate(liar, other)                                               # an unmeasured pair of the liar's
    assert e is not None and not e.measured and e.bandwidth == MEASURED       # its measured figure, not 4x it
    e = t.estimate(other, liar)
    assert e is not None and e.bandwidth == MEASURED                          # its downlink claim as well
    # each contradicted announcement counts once: the same report seen again does not, a new one does
    t.on_report(_report(witness, 2, 50e6, 50e6, (liar, MEASURED)))
    assert t.strikes == {liar: 1}
    t.on_report(_report(liar, 2, 10 * MEASURED, 10 * MEASURED))
    assert t.strikes == {liar: 2}
    # within the slack (its measured peers may be slower than itself) the announcement stands, uncounted
    t.on_report(_report(liar, 3, CAPACITY_SLACK * MEASURED, CAPACITY_SLACK * MEASURED))
    assert not t.contradicted(liar) and t.strikes == {liar: 2}
    e = t.estimate(liar, other)
    assert e is not None and e.bandwidth == CAPACITY_SLACK * MEASURED
    # the witness and the fast node announce what nobody contradicts
    assert witness not in t.strikes and other not in t.strikes


def test_a_measurement_is_never_overridden_by_an_announcement() -> None:
    t = BandwidthTable()
    t.on_report(_report(P[0], 1, 1e9, 1e9))
    t.on_report(_report(P[1], 1, 1e3, 1e3, (P[0], MEASURED)))
    for a, b in ((P[0], P[1]), (P[1], P[0])):
        e = t.estimate(a, b)
        assert e is not None and e.measured and e.bandwidth == MEASURED


@settings(max_examples=100, deadline=None)
@given(announced=st.lists(st.tuples(st.floats(0, 1e10), st.floats(0, 1e10)), min_size=4, max_size=4),
       links=st.dictionaries(st.tuples(st.integers(0, 3), st.integers(0, 3)).filter(lambda x: x[0] != x[1]),
                             st.floats(1.0, 1e9), max_size=8))
def test_estimates_never_exceed_what_measurements_allow(announced: list[tuple[float, float]],
                                                         links: dict[tuple[int, int], float]) -> None:
    t = BandwidthTable()
    for i, (up, down) in enumerate(announced):
        t.on_report(_report(P[i], 1, up, down, *[(P[d], bw) for (s, d), bw in links.items() if s == i]))
    for a in range(4):
        for b in range(4):
            if a == b:
                continue
            e = t.estimate(P[a], P[b])
            measured = [bw for (s, d), bw in links.items() if {s, d} == {a, b}]
            if measured:                                    # a measured pair: one of its measurements, as is
                assert e is not None and e.measured and e.bandwidth in measured
                continue
            up, _, _ = t.capacity(P[a])
            _, down, _ = t.capacity(P[b])
            caps = [c for c in (up, down) if c > 0]
            assert (e is None) == (not caps) and (e is None or e.bandwidth == min(caps))
            # each end's capacity: never above the slack times the best rate others measured of it
            for cap, end in ((up, P[a]), (down, P[b])):
                best = t.measured_of(end)
                assert best is None or cap <= CAPACITY_SLACK * best
    # every contradicted announcement (one a node here) is counted once against its node
    assert all(n == 1 for n in t.strikes.values())
    assert all(p in t.strikes for p in P if t.contradicted(p))


# --- strikes acted on (swarm/capacity_trust.py): a node contradicted again and again is planned from others'
# measurements only; its own measurements of its pairs count only where the other end backs them

def test_a_node_contradicted_report_after_report_is_planned_from_others_measurements_only() -> None:
    liar, witness, honest = P[0], P[1], P[2]
    t = BandwidthTable()
    t.on_report(_report(honest, 1, 2 * MEASURED, 2 * MEASURED))        # the honest end: its probe server saw 2 MB/s
    t.on_report(_report(witness, 1, 50e6, 50e6, (liar, MEASURED)))     # others measured the liar at 1 MB/s
    # the liar announces 100x that and reports its own pair with the honest node at 100x, claiming many samples
    seq = 0

    def lie() -> None:
        nonlocal seq
        seq += 1
        t.on_report(BandwidthReport(peer=liar, seq=seq, uplink=100 * MEASURED, downlink=100 * MEASURED,
                                    measurements=(Measurement(src=liar, dst=honest, bandwidth=100 * MEASURED,
                                                              rtt=0.01, samples=1000),)))

    for _ in range(2):
        lie()
    e = t.direct(liar, honest)
    assert t.strikes[liar] == 2 and liar not in t.trust.distrusted
    assert e is not None and e.bandwidth == 100 * MEASURED          # two strikes: its measurement still stands
    lie()                                                            # the third of its last 8 reports
    assert liar in t.trust.distrusted and witness not in t.trust.distrusted and honest not in t.trust.distrusted
    assert t.direct(liar, honest) is None                            # uncorroborated (the honest end saw 2 MB/s)
    e = t.estimate(liar, honest)
    assert e is not None and not e.measured and e.bandwidth == MEASURED   # what the witness measured of it
    assert t.capacity(liar)[:2] == (MEASURED, MEASURED)
    # the other end's own measurement of the pair wins, whatever sample count the liar claims
    t.on_report(_report(honest, 2, 2 * MEASURED, 2 * MEASURED, (liar, 1.5 * MEASURED)))
    e = t.direct(liar, honest)
    assert e is not None and e.measured and e.bandwidth == 1.5 * MEASURED
    # "for a while": honest reports clear it once fewer than 3 of its last 8 were contradicted (6 in a row)
    for i in range(6):
        assert liar in t.trust.distrusted, i
        seq += 1
        t.on_report(_report(liar, seq, MEASURED, MEASURED))
    assert liar not in t.trust.distrusted


def test_a_contradicted_honest_node_keeps_the_fast_pair_its_other_end_backs() -> None:
    """A node on a fast LAN and a slow WAN announces its LAN rate, which its WAN peers contradict every report;
    distrusted, its LAN pair still stands: the other end's probe server timed the same transfer."""
    lan, mate, wan = P[0], P[1], P[2]
    t = BandwidthTable()
    t.on_report(_report(mate, 1, 100 * MEASURED, 100 * MEASURED))               # it timed lan's probe at 100 MB/s
    t.on_report(_report(wan, 1, MEASURED, MEASURED, (lan, MEASURED)))
    for seq in range(1, 5):
        t.on_report(_report(lan, seq, 100 * MEASURED, 100 * MEASURED, (mate, 100 * MEASURED)))
    assert lan in t.trust.distrusted
    e = t.direct(lan, mate)
    assert e is not None and e.measured and e.bandwidth == 100 * MEASURED
    assert t.direct(lan, wan) is not None and t.direct(lan, wan).bandwidth == MEASURED   # type: ignore[union-attr]


def test_trust_config_is_validated() -> None:
    import pytest

    from fusionp2p.errors import ConfigError
    from fusionp2p.swarm.capacity_trust import TrustConfig

    with pytest.raises(ConfigError):
        TrustConfig(strikes=9, window=8)
    with pytest.raises(ConfigError):
        TrustConfig(strikes=0)
