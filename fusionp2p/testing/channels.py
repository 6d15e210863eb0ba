"""An in-memory :class:`~fusionp2p.net.channel.TensorChannel` pair for unit and integration tests.

Messages go through the real wire layout (``fusionp2p.wire.tensor_frame``) so that what a test sends
is exactly what a peer would decode; the window is a bounded memory channel, so ``send`` blocks when
``window`` messages wait unreceived. ``kill()`` simulates a dead peer (the other end gets
PeerUnavailable); ``aclose()`` is a clean close (the other end gets trio.EndOfChannel).
"""

from __future__ import annotations

import trio

from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.channel import TensorMessage
from fusionp2p.wire import tensor_frame as tf


class _Shared:
    def __init__(self) -> None:
        self.dead: set[str] = set()


class MemoryTensorChannel:
    """One end of :func:`memory_channel_pair`."""

    def __init__(self, local: str, remote: str, send: trio.MemorySendChannel[bytes],
                 recv: trio.MemoryReceiveChannel[bytes], shared: _Shared) -> None:
        self._local = local
        self._remote = remote
        self._send = send
        self._recv = recv
        self._shared = shared
        self._closed = False

    @property
    def remote_peer(self) -> str:
        return self._remote

    def _check(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("channel closed")
        if self._remote in self._shared.dead or self._local in self._shared.dead:
            raise PeerUnavailable(self._remote, "peer is dead")

    async def send(self, msg: TensorMessage) -> None:
        self._check()
        data = tf.message_bytes(msg)
        try:
            await self._send.send(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._check()
            raise PeerUnavailable(self._remote, "channel closed by peer") from None
        self._check()

    async def receive(self) -> TensorMessage:
        self._check()
        try:
            data = await self._recv.receive()
        except trio.EndOfChannel:
            self._check()
            raise
        except trio.ClosedResourceError:
            self._check()
            raise
        return TensorMessage(**tf.decode_message(bytearray(data)))

    def kill(self) -> None:
        """This end dies: both ends' operations raise PeerUnavailable from now on."""
        self._shared.dead.add(self._local)
        self._send.close()
        self._recv.close()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._send.aclose()
        await self._recv.aclose()


def memory_channel_pair(peer_a: str = "peer-a", peer_b: str = "peer-b", *, window: int = 8
                        ) -> tuple[MemoryTensorChannel, MemoryTensorChannel]:
    """Two connected channel ends: ``a`` (local peer_a, remote peer_b) and ``b`` (the reverse)."""
    if window < 1:
        raise ValueError("window must be >= 1")
    shared = _Shared()
    a_send, b_recv = trio.open_memory_channel[bytes](window)
    b_send, a_recv = trio.open_memory_channel[bytes](window)
    return (MemoryTensorChannel(peer_a, peer_b, a_send, a_recv, shared),
            MemoryTensorChannel(peer_b, peer_a, b_send, b_recv, shared))


def memory_mesh(n: int, *, window: int = 8, name: str = "p") -> list[list[MemoryTensorChannel]]:
    """Channels between every pair of *n* replicas (named ``p0``, ``p1``, ...): entry ``r`` holds replica
    ``r``'s ends, to the others in order, as a stage worker's ``peers``."""
    peers: list[list[MemoryTensorChannel]] = [[] for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            a, b = memory_channel_pair(f"{name}{i}", f"{name}{j}", window=window)
            peers[i].append(a)
            peers[j].append(b)
    return peers


__all__ = ["MemoryTensorChannel", "memory_channel_pair", "memory_mesh"]
