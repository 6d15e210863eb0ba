"""TCP multiaddrs of the data plane (net/addrs.py): a user's mistake is a one-line ConfigError."""

from __future__ import annotations

import pytest

from fusionp2p.errors import ConfigError
from fusionp2p.net.addrs import tcp_endpoint


def test_good_addresses() -> None:
    assert tcp_endpoint("/ip4/0.0.0.0/tcp/4002", "--data-listen") == ("0.0.0.0", 4002)
    assert tcp_endpoint("/dns4/node.example.org/tcp/4002", "--data-announce", announce=True) == ("node.example.org", 4002)


@pytest.mark.parametrize("port", ["\u00b2", "\u0663", "9" * 5000, "65536", "x"])
def test_a_port_that_is_not_ascii_digits_is_a_config_error(port: str) -> None:
    """Regression: ``"²".isdigit()`` is true and ``int("²")`` raised ValueError (a traceback instead of
    the one-line message); ``"٣"`` was read as port 3."""
    with pytest.raises(ConfigError, match="--data-listen"):
        tcp_endpoint(f"/ip4/0.0.0.0/tcp/{port}", "--data-listen")
