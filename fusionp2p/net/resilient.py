"""A tensor channel that survives its connection: reconnect, resume, retransmit, deliver exactly once.

Theory of operation (docs/dataplane.md "Reconnecting channels"):

* A :class:`ResilientChannel` is a *session* between two peers, named by the dialer's random session id
  and a channel name both sides agree on (e.g. ``"job/stage0->stage1"``). It runs over one
  :class:`~fusionp2p.net.bulk.Link` at a time, the *link*. The dialer opens links
  (``DataPlane.connect``); the listener's :class:`ResilientAcceptor` routes each incoming link to the
  session it resumes, keyed by ``(authenticated remote peer, channel name)``.
* **Handshake.** The dialer's first message on a link is ``hello`` (name, session, whether the session
  is new, the highest sequence number it has *received* and *delivered*, its receive window); the
  acceptor answers ``welcome`` (its own received/delivered/window) or ``reject`` (it does not know the
  session: it restarted and lost it, which no retransmission can repair).
* **Sequence numbers.** Every application message gets the next number of its direction (1, 2, ...),
  carried with a piggybacked acknowledgement in ``meta["_rc"]`` (the one reserved meta key). The
  receiver accepts ``received + 1``, drops anything ``<= received`` (a retransmitted duplicate) and
  treats a gap as a protocol violation. Messages reach the application exactly once, in order.
* **Acknowledgement = delivery.** The receiver acknowledges a message (``ack`` with its delivered
  count, coalesced) when the application takes it. The sender keeps every message not yet
  acknowledged and stops at ``window`` of them, which bounds both its retransmission buffer and the
  receiver's inbox (at most ``window`` received, undelivered messages). The link underneath is always
  drained at once, so acknowledgements never queue behind tensors the application has not taken.
* **Resume.** On a new link each side learns the other's *received* count and resends only what is
  beyond it; received messages survive a lost link in the receiver's inbox.
* **Failure.** A link failing with PeerUnavailable starts a reconnect (dialer: ``connect`` with
  exponential backoff; acceptor: wait for the dialer to come back), bounded by ``reconnect_timeout``;
  after that ``send``/``receive`` raise PeerUnavailable. RemoteProtocolError (a forged record, a
  malformed control message) is never retried: the channel fails and closes. ``aclose`` sends ``bye``
  after every message already sent; the peer's ``receive`` then ends with trio.EndOfChannel.

The bookkeeping is the sans-IO :class:`SequenceBook`; the classes below it only move messages.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, replace
from typing import Any, Protocol

import trio

from fusionp2p.errors import (
    ConfigError,
    FusionError,
    LocalProtocolError,
    PeerUnavailable,
    RemoteProtocolError,
)
from fusionp2p.net.bulk import Link
from fusionp2p.net.channel import TensorMessage
from fusionp2p.types import short_peer
from fusionp2p.wire.msg import expect_map, typed_field

log = logging.getLogger(__name__)

RESERVED = "_rc"           # the meta key (and control-message kind) this layer owns
PROTOCOL_VERSION = 1
MAX_WINDOW = 1024
MAX_NAME = 256
_LINK_ERRORS = (PeerUnavailable, RemoteProtocolError, trio.ClosedResourceError)
_GONE_POLL = 0.5  # seconds between peer_gone checks while the accepting side waits for a link
_SESSION = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResilientConfig:
    """Settings of reconnecting channels (both ends; the window is negotiated down to the smaller one)."""

    window: int = 8                  # unacknowledged messages per direction (sender buffer = receiver inbox bound)
    reconnect_timeout: float = 10.0  # from a lost link until PeerUnavailable, if no new link is up by then
    handshake_timeout: float = 5.0   # for the hello/welcome exchange on a new link
    backoff_initial: float = 0.05    # first pause between dial attempts; doubles up to backoff_max (with jitter)
    backoff_max: float = 1.0
    close_timeout: float = 3.0       # aclose waits this long for a link to say goodbye on
    copy_on_send: bool = True        # keep a copy of each sent message's tensors (the caller may reuse its own)
    max_sessions: int = 256          # sessions one acceptor holds
    incoming_buffer: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.window <= MAX_WINDOW:
            raise ConfigError(f"ResilientConfig.window must be between 1 and {MAX_WINDOW}")
        if min(self.reconnect_timeout, self.handshake_timeout, self.backoff_initial, self.close_timeout) <= 0:
            raise ConfigError("ResilientConfig timeouts and backoff_initial must be positive")
        if self.backoff_max < self.backoff_initial:
            raise ConfigError("ResilientConfig.backoff_max must be >= backoff_initial")
        if self.max_sessions < 1 or self.incoming_buffer < 1:
            raise ConfigError("ResilientConfig.max_sessions and incoming_buffer must be >= 1")


# ------------------------------------------------------------------------------ control messages
@dataclass(frozen=True, slots=True)
class Hello:
    name: str
    session: str
    fresh: bool     # the dialer never had a welcome for this session
    received: int
    delivered: int
    window: int


@dataclass(frozen=True, slots=True)
class Resume:
    """The other side's state as announced in a hello or welcome."""

    received: int
    delivered: int
    window: int


def _control(op: str, **fields: Any) -> TensorMessage:
    return TensorMessage(job="", kind=RESERVED, meta={RESERVED: {"op": op, **fields}})


def hello_message(h: Hello) -> TensorMessage:
    return _control("hello", v=PROTOCOL_VERSION, name=h.name, session=h.session, fresh=h.fresh,
                    r=h.received, d=h.delivered, w=h.window)


def welcome_message(received: int, delivered: int, window: int) -> TensorMessage:
    return _control("welcome", v=PROTOCOL_VERSION, r=received, d=delivered, w=window)


def _count(m: dict[str, Any], name: str, what: str) -> int:
    v = int(typed_field(m, name, int, what))
    if not 0 <= v < 2**63:
        raise RemoteProtocolError(f"{what}: field {name!r} out of range")
    return v


def _window(m: dict[str, Any], what: str) -> int:
    w = int(typed_field(m, "w", int, what))
    if not 1 <= w <= MAX_WINDOW:
        raise RemoteProtocolError(f"{what}: window {w} out of range")
    return w


def _rc(msg: TensorMessage, what: str) -> dict[str, Any]:
    if RESERVED not in msg.meta:
        raise RemoteProtocolError(f"{what}: no {RESERVED!r} meta (the peer is not a resilient channel)")
    return expect_map(msg.meta[RESERVED], what)


def _op(msg: TensorMessage, expected: tuple[str, ...], what: str) -> dict[str, Any]:
    rc = _rc(msg, what)
    op = typed_field(rc, "op", str, what)
    if op not in expected:
        raise RemoteProtocolError(f"{what}: unexpected {op!r}")
    if op in ("hello", "welcome") and rc.get("v") != PROTOCOL_VERSION:
        raise RemoteProtocolError(f"{what}: unsupported version {rc.get('v')!r}")
    return rc


def parse_hello(msg: TensorMessage) -> Hello:
    """The validated hello from a link's first message (RemoteProtocolError otherwise)."""
    what = "resilient hello"
    rc = _op(msg, ("hello",), what)
    name, session = typed_field(rc, "name", str, what), typed_field(rc, "session", str, what)
    if not 0 < len(name) <= MAX_NAME or not _SESSION.fullmatch(session):
        raise RemoteProtocolError(f"{what}: bad channel name or session id")
    return Hello(name=name, session=session, fresh=bool(typed_field(rc, "fresh", bool, what)),
                 received=_count(rc, "r", what), delivered=_count(rc, "d", what), window=_window(rc, what))


def parse_welcome(msg: TensorMessage) -> Resume | str:
    """The acceptor's answer: its state, or the reason it rejected the session."""
    what = "resilient welcome"
    rc = _op(msg, ("welcome", "reject"), what)
    if rc["op"] == "reject":
        return str(typed_field(rc, "why", str, what))[:MAX_NAME]
    return Resume(received=_count(rc, "r", what), delivered=_count(rc, "d", what), window=_window(rc, what))


# ------------------------------------------------------------------------------- sans-IO core
class SequenceBook:
    """Sequence numbers, the retransmission buffer, duplicate suppression and the window of one session.

    Pure: the shell calls ``push``/``wire``/``unsent_after`` on the way out, ``on_link_message`` on the
    way in, ``take`` when the application receives, and ``on_resume`` with the other side's state at
    every new link. Anything a peer could get wrong raises RemoteProtocolError.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.peer_window = window
        self.next_seq = 1                     # of the next message we send
        self.out: deque[tuple[int, TensorMessage]] = deque()  # sent, not known to be delivered
        self.peer_delivered = 0               # acknowledged by the peer (flow control)
        self.received = 0                     # highest sequence number accepted from the peer
        self.delivered = 0                    # ... and taken by the application
        self.inbox: deque[TensorMessage] = deque()
        self.peer_closed = False

    # --- out
    def can_send(self) -> bool:
        return self.next_seq - 1 - self.peer_delivered < min(self.window, self.peer_window)

    def push(self, msg: TensorMessage) -> int:
        """Number and keep *msg* (call only when ``can_send``)."""
        if RESERVED in msg.meta:
            raise LocalProtocolError(f"meta key {RESERVED!r} is reserved by the resilient channel")
        assert self.can_send()
        seq = self.next_seq
        self.next_seq += 1
        self.out.append((seq, msg))
        return seq

    def unsent_after(self, seq: int) -> tuple[int, TensorMessage] | None:
        """The first kept message numbered above *seq* (the next one to put on the link)."""
        for item in self.out:
            if item[0] > seq:
                return item
        return None

    def wire(self, seq: int, msg: TensorMessage) -> TensorMessage:
        """*msg* as sent: its meta plus our sequence number and delivered count."""
        return replace(msg, meta={**msg.meta, RESERVED: {"s": seq, "d": self.delivered}})

    def _acked(self, delivered: int, what: str) -> None:
        if delivered > self.next_seq - 1:
            raise RemoteProtocolError(f"{what}: peer acknowledged message {delivered}, never sent")
        self.peer_delivered = max(self.peer_delivered, delivered)
        self._forget(self.peer_delivered)

    def _forget(self, upto: int) -> None:
        while self.out and self.out[0][0] <= upto:
            self.out.popleft()

    def on_resume(self, peer: Resume) -> int:
        """Apply the other side's state at a new link; returns the sequence number to resend after."""
        if not peer.delivered <= peer.received <= self.next_seq - 1 or peer.received < self.peer_delivered:
            raise RemoteProtocolError(f"resume: peer claims received={peer.received} delivered={peer.delivered}, "
                                      f"we sent {self.next_seq - 1} and saw {self.peer_delivered} delivered")
        self.peer_window = peer.window
        self._acked(peer.delivered, "resume")
        self._forget(peer.received)  # safe in the peer's inbox: never resent
        return peer.received

    # --- in
    def on_link_message(self, msg: TensorMessage) -> str:
        """One message from the link: 'data' (queued for the application), 'duplicate', 'ack' or 'bye'."""
        what = "resilient message"
        rc = _rc(msg, what)
        if "op" in rc:
            op = _op(msg, ("ack", "bye"), what)["op"]
            if op == "ack":
                self._acked(_count(rc, "d", what), what)
            else:
                self.peer_closed = True
            return str(op)
        seq = _count(rc, "s", what)
        self._acked(_count(rc, "d", what), what)
        if seq <= self.received:
            return "duplicate"
        if seq != self.received + 1:
            raise RemoteProtocolError(f"{what}: got message {seq} after {self.received} (a gap)")
        if self.received - self.delivered >= self.window:
            raise RemoteProtocolError(f"{what}: peer sent past the window of {self.window}")
        self.received = seq
        meta = {k: v for k, v in msg.meta.items() if k != RESERVED}
        self.inbox.append(replace(msg, meta=meta))
        return "data"

    def take(self) -> TensorMessage | None:
        if not self.inbox:
            return None
        self.delivered += 1
        return self.inbox.popleft()


# ------------------------------------------------------------------------------------ the shell
class Dialer(Protocol):
    """What a dialing channel reconnects through (a :class:`~fusionp2p.net.bulk.DataPlane`)."""

    async def connect(self, peer: str) -> Link: ...


class _Rejected(Exception):
    pass


async def _close_quietly(link: Link) -> None:
    try:
        await link.aclose()
    except (FusionError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        log.debug("closing a link to %s: %r", link.remote_peer, exc)


class ResilientChannel:
    """A :class:`~fusionp2p.net.channel.TensorChannel` that reconnects and retransmits (see the module
    docstring). Create with :func:`open_resilient_channel` (dialer) or take from
    :attr:`ResilientAcceptor.incoming` (listener)."""

    def __init__(self, *, peer: str, name: str, session: str, cfg: ResilientConfig, nursery: trio.Nursery,
                 dialer: Dialer | None, on_end: Callable[[ResilientChannel], None] | None = None,
                 peer_gone: Callable[[str], bool] | None = None) -> None:
        self._peer = peer
        self._peer_gone = peer_gone           # e.g. the swarm's membership view: stop waiting for a dead peer
        self.name = name
        self.session = session
        self._cfg = cfg
        self._nursery = nursery               # owner of the supervisor and of background link closes
        self._dialer = dialer                 # None on the accepting side
        self._on_end = on_end
        self._book = SequenceBook(cfg.window)
        self._changed = trio.Event()
        self._write_lock = trio.Lock()        # one writer of data at a time, in sequence order
        self._link: Link | None = None
        self._link_scope: trio.CancelScope | None = None
        self._link_sent = 0                   # highest sequence number put on the current link
        self._ack_sent = 0                    # highest delivered count told to the peer
        self._lost: PeerUnavailable | None = None
        self._pending: tuple[Link, Hello] | None = None  # accepting side: a link to resume on
        self._scope = trio.CancelScope()
        self._established = False
        self._error: FusionError | None = None
        self._closed = False
        self.links = 0                        # links opened so far (1 + reconnects)
        self.path = ""                        # of the latest link: "direct" (TCP) or "libp2p" (the fallback stream)

    @property
    def remote_peer(self) -> str:
        return self._peer

    # ------------------------------------------------------------------------------------ public API
    async def send(self, msg: TensorMessage) -> None:
        """Send one message; blocks while ``window`` messages are unacknowledged. Returns once the message
        is kept for retransmission (while reconnecting, that is before it is on a link). PeerUnavailable
        once the peer has been gone for ``reconnect_timeout``."""
        if RESERVED in msg.meta:
            raise LocalProtocolError(f"meta key {RESERVED!r} is reserved by the resilient channel")
        while True:
            self._check_send()
            if self._book.can_send():
                break
            await self._changed.wait()
        if self._cfg.copy_on_send and msg.tensors:
            msg = replace(msg, tensors=tuple(t.detach().clone() for t in msg.tensors))
        self._book.push(msg)
        await self._flush()
        if self._error is not None:
            raise self._error

    async def receive(self) -> TensorMessage:
        """The next message, exactly once and in order; trio.EndOfChannel after the peer's ``aclose``."""
        while True:
            if self._closed:
                raise trio.ClosedResourceError("channel closed")
            msg = self._book.take()
            if msg is not None:
                self._wake()  # the acker acknowledges it
                return msg
            if self._error is not None:
                raise self._error
            if self._book.peer_closed:
                raise trio.EndOfChannel
            await self._changed.wait()

    async def aclose(self, *, timeout: float | None = None) -> None:
        """Say goodbye after every message already sent (waiting up to ``close_timeout``, or *timeout*,
        for a link), then close. Messages the peer has not received by then are lost, as with any channel."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        with trio.CancelScope(shield=True), trio.move_on_after(self._cfg.close_timeout if timeout is None else timeout):
            while self._error is None and not self._book.peer_closed and self._link is None:
                if self._peer_gone is not None and self._peer_gone(self._peer):
                    break   # no goodbye to a peer the swarm declared dead or gone: nobody would read it
                with trio.move_on_after(_GONE_POLL if self._peer_gone is not None else math.inf):
                    await self._changed.wait()
            async with self._write_lock:
                await self._flush_locked()
                link = self._link
                if link is not None and self._error is None and not self._book.peer_closed:
                    try:
                        await link.send(_control("bye"))
                    except (FusionError, trio.ClosedResourceError) as exc:
                        log.info("resilient channel %r to %s: no goodbye: %s", self.name, self._peer, exc)
        self._scope.cancel()
        self._wake()

    # ------------------------------------------------------------------------------------- internals
    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _check_send(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("channel closed")
        if self._error is not None:
            raise self._error
        if self._book.peer_closed:
            raise PeerUnavailable(self._peer, "channel closed by peer")

    def _fail(self, exc: FusionError) -> None:
        """The channel is over: everyone waiting gets *exc*."""
        if self._error is None and not self._closed:
            self._error = exc
            log.info("resilient channel %r to %s failed: %s", self.name, self._peer, exc)
        self._scope.cancel()
        self._wake()

    def _lose(self, link: Link, exc: PeerUnavailable) -> None:
        """*link* failed: stop using it (the supervisor reconnects)."""
        if self._link is link:
            self._link = None
            self._lost = exc
            if self._link_scope is not None:
                self._link_scope.cancel()
            self._wake()

    def _attach(self, link: Link, hello: Hello) -> None:
        """(accepting side) The dialer resumed on *link*: drop the current link, which it has given up."""
        if self._closed or self._error is not None:
            self._nursery.start_soon(_close_quietly, link)
            return
        if self._pending is not None:
            self._nursery.start_soon(_close_quietly, self._pending[0])
        self._pending = (link, hello)
        self.path = self.path or link.path
        if self._link is not None:
            self._lose(self._link, PeerUnavailable(self._peer, "replaced by a new link"))
        self._wake()

    async def _flush(self) -> None:
        async with self._write_lock:
            await self._flush_locked()

    async def _flush_locked(self) -> None:
        """Put every kept message the current link has not carried on it, in order."""
        while (link := self._link) is not None:
            item = self._book.unsent_after(self._link_sent)
            if item is None:
                return
            delivered = self._book.delivered
            wire = self._book.wire(*item)
            try:
                await link.send(wire)
            except _LINK_ERRORS as exc:
                self._link_error(link, exc)
                return  # the message stays kept
            if self._link is link:
                self._link_sent = max(self._link_sent, item[0])
                self._ack_sent = max(self._ack_sent, delivered)

    def _link_error(self, link: Link, exc: BaseException) -> None:
        """A link operation failed: a forged frame fails the channel, anything else loses the link (a
        no-op unless *link* is the current one)."""
        if isinstance(exc, RemoteProtocolError):
            self._fail(exc)
        elif isinstance(exc, PeerUnavailable) and getattr(link, "closed_by_peer", False) and self._link is link:
            # the peer closed this link cleanly, and what it sent before (a goodbye, acks) may still wait in
            # the link's inbox: the pump reads it and then ends the link, as a goodbye or as a lost link
            pass
        elif isinstance(exc, PeerUnavailable):
            self._lose(link, exc)
        else:
            self._lose(link, PeerUnavailable(self._peer, "link closed"))

    async def _pump(self, link: Link) -> None:
        """Drain the link at once (acks must never wait behind tensors the application has not taken)."""
        while True:
            try:
                msg = await link.receive()
                kind = self._book.on_link_message(msg)
            except trio.EndOfChannel:
                if not self._book.peer_closed:
                    self._lose(link, PeerUnavailable(self._peer, "link closed without a goodbye"))
                return
            except _LINK_ERRORS as exc:
                self._link_error(link, exc)
                return
            if kind != "duplicate":
                self._wake()

    async def _acker(self, link: Link) -> None:
        """Tell the peer what the application has taken (coalesced: one ack in flight at a time)."""
        while True:
            while self._book.delivered <= self._ack_sent:
                await self._changed.wait()
            delivered = self._book.delivered
            try:
                await link.send(_control("ack", d=delivered))
            except _LINK_ERRORS as exc:
                self._link_error(link, exc)
                if self._link is link:  # closed cleanly by the peer: the pump ends this link once drained
                    await trio.sleep_forever()
                return
            self._ack_sent = max(self._ack_sent, delivered)

    @staticmethod
    async def _until_end(fn: Callable[[Link], Awaitable[None]], link: Link,
                         scope: trio.CancelScope) -> None:
        try:
            await fn(link)
        finally:
            scope.cancel()  # the pump or the acker is done with this link: so is the other

    async def _serve_link(self, link: Link, resend_after: int) -> PeerUnavailable | None:
        """Use *link* until it is lost (returns why) or the session ends (returns None)."""
        self._link, self._link_sent, self._ack_sent, self._lost = link, resend_after, self._book.delivered, None
        if link.path != self.path:
            log.info("resilient channel %r to %s runs on the %s path", self.name, short_peer(self._peer), link.path)
        self.path = link.path
        self._established = True
        self.links += 1
        self._wake()
        try:
            with trio.CancelScope() as scope:
                self._link_scope = scope
                async with trio.open_nursery() as n:
                    n.start_soon(self._until_end, self._pump, link, scope)
                    n.start_soon(self._until_end, self._acker, link, scope)
                    n.start_soon(self._flush)  # retransmission, then whatever send() queued meanwhile
        finally:
            self._link_scope = None
            if self._link is link:
                self._link = None
            self._nursery.start_soon(_close_quietly, link)  # in the background: a CLOSE may wait for a hung socket
            self._wake()
        return self._lost

    async def _dial_once(self) -> tuple[Link, Resume]:
        assert self._dialer is not None
        link = await self._dialer.connect(self._peer)
        try:
            book = self._book
            await link.send(hello_message(Hello(name=self.name, session=self.session, fresh=not self._established,
                                                received=book.received, delivered=book.delivered,
                                                window=self._cfg.window)))
            with trio.move_on_after(self._cfg.handshake_timeout):
                answer = parse_welcome(await link.receive())
                if isinstance(answer, str):
                    raise _Rejected(answer)
                return link, answer
            raise PeerUnavailable(self._peer, "no answer to the resume handshake")
        except trio.EndOfChannel:
            self._nursery.start_soon(_close_quietly, link)
            raise PeerUnavailable(self._peer, "link closed during the handshake") from None
        except BaseException:
            self._nursery.start_soon(_close_quietly, link)
            raise

    async def _redial(self, deadline: float, cause: PeerUnavailable | None) -> tuple[Link, int]:
        """(dialing side) A new link, resumed, before *deadline*; PeerUnavailable otherwise."""
        delay = self._cfg.backoff_initial
        while True:
            with trio.move_on_at(deadline):
                try:
                    link, peer = await self._dial_once()
                except PeerUnavailable as exc:
                    cause = exc
                except _Rejected as exc:
                    raise PeerUnavailable(self._peer, f"the peer no longer knows this channel ({exc})") from None
                else:
                    try:
                        return link, self._book.on_resume(peer)
                    except RemoteProtocolError:
                        self._nursery.start_soon(_close_quietly, link)
                        raise
                self._check_gone()
                await trio.sleep_until(min(deadline, trio.current_time() + delay * random.uniform(0.5, 1.0)))
                delay = min(2 * delay, self._cfg.backoff_max)
            if trio.current_time() >= deadline:
                why = f": {cause.reason}" if cause is not None and cause.reason else ""
                raise PeerUnavailable(self._peer, f"not reachable within {self._cfg.reconnect_timeout:g} s{why}")

    async def _await_attach(self, deadline: float, cause: PeerUnavailable | None) -> tuple[Link, int]:
        """(accepting side) The next link the dialer resumes on, before *deadline*."""
        while True:
            if self._pending is not None:
                link, hello = self._pending
                self._pending = None
                try:
                    resend_after = self._book.on_resume(Resume(hello.received, hello.delivered, hello.window))
                    with trio.fail_after(max(0.0, deadline - trio.current_time())):
                        await link.send(welcome_message(self._book.received, self._book.delivered, self._cfg.window))
                    return link, resend_after
                except (PeerUnavailable, trio.TooSlowError, trio.ClosedResourceError) as exc:
                    cause = exc if isinstance(exc, PeerUnavailable) else cause
                    self._nursery.start_soon(_close_quietly, link)
                    continue
                except BaseException:
                    self._nursery.start_soon(_close_quietly, link)
                    raise
            if trio.current_time() >= deadline:
                why = f": {cause.reason}" if cause is not None and cause.reason else ""
                raise PeerUnavailable(self._peer, f"did not come back within {self._cfg.reconnect_timeout:g} s{why}")
            self._check_gone()
            with trio.move_on_at(min(deadline, trio.current_time() + _GONE_POLL if self._peer_gone else deadline)):
                await self._changed.wait()

    def _check_gone(self) -> None:
        if self._peer_gone is not None and self._peer_gone(self._peer):
            raise PeerUnavailable(self._peer, "the swarm declared the peer dead or gone")

    async def _run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The supervisor: serve a link, and on losing it get the next one within ``reconnect_timeout``.
        ``started()`` once the first link is up (the dialer's set-up errors are raised to the caller)."""
        started = False
        try:
            with self._scope:
                cause: PeerUnavailable | None = None
                while True:
                    deadline = trio.current_time() + self._cfg.reconnect_timeout
                    try:
                        if self._dialer is not None:
                            link, resend_after = await self._redial(deadline, cause)
                        else:
                            link, resend_after = await self._await_attach(deadline, cause)
                    except (PeerUnavailable, RemoteProtocolError) as exc:
                        if not started and self._dialer is not None:
                            raise  # to open_resilient_channel's caller
                        self._fail(exc)
                        return
                    if not started:
                        task_status.started()
                        started = True
                    cause = await self._serve_link(link, resend_after)
                    if cause is None or self._closed or self._error is not None or self._book.peer_closed:
                        return
                    log.info("resilient channel %r to %s lost its link (%s); reconnecting", self.name, self._peer,
                             cause.reason)
        finally:
            if self._pending is not None:
                self._nursery.start_soon(_close_quietly, self._pending[0])
                self._pending = None
            if self._error is None and not self._closed and not self._book.peer_closed:
                self._error = PeerUnavailable(self._peer, "channel stopped")
            self._wake()
            if self._on_end is not None:
                self._on_end(self)


@asynccontextmanager
async def open_resilient_channel(dialer: Dialer, peer: str, *, name: str, config: ResilientConfig | None = None,
                                 peer_gone: Callable[[str], bool] | None = None) -> AsyncIterator[ResilientChannel]:
    """``async with open_resilient_channel(dp, peer, name="job/0->1") as ch:`` — dial *peer* (retrying
    for up to ``reconnect_timeout``), and keep the channel connected until the block ends (then
    ``aclose``). *dialer* (the DataPlane) must outlive the block. The peer takes the other end from its
    :class:`ResilientAcceptor`; *name* tells two channels between the same peers apart. *peer_gone*
    (e.g. "the membership view marks it dead or left") ends the wait for a lost peer early."""
    cfg = config or ResilientConfig()
    if not 0 < len(name) <= MAX_NAME:
        raise ConfigError(f"a resilient channel name must have 1 to {MAX_NAME} characters")
    async with trio.open_nursery() as nursery:
        ch = ResilientChannel(peer=peer, name=name, session=os.urandom(16).hex(), cfg=cfg, nursery=nursery,
                              dialer=dialer, peer_gone=peer_gone)
        await nursery.start(ch._run)
        try:
            yield ch
        finally:
            await ch.aclose()


class ResilientAcceptor:
    """The listening side: routes incoming links to sessions (create with :func:`open_resilient_acceptor`).

    New sessions appear on :attr:`incoming`; a link that resumes a known session is attached to it.
    Sessions are keyed by ``(authenticated remote peer, channel name)``: a peer cannot resume another
    peer's session, and a new session under a known key (the dialer restarted) ends the old one.
    """

    def __init__(self, cfg: ResilientConfig, nursery: trio.Nursery,
                 peer_gone: Callable[[str], bool] | None = None) -> None:
        self._cfg = cfg
        self._peer_gone = peer_gone
        self._nursery = nursery
        self._sessions: dict[tuple[str, str], ResilientChannel] = {}
        self._incoming_send, self.incoming = trio.open_memory_channel[ResilientChannel](cfg.incoming_buffer)
        self._closed = False

    async def serve(self, incoming: trio.MemoryReceiveChannel[Link], *,
                    task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Take every link from *incoming* (``DataPlane.incoming``: all its channels must be resilient)
        until it ends; run it again with a restarted data plane's ``incoming``."""
        task_status.started()
        async for link in incoming:
            if self._closed:
                await _close_quietly(link)
            else:
                self._nursery.start_soon(self.attach, link)

    async def attach(self, link: Link, first: TensorMessage | None = None) -> None:
        """Read the hello on one incoming link (within ``handshake_timeout``) and route it; *first* is the
        link's first message when the caller has already read it (to route mixed links: a resilient
        hello has kind ``"_rc"``). A bad or late hello closes the link; it never raises."""
        peer = link.remote_peer
        try:
            with trio.fail_after(self._cfg.handshake_timeout):
                hello = parse_hello(first if first is not None else await link.receive())
        except (FusionError, trio.TooSlowError, trio.EndOfChannel, trio.ClosedResourceError) as exc:
            log.info("no resilient handshake from %s: %r", peer, exc)
            await _close_quietly(link)
            return
        key = (peer, hello.name)
        ch = self._sessions.get(key)
        if ch is not None and ch.session != hello.session:
            if not hello.fresh:  # an older session, already replaced: it must not displace the current one
                await self._reject(link, "unknown session")
                return
            ch._fail(PeerUnavailable(peer, "the peer opened a new session under this name (it restarted)"))
            self._sessions.pop(key, None)
            ch = None
        if ch is None:
            why = ("unknown session" if not hello.fresh else "acceptor closed" if self._closed
                   else "too many sessions" if len(self._sessions) >= self._cfg.max_sessions else "")
            if why:
                await self._reject(link, why)
                return
            ch = ResilientChannel(peer=peer, name=hello.name, session=hello.session, cfg=self._cfg,
                                  nursery=self._nursery, dialer=None, on_end=self._ended, peer_gone=self._peer_gone)
            try:
                self._incoming_send.send_nowait(ch)
            except trio.WouldBlock:
                await self._reject(link, "the application is not accepting channels")
                return
            self._sessions[key] = ch
            self._nursery.start_soon(ch._run)
        ch._attach(link, hello)

    async def _reject(self, link: Link, why: str) -> None:
        log.info("rejecting a resilient channel from %s: %s", link.remote_peer, why)
        with trio.move_on_after(self._cfg.handshake_timeout):
            with suppress(FusionError, trio.ClosedResourceError):
                await link.send(_control("reject", why=why))
        await _close_quietly(link)

    def _ended(self, ch: ResilientChannel) -> None:
        key = (ch.remote_peer, ch.name)
        if self._sessions.get(key) is ch:
            del self._sessions[key]

    async def aclose(self) -> None:
        """Close every session (goodbye to each peer) and end :attr:`incoming`."""
        self._closed = True
        self._incoming_send.close()
        async with trio.open_nursery() as n:
            for ch in list(self._sessions.values()):
                n.start_soon(ch.aclose)


@asynccontextmanager
async def open_resilient_acceptor(*, config: ResilientConfig | None = None,
                                  peer_gone: Callable[[str], bool] | None = None) -> AsyncIterator[ResilientAcceptor]:
    """``async with open_resilient_acceptor() as acc:`` then run ``acc.serve(dp.incoming)`` next to each
    data plane and take channels from ``acc.incoming``. Sessions outlive a data plane (so that a restarted
    one resumes them) but not this block."""
    cfg = config or ResilientConfig()
    async with trio.open_nursery() as nursery:
        acc = ResilientAcceptor(cfg, nursery, peer_gone)
        try:
            yield acc
        finally:
            with trio.CancelScope(shield=True):
                await acc.aclose()
            nursery.cancel_scope.cancel()


__all__ = ["Dialer", "ResilientAcceptor", "ResilientChannel", "ResilientConfig", "SequenceBook",
           "open_resilient_acceptor", "open_resilient_channel"]
