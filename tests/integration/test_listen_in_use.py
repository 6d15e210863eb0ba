"""A host asked to listen on a port that is taken fails with one line (net/listening.py): py-libp2p logs "Failed
to start TCP listener … Address already in use" and comes up listening nowhere."""

from __future__ import annotations

import socket

import multiaddr
import pytest
import trio

from fusionp2p.errors import ConfigError
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport
from fusionp2p.net.listening import not_listening


def test_not_listening_names_only_the_addresses_without_a_listener() -> None:
    asked = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0"), multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/4001")]
    assert not_listening({str(a): object() for a in asked}, asked) is None
    assert not_listening({}, []) is None
    err = not_listening({"/ip4/127.0.0.1/tcp/0": object()}, asked)
    assert isinstance(err, ConfigError)
    assert "/tcp/4001" in str(err) and "/tcp/0" not in str(err) and "\n" not in str(err)


def test_a_port_in_use_is_a_config_error_and_the_same_port_free_listens() -> None:
    async def main() -> None:
        with socket.socket() as held:              # a real listener on the port, as another node would hold it
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            busy = f"/ip4/127.0.0.1/tcp/{port}"
            with trio.fail_after(30), pytest.raises(ConfigError) as err:
                async with open_libp2p_transport(Identity.generate(),
                                                 Libp2pConfig(listen=("/ip4/127.0.0.1/tcp/0", busy))):
                    pytest.fail(f"the host came up without listening on {busy}")
        assert busy in str(err.value) and "/tcp/0" not in str(err.value) and "\n" not in str(err.value)
        # the port freed, the same address listens (the check compares what was asked, not a fixed form)
        with trio.fail_after(30):
            async with open_libp2p_transport(Identity.generate(), Libp2pConfig(listen=(busy,))) as t:
                assert any(f"/tcp/{port}/" in a for a in t.listen_addrs())

    trio.run(main)
