"""The reconnecting channel's sans-IO core (fusionp2p.net.resilient.SequenceBook) and its control messages:
exactly-once in-order delivery over links that lose, duplicate and cut messages; bounded memory; every
malformed peer input is a RemoteProtocolError."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.errors import LocalProtocolError, RemoteProtocolError
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.resilient import (
    RESERVED,
    Hello,
    ResilientConfig,
    Resume,
    SequenceBook,
    hello_message,
    parse_hello,
    parse_welcome,
    welcome_message,
)


def _msg(i: int) -> TensorMessage:
    return TensorMessage(job="j", kind="act", step=i, name=f"e{i}", meta={"codec": "id", "i": i},
                         tensors=(torch.full((3,), float(i)),))


def _ack(d: int) -> TensorMessage:
    return TensorMessage(job="", kind=RESERVED, meta={RESERVED: {"op": "ack", "d": d}})


def _state(b: SequenceBook) -> Resume:
    return Resume(b.received, b.delivered, b.window)


def test_in_order_delivery_strips_the_reserved_meta_and_drops_duplicates() -> None:
    a, b = SequenceBook(4), SequenceBook(4)
    wires = [a.wire(a.push(_msg(i)), _msg(i)) for i in range(3)]
    assert [w.meta[RESERVED]["s"] for w in wires] == [1, 2, 3]
    assert b.on_link_message(wires[0]) == "data"
    assert b.on_link_message(wires[0]) == "duplicate"
    assert b.on_link_message(wires[1]) == "data"
    with pytest.raises(RemoteProtocolError, match="gap"):
        SequenceBook(4).on_link_message(wires[1])  # 2 before 1
    m = b.take()
    assert m is not None and m.key == _msg(0).key and m.meta == _msg(0).meta
    assert b.delivered == 1 and b.received == 2


def test_window_bounds_the_sender_buffer_and_acks_free_it() -> None:
    a = SequenceBook(3)
    for i in range(3):
        a.push(_msg(i))
    assert not a.can_send() and len(a.out) == 3
    assert a.on_link_message(_ack(2)) == "ack"
    assert a.can_send() and [s for s, _ in a.out] == [3]
    a.on_link_message(_ack(1))  # a stale (smaller) ack changes nothing
    assert a.peer_delivered == 2
    with pytest.raises(RemoteProtocolError, match="never sent"):
        a.on_link_message(_ack(4))


def test_the_peer_window_is_respected_both_ways() -> None:
    a, b = SequenceBook(8), SequenceBook(2)
    a.on_resume(Resume(0, 0, b.window))  # b announced 2
    a.push(_msg(0))
    a.push(_msg(1))
    assert not a.can_send()
    b2 = SequenceBook(2)
    liar = SequenceBook(8)
    wires = [liar.wire(liar.push(_msg(i)), _msg(i)) for i in range(3)]
    b2.on_link_message(wires[0])
    b2.on_link_message(wires[1])
    with pytest.raises(RemoteProtocolError, match="window"):
        b2.on_link_message(wires[2])  # a third undelivered message: the peer ignored our window


def test_resume_resends_only_what_the_peer_did_not_receive() -> None:
    a, b = SequenceBook(8), SequenceBook(8)
    wires = [a.wire(a.push(_msg(i)), _msg(i)) for i in range(5)]
    for w in wires[:3]:  # 4 and 5 are lost with the link
        b.on_link_message(w)
    assert b.take() is not None  # the application took 1; 2 and 3 wait in b's inbox
    resend_after = a.on_resume(_state(b))
    assert resend_after == 3
    assert [s for s, _ in a.out] == [4, 5]  # 2, 3 are safe in b's inbox: forgotten
    assert a.peer_delivered == 1  # ... but still count against the window until taken
    item = a.unsent_after(resend_after)
    assert item is not None and item[0] == 4


def test_impossible_resume_claims_are_protocol_errors() -> None:
    a = SequenceBook(8)
    a.push(_msg(0))
    with pytest.raises(RemoteProtocolError):
        a.on_resume(Resume(2, 0, 8))  # received more than we sent
    with pytest.raises(RemoteProtocolError):
        a.on_resume(Resume(0, 1, 8))  # delivered more than received
    a.on_link_message(_ack(1))
    with pytest.raises(RemoteProtocolError):
        a.on_resume(Resume(0, 0, 8))  # forgot what it had acknowledged: not the same session


def test_reserved_meta_key_is_refused_locally() -> None:
    with pytest.raises(LocalProtocolError):
        SequenceBook(2).push(TensorMessage(job="j", kind="act", meta={RESERVED: 1}))


def test_handshake_round_trip_and_validation() -> None:
    h = Hello(name="job/0->1", session="ab" * 16, fresh=True, received=3, delivered=2, window=8)
    assert parse_hello(hello_message(h)) == h
    assert parse_welcome(welcome_message(5, 4, 2)) == Resume(5, 4, 2)
    bad: list[dict[str, Any]] = [
        {"op": "hello", "v": 1, "name": "x", "session": "zz", "fresh": True, "r": 0, "d": 0, "w": 8},
        {"op": "hello", "v": 1, "name": "", "session": "ab" * 16, "fresh": True, "r": 0, "d": 0, "w": 8},
        {"op": "hello", "v": 2, "name": "x", "session": "ab" * 16, "fresh": True, "r": 0, "d": 0, "w": 8},
        {"op": "hello", "v": 1, "name": "x", "session": "ab" * 16, "fresh": 1, "r": 0, "d": 0, "w": 8},
        {"op": "hello", "v": 1, "name": "x", "session": "ab" * 16, "fresh": True, "r": -1, "d": 0, "w": 8},
        {"op": "hello", "v": 1, "name": "x", "session": "ab" * 16, "fresh": True, "r": 0, "d": 0, "w": 0},
        {"op": "ack", "d": 0},
    ]
    for rc in bad:
        with pytest.raises(RemoteProtocolError):
            parse_hello(TensorMessage(job="", kind=RESERVED, meta={RESERVED: rc}))
    with pytest.raises(RemoteProtocolError, match="not a resilient"):
        parse_hello(_msg(0))


_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=40),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
                       max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(rc=_values)
def test_any_control_meta_decodes_or_raises_remote_protocol_error(rc: Any) -> None:
    msg = TensorMessage(job="", kind=RESERVED, meta={RESERVED: rc})
    for fn in (parse_hello, parse_welcome, SequenceBook(4).on_link_message):
        with contextlib.suppress(RemoteProtocolError):
            fn(msg)


@settings(max_examples=400, deadline=None)
@given(ops=st.lists(st.integers(0, 5), max_size=120), window=st.integers(1, 4))
def test_exactly_once_in_order_over_a_lossy_link(ops: list[int], window: int) -> None:
    """Model of the shell: A sends to B over a link that may be cut (losing whatever is in flight both
    ways) at any point; B's application takes messages in between; after each cut both sides resume.
    Whatever happens, B's application sees 0, 1, 2, ... each once, and neither side holds more than
    the window."""
    a, b = SequenceBook(window), SequenceBook(window)
    ab: list[TensorMessage] = []  # in flight A -> B
    ba: list[TensorMessage] = []  # in flight B -> A (acks)
    sent = 0
    link_sent = 0
    taken: list[int] = []
    last: TensorMessage | None = None

    def flush() -> None:
        nonlocal link_sent
        while (item := a.unsent_after(link_sent)) is not None:
            ab.append(a.wire(*item))
            link_sent = item[0]

    def deliver() -> None:
        nonlocal last
        last = ab.pop(0)
        b.on_link_message(last)

    def take() -> None:
        m = b.take()
        if m is not None:
            taken.append(m.step)
            ba.append(_ack(b.delivered))

    def cut() -> None:
        nonlocal link_sent
        ab.clear()
        ba.clear()
        link_sent = a.on_resume(_state(b))
        b.on_resume(_state(a))
        flush()

    for op in ops:
        if op == 0 and a.can_send():
            a.push(_msg(sent))
            sent += 1
            flush()
        elif op == 1 and ab:
            deliver()
        elif op == 2:
            take()
        elif op == 3 and ba:
            a.on_link_message(ba.pop(0))
        elif op == 4:
            cut()
        elif op == 5 and last is not None:
            assert b.on_link_message(last) == "duplicate"  # a resend of something already received
        assert len(a.out) <= window and len(b.inbox) <= window
        assert taken == list(range(len(taken)))
    cut()
    while len(taken) < sent:
        while ab:
            deliver()
        take()
        while ba:
            a.on_link_message(ba.pop(0))
    assert taken == list(range(sent))
    assert not a.out or a.out[-1][0] <= b.received


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="window"):
        ResilientConfig(window=0)
    with pytest.raises(ValueError, match="positive"):
        ResilientConfig(reconnect_timeout=0)
    with pytest.raises(ValueError, match="backoff_max"):
        ResilientConfig(backoff_initial=2.0, backoff_max=1.0)
