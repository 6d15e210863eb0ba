"""A pubsub stream whose negotiation timed out is opened again (py-libp2p 0.8.1, issue 40).

py-libp2p registers a newly connected peer with pubsub by opening one outbound stream to it
(``Pubsub._handle_new_peer_with_retry``), and retries while the peer stays connected, but only on
``SwarmException``/``StreamClosed``. When the peer does not answer the multistream negotiation within
the host's 10 s, ``BasicHost.new_stream`` raises ``StreamFailure``, which that loop takes for a
permanent failure: the peer stays connected and is never registered, so every gossip message to it is
queued ("identify pending") and never sent, for as long as the connection lives. A bootstrap that 20
starting processes kept busy for 10 s lost its pubsub link to the nodes that way (4 node processes on the
loaded 2-core machine, 2026-11-29: every node's gossip mesh stayed empty for the whole 2.5-minute run, no
member ever heard of another, and nothing measured), and as the joining node only dials the members it
hears of, nothing repaired it.

:func:`install` makes a timed-out (or otherwise failed) negotiation retryable: the same loop then tries
again after 0.5, 1, 2 ... 10 s while the peer stays connected. A peer that answers that it lacks the
protocol (``ProtocolNotSupportedError``) is still given up at once.
"""

from __future__ import annotations

from typing import Any

from libp2p.host.exceptions import StreamFailure
from libp2p.network.exceptions import SwarmException
from libp2p.protocol_muxer.exceptions import MultiselectClientError, ProtocolNotSupportedError
from libp2p.pubsub.pubsub import Pubsub


class NegotiationFailed(SwarmException):
    """A pubsub stream's protocol negotiation failed but the peer may answer later: retried."""


def retryable(exc: BaseException) -> bool:
    """Whether *exc*, raised by ``new_stream`` for a pubsub stream, is worth another try."""
    cause = exc.__cause__
    return (isinstance(exc, StreamFailure) and isinstance(cause, MultiselectClientError)
            and not isinstance(cause, ProtocolNotSupportedError))


_installed = False


def install() -> None:
    """Patch ``Pubsub._handle_new_peer`` (once per process) so that :func:`retryable` failures are retried."""
    global _installed
    if _installed:
        return
    _installed = True
    original = Pubsub._handle_new_peer

    async def handle_new_peer(self: Any, peer_id: Any) -> None:
        try:
            await original(self, peer_id)
        except StreamFailure as exc:
            if retryable(exc):
                raise NegotiationFailed(str(exc)) from exc
            raise

    setattr(Pubsub, "_handle_new_peer", handle_new_peer)  # noqa: B010
