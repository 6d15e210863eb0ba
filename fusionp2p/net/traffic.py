"""Bytes sent and received per peer and plane, counted where they cross the wire.

A :class:`Traffic` meter belongs to a transport (``transport.traffic``). Two planes feed it:

* ``"control"``: libp2p, counted per connection at the secure channel (yamux frames with their
  payloads: gossip, DHT, streams; the Noise framing, ~18 bytes a record, is not counted), and in the
  in-memory transport at each stream;
* ``"data"``: the encrypted TCP data plane (``net/bulk.py``). Its lanes already count their bytes in
  their own threads; the data plane *attaches* a source that reports the open channels' counts and
  folds a channel's final counts into the meter when it closes, so nothing is added per record.

Counts are monotonic per (plane, peer), as Prometheus counters must be. The table is bounded: past
``max_peers`` peers per plane, new peers are counted under the peer ``"other"`` (a stranger cannot
make it grow by rotating identities), and a peer once there stays there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

OTHER = "other"
PLANES = ("control", "data")

# A live source: (plane, peer, bytes sent, bytes received) for each of its open connections.
Source = Callable[[], Iterable[tuple[str, str, int, int]]]


@dataclass(slots=True)
class Traffic:
    """Per-(plane, peer) byte counters; cheap to add to, read whole by :meth:`snapshot`."""

    max_peers: int = 1024
    _totals: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    _peers: dict[str, int] = field(default_factory=dict)         # peers tracked per plane
    _sources: list[Source] = field(default_factory=list)

    def add(self, plane: str, peer: str, *, sent: int = 0, received: int = 0) -> None:
        """Count bytes of one write or read (or a closed connection's totals)."""
        c = self._totals.get((plane, peer))
        if c is None:
            c = self._slot(plane, peer)
        c[0] += sent
        c[1] += received

    def attach(self, source: Source) -> Callable[[], None]:
        """Report *source*'s live counts in every snapshot until the returned function is called."""
        self._sources.append(source)

        def detach() -> None:
            if source in self._sources:
                self._sources.remove(source)

        return detach

    def snapshot(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(plane, peer) -> (bytes sent, bytes received), closed and open connections together."""
        out = {k: (v[0], v[1]) for k, v in self._totals.items()}
        for source in list(self._sources):
            for plane, peer, sent, received in source():
                key = (plane, peer) if (plane, peer) in self._totals else self._key(plane, peer)
                s, r = out.get(key, (0, 0))
                out[key] = (s + sent, r + received)
        return out

    def totals(self) -> dict[str, tuple[int, int]]:
        """plane -> (bytes sent, bytes received) over every peer."""
        out: dict[str, tuple[int, int]] = {}
        for (plane, _), (s, r) in self.snapshot().items():
            a, b = out.get(plane, (0, 0))
            out[plane] = (a + s, b + r)
        return out

    def _key(self, plane: str, peer: str) -> tuple[str, str]:
        """Where *peer*'s bytes go: its own row, or ``"other"`` once the plane tracks max_peers peers."""
        return (plane, peer) if self._peers.get(plane, 0) < self.max_peers else (plane, OTHER)

    def _slot(self, plane: str, peer: str) -> list[int]:
        key = self._key(plane, peer)
        c = self._totals.get(key)
        if c is None:
            c = self._totals[key] = [0, 0]
            if key[1] != OTHER:
                self._peers[plane] = self._peers.get(plane, 0) + 1
        return c


__all__ = ["OTHER", "PLANES", "Source", "Traffic"]
