"""Signed records: round trips, forgery, tampering, malformed bytes."""

import contextlib
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.net.identity import Identity, verify
from fusionp2p.types import DeviceProfile
from fusionp2p.wire.msg import packb, unpackb
from fusionp2p.wire.records import (
    MAX_RECORD,
    BandwidthReport,
    Measurement,
    NodeRecord,
    decode_signed,
    encode_bundle,
    encode_signed,
    split_bundle,
)

PROFILE = DeviceProfile(device="cpu", kind="cpu", name="test", flops_fp32=1e10, flops_bf16=5e9, memory_bytes=2**30,
                        versions=(("torch", "2.13.0"),))
A = Identity(b"\x01" * 32)
B = Identity(b"\x02" * 32)


def node_record(ident: Identity = A, **kw: object) -> NodeRecord:
    base = {"peer": ident.peer_id, "role": "node", "addrs": ("/ip4/127.0.0.1/tcp/1",), "profile": PROFILE, "started": 1.5, "seq": 3}
    base.update(kw)
    return NodeRecord(**base)  # type: ignore[arg-type]


def test_node_record_round_trip() -> None:
    rec = node_record()
    assert decode_signed(encode_signed(rec, A.sign), verify) == rec


def test_node_record_carries_data_addresses_and_reachability() -> None:
    rec = node_record(data=("/ip4/203.0.113.7/tcp/4002",), reach="p2p")
    assert decode_signed(encode_signed(rec, A.sign), verify) == rec
    old = {k: v for k, v in rec.body().items() if k not in ("data", "reach")}   # a node before issue 21
    b = packb(old)
    back = decode_signed(packb({"v": 1, "t": "node", "b": b, "s": A.sign(b"node\x00" + b)}), verify)
    assert isinstance(back, NodeRecord)
    assert back.data == ()
    assert back.reach == "unknown"


def test_bandwidth_report_round_trip() -> None:
    rep = BandwidthReport(peer=A.peer_id, seq=1, uplink=1e6, downlink=2e6,
                          measurements=(Measurement(src=A.peer_id, dst=B.peer_id, bandwidth=1e6, rtt=0.01, samples=2),))
    assert decode_signed(encode_signed(rep, A.sign), verify) == rep


def test_deterministic_identity_peer_id() -> None:
    assert Identity(b"\x01" * 32).peer_id == A.peer_id
    assert A.peer_id.startswith("12D3KooW")


def test_forged_record_rejected() -> None:
    # B signs a record that claims to be A's.
    with pytest.raises(RemoteProtocolError, match="signature"):
        decode_signed(encode_signed(node_record(A), B.sign), verify)


def test_tampered_record_rejected() -> None:
    data = encode_signed(node_record(), A.sign)
    env = unpackb(data)
    body = unpackb(env["b"])
    body["seq"] = 99
    env["b"] = packb(body)
    with pytest.raises(RemoteProtocolError):
        decode_signed(packb(env), verify)


def test_unsigned_and_wrong_version_rejected() -> None:
    data = unpackb(encode_signed(node_record(), A.sign))
    with pytest.raises(RemoteProtocolError):
        decode_signed(packb({**data, "s": b""}), verify)
    with pytest.raises(RemoteProtocolError):
        decode_signed(packb({**data, "v": 2}), verify)


def test_malformed_body_fields_rejected() -> None:
    def signed(body: dict[str, object]) -> bytes:
        b = packb(body)
        return packb({"v": 1, "t": "node", "b": b, "s": A.sign(b"node\x00" + b)})

    good = node_record().body()
    for bad in ({**good, "role": "king"}, {**good, "addrs": "nope"}, {**good, "seq": -1}, {**good, "reach": "yes"},
                {**good, "data": "nope"}, {**good, "data": [1]}, {**good, "data": ["x"] * 17},
                {**good, "profile": {"device": "cpu"}}, {k: v for k, v in good.items() if k != "started"}):
        with pytest.raises(RemoteProtocolError):
            decode_signed(signed(bad), verify)


def test_oversized_record_rejected() -> None:
    rec = dataclasses.replace(node_record(), addrs=tuple("/ip4/1.1.1.1/tcp/1" for _ in range(2000)))
    with pytest.raises(RemoteProtocolError):
        decode_signed(encode_signed(rec, A.sign), verify)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode_signed(data, verify)


def test_heartbeat_period_round_trip_and_old_records_without_it() -> None:
    rec = node_record(period=2.5)
    assert decode_signed(encode_signed(rec, A.sign), verify).period == 2.5   # type: ignore[union-attr]
    # a record from a node that does not announce its period (older version) still decodes, as "unknown"
    body = {k: v for k, v in node_record().body().items() if k != "hb"}
    data = packb({"v": 1, "t": "node", "b": packb(body), "s": A.sign(b"node\x00" + packb(body))})
    assert decode_signed(data, verify).period == 0.0   # type: ignore[union-attr]
    for bad in (-1.0, 1e9, "1"):
        body = {**node_record().body(), "hb": bad}
        data = packb({"v": 1, "t": "node", "b": packb(body), "s": A.sign(b"node\x00" + packb(body))})
        with pytest.raises(RemoteProtocolError):
            decode_signed(data, verify)


def test_bundle_carries_several_records_each_verified_on_its_own() -> None:
    rep = BandwidthReport(peer=A.peer_id, seq=1, uplink=1e6, downlink=1e6, measurements=())
    parts = [encode_signed(node_record(), A.sign), encode_signed(rep, A.sign)]
    assert split_bundle(encode_bundle(parts)) == parts
    assert split_bundle(parts[0]) == [parts[0]]          # a bare record is a bundle of one
    with pytest.raises(ValueError):
        encode_bundle([])
    for bad in (packb([]), packb([1, 2]), packb(["x"]), packb([b"r"] * 5), packb(3), packb([b"\x00" * (MAX_RECORD + 1)])):
        with pytest.raises(RemoteProtocolError):
            split_bundle(bad)
    forged = encode_bundle([parts[0], encode_signed(rep, B.sign)])   # second part signed by someone else
    with pytest.raises(RemoteProtocolError):
        decode_signed(split_bundle(forged)[1], verify)


def test_training_speed_round_trip_bounded_and_absent_in_old_records() -> None:
    rec = node_record(speed=0.37, speed_model="c" * 64)
    back = decode_signed(encode_signed(rec, A.sign), verify)
    assert back == rec and isinstance(back, NodeRecord) and back.speed_on("c" * 64) == 0.37
    body = node_record().body()    # a node that measured none: neither key is sent
    assert "speed" not in body and "speed_of" not in body
    data = packb({"v": 1, "t": "node", "b": packb(body), "s": A.sign(b"node\x00" + packb(body))})
    assert decode_signed(data, verify).speed == 0.0   # type: ignore[union-attr]
    for key, bad in (("speed", -0.5), ("speed", 65.0), ("speed", float("inf")), ("speed", float("nan")), ("speed", "2"),
                     ("speed_of", "d" * 65), ("speed_of", 3)):
        body = {**node_record().body(), key: bad}
        data = packb({"v": 1, "t": "node", "b": packb(body), "s": A.sign(b"node\x00" + packb(body))})
        with pytest.raises(RemoteProtocolError):
            decode_signed(data, verify)
