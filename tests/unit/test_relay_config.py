"""Circuit relay settings (net/relay.py, swarm/node.py): limits are validated, and only the libp2p
transport speaks the relay (the in-memory one does not, so the swarm skips relaying there)."""

from __future__ import annotations

import pytest
import trio

from fusionp2p.errors import ConfigError
from fusionp2p.net.holepunch import HolePunchLimits
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, Libp2pTransport
from fusionp2p.net.memory import MemoryNetwork
from fusionp2p.net.relay import RelayLimits, _Bucket, is_circuit
from fusionp2p.net.transport import Relaying
from fusionp2p.swarm.node import SwarmConfig


def test_limits_are_validated() -> None:
    assert RelayLimits().rate == 10e6
    for bad in ({"reservations": 0}, {"per_ip": 0}, {"circuits": 0}, {"circuits_per_peer": 0}, {"circuits_per_ip": 0},
                {"reservation_ttl": 0}, {"duration": 0}, {"circuit_bytes": 0}, {"rate": 0.0}, {"rate": float("nan")}):
        with pytest.raises(ConfigError):
            RelayLimits(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        SwarmConfig(relays=-1)
    assert Libp2pConfig(relay=RelayLimits(circuits=2)).relay is not None
    for bad_punch in ({"addrs": 0}, {"dials": 0}, {"window": 0.0}, {"window": float("nan")}, {"memory": 0.0}):
        with pytest.raises(ConfigError):
            HolePunchLimits(**bad_punch)  # type: ignore[arg-type]
    assert Libp2pConfig(hole_punch=True).hole_punch_limits == HolePunchLimits()


def test_circuit_addresses_are_recognised() -> None:
    assert is_circuit("/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWA/p2p-circuit/p2p/12D3KooWB")
    assert not is_circuit("/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWA")


def test_only_the_libp2p_transport_relays() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            net = MemoryNetwork(nursery)
            assert not isinstance(net.add_host(), Relaying)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert isinstance(Libp2pTransport(Identity.generate(), Libp2pConfig()), Relaying)


def test_rate_bucket_paces_bytes() -> None:
    async def main() -> None:
        bucket = _Bucket(1000.0)           # one second of burst, then 1000 B/s
        t0 = trio.current_time()
        for _ in range(4):
            await bucket.take(500)         # 2000 bytes: the first 1000 are burst, the rest take ~1 s
        assert 0.9 <= trio.current_time() - t0 <= 1.1

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
