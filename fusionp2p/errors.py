"""One exception tree that says whose fault it was (STYLE.md 7).

* ``ConfigError`` — the user asked for something impossible or malformed; it is also a
  ``ValueError`` and its message says what to do.
* ``LocalProtocolError`` — *we* tried to send something the protocol forbids (a bug or misuse here).
* ``RemoteProtocolError`` — a *peer* sent bytes that do not decode, do not verify, or break a limit.
  It never crashes a node: the offending message is dropped (and counted) or the stream closed.
* ``PeerUnavailable`` — a peer is dead, unreachable or timed out.
"""

from __future__ import annotations

import sys

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


class FusionError(Exception):
    """Base of every error fusionp2p raises on purpose."""


class ConfigError(FusionError, ValueError):
    """A user mistake: bad argument, bad file, impossible job. The message says what to do."""


class ProtocolError(FusionError):
    """Something broke the wire protocol."""


class LocalProtocolError(ProtocolError):
    """We were about to violate the protocol (e.g. an oversized frame): a bug on our side."""


class RemoteProtocolError(ProtocolError):
    """A peer sent malformed, oversized, unsigned or forged data."""


class IntegrityError(RemoteProtocolError):
    """Content whose hash or signature does not match what was promised."""


class PeerUnavailable(FusionError):
    """A peer died, left, or did not answer before the deadline."""

    def __init__(self, peer: str, reason: str = "") -> None:
        self.peer = peer
        self.reason = reason
        super().__init__(f"peer {peer} unavailable" + (f": {reason}" if reason else ""))


class PlanError(FusionError):
    """No valid plan exists for a job on the current members (e.g. the model fits no memory)."""


class JobError(FusionError):
    """A training job failed or was rejected; the message says why."""


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """The exceptions inside *exc*, with (nested) exception groups flattened, in order."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaf_errors(e)]
    return [exc]
