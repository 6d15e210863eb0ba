"""Why a dial failed, in words a user can act on.

py-libp2p reports every failed dial as ``SwarmDialAllFailedError: unable to connect to <id>, no
addresses established a successful connection (with exceptions)``; the cause that tells a typo'd peer
id from a stopped bootstrap sits several ``__cause__`` links and a ``MultiError`` deep. :func:`dial_cause`
walks that chain (pure: no I/O, no py-libp2p import) and names the likeliest cause with what to do.
:func:`is_final` says whether retrying can help: a port that answers with another peer id answers the
same way next time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from fusionp2p.errors import leaf_errors

# PeerIDMismatchesPubkey's message carries the id the port actually answered with
_ACTUAL_ID = re.compile(r"remote_peer_id_from_pubkey=(\w+)")

ID_DIFFERS = "the port answered but the peer id differs"
NOT_LIBP2P = "the port answered but does not speak libp2p"
REFUSED = "connection refused"


def _chain(exc: BaseException, depth: int = 0) -> Iterator[BaseException]:
    """*exc*, its causes and contexts, and the members of any group or MultiError on the way."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and depth < 8:
        seen.add(id(cur))
        yield cur
        members = getattr(cur, "errors", None) or getattr(cur, "exceptions", None)   # MultiError / ExceptionGroup
        if isinstance(members, (list, tuple)):
            for m in members:
                if isinstance(m, BaseException):
                    for leaf in leaf_errors(m):
                        yield from _chain(leaf, depth + 1)
        cur = cur.__cause__ or cur.__context__


def dial_cause(exc: BaseException, addr: str) -> str:
    """One clause naming why dialling *addr* (``/ip4/H/tcp/P/p2p/ID``) failed and what to do."""
    where = addr.split("/p2p/", 1)[0] or addr
    texts = []
    for e in _chain(exc):
        name, text = type(e).__name__, str(e)
        texts.append(text)
        if name == "PeerIDMismatchesPubkey" or "does not correspond to the received pubkey" in text:
            m = _ACTUAL_ID.search(text)
            actual = f", it is {m.group(1)}" if m else ""
            return f"{ID_DIFFERS} at {where}{actual}: copy the full /p2p/ address the bootstrap printed"
        if isinstance(e, ConnectionRefusedError):
            return f"{REFUSED} at {where}: nothing listens there; is the bootstrap running, and is the port right?"
        if name in ("MultiselectError", "MultiselectClientError", "ParseError") or "negotiate" in text:
            return f"{NOT_LIBP2P} at {where}: another service holds that port; check the port the bootstrap printed"
    joined = " ".join(texts)
    if "recently failed all addresses" in joined:
        return f"{where} failed moments ago and is not retried yet (py-libp2p's negative cache)"
    if "timed out" in joined.lower() or "TooSlow" in joined:
        return f"no answer from {where} in time: wrong host, or a firewall in the way?"
    return f"cannot connect to {where}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"


def is_final(cause: str) -> bool:
    """Whether a dial that failed for *cause* (from :func:`dial_cause`) fails the same way when retried."""
    return cause.startswith((ID_DIFFERS, NOT_LIBP2P))


__all__ = ["ID_DIFFERS", "NOT_LIBP2P", "REFUSED", "dial_cause", "is_final"]
