"""A tiny TCP throughput probe, run inside testbed hosts with ``ip netns exec``.

Theory of operation: the receiver listens, prints its port on the first stdout line (so the
caller can read it with a deadline instead of sleeping), accepts one connection and reads to EOF;
the sender writes zeros for a fixed time and closes. The receiver reports the *steady* rate: the
bytes received after a warm-up divided by the time they took. The warm-up exists because a token
bucket (``tc tbf``) lets its first ``burst`` bytes through at line rate and TCP needs a few round
trips to open its window; both would inflate or deflate a short measurement.

Usage (each prints one JSON object on its last stdout line)::

    python -m fusionp2p.testbed.tcpprobe recv --bind 10.77.3.10 [--port 0] [--warmup 0.3]
    python -m fusionp2p.testbed.tcpprobe send --to 10.77.3.11:PORT [--seconds 2]

This is a measuring tool for the emulated WAN only: it never resolves names and only talks to the
address it is given.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

_CHUNK = 256 * 1024
_SOCKBUF = 4 * 1024 * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeResult:
    """What the receiver measured.

    ``total_bytes``/``total_seconds`` cover the whole connection; ``steady_bytes``/``steady_seconds``
    only the part after the warm-up, which is what ``bits_per_s`` is computed from.
    """

    total_bytes: int
    total_seconds: float
    steady_bytes: int
    steady_seconds: float

    @property
    def bits_per_s(self) -> float:
        if self.steady_seconds <= 0.0:
            return 0.0
        return 8.0 * self.steady_bytes / self.steady_seconds

    def to_json(self) -> str:
        return json.dumps(
            {
                "total_bytes": self.total_bytes,
                "total_seconds": self.total_seconds,
                "steady_bytes": self.steady_bytes,
                "steady_seconds": self.steady_seconds,
                "bits_per_s": self.bits_per_s,
            }
        )


class RateMeter:
    """Pure accounting of received bytes against caller-supplied times (testable without sockets).

    Call :meth:`add` with the monotonic time *after* each receive and the byte count. The steady
    window starts at the first receive at or after ``first + warmup``; bytes counted in the window
    are those received strictly after that mark.
    """

    def __init__(self, *, warmup: float) -> None:
        if warmup < 0.0:
            raise ValueError("warmup must be >= 0")
        self._warmup = warmup
        self._first: float | None = None
        self._last = 0.0
        self._total = 0
        self._mark_time: float | None = None
        self._mark_total = 0

    def add(self, now: float, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if self._first is None:
            self._first = now
        self._total += nbytes
        self._last = now
        if self._mark_time is None and now >= self._first + self._warmup:
            self._mark_time = now
            self._mark_total = self._total

    def result(self) -> ProbeResult:
        first = self._first if self._first is not None else 0.0
        mark = self._mark_time if self._mark_time is not None else self._last
        return ProbeResult(
            total_bytes=self._total,
            total_seconds=self._last - first,
            steady_bytes=self._total - (self._mark_total if self._mark_time is not None else self._total),
            steady_seconds=self._last - mark,
        )


def receive(bind: str, port: int, *, warmup: float, accept_timeout: float) -> ProbeResult:
    """Listen on ``bind:port``, print the bound port, measure one connection until EOF."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKBUF)  # inherited by the accepted socket
        srv.bind((bind, port))
        srv.listen(1)
        srv.settimeout(accept_timeout)
        print(srv.getsockname()[1], flush=True)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(accept_timeout)
            meter = RateMeter(warmup=warmup)
            buf = bytearray(_CHUNK)
            while True:
                n = conn.recv_into(buf)
                now = time.monotonic()
                if n == 0:
                    break
                meter.add(now, n)
    return meter.result()


def send(host: str, port: int, *, seconds: float, connect_timeout: float) -> int:
    """Connect to ``host:port``, write zeros for ``seconds``, close; return the bytes written."""
    payload = bytes(_CHUNK)
    sent = 0
    with socket.create_connection((host, port), timeout=connect_timeout) as conn:
        # A deep send buffer keeps the shaped link busy while this process waits for a CPU on a
        # loaded machine; the kernel, not our scheduling, should decide the rate we measure.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKBUF)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(payload)
            sent += len(payload)
        conn.shutdown(socket.SHUT_WR)
        # Wait for the receiver to close, so the sender's exit means "all bytes delivered".
        while conn.recv(4096):
            pass
    return sent


def _split_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise SystemExit(f"tcpprobe: expected IP:PORT, got {text!r}")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusionp2p.testbed.tcpprobe", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recv", help="listen, print the port, measure one connection")
    r.add_argument("--bind", required=True)
    r.add_argument("--port", type=int, default=0)
    r.add_argument("--warmup", type=float, default=0.3)
    r.add_argument("--timeout", type=float, default=30.0)
    s = sub.add_parser("send", help="connect and send zeros for a while")
    s.add_argument("--to", required=True, help="IP:PORT")
    s.add_argument("--seconds", type=float, default=2.0)
    s.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args(argv)
    if args.cmd == "recv":
        res = receive(args.bind, args.port, warmup=args.warmup, accept_timeout=args.timeout)
        print(res.to_json(), flush=True)
    else:
        host, port = _split_hostport(args.to)
        n = send(host, port, seconds=args.seconds, connect_timeout=args.timeout)
        print(json.dumps({"sent_bytes": n}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
