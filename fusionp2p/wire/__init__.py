"""The only place that knows byte layouts: framing, msgpack messages, tensor codec, protocol ids, limits.

Every decoder here has a size bound and raises :class:`~fusionp2p.errors.RemoteProtocolError` on
anything it cannot accept; none of them ever unpickles. The tensor codec is loaded lazily so that
processes that never touch tensors (the bootstrap, ``fusionp2p status``) do not import torch.
"""

from __future__ import annotations

from typing import Any

from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.limits import Limits
from fusionp2p.wire.msg import packb, unpackb

_TENSOR = ("decode_tensor", "encode_tensor", "tensor_header")


def __getattr__(name: str) -> Any:
    if name in _TENSOR:
        from fusionp2p.wire import tensor

        return getattr(tensor, name)
    raise AttributeError(name)


__all__ = [
    "FrameDecoder",
    "Limits",
    "decode_tensor",
    "encode_frame",
    "encode_tensor",
    "packb",
    "tensor_header",
    "unpackb",
]
