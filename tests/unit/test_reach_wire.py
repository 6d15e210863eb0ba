"""REACH messages (wire/reach.py): round trips, bounds, and any bytes decode or raise RemoteProtocolError."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.swarm.reach import _endpoint
from fusionp2p.wire import reach as wr
from fusionp2p.wire.msg import packb


def test_round_trips() -> None:
    assert wr.decode_request(wr.encode("check", p2p=["/ip4/1.2.3.4/tcp/4001"], data=[])) == \
        ("check", {"p2p": ["/ip4/1.2.3.4/tcp/4001"], "data": []})
    assert wr.decode_request(wr.encode("reverse", target="12D3KooWx")) == ("reverse", {"target": "12D3KooWx"})
    assert wr.decode_request(wr.encode("dial", peer="p", addrs=["/ip4/1.2.3.4/tcp/1"]))[1]["addrs"] == ["/ip4/1.2.3.4/tcp/1"]
    assert wr.decode_check_reply(wr.encode("reply", p2p=True, data=False, ip="1.2.3.4")) == (True, False, "1.2.3.4", "")
    assert wr.decode_ok_reply(wr.encode("reply", ok=False, why="busy")) == (False, "busy")


@pytest.mark.parametrize("bad", [
    {"v": 2, "op": "check", "p2p": [], "data": []},
    {"v": 1, "op": "jump"},
    {"v": 1, "op": "check", "p2p": ["x"] * 9, "data": []},
    {"v": 1, "op": "check", "p2p": ["x" * 300], "data": []},
    {"v": 1, "op": "check", "p2p": [1], "data": []},
    {"v": 1, "op": "reverse", "target": "x" * 200},
    {"v": 1, "op": "dial", "peer": "p"},
])
def test_malformed_requests_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(RemoteProtocolError):
        wr.decode_request(packb(bad))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    for decode in (wr.decode_request, wr.decode_check_reply, wr.decode_ok_reply):
        with contextlib.suppress(RemoteProtocolError):
            decode(data)


def test_dial_back_only_at_the_observed_ip() -> None:
    """The AutoNAT rule: a bootstrap dials a requester's addresses only at the IP it sees it at (an
    unspecified address stands for that IP); never a third party's."""
    assert _endpoint("/ip4/203.0.113.7/tcp/4002", "203.0.113.7") == ("203.0.113.7", 4002)
    assert _endpoint("/ip4/0.0.0.0/tcp/4002", "203.0.113.7") == ("203.0.113.7", 4002)
    assert _endpoint("/ip4/10.0.0.5/tcp/4002", "203.0.113.7") is None
    assert _endpoint("/dns4/example.org/tcp/4002", "203.0.113.7") is None
    assert _endpoint("/ip4/203.0.113.7/udp/4002", "203.0.113.7") is None
    assert _endpoint("/ip4/203.0.113.7/tcp/0", "203.0.113.7") is None


def test_a_port_of_non_ascii_digits_is_not_dialled() -> None:
    """Regression (fuzz, issue 15): ``"²".isdigit()`` is true but ``int("²")`` raises ValueError, which
    ended the bootstrap's handler of that request with an exception other than RemoteProtocolError; and
    ``"٣"`` (Arabic-Indic three) was read as port 3. Both, and a port of thousands of digits, are refused."""
    for port in ("\u00b2", "\u0663", "4\u00b9", "9" * 5000, "65536"):
        assert _endpoint(f"/ip4/203.0.113.7/tcp/{port}", "203.0.113.7") is None
    # through the request decoder, as the server sees it
    _, f = wr.decode_request(wr.encode("check", p2p=["/ip4/203.0.113.7/tcp/\u00b2"], data=[]))
    assert [_endpoint(a, "203.0.113.7") for a in f["p2p"]] == [None]


def test_the_codec_encodes_the_same_bytes() -> None:
    """The REACH requests moved onto the generic codec without changing a byte (golden bytes too)."""
    from fusionp2p.wire import codec

    assert codec.encode(wr.CheckRequest(v=1, op="check", p2p=("/ip4/1.2.3.4/tcp/1",), data=())) == \
        wr.encode("check", p2p=["/ip4/1.2.3.4/tcp/1"], data=[])
    assert codec.encode(wr.ReverseRequest(v=1, op="reverse", target="p")) == wr.encode("reverse", target="p")
    assert codec.encode(wr.DialRequest(v=1, op="dial", peer="p", addrs=("/ip4/1.2.3.4/tcp/1",))) == \
        wr.encode("dial", peer="p", addrs=["/ip4/1.2.3.4/tcp/1"])
    # a refusal is read as one by both askers, not as "nothing dialable" (issue 43: a busy server made
    # every node it refused announce itself private); servers before issue 43 sent p2p/data false beside it
    for refusal in (wr.encode("reply", ok=False, why="busy", p2p=False, data=False, ip=""),
                    wr.encode("reply", ok=False, why="busy")):
        assert wr.decode_check_reply(refusal).refused == "busy"
        assert wr.decode_ok_reply(refusal) == (False, "busy")
    assert not wr.decode_check_reply(wr.encode("reply", p2p=False, data=False, ip="1.2.3.4")).refused
    with pytest.raises(RemoteProtocolError):
        wr.decode_ok_reply(wr.encode("reply", p2p=True, data=True, ip="1.2.3.4"))   # not an ok reply


def test_a_reversal_dials_the_same_few_ports_whatever_the_peerstore_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A requester claiming 16 ports gets the same 4 dialled every time (issue 43: in the peerstore's order,
    which trims and identify pushes reshuffle, honest nodes dialled 14 of an attacker's 16 over one run)."""
    import trio

    from fusionp2p.net.addrs import DIAL_LIMIT
    from fusionp2p.swarm import reach

    ports = [str(p) for p in range(9000, 9016)]
    orders = [ports, ports[::-1], ports[5:] + ports[:5]]
    sent: list[list[str]] = []

    class _T:
        def connected_peers(self) -> list[str]:
            return ["target"]

        def peer_addrs(self, peer: str) -> list[str]:
            return [f"/ip4/203.0.113.7/tcp/{p}" for p in orders[len(sent)]]

    async def fake_request(t: object, peer: str, msg: bytes, timeout: float) -> bytes:
        sent.append(list(wr.decode_request(msg)[1]["addrs"]))
        return wr.encode("reply", ok=True, why="")

    monkeypatch.setattr(reach, "_request", fake_request)
    svc = reach.ReachService(_T(), serve_checks=True, servers=set)   # type: ignore[arg-type]
    for _ in orders:
        trio.run(svc._reverse, "requester", "203.0.113.7", "target")
    assert len(sent) == 3 and sent[0] == sent[1] == sent[2] and len(sent[0]) == DIAL_LIMIT, sent
