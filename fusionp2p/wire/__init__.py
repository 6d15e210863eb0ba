"""The only place that knows byte layouts: framing, msgpack messages, tensor codec, protocol ids, limits.

Every decoder here has a size bound and raises :class:`~fusionp2p.errors.RemoteProtocolError` on
anything it cannot accept; none of them ever unpickles.
"""

from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.limits import Limits
from fusionp2p.wire.msg import packb, unpackb
from fusionp2p.wire.tensor import decode_tensor, encode_tensor, tensor_header

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
