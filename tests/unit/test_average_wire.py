"""The averaging message codec of the runtime shell: round trip, and peer garbage -> RemoteProtocolError."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.average.allreduce import RoundMsg
from fusionp2p.errors import RemoteProtocolError
from fusionp2p.net.channel import TensorMessage
from fusionp2p.train.averager import from_message, to_message


def test_round_trip() -> None:
    msg = RoundMsg(round_id=5, epoch="abc", phase="gather", lo=3, hi=7, data=torch.arange(4.0), weight=2.5, scalar=0.125)
    tm = to_message("job", 2, msg)
    assert (tm.kind, tm.job, tm.stage, tm.step, tm.name) == ("avg", "job", 2, 5, "gather")
    back = from_message(tm)
    assert (back.round_id, back.epoch, back.phase, back.lo, back.hi, back.weight, back.scalar) == (5, "abc", "gather", 3, 7, 2.5, 0.125)
    assert torch.equal(back.data, msg.data)


def test_a_gather_part_carries_its_owners_speed_and_a_round_gathers_them() -> None:
    """Re-dealing replicas (train/deal.py ``Deal.redeal``): an owner's anchor shard carries its seconds per
    micro-batch ("v", left out at 0), and a complete round hands every owner's figure over in rank order.
    A speed that is negative, not finite or absurd is a bad part."""
    from fusionp2p.average.allreduce import MAX_SPEED_S, AllReduceRound, Finished, Reduced, Send

    msg = RoundMsg(round_id=1, epoch="e", phase="gather", lo=0, hi=2, data=torch.zeros(2), speed=0.052)
    assert to_message("j", 0, msg).meta["v"] == 0.052 and from_message(to_message("j", 0, msg)).speed == 0.052
    assert "v" not in to_message("j", 0, RoundMsg(round_id=1, epoch="e", phase="gather", lo=0, hi=2,
                                                  data=torch.zeros(2))).meta
    peers = ["r0", "r1"]
    rounds = {p: AllReduceRound(peers=peers, me=p, n_elems=4, round_id=1, epoch="e") for p in peers}
    inbox: list[tuple[str, str, RoundMsg]] = []
    done: dict[str, Finished] = {}

    def act(me: str, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Send):
                inbox.append((me, a.peer, from_message(to_message("j", 0, a.msg))))
            elif isinstance(a, Reduced):
                act(me, rounds[me].publish(a.mean, 0.0, {"r0": 0.05, "r1": 0.12}[me]))
            elif isinstance(a, Finished):
                done[me] = a

    for p in peers:
        act(p, rounds[p].start(torch.ones(4), 1.0))
    while inbox:
        src, dst, m = inbox.pop(0)
        act(dst, rounds[dst].receive(src, m))
    assert {p: f.result.speeds for p, f in done.items()} == dict.fromkeys(peers, (("r0", 0.05), ("r1", 0.12)))
    for bad in (-1.0, MAX_SPEED_S * 2):
        r = AllReduceRound(peers=peers, me="r0", n_elems=4, round_id=1, epoch="e")
        r.start(torch.ones(4), 1.0)
        with pytest.raises(RemoteProtocolError, match="speed"):
            r.receive("r1", RoundMsg(round_id=1, epoch="e", phase="scatter", lo=0, hi=2, data=torch.ones(2), speed=bad))
    with pytest.raises(RemoteProtocolError):
        from_message(TensorMessage(job="j", kind="avg", meta={**GOOD, "v": float("nan")}, tensors=(torch.zeros(2),)))


GOOD: dict[str, Any] = {"epoch": "e", "lo": 0, "hi": 2, "w": 1.0, "s": 0.0}


def test_a_gather_part_carries_when_the_scatter_parts_reached_its_owner() -> None:
    """Speed claims checked (train/claims.py): an owner's anchor shard names, per rank, when that rank's
    scatter part reached it ("a", left out when empty), and a complete round hands every owner's figures
    over by peer id. Ranks out of range, named twice, or times not finite are a bad part."""
    from fusionp2p.average.allreduce import AllReduceRound, Finished, Reduced, Send

    msg = RoundMsg(round_id=1, epoch="e", phase="gather", lo=0, hi=2, data=torch.zeros(2), arrived=((0, 0.0), (1, 0.25)))
    assert from_message(to_message("j", 0, msg)).arrived == ((0, 0.0), (1, 0.25))
    assert "a" not in to_message("j", 0, RoundMsg(round_id=1, epoch="e", phase="gather", lo=0, hi=2,
                                                  data=torch.zeros(2))).meta
    peers = ["r0", "r1"]
    rounds = {p: AllReduceRound(peers=peers, me=p, n_elems=4, round_id=1, epoch="e") for p in peers}
    inbox: list[tuple[str, str, RoundMsg]] = []
    done: dict[str, Finished] = {}

    def act(me: str, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Send):
                inbox.append((me, a.peer, from_message(to_message("j", 0, a.msg))))
            elif isinstance(a, Reduced):
                other = "r1" if me == "r0" else "r0"
                act(me, rounds[me].publish(a.mean, 0.0, 0.1, (), [(me, 0.0), (other, 0.5)]))
            elif isinstance(a, Finished):
                done[me] = a

    for p in peers:
        act(p, rounds[p].start(torch.ones(4), 1.0))
    while inbox:
        src, dst, m = inbox.pop(0)
        act(dst, rounds[dst].receive(src, m))
    want = (("r0", (("r0", 0.0), ("r1", 0.5))), ("r1", (("r1", 0.0), ("r0", 0.5))))
    assert {p: f.result.arrivals for p, f in done.items()} == dict.fromkeys(peers, want)
    for bad in (((2, 0.0),), ((1, 0.0), (1, 1.0)), ((0, float("inf")),)):
        r = AllReduceRound(peers=peers, me="r0", n_elems=4, round_id=1, epoch="e")
        r.start(torch.ones(4), 1.0)
        with pytest.raises(RemoteProtocolError, match="arrival"):
            r.receive("r1", RoundMsg(round_id=1, epoch="e", phase="gather", lo=2, hi=4, data=torch.ones(2), arrived=bad))
    for meta in ({**GOOD, "a": [[0]]}, {**GOOD, "a": [[0, "x"]]}, {**GOOD, "a": [[-1, 0.0]]}, {**GOOD, "a": 3}):
        with pytest.raises(RemoteProtocolError):
            from_message(TensorMessage(job="j", kind="avg", meta=meta, tensors=(torch.zeros(2),)))


@pytest.mark.parametrize(
    ("meta", "tensors"),
    [
        ({}, (torch.zeros(2),)),
        ({**GOOD, "lo": "0"}, (torch.zeros(2),)),
        ({**GOOD, "lo": True}, (torch.zeros(2),)),
        ({**GOOD, "w": "heavy"}, (torch.zeros(2),)),
        ({**GOOD, "epoch": 3}, (torch.zeros(2),)),
        ({**GOOD, "lo": 5, "hi": 2}, (torch.zeros(2),)),
        (GOOD, ()),
        (GOOD, (torch.zeros(2), torch.zeros(2))),
    ],
)
def test_malformed_meta_rejected(meta: dict[str, Any], tensors: tuple[torch.Tensor, ...]) -> None:
    with pytest.raises(RemoteProtocolError):
        from_message(TensorMessage(job="j", kind="avg", meta=meta, tensors=tensors))


@settings(max_examples=60, deadline=None)
@given(meta=st.dictionaries(st.sampled_from(["epoch", "lo", "hi", "w", "s", "v", "x"]),
                            st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=3))))
def test_any_meta_decodes_or_raises_remote_protocol_error(meta: dict[str, Any]) -> None:
    with contextlib.suppress(RemoteProtocolError):
        from_message(TensorMessage(job="j", kind="avg", meta=meta, tensors=(torch.zeros(1),)))


def test_a_bf16_part_names_its_base_and_an_fp32_part_may() -> None:
    """CO2.wire "bf16": a difference travels as bf16 with the base it is a difference from ("b"); an fp32
    part may name the sender's base too (the owner learns who holds it); a bf16 part without one, or a
    base that is not a round id, is refused."""
    diff = RoundMsg(round_id=9, epoch="e", phase="scatter", lo=0, hi=2, data=torch.tensor([1e-3, -2e-3]).bfloat16(), base=5)
    back = from_message(to_message("job", 0, diff))
    assert back.base == 5 and back.data.dtype == torch.bfloat16
    plain = from_message(to_message("job", 0, RoundMsg(round_id=9, epoch="e", phase="scatter", lo=0, hi=2,
                                                       data=torch.zeros(2), base=5)))
    assert plain.base == 5 and plain.data.dtype == torch.float32
    assert "b" not in to_message("job", 0, RoundMsg(round_id=9, epoch="e", phase="gather", lo=0, hi=2,
                                                    data=torch.zeros(2))).meta   # the fp32 wire keeps its bytes
    for meta, t in (({**GOOD}, torch.zeros(2).bfloat16()), ({**GOOD, "b": -1}, torch.zeros(2).bfloat16()),
                    ({**GOOD, "b": "x"}, torch.zeros(2))):
        with pytest.raises(RemoteProtocolError):
            from_message(TensorMessage(job="job", kind="avg", stage=0, step=1, name="scatter", meta=meta, tensors=(t,)))
