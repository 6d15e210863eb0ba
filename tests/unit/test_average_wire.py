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


GOOD: dict[str, Any] = {"epoch": "e", "lo": 0, "hi": 2, "w": 1.0, "s": 0.0}


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
@given(meta=st.dictionaries(st.sampled_from(["epoch", "lo", "hi", "w", "s", "x"]),
                            st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=3))))
def test_any_meta_decodes_or_raises_remote_protocol_error(meta: dict[str, Any]) -> None:
    with contextlib.suppress(RemoteProtocolError):
        from_message(TensorMessage(job="j", kind="avg", meta=meta, tensors=(torch.zeros(1),)))
