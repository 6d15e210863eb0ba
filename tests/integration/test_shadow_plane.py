"""A shadow copy's bytes over the encrypted data plane (fusionp2p/jobs/shadow_plane.py, issue 37): the
holder pushes a stage file from its content store, the keeper writes it to its own store as it comes and
adopts it only when every byte matches the announced hash; a holder that sends other bytes, more bytes, or
messages out of shape is refused with RemoteProtocolError and leaves nothing in the store. Two hosts of
the in-memory network with real data planes (AES-GCM over loopback TCP) in one trio.run."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from fusionp2p.errors import IntegrityError, RemoteProtocolError
from fusionp2p.jobs import shadow_plane
from fusionp2p.jobs.host import NodeJobConfig
from fusionp2p.jobs.store import ContentStore
from fusionp2p.net.bulk import DataPlane, open_data_plane
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.memory import memory_network
from fusionp2p.net.resilient import ResilientAcceptor, open_resilient_acceptor, open_resilient_channel

JOB = "j" * 16
NAME = shadow_plane.link_name(0, 1, 7)


@dataclass
class _Content:
    store: ContentStore


@dataclass
class _Svc:
    """What send_copy / receive_copy use of a node's job service (``JobHost``)."""

    data_plane: DataPlane
    content: _Content
    acc: ResilientAcceptor
    config: NodeJobConfig = field(default_factory=NodeJobConfig)

    def peer_gone(self, peer: str) -> bool:
        return False

    async def claim(self, job: str, name: str, peer: str, *, alive: Any) -> Any:
        ch = await self.acc.incoming.receive()
        assert (ch.name, ch.remote_peer) == (f"{job}/{name}", peer)
        return ch


def _pair(tmp_path: Path, body: Callable[[_Svc, _Svc, str, str], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with memory_network() as net:
                ta, tb = net.add_host(), net.add_host()
                async with open_resilient_acceptor() as acc, open_data_plane(ta) as da, \
                        open_data_plane(tb) as db, trio.open_nursery() as n:
                    await n.start(acc.serve, db.incoming)
                    holder = _Svc(da, _Content(ContentStore(tmp_path / "a")), acc)
                    keeper = _Svc(db, _Content(ContentStore(tmp_path / "b")), acc)
                    await body(holder, keeper, ta.peer_id, tb.peer_id)
                    n.cancel_scope.cancel()

    trio.run(main)


def test_a_copy_travels_whole_and_checked(tmp_path: Path) -> None:
    blob = os.urandom(3 * shadow_plane.CHUNK + 12345)   # three full chunks and a short one

    async def body(holder: _Svc, keeper: _Svc, a: str, b: str) -> None:
        h = holder.content.store.put(blob)
        sent = 0
        async with trio.open_nursery() as n:
            async def push() -> None:
                nonlocal sent
                sent = await shadow_plane.send_copy(holder, JOB, b, NAME, h)   # type: ignore[arg-type]
            n.start_soon(push)
            await shadow_plane.receive_copy(keeper, JOB, a, NAME, h, len(blob), alive=lambda p: True)  # type: ignore[arg-type]
        assert sent == len(blob)
        assert keeper.content.store.get(h) == blob
        assert not list((tmp_path / "b").glob("*.tmp"))

    _pair(tmp_path, body)


def _chunk(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@pytest.mark.parametrize("attack", ["other-bytes", "more-bytes", "wrong-kind", "float-tensor", "short-chunk"])
def test_a_holder_that_sends_other_bytes_is_refused_and_nothing_is_kept(tmp_path: Path, attack: str) -> None:
    good = os.urandom(shadow_plane.CHUNK + 100)
    h = hashlib.sha256(good).hexdigest()
    C = shadow_plane.CHUNK
    msgs = {
        "other-bytes": [(0, _chunk(good[:C])), (1, _chunk(b"x" * 100))],
        "more-bytes": [(0, _chunk(good[:C])), (1, _chunk(good[C:] + b"!"))],
        "wrong-kind": [(0, _chunk(good[:C]))],
        "float-tensor": [(0, torch.zeros(C // 4))],
        "short-chunk": [(0, _chunk(good[:100])), (1, _chunk(good[100:]))],
    }[attack]

    async def body(holder: _Svc, keeper: _Svc, a: str, b: str) -> None:
        async def lie() -> None:
            async with open_resilient_channel(holder.data_plane, b, name=f"{JOB}/{NAME}") as ch:
                for i, t in msgs:
                    kind = "act" if attack == "wrong-kind" else shadow_plane.KIND
                    await ch.send(TensorMessage(job=JOB, kind=kind, step=i, tensors=(t,)))
                await trio.sleep_forever()   # until the keeper refused (the test cancels)

        async with trio.open_nursery() as n:
            n.start_soon(lie)
            with pytest.raises(RemoteProtocolError) as got:
                await shadow_plane.receive_copy(keeper, JOB, a, NAME, h, len(good), alive=lambda p: True)  # type: ignore[arg-type]
            n.cancel_scope.cancel()
        assert isinstance(got.value, IntegrityError) == (attack == "other-bytes")
        assert not keeper.content.store.has(h)
        assert not list((tmp_path / "b").glob("*.tmp"))

    _pair(tmp_path, body)


@pytest.mark.parametrize("req", [{"link": 5, "size": 3}, {"link": "x" * 129, "size": 3}, {"link": "e0/s", "size": 0},
                                 {"link": "e0/s", "size": True}, {"link": "e0/s"}, {"link": "", "size": 3},
                                 {"link": "e0/s", "size": 2**63}])
def test_a_keep_requests_link_is_checked(req: dict[str, Any]) -> None:
    from fusionp2p.jobs.node import _keep_link

    assert _keep_link({}) == {}
    assert _keep_link({"link": "e0/shadow1@7", "size": 12}) == {"link": "e0/shadow1@7", "size": 12}
    with pytest.raises(RemoteProtocolError):
        _keep_link(req)


def test_a_push_cut_at_the_epochs_end_never_ends_the_epoch(tmp_path: Path) -> None:
    """The lane's nursery is cancelled while a copy is pushed (the keeper never takes it): only the
    cancellation leaves the nursery, never the channel's error ("channel stopped" ended a job's epoch)."""
    from fusionp2p.jobs.shadow import ShadowConfig, Shadows

    async def body(holder: _Svc, keeper: _Svc, a: str, b: str) -> None:
        h = holder.content.store.put(os.urandom(16 * shadow_plane.CHUNK))

        @dataclass
        class _Run:
            svc: _Svc
            job_id: str = JOB

        shadows = Shadows(_Run(holder), ShadowConfig())   # type: ignore[arg-type]
        async with trio.open_nursery() as lane:
            lane.start_soon(shadows._push, b, NAME, h)
            await keeper.acc.incoming.receive()   # the link is up; nobody reads it: the push waits on its window
            lane.cancel_scope.cancel()

    _pair(tmp_path, body)
