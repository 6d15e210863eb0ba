"""Emulated link rates on one machine: a token bucket per direction of each shaped pair of peers.

``Swarm.local(..., links=...)`` (jobs/embedded.py) shapes both planes of an embedded swarm with one
:class:`LinkEmulator`: the in-memory transport (so the nodes' bandwidth probes *measure* the emulated
rates, and the planner sees them as it would on a WAN) and the encrypted TCP data plane on
127.0.0.1 (so activations, gradients and averaging parts really move at those rates, and AdaTopK's
smaller payloads really arrive sooner). Like ``tc tbf`` it shapes rate only: latency is not added.

A :class:`TokenBucket` is a virtual clock of when its link is free again: reserving *n* bytes at
``now`` returns how long the sender must wait before the last of them has left at the link's rate
(a burst of ``burst`` bytes passes at once). It holds a lock because the data plane's lanes send from
their own threads; the time is passed in (trio's clock for the transport, ``time.monotonic`` in the
data plane's writer threads; the two planes have separate buckets).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

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


__all__ = ["LinkEmulator", "TokenBucket"]
