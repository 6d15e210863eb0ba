"""The averaging messages on the wire (``TensorMessage(kind="avg")``; layout: ``train/averager.py``'s
docstring): encoding, the checked decoding of a peer's message, and the bf16 differences of the "bf16" wire."""

from __future__ import annotations

import dataclasses

import torch

from fusionp2p.average.allreduce import RoundMsg
from fusionp2p.errors import RemoteProtocolError
from fusionp2p.net.channel import TensorMessage
from fusionp2p.wire.check import U63, as_float, as_int, as_list, as_map, as_pair_list, as_str

KIND = "avg"
MAX_FRAGMENTS = 1 << 20   # a fragment index on the wire is below this (streaming: one fragment per tau)


def to_message(job: str, stage: int, msg: RoundMsg) -> TensorMessage:
    meta: dict[str, object] = {"epoch": msg.epoch, "lo": msg.lo, "hi": msg.hi, "w": msg.weight, "s": msg.scalar}
    if msg.speed:                  # re-dealing replicas only: other parts keep their bytes
        meta["v"] = msg.speed
    if msg.fragment is not None:   # streaming only: the whole-vector form keeps its bytes
        meta["f"] = msg.fragment
    if msg.base is not None:       # wire "bf16": the sender's base (fp32 parts without one keep their bytes)
        meta["b"] = msg.base
    if msg.clipped:                # robust reduction: the ranks the owner clipped (none: the part keeps its bytes)
        meta["c"] = list(msg.clipped)
    if msg.arrived:                # re-dealing replicas: when the owner got each rank's scatter part
        meta["a"] = [[r, t] for r, t in msg.arrived]
    return TensorMessage(job=job, kind=KIND, stage=stage, step=msg.round_id, name=msg.phase, meta=meta, tensors=(msg.data,))


def from_message(tm: TensorMessage) -> RoundMsg:
    """Decode a peer's averaging message; anything malformed raises RemoteProtocolError."""
    w = "averaging message"
    m = as_map(tm.meta, w, required=("epoch", "lo", "hi", "w", "s"), optional=("f", "b", "v", "c", "a"))
    clipped = tuple(as_int(r, f"{w} clipped rank", lo=0, hi=MAX_FRAGMENTS) for r in as_list(m["c"], f"{w} clipped",
                                                                                          max_len=1024)) if "c" in m else ()
    arrived = tuple((as_int(r, f"{w} arrival rank", lo=0, hi=MAX_FRAGMENTS), as_float(t, f"{w} arrival time"))
                    for r, t in as_pair_list(m["a"], f"{w} arrivals", max_len=1024, arity=2)) if "a" in m else ()
    fragment = as_int(m["f"], f"{w} fragment", lo=0, hi=MAX_FRAGMENTS - 1) if "f" in m else None
    base = as_int(m["b"], f"{w} base", lo=0, hi=U63) if "b" in m else None
    lo, hi = as_int(m["lo"], f"{w} lo", lo=0, hi=U63), as_int(m["hi"], f"{w} hi", lo=0, hi=U63)
    if len(tm.tensors) != 1 or not lo <= hi:
        raise RemoteProtocolError("averaging message must carry exactly one slice")
    if tm.tensors[0].dtype == torch.bfloat16 and base is None:
        raise RemoteProtocolError("averaging message: a bf16 part needs a base")
    # weight and scalar finite here; the round refuses a weight out of proportion to ours
    return RoundMsg(round_id=tm.step, epoch=as_str(m["epoch"], f"{w} epoch", max_len=64), phase=tm.name, lo=lo, hi=hi,
                    data=tm.tensors[0], weight=as_float(m["w"], f"{w} weight"), scalar=as_float(m["s"], f"{w} scalar"),
                    speed=as_float(m["v"], f"{w} speed") if "v" in m else 0.0, fragment=fragment, base=base,
                    clipped=clipped, arrived=arrived)


def _encode(msg: RoundMsg, base: tuple[int, torch.Tensor] | None, scatter_q: torch.Tensor | None,
            gather_q: torch.Tensor | None, peer_tag: int | None, shared: bool, bf16: bool = True) -> RoundMsg:
    """A part as it goes to one peer: a bf16 difference from *base* (wire "bf16") where the peer can
    decode it and its link carries bf16 (*bf16*), else fp32 values. Scatter: our snapshot's difference *scatter_q* (the round went on
    ``base + q``, so an fp32 part has the same values), to a peer that held the same base as we did in
    the fragment's last round (*shared*). Gather: our published shard's difference *gather_q* (which we
    loaded as ``base + q`` ourselves), to a peer whose scatter part named our base; a peer that sent
    fp32 or another base gets the fp32 shard."""
    if base is None:
        return msg
    tag = base[0]
    if msg.phase == "scatter":   # names our base even in fp32: the owner learns that we hold it
        if not shared or scatter_q is None or not bf16:
            return dataclasses.replace(msg, base=tag)
        return dataclasses.replace(msg, data=scatter_q[msg.lo:msg.hi], base=tag)
    if gather_q is not None and peer_tag == tag and bf16:
        return dataclasses.replace(msg, data=gather_q, base=tag)
    return msg


__all__ = ["KIND", "MAX_FRAGMENTS", "from_message", "to_message"]
