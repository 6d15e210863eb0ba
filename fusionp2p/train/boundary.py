"""A stage's tensors at its boundary with its peers: a message's tensors encoded (AdaTopK where the
fence is compressed) on the stage's device and copied to the host for the wire, off the event loop when
that copy waits for a device (``fusionp2p.device``); received messages decoded and checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import trio

from fusionp2p import device as dev
from fusionp2p.compress.adatopk import TopKLink
from fusionp2p.compress.codec import decode
from fusionp2p.errors import RemoteProtocolError
from fusionp2p.net.channel import TensorMessage


def encode_boundary(x: torch.Tensor, rho: float) -> tuple[dict[str, Any], tuple[torch.Tensor, ...]]:
    """The message of *x* at kept fraction *rho*: compressed on *x*'s device, then copied to the host."""
    if rho >= 1.0:
        return {}, dev.to_host((x.contiguous(),))
    payload, meta = TopKLink(ratio=rho).encode_act(x)
    return dict(meta), dev.to_host(payload)


async def encoded(x: torch.Tensor, rho: float) -> tuple[dict[str, Any], tuple[torch.Tensor, ...]]:
    """:func:`encode_boundary`; a device tensor's in a worker thread (the copy waits for the device)."""
    if x.device.type == "cpu":
        return encode_boundary(x, rho)
    return await trio.to_thread.run_sync(encode_boundary, x, rho)


def check_tied_message(msg: TensorMessage, *, src: int, stage: int = -1,
                       holders: Mapping[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient, finite flag) of a peer stage's tied-weight message (kind ``tied``), checked against
    ``holders`` (parameter name -> (holder stages, shape, dtype)); RemoteProtocolError otherwise. The flag
    is read by the caller (one element equal to 1.0: finite; anything else makes the step skip)."""
    held = holders.get(msg.name)
    if held is None or src not in held[0] or len(msg.tensors) != 2 or msg.meta:
        raise RemoteProtocolError(f"stage {stage}: unexpected tied gradient {msg.name[:64]!r} from stage {src}")
    g, flag = msg.tensors
    if tuple(g.shape) != held[1] or g.dtype != held[2]:
        raise RemoteProtocolError(f"stage {stage}: tied gradient {msg.name!r} from stage {src} "
                                  f"has {tuple(g.shape)} {g.dtype}, expected {held[1]} {held[2]}")
    return g, flag


def decode_boundary(msg: TensorMessage) -> torch.Tensor:
    if not msg.meta:
        if len(msg.tensors) != 1:
            raise RemoteProtocolError(f"{msg.kind} {msg.name!r}: expected one tensor")
        return msg.tensors[0]
    return decode(msg.tensors, msg.meta)
