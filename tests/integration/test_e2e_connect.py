"""``Swarm.connect`` errors: a malformed address and an unreachable bootstrap fail fast and clearly."""

from __future__ import annotations

import time

import pytest

from fusionp2p.errors import ConfigError, PeerUnavailable
from fusionp2p.net.identity import Identity
from fusionp2p.sdk import Swarm


def test_malformed_bootstrap_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        Swarm.connect(["/ip4/127.0.0.1/tcp/4001"])     # no /p2p/<peer id>
    with pytest.raises(ValueError, match="bootstrap"):
        Swarm.connect([])


def test_unreachable_bootstrap_raises_peer_unavailable() -> None:
    peer = Identity.generate().peer_id
    t0 = time.monotonic()
    with pytest.raises(PeerUnavailable):
        Swarm.connect([f"/ip4/127.0.0.1/tcp/1/p2p/{peer}"], listen="/ip4/127.0.0.1/tcp/0")
    assert time.monotonic() - t0 < 30
