"""The publisher's first plan judges capacity claims as members do (issue 46): a node the bootstrap distrusts
(``swarm/capacity_trust.py``: contradicted in 3 of its last 8 reports) is planned from others' measurements
of it, though one view of the latest reports holds no strike history (``membership.judged_links``, the VIEW's
``distrusted``, ``publisher.discover``)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs import publisher, verify_links
from fusionp2p.net.identity import Identity
from fusionp2p.swarm.membership import judged_links
from fusionp2p.swarm.node import SwarmConfig
from fusionp2p.swarm.view_wire import decode_view
from fusionp2p.testing.swarm import converge, local_swarm
from fusionp2p.wire.msg import packb
from fusionp2p.wire.records import BandwidthReport, Measurement

LIAR, WITNESS, OTHER = (Identity(bytes([0x31 + i]) * 32).peer_id for i in range(3))
MEASURED = 1e6   # bytes/s: what the witness measured of the liar


def _report(peer: str, up: float, *links: tuple[str, float, int]) -> BandwidthReport:
    return BandwidthReport(peer=peer, seq=1, uplink=up, downlink=up, measurements=tuple(
        Measurement(src=peer, dst=d, bandwidth=bw, rtt=0.02, samples=n) for d, bw, n in links))


def _swarm() -> list[BandwidthReport]:
    """The liar announces 100x what the witness measured of it, and reports its pairs at 100x with 1,000
    samples: the one to the witness (which measured it too) and the one to OTHER (which measured nothing
    and announces too little to back it)."""
    return [_report(LIAR, 100 * MEASURED, (WITNESS, 100 * MEASURED, 1000), (OTHER, 100 * MEASURED, 1000)),
            _report(WITNESS, 50e6, (LIAR, MEASURED, 3)),
            _report(OTHER, 2 * MEASURED)]


def _links(judged: list[Any]) -> dict[frozenset[str], list[float]]:
    out: dict[frozenset[str], list[float]] = {}
    for a, b, e in judged:
        out.setdefault(frozenset((a, b)), []).append(e.bandwidth)
    return out


def test_a_node_the_bootstrap_distrusts_is_planned_from_others_measurements_in_the_first_plan() -> None:
    # without the strike history (as before): one contradicted report is no history, its word on pairs stands
    before = _links(judged_links(_swarm()))
    assert before[frozenset((LIAR, OTHER))] == [100 * MEASURED]
    assert sorted(before[frozenset((LIAR, WITNESS))]) == [MEASURED, 100 * MEASURED]
    # the bootstrap's history: its own pair measurements are dropped where the other end measured the pair
    # (the witness's figure alone) and estimated from what others measured of it where nobody backs them
    judged = judged_links(_swarm(), [LIAR])
    after = _links(judged)
    assert after[frozenset((LIAR, WITNESS))] == [MEASURED]
    assert after[frozenset((LIAR, OTHER))] == [MEASURED]
    assert not next(e for a, b, e in judged if {a, b} == {LIAR, OTHER}).measured


def test_an_honest_swarm_plans_from_its_measurements_as_before() -> None:
    reps = [_report(WITNESS, 50e6, (LIAR, 40e6, 3), (OTHER, 30e6, 2)), _report(OTHER, 30e6, (WITNESS, 20e6, 5)),
            _report(LIAR, 40e6, (OTHER, float("inf"), 1))]
    raw = [(m.src, m.dst, m.bandwidth, m.rtt) for r in reps for m in r.measurements if m.bandwidth < float("inf")]
    assert [(a, b, e.bandwidth, e.rtt) for a, b, e in judged_links(reps)] == raw
    # a distrusted node's fast pair that the other end's announcement backs (a LAN pair) stands
    lan = [_report(LIAR, 40e6, (OTHER, 100e6, 3)), _report(OTHER, 100e6), _report(WITNESS, 50e6, (LIAR, 40e6, 3))]
    assert _links(judged_links(lan, [LIAR]))[frozenset((LIAR, OTHER))] == [100e6]


def test_the_views_distrusted_nodes_are_bounded_and_optional() -> None:
    base: dict[str, Any] = {"records": [], "bw": [], "alive": [], "dead": []}
    assert decode_view(packb(base))["distrusted"] == []                       # an older node's answer
    assert decode_view(packb({**base, "distrusted": [LIAR]}))["distrusted"] == [LIAR]
    for bad in ([1], "x", [b"x"], {"a": 1}):
        with pytest.raises(RemoteProtocolError):
            decode_view(packb({**base, "distrusted": bad}))
    with pytest.raises(RemoteProtocolError):
        decode_view(packb({**base, "distrusted": [], "other": 1}))


def test_discover_takes_the_bootstraps_distrusted_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the VIEW protocol of a real (in-memory) swarm: the bootstrap's distrusted nodes reach the
    judgement of the publisher's first plan."""
    seen: list[list[str]] = []
    real = judged_links

    def spy(reports: Any, distrusted: Any = ()) -> Any:
        seen.append(list(distrusted))
        return real(reports, distrusted)

    monkeypatch.setattr(verify_links, "judged_links", spy)

    want: list[str] = []

    async def main() -> None:
        with trio.fail_after(30):
            async with local_swarm(2, libp2p=False, config=SwarmConfig(probing=False)) as (boot, nodes):
                await converge(nodes, bandwidth=False, timeout=10)
                boot.bandwidth.trust.distrusted.add(nodes[0].peer_id)
                want.append(nodes[0].peer_id)
                view = await publisher.discover(nodes[1].transport, [boot.peer_id], timeout=10)
                assert set(view.members) == {n.peer_id for n in nodes}

    trio.run(main)
    assert seen == [want]
