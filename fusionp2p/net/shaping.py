"""Emulated link rates on one machine: a token bucket per direction of each shaped pair of peers.

``Swarm.local(..., links=...)`` (jobs/embedded.py) shapes both planes of an embedded swarm with one
:class:`LinkEmulator`: the in-memory transport (so the nodes' bandwidth probes *measure* the emulated
rates, and the planner sees them as it would on a WAN) and the encrypted TCP data plane on
127.0.0.1 (so activations, gradients and averaging parts really move at those rates, and AdaTopK's
smaller payloads really arrive sooner). Like ``tc tbf`` it shapes rate only: latency is not added.

**Access links** (``LinkEmulator.set_access``, benchmarks/swarm_scale.py): a node's own uplink and
downlink rates and one-way latency, as a home, office or datacenter connection. They shape the in-memory
transport only: a chunk from *a* to *b* leaves when *a*'s uplink bucket, *b*'s downlink bucket and the
pair's bucket (if set) all let it through, so every stream of a node shares its access link, as on a real
connection, and it arrives the two nodes' latencies later (``MemoryStream`` holds it until then). Their
buckets pass a burst of one 64 KiB chunk only: at 5 ms of a 10 Gbit/s rate, a probe's whole transfer
would pass in the burst and read as infinitely fast.

A :class:`TokenBucket` is a virtual clock of when its link is free again: reserving *n* bytes at
``now`` returns how long the sender must wait before the last of them has left at the link's rate
(a burst of ``burst`` bytes passes at once). It holds a lock because the data plane's lanes send from
their own threads; the time is passed in (trio's clock for the transport, ``time.monotonic`` in the
data plane's writer threads; the two planes have separate buckets).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from fusionp2p.errors import ConfigError


class TokenBucket:
    """Rate limiter of one direction of one link: ``rate`` bytes/s, ``burst`` bytes at once."""

    def __init__(self, rate: float, *, burst: float | None = None) -> None:
        if not rate > 0:
            raise ConfigError(f"a link rate must be positive bytes/s, got {rate}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else max(4096.0, self.rate * 0.005)
        self._free_at = -float("inf")
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, now: float) -> float:
        """Seconds to wait before *nbytes* sent at *now* have left the link (0.0 within the burst)."""
        with self._lock:
            start = max(self._free_at, now - self.burst / self.rate)
            self._free_at = start + nbytes / self.rate
            return max(0.0, self._free_at - now)

    def piece(self) -> int:
        """Bytes to send between two waits: about 5 ms at the rate (a slow link keeps flowing, it never
        falls silent long enough for a peer to think it dead)."""
        return max(1024, int(self.rate * 0.005))


@dataclass(frozen=True, slots=True, kw_only=True)
class Access:
    """A node's access link: uplink and downlink in bytes/s, one-way latency in seconds."""

    up: float
    down: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not (self.up > 0 and self.down > 0) or not 0 <= self.latency < 60:
            raise ConfigError(f"an access link needs positive rates and a latency in [0, 60) s, got {self}")


ACCESS_BURST = 64 * 1024   # bytes an idle access link passes at once (one in-memory chunk; module docstring)


class LinkEmulator:
    """Rates of the shaped pairs of an embedded swarm, by peer id; unlisted pairs are not shaped.

    ``bucket(src, dst, plane)`` is the bucket of the direction src -> dst on *plane* ("control": the
    in-memory transport; "data": the TCP data plane), created on first use and shared by every stream
    or channel of that direction, as one physical link would be.
    """

    def __init__(self) -> None:
        self._rates: dict[frozenset[str], float] = {}
        self._buckets: dict[tuple[str, str, str], TokenBucket] = {}
        self._lock = threading.Lock()
        self._access: dict[str, Access] = {}
        self._ends: dict[tuple[str, str], TokenBucket] = {}   # (peer, "up" | "down") -> its access bucket

    def set_access(self, peer: str, access: Access) -> None:
        """Give *peer* an access link (the module docstring): every in-memory stream to or from it shares it."""
        with self._lock:
            self._access[peer] = access
            self._ends[(peer, "up")] = TokenBucket(access.up, burst=ACCESS_BURST)
            self._ends[(peer, "down")] = TokenBucket(access.down, burst=ACCESS_BURST)

    def access(self, peer: str) -> Access | None:
        return self._access.get(peer)

    def path_rate(self, src: str, dst: str) -> float | None:
        """The emulated rate from *src* to *dst* with nothing else sent (None: not shaped)."""
        ends = [a.up for a in (self._access.get(src),) if a] + [a.down for a in (self._access.get(dst),) if a]
        pair = self._rates.get(frozenset((src, dst)))
        rates = ends + ([pair] if pair is not None else [])
        return min(rates) if rates else None

    def latency(self, src: str, dst: str) -> float:
        """One-way seconds from *src* to *dst*: the sum of their access latencies (0 without access links)."""
        return sum(a.latency for a in (self._access.get(src), self._access.get(dst)) if a)

    def delay(self, src: str, dst: str, nbytes: int, now: float, plane: str = "control") -> float:
        """Seconds to wait before *nbytes* sent from *src* to *dst* at *now* have left: the longest wait of
        the pair's bucket and the two access buckets (each reserved at once; 0.0 when none is shaped)."""
        buckets = [self.bucket(src, dst, plane), self._ends.get((src, "up")), self._ends.get((dst, "down"))]
        return max((b.reserve(nbytes, now) for b in buckets if b is not None), default=0.0)

    def set_rate(self, a: str, b: str, rate: float) -> None:
        """Shape the link between *a* and *b* (both directions) to *rate* bytes/s."""
        if a == b:
            raise ConfigError("a link joins two different peers")
        if not rate > 0:
            raise ConfigError(f"a link rate must be positive bytes/s, got {rate}")
        with self._lock:
            self._rates[frozenset((a, b))] = float(rate)
            for key in [k for k in self._buckets if {k[0], k[1]} == {a, b}]:
                del self._buckets[key]

    def rates(self) -> Mapping[frozenset[str], float]:
        return dict(self._rates)

    def rate(self, a: str, b: str) -> float | None:
        return self._rates.get(frozenset((a, b)))

    def bucket(self, src: str, dst: str, plane: str = "data") -> TokenBucket | None:
        rate = self._rates.get(frozenset((src, dst)))
        if rate is None:
            return None
        with self._lock:
            key = (src, dst, plane)
            got = self._buckets.get(key)
            if got is None:
                got = self._buckets[key] = TokenBucket(rate)
            return got


__all__ = ["ACCESS_BURST", "Access", "LinkEmulator", "TokenBucket"]
