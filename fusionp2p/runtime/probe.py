"""Bandwidth and RTT probes between two peers over a Transport stream (protocol PROBE).

Client: three ping/pong round trips (RTT = the minimum), then asks for a bulk transfer of *n* bytes;
the server answers ``go`` (or ``busy`` while it is measuring another peer: concurrent transfers would
share its link and each would under-measure), the client sends, and the server acknowledges once all
arrived; throughput = n / (elapsed - rtt). The server bounds *n*. It also times the second half of
the bytes it receives (from the ``mark`` the client names, n/2, to the last byte), which gives the
node a downlink figure; timing only the second half leaves out what a token bucket lets through at
line rate at the start (its burst) and TCP's slow start.
All frames use the project's framing (wire/framing.py); control frames are small msgpack maps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.net.transport import Stream, Transport
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.msg import expect_map, field, packb, unpackb
from fusionp2p.wire.protocols import PROBE

log = logging.getLogger(__name__)

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

    async def recv_payload(self, n: int, mark: int) -> tuple[int, float | None, int]:
        """Receive *n* payload bytes in frames; (bytes, seconds from the *mark*-th raw byte to the last, raw bytes after it)."""
        got = sum(len(fr) for fr in self.frames)
        self.frames.clear()
        raw = 0
        t_mark: float | None = None
        raw_at_mark = 0
        while got < n:
            data = await self.s.receive_some()
            if not data:
                self.dec.check_eof()
                raise PeerUnavailable(self.s.remote_peer, "probe stream closed")
            raw += len(data)
            if t_mark is None and raw >= mark:
                t_mark, raw_at_mark = trio.current_time(), raw
            got += sum(len(fr) for fr in self.dec.feed(data))
        if t_mark is None:
            return got, None, 0
        return got, trio.current_time() - t_mark, raw - raw_at_mark

    async def recv_ctrl(self) -> dict[str, object]:
        return expect_map(unpackb(await self.recv(), max_size=_CTRL), "probe")

    async def send_ctrl(self, m: dict[str, object]) -> None:
        await self.s.send_all(encode_frame(packb(m), max_frame=_CTRL))


class ProbeBusy(Exception):
    """The peer is measuring someone else right now; try again later (not a failure)."""


class ProbeServer:
    """Server side of PROBE: one bulk transfer at a time, so that measurements do not share the link.

    It also remembers the rate at which the second half of each peer's probe arrived (EMA): our downlink.
    """

    MAX_PEERS = 1024

    def __init__(self, *, alpha: float = 0.5) -> None:
        self._busy = False
        self._alpha = alpha
        self.inbound: dict[str, float] = {}

    async def __call__(self, stream: Stream) -> None:
        await serve_probe(stream, self)

    def record_inbound(self, peer: str, rate: float) -> None:
        old = self.inbound.pop(peer, None)
        self.inbound[peer] = rate if old is None else (1 - self._alpha) * old + self._alpha * rate
        while len(self.inbound) > self.MAX_PEERS:
            del self.inbound[next(iter(self.inbound))]

    def best_inbound(self) -> float:
        """The best rate any peer's probe reached us at (0 while none did)."""
        return max(self.inbound.values(), default=0.0)


SERVER_IDLE = 10.0      # seconds a probe stream may sit without its next control frame
SERVER_BULK = 30.0      # seconds a bulk transfer may take before the server gives up on it


async def serve_probe(stream: Stream, server: ProbeServer | None = None) -> None:
    """Serve one PROBE stream; a protocol violation or a deadline closes it (and frees the server)."""
    try:
        await _serve_probe(stream, server)
    except (trio.TooSlowError, PeerUnavailable):   # a deadline, or the client went away mid-transfer
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
                mark = m.get("mark", n)
                mark = mark if isinstance(mark, int) and 0 < mark < n else n
                try:
                    with trio.fail_after(SERVER_BULK):
                        await f.send_ctrl({"op": "go"})
                        got, dt, db = await f.recv_payload(n, mark)
                        if got != n:
                            raise RemoteProtocolError("probe payload overran its announced size")
                        await f.send_ctrl({"op": "ack", "n": got})
                    if server is not None and dt is not None and dt > 0 and db > 0:
                        server.record_inbound(stream.remote_peer, db / dt)
                finally:
                    if server is not None:
                        server._busy = False
            else:
                raise RemoteProtocolError(f"unknown probe op {op!r}")
    except RemoteProtocolError:
        return


async def probe(transport: Transport, peer: str, *, nbytes: int, pings: int = 3, timeout: float = 20.0,
                ctrl_timeout: float | None = None) -> ProbeResult:
    """Measure RTT and throughput to *peer*; PeerUnavailable on failure or deadline.

    *timeout* bounds the whole probe; *ctrl_timeout* (default: *timeout*) bounds the part before the
    transfer (open, pings, the server's go/busy): a peer too loaded to answer a ping within it is
    given up on quickly, rather than holding up the caller's other probes.
    """
    if not 0 < nbytes <= MAX_PROBE_BYTES:
        raise ValueError(f"nbytes must be in (0, {MAX_PROBE_BYTES}]")
    phase = "open"
    try:
        with trio.fail_after(timeout):
            ctrl_deadline = trio.current_time() + min(timeout, ctrl_timeout or timeout)
            t_open = trio.current_time()
            with trio.fail_at(ctrl_deadline):
                stream = await transport.open_stream(peer, PROBE)
            log.debug("probe %s: stream open in %.0f ms", peer[:16], 1e3 * (trio.current_time() - t_open))
            f = _Framed(stream, _CTRL)
            try:
                with trio.fail_at(ctrl_deadline):
                    phase = "ping"
                    rtts = []
                    for i in range(pings):
                        t0 = trio.current_time()
                        await f.send_ctrl({"op": "ping", "i": i})
                        await f.recv_ctrl()
                        rtts.append(trio.current_time() - t0)
                    rtt = min(rtts)
                    phase = "go"
                    await f.send_ctrl({"op": "bulk", "n": nbytes, "mark": nbytes // 2})
                    answer = await f.recv_ctrl()
                if answer.get("op") == "busy":
                    raise ProbeBusy(peer)
                if answer.get("op") != "go":
                    raise RemoteProtocolError(f"unexpected probe answer {answer.get('op')!r}")
                phase = "bulk"
                chunk = b"\x5a" * min(_CHUNK, nbytes)
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
