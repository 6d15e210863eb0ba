"""Did py-libp2p listen where it was asked to? (It logs a listener that failed to start and runs on without it.)

``Swarm.listen`` catches the ``OSError`` of a port in use, logs "Failed to start TCP listener … Address already
in use" and returns False, which ``BasicHost.run`` ignores: the host came up listening nowhere, and a node
would join the swarm with no address a peer could dial. A listener that started is kept in the network's
``listeners`` under the multiaddr it was asked for (``/tcp/0`` included), one that failed is not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import multiaddr

from fusionp2p.errors import ConfigError


def not_listening(listeners: Mapping[str, Any], asked: Sequence[multiaddr.Multiaddr]) -> ConfigError | None:
    """The one-line error for the addresses of *asked* that have no listener, or None when all have one."""
    missing = [str(a) for a in asked if str(a) not in listeners]
    if not missing:
        return None
    return ConfigError(f"cannot listen on {', '.join(missing)}: the port is in use (or the address is not this "
                       "machine's); choose another with --listen, or stop what holds it")
