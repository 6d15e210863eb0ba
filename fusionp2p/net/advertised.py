"""The addresses a libp2p host advertises (identify) when it listens on ``0.0.0.0`` or ``::`` with no
``--announce-addr``: its interfaces' addresses in place of the unspecified one (go-libp2p does the same).

py-libp2p advertises a wildcard listen address as it is, and ``0.0.0.0`` is dialled by nobody
(``net/addrs.peer_dial_addrs``). So a peer that reached such a host over a connection the host opened
knew no address to come back to once that connection closed. In issue 43's live hostile test the job's
publisher (the CLI listens on ``0.0.0.0``) reached the NAT'd members through the relay; when a member's
link to the relay dropped, the member could not fetch the job's weights from the publisher nor send it
its reports ("No known addresses"), though the publisher is public and the member can dial out.
"""

from __future__ import annotations

import ipaddress
import time

import multiaddr
from libp2p.utils.address_validation import expand_wildcard_address

REFRESH_S = 10.0   # the interface list is re-read this often (identify asks on every connection; ~1 ms a read)


class WildcardExpander:
    """An ``addrs_factory`` for py-libp2p's ``new_host``: every unspecified address replaced by the
    interfaces' addresses on its port (kept as is where no interface has one); the rest unchanged."""

    def __init__(self, refresh_s: float = REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self._cache: dict[str, tuple[float, list[multiaddr.Multiaddr]]] = {}

    def __call__(self, candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        out: list[multiaddr.Multiaddr] = []
        seen: set[str] = set()
        for addr in candidates:
            for a in self._expand(addr) if _unspecified(addr) else [addr]:
                if str(a) not in seen:
                    seen.add(str(a))
                    out.append(a)
        return out

    def _expand(self, addr: multiaddr.Multiaddr) -> list[multiaddr.Multiaddr]:
        key, now = str(addr), time.monotonic()
        hit = self._cache.get(key)
        if hit is None or now - hit[0] > self.refresh_s:
            hit = self._cache[key] = (now, expand_wildcard_address(addr) or [addr])
        return hit[1]


def _unspecified(addr: multiaddr.Multiaddr) -> bool:
    for proto in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(addr.value_for_protocol(proto)).is_unspecified
        except Exception:   # no such part (a circuit or memory address), or not an IP
            continue
    return False


__all__ = ["WildcardExpander"]
