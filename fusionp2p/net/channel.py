"""Tensor channels: the data plane's interface (activations, gradients, averaging parts).

A :class:`TensorChannel` carries :class:`TensorMessage` s between two authenticated peers, in order,
with a bounded in-flight window (``send`` blocks when the peer is behind). The key
``(job, kind, stage, step, micro, name)`` makes retransmission idempotent: a receiver that already
holds a key ignores a duplicate.

Implementations: the encrypted TCP side channel (``fusionp2p.net.bulk``), and the in-memory pair
(``fusionp2p.testing.channels``) used by unit and integration tests. Both pass
tests/unit/test_channel_conformance.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMessage:
    """One framed message of the data plane."""

    job: str
    kind: str            # "act" | "grad" | "avg" | ... (free-form, short)
    stage: int = 0
    step: int = 0
    micro: int = 0
    name: str = ""       # edge / part / parameter-shard name
    meta: dict[str, Any] = field(default_factory=dict)  # codec meta: msgpack-able scalars, lists, maps
    tensors: tuple[torch.Tensor, ...] = ()

    @property
    def key(self) -> tuple[str, str, int, int, int, str]:
        return (self.job, self.kind, self.stage, self.step, self.micro, self.name)


class TensorChannel(Protocol):
    """A bidirectional, ordered, flow-controlled channel of TensorMessages to one peer."""

    @property
    def remote_peer(self) -> str: ...

    async def send(self, msg: TensorMessage) -> None:
        """Send one message; blocks while the in-flight window is full. PeerUnavailable if the peer is gone."""
        ...

    async def receive(self) -> TensorMessage:
        """Next message; raises trio.EndOfChannel at a clean close, PeerUnavailable if the peer died,
        RemoteProtocolError (and closes) on a malformed or unauthenticated frame."""
        ...

    async def aclose(self) -> None: ...
