"""TCP endpoints written as multiaddrs (``--data-listen``, ``--data-announce``; docs/networking.md), and
which of a peer's announced addresses we dial (issue 43; docs/security.md, "Addresses").

The data plane listens on, and announces, plain TCP addresses; users write them the way they write the
libp2p ones (``/ip4/0.0.0.0/tcp/4002``), so the two sets of options follow one rule.

A peer's addresses are its own claim (a signed record proves who claims them, not that they are its):
dialled as announced, one gossiped record made every node that read it connect to 16 hosts of the
sender's choosing, DNS names and the cloud metadata address included. :func:`peer_dial_addrs` keeps
the few that may be dialled: TCP at an IP literal, at most ``limit`` addresses on ``max_ips`` IPs, in a
scope we are in ourselves (:func:`dial_scopes`: public unicast always; private ranges only for a node
that is on a private network itself, loopback only for one on loopback), never link-local, multicast,
unspecified, documentation or other reserved ranges.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Iterable

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


GLOBAL, PRIVATE, LOOPBACK = "global", "private", "loopback"
_PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in
                      ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"))


def ip_scope(host: str) -> str | None:
    """GLOBAL (public unicast), PRIVATE (RFC 1918, carrier-grade NAT, IPv6 ULA) or LOOPBACK; None for
    what is never dialled on a peer's word (not an IP, unspecified, multicast, link-local such as
    169.254.169.254, documentation, benchmarking and other reserved ranges)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip_scope(str(ip.ipv4_mapped))
    if ip.is_unspecified or ip.is_multicast or ip.is_link_local:
        return None
    if ip.is_loopback:
        return LOOPBACK
    if ip.is_global:
        return GLOBAL
    return PRIVATE if any(ip in net for net in _PRIVATE_NETS) else None


def dial_scopes(own: Iterable[str]) -> frozenset[str]:
    """The scopes a node at the IPs *own* (its listen addresses, the bootstraps it reached, the IP a
    bootstrap saw it at) dials peers in: always GLOBAL, plus PRIVATE and LOOPBACK where it is one."""
    return frozenset({GLOBAL} | {sc for ip in own if (sc := ip_scope(ip)) is not None})


def addr_ip(addr: str) -> str | None:
    """The IP of ``/ip4|ip6/IP/tcp/PORT`` (optionally ``/p2p/ID``, optionally then ``/p2p-circuit``: a relay's
    part), or None for anything else (DNS names, other transports, a bad port, trailing parts)."""
    parts = addr.split("/")
    if len(parts) < 5 or parts[0] or parts[1] not in _IP or parts[3] != "tcp" \
            or not (parts[4].isascii() and parts[4].isdigit() and len(parts[4]) <= 5) or not 0 < int(parts[4]) < 65536:
        return None
    rest = parts[5:]
    if rest and not (len(rest) in (2, 3) and rest[0] == "p2p" and rest[1] and rest[2:] in ([], ["p2p-circuit"])):
        return None
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return None
    return str(ip) if (ip.version == 4) == (parts[1] == "ip4") else None


DIAL_LIMIT = 4   # addresses of one peer's that we dial at most, for one dial


def peer_dial_addrs(addrs: Iterable[str], scopes: Collection[str], *, limit: int = DIAL_LIMIT, max_ips: int = 2,
                    at: Collection[str] | None = None) -> list[str]:
    """The addresses of a peer's that we dial, in its order: TCP at an IP in *scopes* (and in *at*, the
    IPs it may be reached at, if given), at most *limit* of them on at most *max_ips* IPs. In-process
    ``/memory/`` addresses (the in-memory transport) are kept: they reach no socket."""
    out: list[str] = []
    ips: set[str] = set()
    for addr in addrs:
        if len(out) >= limit:
            break
        if addr.startswith("/memory/"):
            out.append(addr)
            continue
        ip = addr_ip(addr)
        if ip is None or ip_scope(ip) not in scopes or (at is not None and ip not in at):
            continue
        if ip not in ips and len(ips) >= max_ips:
            continue
        ips.add(ip)
        out.append(addr)
    return out


__all__ = ["DIAL_LIMIT", "GLOBAL", "LOOPBACK", "PRIVATE", "addr_ip", "dial_scopes", "ip_scope", "peer_dial_addrs", "tcp_endpoint",
           "tcp_multiaddr"]
