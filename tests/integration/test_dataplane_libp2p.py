"""The encrypted data plane keyed over the real libp2p adapter (Noise-authenticated ticket exchange)."""

from __future__ import annotations

from contextlib import AsyncExitStack

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
