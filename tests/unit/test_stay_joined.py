"""A node stays reachable while its swarm forms (issue 40): a pubsub stream whose negotiation timed out is
opened again (``net/pubsub_retry.py``), and a dropped bootstrap connection is dialled again
(``swarm/rejoin.py``). Before either, one loaded bootstrap left nodes alone for the whole run."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from libp2p.host.exceptions import StreamFailure
from libp2p.network.exceptions import SwarmException
from libp2p.protocol_muxer.exceptions import MultiselectClientError, ProtocolNotSupportedError
from libp2p.pubsub.pubsub import Pubsub

from fusionp2p.net.memory import memory_network
from fusionp2p.net.pubsub_retry import install, retryable
from fusionp2p.swarm.rejoin import keep_joined


def _failure(cause: Exception) -> StreamFailure:
    try:
        raise StreamFailure("failed to open a stream") from cause
    except StreamFailure as exc:
        return exc


def test_only_negotiation_failures_are_retryable() -> None:
    assert retryable(_failure(MultiselectClientError("response timed out after 10s")))
    assert not retryable(_failure(ProtocolNotSupportedError("protocol not supported")))
    assert not retryable(StreamFailure("no cause"))


def _pubsub(cause: Exception, connected_for: int) -> tuple[Any, list[int]]:
    """A stand-in for py-libp2p's Pubsub whose host times out every stream negotiation; it stays connected
    for *connected_for* tries."""
    tries: list[int] = []

    class Host:
        async def new_stream(self, peer: Any, protocols: Any) -> Any:
            tries.append(1)
            raise _failure(cause)

    fake = SimpleNamespace(peers={}, host=Host(), protocols=[], is_peer_blacklisted=lambda peer: False,
                           _peer_is_connected=lambda peer: len(tries) < connected_for)
    fake._handle_new_peer = lambda peer: Pubsub._handle_new_peer(fake, peer)  # type: ignore[arg-type]
    return fake, tries


def test_a_timed_out_pubsub_negotiation_is_tried_again_while_connected() -> None:
    install()

    async def main() -> None:
        fake, tries = _pubsub(MultiselectClientError("response timed out after 10s"), connected_for=4)
        with pytest.raises(SwarmException):
            await Pubsub._handle_new_peer(fake, "peer")   # type: ignore[arg-type]
        tries.clear()
        with trio.fail_after(60):
            await Pubsub._handle_new_peer_with_retry(fake, "peer")   # type: ignore[arg-type]
        assert len(tries) == 4   # before: given up after the first
        refused, tries = _pubsub(ProtocolNotSupportedError("not supported"), connected_for=4)
        await Pubsub._handle_new_peer_with_retry(refused, "peer")   # type: ignore[arg-type]
        assert len(tries) == 1   # a peer without pubsub is not asked again

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_dropped_bootstrap_is_dialled_again_and_its_view_pulled() -> None:
    async def main() -> None:
        with trio.fail_after(600):
            async with memory_network() as net, trio.open_nursery() as nursery:
                node, boot = net.add_host(), net.add_host()
                addr = boot.listen_addrs()[0]
                await node.connect(addr)
                pulled = trio.Event()

                async def pull(peer: str) -> None:
                    assert peer == boot.peer_id
                    pulled.set()

                nursery.start_soon(lambda: keep_joined(node, {boot.peer_id: addr}, period=lambda: 1.0, pull=pull,
                                                       dial_timeout=5.0))
                await trio.sleep(5)   # connected: nothing to do
                assert not pulled.is_set()
                await node.hang_up(boot.peer_id)
                t0 = trio.current_time()
                await pulled.wait()
                assert boot.peer_id in node.connected_peers() and trio.current_time() - t0 <= 1.0
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_unreachable_bootstrap_is_redialled_with_backoff() -> None:
    async def main() -> None:
        async with memory_network() as net, trio.open_nursery() as nursery:
            node, boot = net.add_host(), net.add_host()
            addr = boot.listen_addrs()[0]
            net.kill(boot.peer_id)
            dials: list[float] = []
            connect = node.connect

            async def counted(a: str) -> str:
                dials.append(trio.current_time())
                return await connect(a)

            node.connect = counted   # type: ignore[method-assign,assignment]

            async def pull(peer: str) -> None:
                raise AssertionError("a dead bootstrap cannot be pulled")

            nursery.start_soon(lambda: keep_joined(node, {boot.peer_id: addr}, period=lambda: 1.0, pull=pull,
                                                   dial_timeout=5.0))
            await trio.sleep(200)
            nursery.cancel_scope.cancel()
        gaps = [b - a for a, b in itertools.pairwise(dials)]
        assert 10 <= len(dials) <= 20 and max(gaps) <= 17   # 2, 4, 8, then every 16 heartbeats

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
