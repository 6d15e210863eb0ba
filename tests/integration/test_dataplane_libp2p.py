"""The encrypted data plane keyed over the real libp2p adapter (Noise-authenticated ticket exchange)."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import torch
import trio

from fusionp2p.net.bulk import open_data_plane
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import open_libp2p_transport


def test_tensor_channel_over_libp2p_keyed_side_channel() -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with AsyncExitStack() as st:
                ta = await st.enter_async_context(open_libp2p_transport(Identity.generate()))
                tb = await st.enter_async_context(open_libp2p_transport(Identity.generate()))
                await ta.connect(tb.listen_addrs()[0])
                da = await st.enter_async_context(open_data_plane(ta, listen_host="127.0.0.1"))
                db = await st.enter_async_context(open_data_plane(tb, listen_host="127.0.0.1"))
                ch = await da.connect(tb.peer_id)
                peer_ch = await db.incoming.receive()
                # the accepting side knows the dialer by its Noise-authenticated libp2p identity
                assert peer_ch.remote_peer == ta.peer_id
                assert ch.remote_peer == tb.peer_id
                x = torch.randn(64, 128)
                await ch.send(TensorMessage(job="j", kind="act", stage=1, step=2, micro=3, name="h", tensors=(x,)))
                got = await peer_ch.receive()
                assert got.key == ("j", "act", 1, 2, 3, "h")
                assert torch.equal(got.tensors[0], x)
                await peer_ch.send(TensorMessage(job="j", kind="grad", stage=0, step=2, micro=3, name="h", tensors=(2 * x,)))
                back = await ch.receive()
                assert torch.equal(back.tensors[0], 2 * x)
                await ch.aclose()
                await peer_ch.aclose()

    trio.run(main)


def test_fallback_over_the_libp2p_stream_when_the_data_port_refuses() -> None:
    """A listener whose announced data-plane port refuses connections (a NAT, an unpublished container
    port): the dialer falls back to a Noise + yamux stream on the libp2p connection, and remembers it."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = int(sock.getsockname()[1])

    async def main() -> None:
        with trio.fail_after(30):
            async with AsyncExitStack() as st:
                ta = await st.enter_async_context(open_libp2p_transport(Identity.generate()))
                tb = await st.enter_async_context(open_libp2p_transport(Identity.generate()))
                await ta.connect(tb.listen_addrs()[0])
                da = await st.enter_async_context(open_data_plane(ta, listen_host="127.0.0.1"))
                db = await st.enter_async_context(open_data_plane(tb, listen_host="127.0.0.1", advertise_port=closed))
                assert db.announced == ("127.0.0.1", closed)
                ch = await da.connect(tb.peer_id)
                peer_ch = await db.incoming.receive()
                assert ch.path == peer_ch.path == "libp2p"
                assert peer_ch.remote_peer == ta.peer_id
                assert da.path_to(tb.peer_id) == "libp2p"   # the next connect goes straight to the fallback
                x = torch.randn(512, 1024)                  # 2 MiB: many Noise frames
                await ch.send(TensorMessage(job="j", kind="act", stage=1, step=2, micro=3, name="h", tensors=(x,)))
                got = await peer_ch.receive()
                assert torch.equal(got.tensors[0], x)
                await peer_ch.send(TensorMessage(job="j", kind="grad", name="h", tensors=(2 * x,)))
                assert torch.equal((await ch.receive()).tensors[0], 2 * x)
                await ch.aclose()
                with pytest.raises(trio.EndOfChannel):
                    await peer_ch.receive()
                await peer_ch.aclose()

    trio.run(main)
