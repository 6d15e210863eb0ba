"""TCP endpoints written as multiaddrs (``--data-listen``, ``--data-announce``; docs/networking.md).

The data plane listens on, and announces, plain TCP addresses; users write them the way they write the
libp2p ones (``/ip4/0.0.0.0/tcp/4002``), so the two sets of options follow one rule.
"""

from __future__ import annotations

import ipaddress

from fusionp2p.errors import ConfigError

_IP = ("ip4", "ip6")
_DNS = ("dns", "dns4", "dns6")


def tcp_endpoint(addr: str, flag: str, *, announce: bool = False) -> tuple[str, int]:
    """(host, port) of a TCP multiaddr such as ``/ip4/0.0.0.0/tcp/4002``. An announced address may also
    name a DNS host (``/dns4/node.example.org/tcp/4002``) and needs a real port; a listen address may use
    port 0 (any free port). A one-line ConfigError that shows an example otherwise."""
    example = "/ip4/PUBLIC_IP/tcp/4002" if announce else "/ip4/0.0.0.0/tcp/4002"
    parts = addr.split("/")
    kinds = _IP + _DNS if announce else _IP
    if len(parts) != 5 or parts[0] or parts[1] not in kinds or parts[3] != "tcp" \
            or not (parts[4].isascii() and parts[4].isdigit() and len(parts[4]) <= 5):   # not "²" (int() refuses it)
        raise ConfigError(f"{flag} {addr!r}: expected a TCP multiaddr such as {example}")
    host, port = parts[2], int(parts[4])
    if parts[1] in _IP:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(f"{flag} {addr!r}: {host!r} is not an IP address; e.g. {example}") from None
        if (ip.version == 4) != (parts[1] == "ip4"):
            raise ConfigError(f"{flag} {addr!r}: {host} is not an {parts[1]} address")
        if announce and ip.is_unspecified:
            raise ConfigError(f"{flag} {addr!r}: announce the address peers dial, not {host}; e.g. {example}")
    elif not host or len(host) > 253:
        raise ConfigError(f"{flag} {addr!r}: empty or overlong host name")
    if not 0 <= port < 65536 or (announce and port == 0):
        raise ConfigError(f"{flag} {addr!r}: the port must be between {1 if announce else 0} and 65535")
    return host, port


def tcp_multiaddr(host: str, port: int) -> str:
    """The multiaddr of an IP endpoint (``/ip4/H/tcp/P`` or ``/ip6/H/tcp/P``)."""
    return f"/{'ip6' if ':' in host else 'ip4'}/{host}/tcp/{port}"


__all__ = ["tcp_endpoint", "tcp_multiaddr"]
