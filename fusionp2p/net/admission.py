"""What the data plane lets a peer cost this node: channels, handshakes and buffered bytes (issue 15, item 5).

The data plane (``net/bulk.py``) answers anyone who can open a Noise-authenticated stream, and every
channel it accepts costs two OS threads per lane and up to ``window`` messages of up to
``limits.max_frame`` bytes. Before these bounds a stranger could make a node allocate at will: six
half-sent messages, each announcing 256 MiB, took a node from 302 MiB to 1.9 GiB and from 5 to 17
threads in 7 s. So:

* **Who**: a ticket is issued only to a peer the data plane's ``admit`` predicate accepts (the job
  service admits the members of this node's started jobs, ``jobs/node.py``); everyone else is refused
  before any key, ticket or socket exists.
* **How many**: :class:`Admission` caps the handshakes in progress (ticket exchanges and TCP lanes
  waiting for their ticket), the outstanding tickets per peer, and the accepted channels per peer and
  in total (threads follow from channels).
* **How many bytes**: :class:`BufferBudget` counts, per peer and in total, the bytes of every incoming
  message from the moment its size is announced (the message buffer is allocated then) until the
  application takes it; a message that would exceed a bound is a protocol error on its channel, which
  closes (its claims are returned).

All three are plain counters with a lock (reader threads claim bytes); the caller passes nothing but
peer ids and sizes, so they are tested without sockets.
"""

from __future__ import annotations

import threading
from collections import Counter

from fusionp2p.errors import ConfigError, RemoteProtocolError


class BufferBudget:
    """Bytes of incoming messages held (announced, not yet taken by the application), per peer and in total."""

    def __init__(self, *, max_total: int, max_peer: int) -> None:
        if max_total < 1 or max_peer < 1:
            raise ConfigError("buffer budget bounds must be positive")
        self.max_total = max_total
        self.max_peer = max_peer
        self.total = 0
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def held(self, peer: str) -> int:
        with self._lock:
            return self._held[peer]

    def claim(self, peer: str, n: int) -> None:
        """(any thread) Count *n* bytes for *peer*; RemoteProtocolError (nothing counted) over a bound."""
        with self._lock:
            if self._held[peer] + n > self.max_peer:
                raise RemoteProtocolError(f"peer's incoming messages would hold {self._held[peer] + n} bytes "
                                          f"here, over the per-peer bound of {self.max_peer}")
            if self.total + n > self.max_total:
                raise RemoteProtocolError(f"incoming messages would hold {self.total + n} bytes here, over the "
                                          f"data plane's bound of {self.max_total}")
            self._held[peer] += n
            self.total += n

    def release(self, peer: str, n: int) -> None:
        with self._lock:
            self._held[peer] -= n
            self.total -= n
            if self._held[peer] <= 0:
                del self._held[peer]


class Admission:
    """Caps on handshakes, tickets and accepted channels (trio thread only)."""

    def __init__(self, *, max_handshakes: int, max_peer_tickets: int, max_channels: int, max_peer_channels: int) -> None:
        if min(max_handshakes, max_peer_tickets, max_channels, max_peer_channels) < 1:
            raise ConfigError("data plane admission caps must be >= 1")
        self.max_handshakes = max_handshakes
        self.max_peer_tickets = max_peer_tickets
        self.max_channels = max_channels
        self.max_peer_channels = max_peer_channels
        self.handshakes = 0
        self.tickets: Counter[str] = Counter()     # outstanding (issued, lanes not all in yet)
        self.channels: Counter[str] = Counter()    # accepted and running

    def start_handshake(self) -> bool:
        if self.handshakes >= self.max_handshakes:
            return False
        self.handshakes += 1
        return True

    def end_handshake(self) -> None:
        self.handshakes -= 1

    def may_issue(self, peer: str) -> str:
        """"" if *peer* may get one more ticket, else why not."""
        if self.tickets[peer] >= self.max_peer_tickets:
            return f"{self.tickets[peer]} tickets outstanding"
        if self.tickets[peer] + self.channels[peer] >= self.max_peer_channels:
            return f"{self.channels[peer]} channels open"
        if sum(self.channels.values()) + sum(self.tickets.values()) >= self.max_channels:
            return "the data plane is full"
        return ""

    def issued(self, peer: str) -> None:
        self.tickets[peer] += 1

    def ticket_done(self, peer: str) -> None:
        """A ticket was used up (its channel is accepted) or expired."""
        self.tickets[peer] -= 1
        if self.tickets[peer] <= 0:
            del self.tickets[peer]

    def channel_opened(self, peer: str) -> None:
        self.channels[peer] += 1

    def channel_closed(self, peer: str) -> None:
        self.channels[peer] -= 1
        if self.channels[peer] <= 0:
            del self.channels[peer]


__all__ = ["Admission", "BufferBudget"]
