"""Bandwidth and RTT probes between two peers over a Transport stream (protocol PROBE).

Client: three ping/pong round trips (RTT = the minimum), then asks for a bulk transfer of *n* bytes;
the server answers ``go`` (or ``busy`` while it is measuring another peer: concurrent transfers would
share its link and each would under-measure), the client sends, and the server acknowledges once all
arrived; throughput = n / (elapsed - rtt). The server bounds *n*.
All frames use the project's framing (wire/framing.py); control frames are small msgpack maps.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.net.transport import Stream, Transport
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.msg import expect_map, field, packb, unpackb
from fusionp2p.wire.protocols import PROBE

MAX_PROBE_BYTES = 64 * 1024 * 1024
_CHUNK = 256 * 1024
_CTRL = 4096


@dataclass(frozen=True, slots=True)
class ProbeResult:
    peer: str
    rtt: float          # seconds
    bandwidth: float    # bytes / s
    nbytes: int
    elapsed: float


class _Framed:
    def __init__(self, stream: Stream, max_frame: int) -> None:
        self.s = stream
        self.dec = FrameDecoder(max_frame=max_frame)
        self.frames: list[bytes] = []

    async def recv(self) -> bytes:
        while not self.frames:
            data = await self.s.receive_some()
            if not data:
                self.dec.check_eof()
                raise PeerUnavailable(self.s.remote_peer, "probe stream closed")
            self.frames.extend(self.dec.feed(data))
        return self.frames.pop(0)

    async def recv_ctrl(self) -> dict[str, object]:
        return expect_map(unpackb(await self.recv(), max_size=_CTRL), "probe")

    async def send_ctrl(self, m: dict[str, object]) -> None:
        await self.s.send_all(encode_frame(packb(m), max_frame=_CTRL))


class ProbeBusy(Exception):
    """The peer is measuring someone else right now; try again later (not a failure)."""


class ProbeServer:
    """Server side of PROBE: one bulk transfer at a time, so that measurements do not share the link."""

    def __init__(self) -> None:
        self._busy = False

    async def __call__(self, stream: Stream) -> None:
        await serve_probe(stream, self)


SERVER_IDLE = 10.0      # seconds a probe stream may sit without its next control frame
SERVER_BULK = 30.0      # seconds a bulk transfer may take before the server gives up on it


async def serve_probe(stream: Stream, server: ProbeServer | None = None) -> None:
    """Serve one PROBE stream; a protocol violation or a deadline closes it (and frees the server)."""
    try:
        await _serve_probe(stream, server)
    except trio.TooSlowError:
        return


async def _serve_probe(stream: Stream, server: ProbeServer | None) -> None:
    f = _Framed(stream, _CHUNK)
    try:
        while True:
            try:
                with trio.fail_after(SERVER_IDLE):
                    m = await f.recv_ctrl()
            except PeerUnavailable:
                return
            op = field(m, "op", str, "probe")
            if op == "ping":
                with trio.fail_after(SERVER_IDLE):
                    await f.send_ctrl({"op": "pong", "i": m.get("i", 0)})
            elif op == "bulk":
                n = field(m, "n", int, "probe")
                if not 0 < n <= MAX_PROBE_BYTES:
                    raise RemoteProtocolError(f"probe of {n} bytes refused")
                if server is not None and server._busy:
                    with trio.fail_after(SERVER_IDLE):
                        await f.send_ctrl({"op": "busy"})
                    continue
                if server is not None:
                    server._busy = True
                try:
                    with trio.fail_after(SERVER_BULK):
                        await f.send_ctrl({"op": "go"})
                        got = 0
                        while got < n:
                            got += len(await f.recv())
                        if got != n:
                            raise RemoteProtocolError("probe payload overran its announced size")
                        await f.send_ctrl({"op": "ack", "n": got})
                finally:
                    if server is not None:
                        server._busy = False
            else:
                raise RemoteProtocolError(f"unknown probe op {op!r}")
    except RemoteProtocolError:
        return


async def probe(transport: Transport, peer: str, *, nbytes: int, pings: int = 3, timeout: float = 20.0) -> ProbeResult:
    """Measure RTT and throughput to *peer*; PeerUnavailable on failure or deadline."""
    if not 0 < nbytes <= MAX_PROBE_BYTES:
        raise ValueError(f"nbytes must be in (0, {MAX_PROBE_BYTES}]")
    phase = "open"
    try:
        with trio.fail_after(timeout):
            stream = await transport.open_stream(peer, PROBE)
            phase = "ping"
            f = _Framed(stream, _CTRL)
            try:
                rtts = []
                for i in range(pings):
                    t0 = trio.current_time()
                    await f.send_ctrl({"op": "ping", "i": i})
                    await f.recv_ctrl()
                    rtts.append(trio.current_time() - t0)
                rtt = min(rtts)
                phase = "bulk"
                chunk = b"\x5a" * min(_CHUNK, nbytes)
                await f.send_ctrl({"op": "bulk", "n": nbytes})
                answer = await f.recv_ctrl()
                if answer.get("op") == "busy":
                    raise ProbeBusy(peer)
                if answer.get("op") != "go":
                    raise RemoteProtocolError(f"unexpected probe answer {answer.get('op')!r}")
                t0 = trio.current_time()
                sent = 0
                while sent < nbytes:
                    part = chunk[: nbytes - sent]
                    await stream.send_all(encode_frame(part, max_frame=_CHUNK))
                    sent += len(part)
                ack = await f.recv_ctrl()
                elapsed = trio.current_time() - t0   # = n / bandwidth + one round trip (first byte out, ack back)
                if ack.get("n") != nbytes:
                    raise RemoteProtocolError("probe ack does not match")
            finally:
                await stream.aclose()
    except trio.TooSlowError:
        raise PeerUnavailable(peer, f"probe timed out ({phase})") from None
    except RemoteProtocolError as exc:
        raise PeerUnavailable(peer, f"probe failed: {exc}") from None
    bw = nbytes / max(elapsed - rtt, 1e-6)
    return ProbeResult(peer=peer, rtt=rtt, bandwidth=bw, nbytes=nbytes, elapsed=elapsed)


def next_probe_size(current: int, elapsed: float, *, target: float = 0.3, lo: int = 256 * 1024, hi: int = 16 * 1024 * 1024) -> int:
    """Size the next probe so that it lasts about *target* seconds (short probes overestimate through tbf bursts)."""
    if elapsed <= 0:
        return min(hi, current * 4)
    want = int(current * target / elapsed)
    return max(lo, min(hi, want, current * 8))
