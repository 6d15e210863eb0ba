"""Wire layout of tensor messages and sealed channel records: golden bytes, any split of the stream,
truncation, tampering, replay, bounds checked before allocation, and fuzzing (STYLE.md 4)."""

from __future__ import annotations

import contextlib
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.net.aead import Opener, Sealer, new_key
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.tensor_stream import RecordReader, RecordWriter, SlotCursor, Stripe
from fusionp2p.wire import tensor_frame as tf
from fusionp2p.wire.limits import Limits

KEY = bytes(range(32))


def _msg(seed: int = 0, n: int = 1000) -> TensorMessage:
    g = torch.Generator().manual_seed(seed)
    return TensorMessage(job="job1", kind="act", stage=2, step=7, micro=3, name="e0", meta={"codec": "id", "k": [1, 2]},
                         tensors=(torch.randn(n, generator=g), torch.arange(5, dtype=torch.int16),
                                  torch.tensor([True, False, True]), torch.empty(0, 3), torch.randn(2, 3).bfloat16()))


def _same(a: TensorMessage, b: TensorMessage) -> None:
    assert a.key == b.key
    assert a.meta == b.meta
    assert len(a.tensors) == len(b.tensors)
    for x, y in zip(a.tensors, b.tensors):
        assert x.dtype == y.dtype
        assert x.shape == y.shape
        assert torch.equal(x, y)


def test_message_golden_bytes() -> None:
    msg = TensorMessage(job="j", kind="k", tensors=(torch.tensor([1.0], dtype=torch.float32),))
    data = tf.message_bytes(msg)
    header = bytes.fromhex("89a17601a36a6f62a16aa46b696e64a16ba5737461676500a47374657000a56d6963726f00a46e616d65a0a46d65746180a1749192a36633329101")
    assert data == struct.pack(">I", len(header)) + header + bytes(-(4 + len(header)) % 8) + struct.pack("<f", 1.0) + bytes(4)
    assert tf.record_header(tf.PING, 16) == bytes.fromhex("0000001104")


def test_message_roundtrip_zero_copy() -> None:
    msg = _msg()
    data = bytearray(tf.message_bytes(msg))
    out = TensorMessage(**tf.decode_message(data))
    _same(msg, out)
    assert out.tensors[0].data_ptr() - torch.frombuffer(data, dtype=torch.uint8).data_ptr() in range(len(data))
    _same(msg, TensorMessage(**tf.decode_message(bytes(data))))


@pytest.mark.parametrize("cut", [0, 3, 10, -1, -5])
def test_truncated_message_rejected(cut: int) -> None:
    data = tf.message_bytes(_msg())
    with pytest.raises(RemoteProtocolError):
        tf.decode_message(data[:cut])
    with pytest.raises(RemoteProtocolError):
        tf.decode_message(data + b"\0" * 8)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=4))
def test_decode_message_fuzz(data: bytes, flips: list[tuple[int, int]]) -> None:
    base = bytearray(tf.message_bytes(_msg(n=4)) if len(data) % 2 else data)
    for pos, x in flips:
        if base:
            base[pos % len(base)] ^= x
    with contextlib.suppress(RemoteProtocolError):
        tf.decode_message(bytes(base))


def _pair(chunk: int = 4096, cipher: str = "aes-gcm") -> tuple[RecordWriter, RecordReader]:
    return (RecordWriter(Sealer(cipher, KEY), chunk_size=chunk),
            RecordReader(Opener(cipher, KEY), chunk_size=chunk))


def _stream(w: RecordWriter, msgs: list[TensorMessage]) -> bytes:
    out = bytearray()
    for m in msgs:
        for p in w.plan_message(m):
            out += w.seal(p)
    out += w.control(tf.ACK, tf.encode_ack(3))
    out += w.control(tf.PING)
    return bytes(out)


@pytest.mark.parametrize("cipher", ["aes-gcm", "chacha20-poly1305", "none"])
def test_records_whole_and_one_byte_at_a_time(cipher: str) -> None:
    msgs = [_msg(1, 3000), _msg(2, 10)]  # the first spans several 4 KiB records
    w, _ = _pair(cipher=cipher)
    data = _stream(w, msgs)
    for step in (len(data), 1, 7):
        _, r = _pair(cipher=cipher)
        events = []
        for i in range(0, len(data), step):
            events += r.feed(data[i : i + step])
        got = [TensorMessage(**e.message) for e in events if e.kind == tf.MSG_END]  # type: ignore[arg-type]
        assert len(got) == 2
        _same(msgs[0], got[0])
        _same(msgs[1], got[1])
        assert [e.kind for e in events][-2:] == [tf.ACK, tf.PING]
        assert events[-2].count == 3
        assert r.pending == 0
        r.check_eof()


def test_truncated_record_stream_detected() -> None:
    w, _ = _pair()
    data = _stream(w, [_msg(1, 3000)])
    for cut in (1, 5, 100, 4200, len(data) - 1):
        _, r = _pair()
        r.feed(data[:cut])
        with pytest.raises(RemoteProtocolError):
            r.check_eof()


@pytest.mark.parametrize("pos", [0, 3, 4, 5, 20, -1])
def test_tampered_record_rejected(pos: int) -> None:
    w, r = _pair()
    rec = bytearray(w.control(tf.ACK, tf.encode_ack(1)))
    rec[pos] ^= 0x01
    with pytest.raises(RemoteProtocolError):
        r.feed(bytes(rec))


def test_replayed_and_reordered_records_rejected() -> None:
    w, r = _pair()
    a, b = w.control(tf.PING), w.control(tf.PING)
    r.feed(a)
    with pytest.raises(RemoteProtocolError):
        r.feed(a)  # replay
    w2, r2 = _pair()
    a, b = w2.control(tf.PING), w2.control(tf.PING)
    with pytest.raises(RemoteProtocolError):
        r2.feed(b)  # reorder


def test_wrong_key_rejected() -> None:
    w = RecordWriter(Sealer("aes-gcm", new_key()), chunk_size=4096)
    _, r = _pair()
    with pytest.raises(RemoteProtocolError):
        r.feed(w.control(tf.PING))


def test_oversized_record_rejected_before_allocation() -> None:
    _, r = _pair(chunk=4096)
    # only the 5 header bytes arrive; the announced 2 GiB body is refused at once
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        r.feed(struct.pack(">IB", 2**31, tf.MSG_END))
    _, r = _pair()
    with pytest.raises(RemoteProtocolError, match="kind"):
        r.feed(struct.pack(">IB", 10, 99))


def test_oversized_message_rejected() -> None:
    limits = Limits(max_frame=64 * 1024)
    w = RecordWriter(Sealer("aes-gcm", KEY), chunk_size=4096)
    r = RecordReader(Opener("aes-gcm", KEY), chunk_size=4096, limits=limits)
    msg = TensorMessage(job="j", kind="k", tensors=(torch.zeros(20_000),))
    data = b"".join(w.seal(p) for p in w.plan_message(msg))
    with pytest.raises(RemoteProtocolError, match="limit"):
        r.feed(data)


def test_control_record_bodies_checked() -> None:
    w, r = _pair()
    with pytest.raises(RemoteProtocolError):
        r.feed(w.control(tf.PING, b"x"))
    w, r = _pair()
    with pytest.raises(RemoteProtocolError):
        r.feed(w.control(tf.ACK, b"xx"))
    w, r = _pair()
    r.feed(w.control(tf.CLOSE))
    with pytest.raises(RemoteProtocolError):
        r.feed(w.control(tf.PING))


def test_ticket_messages() -> None:
    assert tf.decode_ticket_request(tf.encode_ticket_request("aes-gcm", 3)) == ("aes-gcm", 3)
    for lanes in (0, tf.MAX_LANES + 1):
        with pytest.raises(RemoteProtocolError, match="lanes"):
            tf.decode_ticket_request(tf.encode_ticket_request("aes-gcm", lanes))
    good = {"ticket": bytes(16), "cipher": "aes-gcm", "k_dial": bytes(32), "k_listen": bytes(32), "host": "127.0.0.1",
            "port": 4001, "lanes": 2}
    reply = tf.decode_ticket_reply(tf.encode_ticket_reply(**good))  # type: ignore[arg-type]
    assert (reply["port"], reply["lanes"]) == (4001, 2)
    for bad in ({"ticket": bytes(15)}, {"k_dial": bytes(31)}, {"port": 0}, {"port": "x"}, {"host": 5}, {"lanes": 0},
                {"lanes": "2"}):
        with pytest.raises(RemoteProtocolError):
            tf.decode_ticket_reply(tf.encode_ticket_reply(**{**good, **bad}))  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError):
        tf.decode_ticket_reply(b"\xc1")


def test_message_start_bounds_and_order() -> None:
    limits = Limits(max_frame=64 * 1024)
    w = RecordWriter(Sealer("aes-gcm", KEY), chunk_size=4096)
    r = RecordReader(Opener("aes-gcm", KEY), chunk_size=4096, limits=limits)
    # an announced total over the limit is refused before the message buffer is allocated
    rec = w.sealer.seal(w.sealer.next_nonce(), tf.MSG_START, [tf.encode_start(2**40), b"x"])
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        r.feed(rec)
    w, r = _pair()
    with pytest.raises(RemoteProtocolError, match="without"):
        r.feed(w.sealer.seal(w.sealer.next_nonce(), tf.MSG_MORE, [b"abc"]))
    # slices longer than announced
    w, r = _pair()
    r.feed(w.sealer.seal(w.sealer.next_nonce(), tf.MSG_START, [tf.encode_start(10), b"12345"]))
    with pytest.raises(RemoteProtocolError, match="exceed"):
        r.feed(w.sealer.seal(w.sealer.next_nonce(), tf.MSG_END, [b"1234567"]))
    # and shorter
    w, r = _pair()
    r.feed(w.sealer.seal(w.sealer.next_nonce(), tf.MSG_START, [tf.encode_start(10), b"12345"]))
    with pytest.raises(RemoteProtocolError, match="shorter"):
        r.feed(w.sealer.seal(w.sealer.next_nonce(), tf.MSG_END, [b"12"]))


def test_multi_record_message_roundtrip() -> None:
    w, r = _pair(chunk=4096)
    msg = _msg(3, 5000)
    plans = w.plan_message(msg)
    assert plans[0].kind == tf.MSG_START
    assert plans[-1].kind == tf.MSG_END
    events = r.feed(b"".join(bytes(w.seal(p)) for p in plans))
    _same(msg, TensorMessage(**events[0].message))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------- lanes
@given(body=st.integers(1, 10 * 2**20), lanes=st.integers(1, tf.MAX_LANES),
       chunk=st.sampled_from([tf.MIN_SLOT, 16 * 1024, 2**20]))
def test_stripe_slot_shares_the_body_evenly(body: int, lanes: int, chunk: int) -> None:
    slot = tf.stripe_slot(body, lanes, chunk)
    assert tf.MIN_SLOT <= slot <= chunk
    assert slot % 4096 == 0 or slot == chunk
    n = -(-body // slot)
    assert n * slot >= body > (n - 1) * slot
    if body >= lanes * chunk:  # enough for every lane: each gets the same number of slots, or one more
        assert n >= lanes


def _striped(lanes: int, msg: TensorMessage, *, first: int = 0, chunk: int = 16 * 1024
             ) -> tuple[RecordReader, list[Opener], list[list[memoryview]]]:
    """Seal *msg* striped over *lanes*: the receiving lane-0 reader, the lanes' openers, each lane's records."""
    w = RecordWriter(Sealer("aes-gcm", KEY), chunk_size=chunk)
    sealers = [w.sealer] + [Sealer("aes-gcm", KEY, lane=i) for i in range(1, lanes)]
    parts = tf.encode_message(msg)
    assert w.can_stripe(parts)
    plans = w.plan_striped(parts, sealers, first)
    records = [[sealers[i].seal(p.nonce, p.kind, p.parts) for p in plans[i]] for i in range(lanes)]
    reader = RecordReader(Opener("aes-gcm", KEY), chunk_size=chunk, lanes=lanes)
    reader.stripes = first
    return reader, [reader.opener] + [Opener("aes-gcm", KEY, lane=i) for i in range(1, lanes)], records


def _open_slot(cursor: SlotCursor, opener: Opener, rec: memoryview) -> Stripe:
    kind, n = tf.parse_record_header(rec, max_body=1 << 20)
    assert kind == tf.SLOT
    stripe, dest = cursor.next(n)
    opener.open(opener.next_nonce(), bytes(rec[: tf.RECORD_HEADER]), rec[tf.RECORD_HEADER :], dest)
    stripe.left -= 1
    return stripe


@pytest.mark.parametrize(("lanes", "first"), [(2, 0), (3, 1), (3, 2)])
def test_a_striped_message_reassembles_from_its_lanes(lanes: int, first: int) -> None:
    msg = _msg(3, n=40_000)  # 160 KB over 16 KiB slots, tensors of odd sizes after it
    reader, openers, records = _striped(lanes, msg, first=first)
    start, *own = records[0]
    (ev,) = reader.feed(start)
    assert ev.kind == tf.STRIPE_START and ev.stripe is not None
    stripe = ev.stripe
    assert (stripe.first, stripe.n) == (first, sum(len(r) for r in records) - 1)
    cursors = [SlotCursor(i, "aes-gcm") for i in range(lanes)]
    for c in cursors:
        c.add(stripe)
    for i in reversed(range(lanes)):  # any lane may finish first
        for rec in (own if i == 0 else records[i]):
            _open_slot(cursors[i], openers[i], rec)
        assert not cursors[i].waiting
    assert stripe.left == 0
    _same(TensorMessage(**tf.decode_message(stripe.buf)), msg)
    assert {len(r) for r in records[1:]} <= {len(own), len(own) + 1, len(own) - 1}  # shares differ by one slot at most


def test_striped_records_are_checked() -> None:
    msg = _msg(4, n=20_000)
    reader, openers, records = _striped(2, msg)
    (ev,) = reader.feed(records[0][0])
    assert ev.stripe is not None
    cursor = SlotCursor(1, "aes-gcm")
    cursor.add(ev.stripe)
    rec = bytearray(records[1][0])
    rec[-1] ^= 1  # a tampered slot fails authentication
    with pytest.raises(RemoteProtocolError, match="authentication"):
        _open_slot(cursor, openers[1], memoryview(rec))
    with pytest.raises(RemoteProtocolError, match="no striped message"):  # a slot nobody announced
        SlotCursor(1, "aes-gcm").next(100)
    c2 = SlotCursor(1, "aes-gcm")
    c2.add(ev.stripe)
    with pytest.raises(RemoteProtocolError, match="length"):
        c2.next(17)
    # a one-lane channel refuses striping; announcements are bounded before allocating
    w = RecordWriter(Sealer("aes-gcm", KEY), chunk_size=16 * 1024)
    one_lane = RecordReader(Opener("aes-gcm", KEY), chunk_size=16 * 1024)
    with pytest.raises(RemoteProtocolError, match="one lane"):
        one_lane.feed(w.sealer.seal(w.sealer.next_nonce(), tf.STRIPE_START, [tf.encode_stripe_start(10_000, 4096), b"h"]))
    limits = Limits(max_frame=1 << 20)
    for total, slot, match in ((2**40, 4096, "limit"), (10_000, 1024, "slot"), (10_000, 1 << 20, "slot"),
                               (1, 4096, "no slots")):
        with pytest.raises(RemoteProtocolError, match=match):
            tf.decode_stripe_start(tf.encode_stripe_start(total, slot) + b"h", max_slot=16 * 1024, limits=limits)


def test_lanes_never_share_a_nonce() -> None:
    nonces = {Sealer("aes-gcm", KEY, lane=i).next_nonce() for i in range(tf.MAX_LANES)}
    assert len(nonces) == tf.MAX_LANES
