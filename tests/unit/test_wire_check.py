"""Decoders raise only RemoteProtocolError: the checked helpers, and one test per class of failure that
a peer's bytes used to turn into another exception (issue 15, item 1)."""

from __future__ import annotations

import math

import pytest
import torch

from fusionp2p.compress.codec import decode as codec_decode
from fusionp2p.errors import RemoteProtocolError
from fusionp2p.jobs.events import decode_event
from fusionp2p.jobs.replan import Halted, Resume
from fusionp2p.net.identity import Identity, verify
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.types import DeviceProfile
from fusionp2p.wire.check import as_float, as_int, as_map, as_shape, as_str, malformed
from fusionp2p.wire.msg import packb, typed_field, unpackb
from fusionp2p.wire.records import BandwidthReport, Measurement, NodeRecord, decode_signed, encode_signed
from fusionp2p.wire.tensor import decode_tensor

EVE = Identity(bytes(range(7, 39)))
PROFILE = DeviceProfile(device="cpu", kind="cpu", name="test", flops_fp32=1e10, flops_bf16=0.0, memory_bytes=1 << 30)


def test_numbers_are_typed_bounded_and_finite() -> None:
    assert as_int(5, "x", lo=0, hi=5) == 5
    for bad in (True, 1.0, "1", None, 6, -1):
        with pytest.raises(RemoteProtocolError):
            as_int(bad, "x", lo=0, hi=5)
    assert as_float(3, "x") == 3.0 and isinstance(as_float(3, "x"), float)
    assert as_float(2**64 - 1, "x") == float(2**64 - 1)        # the largest msgpack int is a finite double
    for bad in (math.inf, -math.inf, math.nan, False, "1.0"):
        with pytest.raises(RemoteProtocolError):
            as_float(bad, "x")
    assert math.isnan(as_float(math.nan, "loss", finite=False))
    with pytest.raises(RemoteProtocolError, match="outside"):
        as_float(1e39, "x", hi=1e30)
    with pytest.raises(RemoteProtocolError):
        typed_field({"f": math.inf}, "f", float, "m")             # wire.msg's typed read refuses it too


def test_strings_maps_and_the_boundary_guard() -> None:
    with pytest.raises(RemoteProtocolError, match="length"):
        as_str("x" * 300, "name")
    with pytest.raises(RemoteProtocolError, match="one of"):
        as_str("gpu", "kind", choices=("cpu", "cuda"))
    with pytest.raises(RemoteProtocolError, match="missing"):
        as_map({"a": 1}, "m", required=("a", "b"))
    with pytest.raises(RemoteProtocolError, match="unknown"):
        as_map({"a": 1, "z": 2}, "m", required=("a",), optional=())
    with pytest.raises(RemoteProtocolError, match="keys"):
        as_map({1: 2}, "m")
    with pytest.raises(RemoteProtocolError, match="OverflowError"), malformed("thing"):
        int(math.inf)
    with pytest.raises(RemoteProtocolError, match="AttributeError"), malformed("thing"):
        [].get("x")  # type: ignore[attr-defined]


def test_shapes_bound_their_extent_zero_sized_ones_included() -> None:
    assert as_shape([2, 0, 3], "s") == (2, 0, 3)
    for bad in ([2**40], [-1], [1.0], [True], [1] * 9, [0, 2**39, 2**39, 2**39]):
        with pytest.raises(RemoteProtocolError):
            as_shape(bad, "s")


def _record_with_profile(**prof: object) -> bytes:
    body = NodeRecord(peer=EVE.peer_id, role="node", addrs=(), profile=PROFILE, started=1.0, seq=1).body()
    body["profile"] = {**body["profile"], **prof}
    raw = packb(body)
    return packb({"v": 1, "t": "node", "b": raw, "s": EVE.sign(b"node\x00" + raw)})


@pytest.mark.parametrize("bad", [{"memory_bytes": math.inf}, {"memory_bytes": 2**64 - 1}, {"flops_fp32": math.nan},
                                 {"flops_fp32": 1e300}, {"threads": -1}, {"versions": [["a"]]}, {"extra": 1}])
def test_a_signed_heartbeat_with_an_impossible_profile_is_refused(bad: dict[str, object]) -> None:
    """Before: memory_bytes = +inf made int() raise OverflowError, which ended the node and the bootstrap."""
    assert decode_signed(_record_with_profile(), verify).profile == PROFILE
    with pytest.raises(RemoteProtocolError):
        decode_signed(_record_with_profile(**bad), verify)


@pytest.mark.parametrize("samples", [math.inf, math.nan, 1.5, -1, 2**64 - 1])
def test_a_bandwidth_report_with_impossible_samples_is_refused(samples: object) -> None:
    rep = BandwidthReport(peer=EVE.peer_id, seq=1, uplink=1e6, downlink=1e6,
                          measurements=(Measurement(src=EVE.peer_id, dst="p", bandwidth=1e6, rtt=0.01, samples=3),))
    body = rep.body()
    body["m"][0][3] = samples
    raw = packb(body)
    data = packb({"v": 1, "t": "bw", "b": raw, "s": EVE.sign(b"bw\x00" + raw)})
    with pytest.raises(RemoteProtocolError):
        decode_signed(data, verify)
    assert decode_signed(encode_signed(rep, EVE.sign), verify) == rep


def test_a_snapshot_with_an_infinite_memory_is_refused() -> None:
    snap = Snapshot(job="j", epoch=0, members={"a": PROFILE, "b": PROFILE}, links={})
    assert Snapshot.from_wire(snap.to_wire()) == snap
    obj = unpackb(snap.to_wire())
    obj["members"][0][1]["memory_bytes"] = math.inf
    with pytest.raises(RemoteProtocolError):
        Snapshot.from_wire(packb(obj))
    obj = unpackb(snap.to_wire())
    obj["epoch"] = 2**64 - 1
    with pytest.raises(RemoteProtocolError):
        Snapshot.from_wire(packb(obj))


@pytest.mark.parametrize("kind", [[], {}, 1, None, b"step"])
def test_a_progress_event_with_an_unhashable_type_is_refused(kind: object) -> None:
    """Before: {"type": []} raised TypeError (unhashable) in the publisher's event loop and ended it."""
    with pytest.raises(RemoteProtocolError):
        decode_event(packb({"type": kind, "job": "j", "step": 1}))
    with pytest.raises(RemoteProtocolError):
        decode_event(packb({"type": "step", "job": "j", "step": 1, "tokens_per_s": math.inf}))
    assert math.isnan(decode_event(packb({"type": "step", "job": "j", "step": 1, "loss": math.nan})).loss)  # type: ignore[union-attr]


def test_zero_sized_tensors_with_overflowing_strides_are_refused() -> None:
    """Before: torch raised RuntimeError ("Stride calculation overflowed") on these 0-byte shapes."""
    shape = [0, 2**39, 2**39, 2**39, 2**39]
    with pytest.raises(RemoteProtocolError):
        decode_tensor({"dtype": "f32", "shape": shape}, b"")
    meta = {"codec": "topk", "dtype": "f32", "shape": shape, "k": 0, "row": False}
    with pytest.raises(RemoteProtocolError, match="too large"):
        codec_decode((torch.empty(0), torch.empty(0, dtype=torch.int32)), meta)


@pytest.mark.parametrize("obj", [[], "halt", None, 3])
def test_halt_and_resume_answers_that_are_not_maps_are_refused(obj: object) -> None:
    with pytest.raises(RemoteProtocolError):
        Halted.from_wire(obj)
    with pytest.raises(RemoteProtocolError):
        Resume.from_wire(obj)
