"""Content-addressed blobs (OP-DAGs, weights, dataset shards and manifests): store, serve, fetch.

Blobs are named by the lowercase hex sha256 of their bytes. A node that holds a blob serves it on
the ``CONTENT`` protocol and announces it with ``transport.provide(hash)``; a node that needs it
asks ``find_providers(hash)`` and fetches from them in turn, checking the size against its cap
*before* receiving and the hash *after*. Whatever a peer sends, the fetcher either gets the exact
bytes promised or raises (RemoteProtocolError for a broken exchange, IntegrityError for the wrong
bytes); it never buffers more than its cap. The store itself, its caps and what it evicts:
:mod:`fusionp2p.jobs.store`.

Wire (framed with :mod:`fusionp2p.wire.framing`, maps with :mod:`fusionp2p.wire.msg`)::

    client → server  frame(msgpack {"op": "get", "hash": <hex>, "max": <int>})
    server → client  frame(msgpack {"ok": true, "size": n})  then raw data frames of <= chunk bytes
                     totalling exactly n, then end of stream
                 or  frame(msgpack {"ok": false, "error": <str>})
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import BinaryIO, TypeVar

import trio

from fusionp2p.data.shards import is_sha256_hex
from fusionp2p.errors import ConfigError, IntegrityError, PeerUnavailable, RemoteProtocolError
from fusionp2p.jobs.store import ContentStore, sha256_hex
from fusionp2p.net.refusals import Refusals
from fusionp2p.net.transport import Stream, Transport
from fusionp2p.types import short_peer
from fusionp2p.wire.check import U63, as_bool, as_int, as_map, as_str
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.limits import DEFAULT_LIMITS, GiB, MiB
from fusionp2p.wire.msg import packb, unpackb
from fusionp2p.wire.protocols import CONTENT

log = logging.getLogger(__name__)


# Rounds over a blob's providers. Opening a stream fails now and then under load (py-libp2p: a
# multiselect handshake whose read fails), and a blob often has one provider (a stage file, its trainer):
# on benchmarks.wan a finished job failed at its download on one such stream. A provider that answered
# (refused, sent bad bytes), hung for fetch_timeout or could not be reached at all (no connection to it
# after the attempt: a dead node, which the DHT goes on naming for hours) is not asked again within the
# fetch; the rounds after the first look the providers up afresh (net/dht_providers.py).
FETCH_ROUNDS = 3
FETCH_BACKOFF = 0.5   # seconds before a round that asks a provider again, doubled for each next one

T = TypeVar("T")


class _Refused(PeerUnavailable):
    """A provider answered that it cannot serve the blob (a reply, not a failed stream)."""


class _Cut(PeerUnavailable):
    """A blob's stream ended before the bytes its provider announced: the stream failed (in benchmarks.churn a
    TCP connection reset under load ended one inside a frame, and the re-plan whose state fetch it was cost a
    whole second re-plan), so it is worth another round; a provider that cuts every stream is asked
    FETCH_ROUNDS times at most."""


class _Asked:
    """Whom one fetch asked and how it went (see FETCH_ROUNDS): who is not to be asked again, who may be in
    the next round (their stream failed on a live connection), and a line per failure for the error."""

    def __init__(self, me: str) -> None:
        self.skip = {me}
        self.again = False        # a provider's stream failed on a live connection: worth another round
        self.errors: list[str] = []

    def order(self, candidates: Iterable[str], connected: Iterable[str]) -> list[str]:
        """*candidates* not to skip, once each, those this node is connected to first (likely alive, no dial)."""
        todo = [p for p in dict.fromkeys(candidates) if p not in self.skip]
        live = set(connected)
        return [p for p in todo if p in live] + [p for p in todo if p not in live]

    def failed(self, peer: str, exc: Exception, *, reachable: bool) -> None:
        if isinstance(exc, PeerUnavailable) and not isinstance(exc, _Refused) and reachable:
            self.again = True
            why = "stream failed"
        else:
            self.skip.add(peer)
            why = ("unreachable" if isinstance(exc, PeerUnavailable) and not isinstance(exc, _Refused)
                   else "refused" if isinstance(exc, _Refused) else type(exc).__name__)
        self.errors.append(f"{short_peer(peer)}: {why}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ContentConfig:
    chunk_bytes: int = 1 * MiB          # data frame size on the wire
    max_blob_bytes: int = 4 * GiB       # the most this node serves or stores in one blob
    request_timeout: float = 30.0       # server: seconds to wait for a client's request
    fetch_timeout: float = 600.0        # client: seconds for one whole fetch from one peer

    def __post_init__(self) -> None:
        if not 1024 <= self.chunk_bytes <= DEFAULT_LIMITS.max_frame:
            raise ConfigError(f"chunk_bytes must lie in [1024, {DEFAULT_LIMITS.max_frame}]")
        if self.max_blob_bytes < 1 or self.request_timeout <= 0 or self.fetch_timeout <= 0:
            raise ConfigError("max_blob_bytes and timeouts must be positive")


def decode_request(frame: bytes) -> tuple[str, int]:
    """A CONTENT request: ``{"op": "get", "hash": sha256 hex, "max": the asker's cap}`` -> (hash, cap)."""
    w = "content request"
    m = as_map(unpackb(frame, max_size=DEFAULT_LIMITS.max_control_frame), w, required=("op", "hash", "max"), optional=())
    as_str(m["op"], f"{w} op", choices=("get",))
    h = as_str(m["hash"], f"{w} hash", max_len=64)
    if not is_sha256_hex(h):
        raise RemoteProtocolError(f"{w}: not a sha256 hash")
    return h, as_int(m["max"], f"{w} max", lo=0, hi=U63)


def decode_response_head(frame: bytes) -> tuple[int, str | None]:
    """The first frame of a CONTENT answer: (size, None) when the blob follows, else (0, the reason)."""
    w = "content response"
    m = as_map(unpackb(frame, max_size=DEFAULT_LIMITS.max_control_frame), w, required=("ok",), optional=("size", "error"))
    if not as_bool(m["ok"], f"{w} ok"):
        err = m.get("error")
        return 0, err[:200] if isinstance(err, str) else "refused"
    return as_int(m.get("size"), f"{w} size", lo=0, hi=U63), None


async def _read_frame(stream: Stream, dec: FrameDecoder, pending: list[bytes], *, cut: str = "") -> bytes | None:
    """Next frame, or None at a clean end of stream; RemoteProtocolError if cut inside a frame (``_Cut``
    naming the peer *cut* when given: a client reading a blob)."""
    while not pending:
        chunk = await stream.receive_some(64 * 1024)
        if not chunk:
            if cut and dec.pending:
                raise _Cut(cut, f"the stream ended inside a frame ({dec.pending} bytes pending)")
            dec.check_eof()
            return None
        pending.extend(dec.feed(chunk))
    return pending.pop(0)


class ContentService:
    """Serve the blobs of a :class:`ContentStore` and fetch missing ones from providers."""

    def __init__(self, transport: Transport, store: ContentStore, config: ContentConfig | None = None, *,
                 refusals: Refusals | None = None) -> None:
        self.transport = transport
        self.store = store
        self.config = config or ContentConfig()
        self.served = 0
        self.rejected = 0
        self.refusals = refusals if refusals is not None else Refusals()   # the node's table (SwarmNode.refusals)

    def install(self) -> None:
        """Register the CONTENT stream handler on the transport."""
        self.transport.set_stream_handler(CONTENT, self._handle)

    async def publish(self, data: bytes | bytearray | memoryview) -> str:
        """Store *data*, announce it on the DHT and return its hash."""
        h = self.store.put(data)
        await self.transport.provide(h)
        return h

    async def put_chunks(self, parts: Iterable[bytes | memoryview], size: int) -> str:
        """Store the blob that *parts* (*size* bytes) make up and return its hash: on a store on disk written
        in a worker thread as the parts come, never whole in memory (``ContentStore.write_chunks``). The
        parts must not change until this returns. Not announced (``publish`` and the caller do that)."""
        store = self.store
        if not store.on_disk:
            return store.put_chunks(parts, size)
        return store.adopt(await trio.to_thread.run_sync(store.write_chunks, parts, size))

    # -- server ------------------------------------------------------------------------------------

    async def _handle(self, stream: Stream) -> None:
        peer = stream.remote_peer
        try:
            if self.refusals.banned(peer, now=trio.current_time()):
                self.rejected += 1
                return   # closed unread
            await self._serve_one(stream)
        except RemoteProtocolError as exc:
            self.rejected += 1
            self.refusals.refuse(peer, "content/request", now=trio.current_time(), detail=str(exc))
        except PeerUnavailable as exc:
            self.rejected += 1
            log.info("content request from %s dropped: %s", peer, exc)
        finally:
            await stream.aclose()

    async def _serve_one(self, stream: Stream) -> None:
        dec = FrameDecoder(max_frame=DEFAULT_LIMITS.max_control_frame)
        req = None
        with trio.move_on_after(self.config.request_timeout):
            req = await _read_frame(stream, dec, [])
        if req is None:
            raise RemoteProtocolError("no request before the timeout or end of stream")
        h, cap = decode_request(req)
        if not self.store.has(h):
            await stream.send_all(encode_frame(packb({"ok": False, "error": "not found"}), max_frame=DEFAULT_LIMITS.max_control_frame))
            return
        size = self.store.size(h)
        if size > cap or size > self.config.max_blob_bytes:
            await stream.send_all(encode_frame(packb({"ok": False, "error": f"blob of {size} bytes exceeds the cap"}), max_frame=DEFAULT_LIMITS.max_control_frame))
            return
        step = self.config.chunk_bytes
        # read a chunk at a time from disk (a stage file is several times a stage's weights: reading it whole
        # would put that on the serving node's peak); the fetcher checks the hash of what it gets
        with contextlib.ExitStack() as held:
            try:
                f = held.enter_context(self.store.reader(h))
            except KeyError:   # gone from disk, or a publisher's view whose module changed since
                await stream.send_all(encode_frame(packb({"ok": False, "error": "not found"}), max_frame=DEFAULT_LIMITS.max_control_frame))
                return
            await stream.send_all(encode_frame(packb({"ok": True, "size": size}), max_frame=DEFAULT_LIMITS.max_control_frame))
            for _ in range(0, size, step):
                await stream.send_all(encode_frame(f.read(step), max_frame=step))
        await stream.send_eof()
        self.served += 1

    # -- client ------------------------------------------------------------------------------------

    async def fetch_from(self, peer: str, h: str, *, max_size: int) -> bytes:
        """Fetch blob *h* from *peer*, at most *max_size* bytes, verified. Does not store it.

        Raises PeerUnavailable (cannot reach / does not have it / the stream ended before the blob did),
        RemoteProtocolError (broken exchange, over the cap) or IntegrityError (wrong bytes).
        """
        if not is_sha256_hex(h):
            raise ConfigError(f"{h!r} is not a sha256 content hash")
        max_size = min(max_size, self.config.max_blob_bytes)
        with trio.fail_after(self.config.fetch_timeout):
            stream = await self.transport.open_stream(peer, CONTENT)
            try:
                return await self._fetch_on(stream, peer, h, max_size)
            finally:
                with trio.CancelScope(shield=True):
                    await stream.aclose()

    async def fetch_to_store(self, h: str, *, max_size: int, peers: list[str] | None = None,
                             holders: Sequence[str] = (), provide: bool = True) -> None:
        """Blob *h* into the store from *peers* (or the DHT's providers and *holders*) in turn, as :meth:`fetch`
        asks them, written to disk frame by frame as it comes (never whole in memory: a stage file a keeper holds
        for another node), and announced (unless not *provide*). On a store in memory, :meth:`fetch`. Raises as
        :meth:`fetch`."""
        store = self.store
        if store.has(h):
            return
        if not store.on_disk:
            await self.fetch(h, max_size=max_size, peers=peers, holders=holders, provide=provide)
            return
        cap = min(max_size, self.config.max_blob_bytes)

        async def one(peer: str) -> None:
            tmp = store.temp_path()
            try:
                with trio.fail_after(self.config.fetch_timeout), open(tmp, "wb") as f:  # noqa: ASYNC230 - frame-sized page-cache writes
                    stream = await self.transport.open_stream(peer, CONTENT)
                    try:
                        await self._fetch_on(stream, peer, h, cap, f)
                    finally:
                        with trio.CancelScope(shield=True):
                            await stream.aclose()
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            store.adopt((tmp, h))

        await self._ask(h, peers, holders, one)
        if provide:
            await self.transport.provide(h)

    async def _fetch_on(self, stream: Stream, peer: str, h: str, max_size: int, sink: BinaryIO | None = None) -> bytes:
        """The blob from *stream*, hashed as it comes; into *sink* when given (then b"" is returned)."""
        req = packb({"op": "get", "hash": h, "max": max_size})
        await stream.send_all(encode_frame(req, max_frame=DEFAULT_LIMITS.max_control_frame))
        await stream.send_eof()
        # Data frames are at most one chunk; allow the larger of our chunk and the control bound.
        dec = FrameDecoder(max_frame=max(self.config.chunk_bytes, DEFAULT_LIMITS.max_control_frame))
        pending: list[bytes] = []
        head = await _read_frame(stream, dec, pending)
        if head is None:
            raise RemoteProtocolError(f"{peer} closed the content stream without answering")
        size, err = decode_response_head(head)
        if err is not None:
            raise _Refused(peer, f"cannot serve {h[:16]}…: {err}"[:200])
        if size > max_size:
            raise RemoteProtocolError(f"{peer} announced {size} bytes for {h[:16]}…; the cap is {max_size}")
        buf = bytearray()
        digest = hashlib.sha256()
        got = 0
        while got < size:
            frame = await _read_frame(stream, dec, pending, cut=peer)
            if frame is None:
                raise _Cut(peer, f"the content stream ended after {got} of {size} bytes")
            if got + len(frame) > size:
                raise RemoteProtocolError(f"{peer} sent more than the {size} bytes it announced")
            digest.update(frame)
            got += len(frame)
            if sink is None:
                buf += frame
            else:
                sink.write(frame)
        if pending or await _read_frame(stream, dec, pending) is not None:
            raise RemoteProtocolError(f"{peer} sent data after the blob")
        if digest.hexdigest() != h:
            raise IntegrityError(f"{peer} served bytes that do not match {h[:16]}…")
        return bytes(buf)

    async def fetch(self, h: str, *, max_size: int, peers: list[str] | None = None, holders: Sequence[str] = (),
                    provide: bool = True) -> bytes:
        """The blob *h*: from the local store, else from *peers* (only them), or else from the DHT's providers
        and *holders* (nodes known to hold it, which the DHT may not name: a job's members hold its graph), in
        rounds (FETCH_ROUNDS): every candidate once a round, those this node is connected to first; a provider
        that answered, hung or could not be reached is not asked again, and each round after the first looks
        the providers up afresh. The caller bounds the whole with its deadline.

        A verified blob is stored and announced (this node becomes a provider), unless not *provide*: a DHT
        announcement takes seconds (up to the transport's DHT timeout), and a caller on a critical path (a
        re-plan's state fetch) announces in the background. Raises PeerUnavailable naming every provider asked
        and how it failed when none delivered it; a provider that sent wrong bytes is logged and skipped.
        """
        if self.store.has(h):
            return self.store.get(h)

        async def one(peer: str) -> bytes:
            return await self.fetch_from(peer, h, max_size=max_size)

        blob = await self._ask(h, peers, holders, one)
        self.store.put(blob)
        if provide:
            await self.transport.provide(h)
        return blob

    async def _ask(self, h: str, peers: list[str] | None, holders: Sequence[str],
                   one: Callable[[str], Awaitable[T]]) -> T:
        """``one(peer)`` for the candidates of *h* in rounds (see :meth:`fetch`) until one delivers."""
        asked = _Asked(self.transport.peer_id)
        delay = FETCH_BACKOFF
        for attempt in range(FETCH_ROUNDS):
            if attempt:
                if asked.again:
                    await trio.sleep(delay)   # a bounded backoff before asking a provider again (FETCH_ROUNDS)
                    delay *= 2
                elif peers is not None or attempt > 1:
                    break                     # nobody to ask again, and the fresh lookup (round 1) was done
            asked.again = False
            if peers is not None:
                candidates = list(peers)
            else:   # the first lookup may answer from this node's records; the next ones ask the network
                candidates = [*await self.transport.find_providers(h, fresh=attempt > 0), *holders]
            for peer in asked.order(candidates, self.transport.connected_peers()):
                try:
                    return await one(peer)
                except (PeerUnavailable, RemoteProtocolError, trio.TooSlowError) as exc:
                    level = logging.WARNING if isinstance(exc, IntegrityError) else logging.INFO
                    log.log(level, "fetch of %s… from %s failed: %s", h[:16], short_peer(peer), exc)
                    asked.failed(peer, exc, reachable=peer in self.transport.connected_peers())
        raise PeerUnavailable(f"providers of {h[:16]}…",
                              f"none of {len(asked.errors)} attempts delivered it ({'; '.join(asked.errors)})"
                              if asked.errors else "no provider found")


__all__ = ["FETCH_BACKOFF", "FETCH_ROUNDS", "ContentConfig", "ContentService", "ContentStore", "decode_request",
           "decode_response_head", "sha256_hex"]
