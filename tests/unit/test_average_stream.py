"""Streaming CO2 (fragmented, one-step-stale): fragment bounds, the fragment index on the wire, the
config flag (absent on the wire at its default) and the flat-slice helpers."""

from __future__ import annotations

import itertools

import pytest
import torch

from fusionp2p.average.allreduce import AllReduceRound, RoundMsg
from fusionp2p.average.outer import OuterConfig
from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.net.channel import TensorMessage
from fusionp2p.train.averager import (
    AveragerConfig,
    ReplicaAverager,
    from_message,
    load_slice_,
    read_slice,
    stream_fragments,
    to_message,
)
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.wire.msg import packb, unpackb


def _avg(n: int, tau: int, *, stream: bool = True, sync: bool = False) -> ReplicaAverager:
    cfg = AveragerConfig(outer=OuterConfig(tau=tau, sync=sync, stream=stream), job="j")
    return ReplicaAverager(cfg, peers=["a"], me="a", channels={}, initial=torch.zeros(n))


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1001])
@pytest.mark.parametrize("tau", [1, 3, 4, 8])
def test_fragments_cover_the_vector_exactly(n: int, tau: int) -> None:
    frags = _avg(n, tau).fragments
    assert len(frags) == min(tau, n)
    assert all(len(fr) == 1 for fr in frags)              # one segment: each fragment one contiguous slice
    flat = [fr[0] for fr in frags]
    assert flat[0][0] == 0 and flat[-1][1] == n
    for (_, hi), (lo, _) in itertools.pairwise(flat):
        assert hi == lo                                   # contiguous, no gap, no overlap
    sizes = [hi - lo for lo, hi in flat]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1   # balanced


@pytest.mark.parametrize("segments", [[(0, 5), (5, 17), (17, 40)], [(0, 3), (3, 4), (4, 40)], [(0, 40)]])
@pytest.mark.parametrize("tau", [1, 4, 6])
def test_fragments_with_segments_partition_the_vector(segments: list[tuple[int, int]], tau: int) -> None:
    frags = stream_fragments(40, tau, segments)
    covered = sorted(r for fr in frags for r in fr)
    assert covered[0][0] == 0 and covered[-1][1] == 40
    for (_, hi), (lo, _) in itertools.pairwise(covered):
        assert hi == lo                                   # a partition of [0, 40)
    sizes = [sum(hi - lo for lo, hi in fr) for fr in frags]
    assert max(sizes) - min(sizes) <= len(segments)       # balanced up to one element per segment


def test_a_tied_segment_falls_in_the_same_fragments_wherever_it_sits() -> None:
    """A tied parameter of 12 elements at offset 0 on one stage and 30 on another: its element k is in
    the same fragment on both (the copies are averaged at the same steps)."""
    def frag_of(frags: tuple[tuple[tuple[int, int], ...], ...], i: int) -> int:
        return next(f for f, fr in enumerate(frags) if any(lo <= i < hi for lo, hi in fr))

    first = stream_fragments(50, 4, [(0, 12), (12, 50)])
    last = stream_fragments(42, 4, [(0, 30), (30, 42)])
    assert [frag_of(first, k) for k in range(12)] == [frag_of(last, 30 + k) for k in range(12)]


def test_bad_segments_refused() -> None:
    for bad in ([(0, 5)], [(0, 5), (6, 10)], [(0, 6), (5, 10)], [(3, 10)]):
        with pytest.raises(ConfigError):
            stream_fragments(10, 2, bad)


def test_fragment_outer_state_is_sharded_per_fragment() -> None:
    cfg = AveragerConfig(outer=OuterConfig(tau=3, sync=False, stream=True), job="j")
    owned = 0
    for me in ("a", "b"):
        avg = ReplicaAverager(cfg, peers=["a", "b"], me=me, channels={"a": None, "b": None}, initial=torch.arange(11.0))  # type: ignore[dict-item]
        for f, fo in enumerate(avg._fopts):
            lo = avg.fragments[f][0][0]
            assert torch.equal(fo.anchor, torch.arange(11.0)[lo + fo.lo:lo + fo.hi])
            owned += fo.anchor.numel()
        assert [lo for lo, _ in avg.momentum_shards()] == [avg.fragments[f][0][0] + fo.lo for f, fo in enumerate(avg._fopts)]
    assert owned == 11                                    # the two replicas' shards add up to the vector


def test_not_streaming_without_the_flag_or_when_sync() -> None:
    assert _avg(10, 4, stream=False).fragments == ()
    assert _avg(10, 4, sync=True).fragments == ()        # sync ignores stream
    with pytest.raises(ConfigError, match="max_staleness"):
        OuterConfig(tau=2, sync=False, stream=True, max_staleness=2)
    OuterConfig(tau=2, sync=True, stream=True, max_staleness=2)   # ignored when sync


def test_fragment_index_round_trips_and_is_absent_otherwise() -> None:
    msg = RoundMsg(round_id=5, epoch="e", phase="scatter", lo=0, hi=3, data=torch.ones(3), fragment=2)
    tm = to_message("j", 0, msg)
    assert tm.meta["f"] == 2
    assert from_message(tm).fragment == 2
    plain = to_message("j", 0, RoundMsg(round_id=5, epoch="e", phase="scatter", lo=0, hi=3, data=torch.ones(3)))
    assert "f" not in plain.meta                          # the whole-vector form keeps its bytes
    assert from_message(plain).fragment is None


@pytest.mark.parametrize("bad", [-1, True, "1", 1.0, None, 1 << 40])
def test_bad_fragment_index_rejected(bad: object) -> None:
    meta = {"epoch": "e", "lo": 0, "hi": 2, "w": 1.0, "s": 0.0, "f": bad}
    with pytest.raises(RemoteProtocolError):
        from_message(TensorMessage(job="j", kind="avg", meta=meta, tensors=(torch.zeros(2),)))


def test_unknown_meta_key_rejected() -> None:
    meta = {"epoch": "e", "lo": 0, "hi": 2, "w": 1.0, "s": 0.0, "g": 1}
    with pytest.raises(RemoteProtocolError):
        from_message(TensorMessage(job="j", kind="avg", meta=meta, tensors=(torch.zeros(2),)))


def test_round_refuses_a_part_of_another_fragment() -> None:
    sm = AllReduceRound(peers=["a", "b"], me="a", n_elems=4, round_id=3, epoch="e", fragment=1)
    sends = sm.start(torch.zeros(4))
    assert all(s.msg.fragment == 1 for s in sends if hasattr(s, "msg"))
    lo, hi = sm.my_bounds
    for wrong in (0, None):
        with pytest.raises(RemoteProtocolError, match="fragment"):
            sm.receive("b", RoundMsg(round_id=3, epoch="e", phase="scatter", lo=lo, hi=hi, data=torch.zeros(hi - lo), fragment=wrong))
    assert sm.receive("b", RoundMsg(round_id=3, epoch="e", phase="scatter", lo=lo, hi=hi, data=torch.zeros(hi - lo), fragment=1))


def test_co2_stream_default_is_left_out_of_the_wire() -> None:
    co2 = CO2()
    assert co2.stream is True
    assert "stream" not in co2.to_wire()
    assert CO2.from_wire(unpackb(packb(co2.to_wire()))) == co2
    cfg = TrainConfig(steps=10, averaging="co2")
    assert "stream" not in cfg.to_wire()["averaging"]
    assert TrainConfig.from_wire(unpackb(packb(cfg.to_wire()))) == cfg
    old = CO2(stream=False)
    assert old.to_wire()["stream"] is False
    assert CO2.from_wire(unpackb(packb(old.to_wire()))) == old
    assert CO2(sync=True).stream is True                  # allowed: sync ignores stream


def test_co2_stream_validated() -> None:
    with pytest.raises(ConfigError, match=r"CO2\.stream"):
        CO2(stream=1)  # type: ignore[arg-type]
    for bad in (1, "yes", None):
        with pytest.raises(RemoteProtocolError):
            CO2.from_wire({**CO2().to_wire(), "stream": bad})


def test_co2_wire_defaults_to_bf16_and_is_left_out_of_the_wire_at_its_default() -> None:
    """CO2.wire: "bf16" (rounds as bf16 differences) unless a job asks for "fp32"; the planner halves the
    bytes of a round, and counts the kept base in a replica's memory."""
    from fusionp2p.jobs.build import planner_config

    assert CO2().wire == "bf16" and "wire" not in CO2().to_wire()
    fp32 = CO2(wire="fp32")
    assert fp32.to_wire()["wire"] == "fp32" and CO2.from_wire(unpackb(packb(fp32.to_wire()))) == fp32
    with pytest.raises(ConfigError, match=r"CO2\.wire"):
        CO2(wire="fp16")
    for bad in ("fp16", 1, None):
        with pytest.raises(RemoteProtocolError):
            CO2.from_wire({**CO2().to_wire(), "wire": bad})
    bf16_pc = planner_config(TrainConfig(steps=10, averaging=CO2()))
    fp32_pc = planner_config(TrainConfig(steps=10, averaging=fp32))
    assert (bf16_pc.averaging_wire, fp32_pc.averaging_wire) == (0.5, 1.0)
    assert bf16_pc.replica_memory_factor == fp32_pc.replica_memory_factor + 1
    assert planner_config(TrainConfig(steps=10)).averaging_wire == 1.0      # the per-step all-reduce: fp32


def test_read_and_load_slices_across_parameters() -> None:
    params = [torch.arange(3.0).reshape(3, 1), torch.arange(3.0, 7.0), torch.arange(7.0, 9.0).reshape(1, 2)]
    assert torch.equal(read_slice(params, 2, 8), torch.arange(2.0, 8.0))
    load_slice_(params, 2, -torch.arange(2.0, 8.0))
    flat = torch.cat([p.reshape(-1) for p in params])
    assert torch.equal(flat, torch.tensor([0.0, 1.0, -2, -3, -4, -5, -6, -7, 8.0]))
    strided = torch.arange(6.0).reshape(2, 3).t()         # not contiguous
    load_slice_([strided], 1, torch.tensor([9.0]))
    assert strided.reshape(-1)[1] == 9.0
    with pytest.raises(ValueError):
        read_slice(params, 0, 10)
