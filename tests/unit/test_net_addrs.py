"""TCP multiaddrs of the data plane (net/addrs.py): a user's mistake is a one-line ConfigError; a peer's
announced addresses are dialled only a few at a time, in our scopes."""

from __future__ import annotations

import pytest
import trio

from fusionp2p.errors import ConfigError, PeerUnavailable
from fusionp2p.net.addrs import (
    GLOBAL,
    LOOPBACK,
    PRIVATE,
    addr_ip,
    dial_scopes,
    ip_scope,
    peer_dial_addrs,
    tcp_endpoint,
)
from fusionp2p.net.identity import Identity
from fusionp2p.net.memory import memory_network
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.testing.wait import poll_until
from fusionp2p.wire.records import NodeRecord, encode_signed


def test_good_addresses() -> None:
    assert tcp_endpoint("/ip4/0.0.0.0/tcp/4002", "--data-listen") == ("0.0.0.0", 4002)
    assert tcp_endpoint("/dns4/node.example.org/tcp/4002", "--data-announce", announce=True) == ("node.example.org", 4002)


@pytest.mark.parametrize("port", ["\u00b2", "\u0663", "9" * 5000, "65536", "x"])
def test_a_port_that_is_not_ascii_digits_is_a_config_error(port: str) -> None:
    """Regression: ``"²".isdigit()`` is true and ``int("²")`` raised ValueError (a traceback instead of
    the one-line message); ``"٣"`` was read as port 3."""
    with pytest.raises(ConfigError, match="--data-listen"):
        tcp_endpoint(f"/ip4/0.0.0.0/tcp/{port}", "--data-listen")


# -- which of a peer's announced addresses are dialled (issue 43) ------------------------------------------


@pytest.mark.parametrize(("ip", "scope"), [
    ("8.8.8.8", GLOBAL), ("2001:4860::8888", GLOBAL), ("10.1.2.3", PRIVATE), ("192.168.1.1", PRIVATE),
    ("172.16.0.1", PRIVATE), ("100.64.0.1", PRIVATE), ("fd00::1", PRIVATE), ("::ffff:10.0.0.1", PRIVATE),
    ("127.0.0.1", LOOPBACK), ("::1", LOOPBACK),
    ("169.254.169.254", None), ("fe80::1", None), ("0.0.0.0", None), ("::", None), ("224.0.0.1", None),
    ("255.255.255.255", None), ("192.0.2.1", None), ("198.18.0.1", None), ("victim.example", None)])
def test_ip_scopes(ip: str, scope: str | None) -> None:
    assert ip_scope(ip) == scope


@pytest.mark.parametrize(("addr", "ip"), [
    ("/ip4/1.2.3.4/tcp/4001", "1.2.3.4"), ("/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWA", "1.2.3.4"),
    ("/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWA/p2p-circuit", "1.2.3.4"), ("/ip6/::1/tcp/1", "::1"),
    ("/dns4/victim.example/tcp/80", None), ("/ip4/1.2.3.4/udp/4001/quic", None), ("/ip4/1.2.3.4/tcp/0", None),
    ("/ip4/1.2.3.4/tcp/4001/ws", None), ("/ip4/::1/tcp/1", None), ("/ip4/1.2.3.4/tcp/\u00b2", None),
    ("/ip4/1.2.3.4/tcp/4001/p2p", None), ("/ip4/1.2.3.4/tcp/1/p2p/A/p2p-circuit/p2p/B", None)])
def test_addr_ip(addr: str, ip: str | None) -> None:
    assert addr_ip(addr) == ip


def test_a_peers_claim_is_cut_to_a_few_addresses_in_our_scopes() -> None:
    hostile = ["/dns4/victim.example/tcp/80", "/ip4/169.254.169.254/tcp/80", "/ip4/10.0.0.1/tcp/22",
               "/ip4/127.0.0.1/tcp/22", *[f"/ip4/8.8.8.{i}/tcp/{4000 + i}" for i in range(12)]]
    public = dial_scopes([])
    assert public == {GLOBAL}
    assert peer_dial_addrs(hostile, public) == ["/ip4/8.8.8.0/tcp/4000", "/ip4/8.8.8.1/tcp/4001"]   # two IPs
    same_ip = [f"/ip4/8.8.8.8/tcp/{p}" for p in range(1, 17)]
    assert peer_dial_addrs(same_ip, public) == same_ip[:4]                                            # four addresses
    lan = dial_scopes(["192.168.1.20", "0.0.0.0"])
    assert lan == {GLOBAL, PRIVATE}
    assert peer_dial_addrs(hostile, lan, max_ips=4) == ["/ip4/10.0.0.1/tcp/22", "/ip4/8.8.8.0/tcp/4000",
                                                        "/ip4/8.8.8.1/tcp/4001", "/ip4/8.8.8.2/tcp/4002"]
    assert peer_dial_addrs(hostile, dial_scopes(["127.0.0.1"]), at={"127.0.0.1"}) == ["/ip4/127.0.0.1/tcp/22"]
    assert peer_dial_addrs(["/memory/x/p2p/x"], public) == ["/memory/x/p2p/x"]     # in-process: no socket


def test_a_gossiped_record_makes_a_node_dial_a_few_addresses_only() -> None:
    """Before: a stranger's signed record of 16 addresses (DNS, link-local, private included) was dialled
    address by address by every node that read it."""
    hostile = ("/dns4/victim.example/tcp/80", "/ip4/169.254.169.254/tcp/80", "/ip4/10.0.0.1/tcp/22",
               "/ip4/127.0.0.1/tcp/22", *[f"/ip4/8.8.8.{i}/tcp/{4000 + i}" for i in range(12)])

    async def main() -> None:
        with trio.fail_after(20):
            async with memory_network() as net, trio.open_nursery() as nursery:
                node = SwarmNode(net.add_host(), SwarmConfig(heartbeat=0.2, dead_timeout=5.0, probing=False), TEST_PROFILE)
                await nursery.start(node.run, [])
                dialled: list[str] = []

                async def connect(addr: str) -> str:
                    dialled.append(addr)
                    raise PeerUnavailable(addr, "refused (test)")

                node.transport.connect = connect  # type: ignore[method-assign]
                stranger = Identity.generate()
                while not stranger.peer_id < node.peer_id:     # the smaller id is dialled by the larger
                    stranger = Identity.generate()
                rec = NodeRecord(peer=stranger.peer_id, role="node", addrs=hostile, profile=TEST_PROFILE, started=0.0,
                                 seq=1)
                node._ingest(encode_signed(rec, stranger.sign), stranger.peer_id)
                await poll_until(lambda: dialled and stranger.peer_id not in node._dialed, timeout=5,
                                 interval=0.01)   # the dialer task: no event
                assert dialled == [f"/ip4/8.8.8.{i}/tcp/{4000 + i}/p2p/{stranger.peer_id}" for i in range(2)]
                nursery.cancel_scope.cancel()

    trio.run(main)
