"""Length-prefixed framing, sans-IO (h11 style).

Layout of one frame: ``u32 big-endian length`` followed by ``length`` bytes of payload.
``FrameDecoder.feed(data)`` accepts any split of the byte stream (one byte at a time, several frames
at once) and returns the complete frames; a length over the bound is rejected *before* buffering.
"""

from __future__ import annotations

import struct

from fusionp2p.errors import LocalProtocolError, RemoteProtocolError

_LEN = struct.Struct(">I")
HEADER_SIZE = _LEN.size


def encode_frame(payload: bytes | bytearray | memoryview, *, max_frame: int) -> bytes:
    """Prefix *payload* with its length. Raises LocalProtocolError if it is over *max_frame*."""
    n = len(payload)
    if n > max_frame:
        raise LocalProtocolError(f"frame of {n} bytes exceeds the limit of {max_frame}")
    return _LEN.pack(n) + bytes(payload)


def frame_header(n: int, *, max_frame: int) -> bytes:
    """Only the 4-byte header, for writers that send a large payload without copying it."""
    if n > max_frame:
        raise LocalProtocolError(f"frame of {n} bytes exceeds the limit of {max_frame}")
    return _LEN.pack(n)


class FrameDecoder:
    """Incremental frame decoder with a hard bound on frame size."""

    __slots__ = ("_buf", "_max_frame", "_need")

    def __init__(self, *, max_frame: int) -> None:
        self._buf = bytearray()
        self._max_frame = max_frame
        self._need: int | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Add received bytes; return every frame now complete, in order."""
        self._buf += data
        out: list[bytes] = []
        while True:
            if self._need is None:
                if len(self._buf) < HEADER_SIZE:
                    return out
                (n,) = _LEN.unpack_from(self._buf, 0)
                if n > self._max_frame:
                    raise RemoteProtocolError(f"peer announced a frame of {n} bytes; limit is {self._max_frame}")
                del self._buf[:HEADER_SIZE]
                self._need = n
            if len(self._buf) < self._need:
                return out
            out.append(bytes(self._buf[: self._need]))
            del self._buf[: self._need]
            self._need = None

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a complete frame (0 at a clean frame boundary)."""
        return len(self._buf) + (HEADER_SIZE if self._need is not None else 0)

    def check_eof(self) -> None:
        """Call at end of stream: raises RemoteProtocolError if a frame was cut off."""
        if self.pending:
            raise RemoteProtocolError(f"stream ended inside a frame ({self.pending} bytes pending)")
