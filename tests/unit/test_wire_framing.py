"""Framing and msgpack: whole buffer, one byte at a time, trailing bytes, golden bytes, property tests."""

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.errors import LocalProtocolError, RemoteProtocolError
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.msg import packb, unpackb

GOLDEN = [
    (b"", b"\x00\x00\x00\x00"),
    (b"a", b"\x00\x00\x00\x01a"),
    (b"hello", b"\x00\x00\x00\x05hello"),
]


@pytest.mark.parametrize(("payload", "wire"), GOLDEN)
def test_golden_frames(payload: bytes, wire: bytes) -> None:
    assert encode_frame(payload, max_frame=100) == wire
    assert FrameDecoder(max_frame=100).feed(wire) == [payload]


def test_three_ways() -> None:
    frames = [b"x" * n for n in (0, 1, 7, 300)]
    data = b"".join(encode_frame(f, max_frame=1000) for f in frames)
    assert FrameDecoder(max_frame=1000).feed(data) == frames
    d = FrameDecoder(max_frame=1000)
    out = []
    for i in range(len(data)):
        out += d.feed(data[i : i + 1])
    assert out == frames
    d = FrameDecoder(max_frame=1000)
    assert d.feed(data + b"\x00\x00") == frames
    assert d.pending == 2
    with pytest.raises(RemoteProtocolError):
        d.check_eof()


def test_oversized_rejected_before_buffering() -> None:
    d = FrameDecoder(max_frame=10)
    with pytest.raises(RemoteProtocolError, match="limit"):
        d.feed(b"\xff\xff\xff\xff")
    with pytest.raises(LocalProtocolError):
        encode_frame(b"x" * 11, max_frame=10)


def test_msgpack_golden_and_limits() -> None:
    assert packb({"a": 1}) == b"\x81\xa1a\x01"
    assert unpackb(b"\x81\xa1a\x01") == {"a": 1}
    with pytest.raises(RemoteProtocolError):
        unpackb(b"\x81\xa1a\x01\x00")  # trailing byte
    with pytest.raises(RemoteProtocolError):
        unpackb(packb(list(range(10))), max_size=3)
    with pytest.raises(RemoteProtocolError):
        unpackb(b"\xc7\x01\x05x")  # ext types are refused


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_decode_or_remote_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        unpackb(data)
    with contextlib.suppress(RemoteProtocolError):
        FrameDecoder(max_frame=16).feed(data)
