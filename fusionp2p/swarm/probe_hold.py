"""The probe server's reservation (``swarm/probe.ProbeServer``): one holder at a time, a share bucket per
peer, and a short FIFO of waiters.

A probe server measures one peer at a time (concurrent transfers would share its link). A client that
finds it held used to be answered ``busy``, try again 0.1-0.3 s later up to three times, then close its
session and open a new one a heartbeat later: at 20 node processes on one machine (issue 40, the idle
run's logs) 7.8 busy answers and 3.8 stream opens per pair, at 0.74 s (median) and 8.6 CPU-ms an open.
A client that says it can wait (``q`` in its first request) now takes a place in this FIFO and is
answered when its turn comes. What a peer can make us hold is bounded: ``QUEUE`` waiters at most, one
place per peer (not the holder's), each for at most ``QUEUE_WAIT`` seconds, after which it is answered
``busy`` as before; a peer whose share is used up is not queued. The node's own measurements (``OWN``)
wait in the same FIFO.

Waiting cannot deadlock two nodes: a measurement needs the prober's own server and the peer's, and the
prober takes the one of the lower peer id first (``may_wait``: its own, then it waits for the peer's; or
the peer's, then it waits for its own, and lets the peer's go if its own does not come in time). Every
chain of waits runs up the id order and cannot close into a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from fusionp2p.errors import ConfigError

OWN = ""   # reserve(OWN, ...): the node measures a link itself (no peer id is empty)
SERVER_HOLD = 10.0      # seconds one reservation lasts at most (= ProbeConfig.timeout, the client's deadline)
SERVER_SHARE = 0.1      # of the time one peer's reservations may take, in the long run
QUEUE = 4               # waiters at most (one place per peer)
QUEUE_WAIT = 3.0        # seconds a waiter waits at most, then it is answered busy


def may_wait(me: str, peer: str) -> bool:
    """Whether our prober may wait for *peer*'s server while it holds its own (else it takes the peer's
    first, then waits for its own)."""
    return me < peer


@dataclass(slots=True)
class Waiter:
    peer: str
    until: float
    granted: trio.Event = field(default_factory=trio.Event)


class Reservations:
    """The reservation, a small state machine with injected time (``now``): :meth:`reserve` grants the
    server to one peer until ``now + hold``; it ends at :meth:`release`, or by itself at that deadline
    (whatever the holder's stream does), and then passes to the first live waiter (:meth:`enqueue`).
    The time held is drawn from the peer's bucket (``hold`` seconds, refilled at ``share`` per second);
    a peer with an empty bucket is refused like a busy server. ``OWN`` holds draw on no share."""

    MAX_PEERS = 1024

    def __init__(self, *, hold: float = SERVER_HOLD, share: float = SERVER_SHARE, queue: int = QUEUE,
                 queue_wait: float = QUEUE_WAIT) -> None:
        if not (hold > 0 and 0 < share <= 1 and queue >= 0 and queue_wait >= 0):
            raise ConfigError("probe server: hold must be positive, share in (0, 1], the queue not negative")
        self.hold = hold
        self.share = share
        self.queue_max = queue
        self.queue_wait = queue_wait
        self._holder: str | None = None
        self._since = 0.0
        self.until = 0.0                          # the current reservation's deadline
        self._bucket: dict[str, tuple[float, float]] = {}   # peer -> (seconds of holding left, as of when)
        self.queue: list[Waiter] = []
        self.tried: dict[str, float] = {}         # peer -> when it last asked us for a probe (takeover)

    def busy(self, now: float) -> bool:
        """Whether some peer holds the server at *now*."""
        self._expire(now)
        return self._holder is not None

    def holds(self, peer: str, now: float) -> bool:
        self._expire(now)
        return self._holder == peer

    def reserve(self, peer: str, now: float) -> bool:
        """Reserve the server for *peer* until ``now + hold``; False while another peer holds it or waits
        for it, or while *peer*'s own reservations exceed its share of the time."""
        self._expire(now)
        self._drop_expired(now)
        if self._holder is not None or self.queue or not self._has_share(peer, now):
            return False
        self._take(peer, now)
        return True

    def enqueue(self, peer: str, now: float) -> Waiter | None:
        """A place in the FIFO for *peer* (whose reserve just failed); None when the queue is full, *peer*
        holds the server or waits already, or its share is used up. Its ``granted`` is set when it holds
        the server; it must :meth:`leave` the queue when it stops waiting."""
        self._expire(now)
        self._drop_expired(now)
        if (len(self.queue) >= self.queue_max or peer == self._holder or any(w.peer == peer for w in self.queue)
                or not self._has_share(peer, now)):
            return None
        w = Waiter(peer, now + self.queue_wait)
        self.queue.append(w)
        if self._holder is None:   # the queue was only of waiters that had gone
            self._next(now)
        return w

    def leave(self, w: Waiter) -> None:
        if w in self.queue:
            self.queue.remove(w)

    async def wait_turn(self, peer: str) -> bool:
        """Wait for the server in the FIFO (within ``queue_wait``): True once *peer* holds it."""
        w = self.enqueue(peer, trio.current_time())
        if w is None:
            return False
        try:
            with trio.move_on_at(w.until):
                await w.granted.wait()
        except BaseException:
            if w.granted.is_set():
                self.release(peer, trio.current_time())
            raise
        finally:
            self.leave(w)
        return w.granted.is_set()

    def saw(self, peer: str, now: float) -> None:
        """*peer* asked us for a probe at *now* (its prober is alive and tries: no takeover)."""
        self.tried.pop(peer, None)
        self.tried[peer] = now
        while len(self.tried) > self.MAX_PEERS:
            del self.tried[next(iter(self.tried))]

    def release(self, peer: str, now: float) -> None:
        if self._holder == peer:
            self._end(now)

    def _take(self, peer: str, now: float) -> None:
        self._holder, self._since, self.until = peer, now, now + self.hold

    def _has_share(self, peer: str, now: float) -> bool:
        return peer == OWN or self._credit(peer, now) > 0

    def _drop_expired(self, now: float) -> None:
        self.queue = [w for w in self.queue if w.until > now or w.granted.is_set()]

    def _expire(self, now: float) -> None:
        if self._holder is not None and now >= self.until:
            self._end(self.until)

    def _credit(self, peer: str, now: float) -> float:
        credit, at = self._bucket.get(peer, (self.hold, now))
        return min(self.hold, credit + self.share * max(0.0, now - at))

    def _end(self, now: float) -> None:
        peer = self._holder
        assert peer is not None
        self._holder = None
        if peer != OWN:   # our own measurement: no share to charge
            left = self._credit(peer, now) - (now - self._since)
            self._bucket.pop(peer, None)
            self._bucket[peer] = (left, now)
            while len(self._bucket) > self.MAX_PEERS:
                del self._bucket[next(iter(self._bucket))]
        self._next(now)

    def _next(self, now: float) -> None:
        """Hand the free server to the first waiter still waiting whose share lasts."""
        while self.queue and self._holder is None:
            w = self.queue.pop(0)
            if w.until > now and not w.granted.is_set() and self._has_share(w.peer, now):
                self._take(w.peer, now)
                w.granted.set()
