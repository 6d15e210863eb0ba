"""dial_cause names the cause a user acts on from py-libp2p's nested dial errors (issue #44)."""

from __future__ import annotations

from fusionp2p.net.dial_errors import dial_cause, is_final

ADDR = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWSbwQgywwmoPLxhPLtDR812UAqTa6w6798Q6z9H8u1xWT"


class MultiError(Exception):   # py-libp2p's shape: the dial errors in .errors
    def __init__(self, errors: list[Exception]) -> None:
        super().__init__("Error 1: ...")
        self.errors = errors


class PeerIDMismatchesPubkey(Exception):
    pass


class ParseError(Exception):
    pass


def wrapped(inner: BaseException) -> Exception:
    """``SwarmDialAllFailedError from MultiError([SwarmException from ... from inner])``, as py-libp2p raises it."""
    mid = RuntimeError("failed to upgrade security")
    mid.__cause__ = inner
    outer = RuntimeError("unable to connect to X, no addresses established a successful connection (with exceptions)")
    outer.__cause__ = MultiError([mid])
    return outer


def test_wrong_peer_id_names_the_id_that_answered_and_is_final() -> None:
    inner = PeerIDMismatchesPubkey("peer id does not correspond to the received pubkey: remote_peer=X, "
                                   "remote_peer_id_from_pubkey=12D3KooWActual")
    cause = dial_cause(wrapped(inner), ADDR)
    assert cause == ("the port answered but the peer id differs at /ip4/127.0.0.1/tcp/4001, it is 12D3KooWActual: "
                     "copy the full /p2p/ address the bootstrap printed")
    assert is_final(cause)


def test_refused_port_is_not_final() -> None:
    group = MultiError([ConnectionRefusedError(111, "Connection refused")])
    cause = dial_cause(wrapped(group), ADDR)
    assert cause.startswith("connection refused at /ip4/127.0.0.1/tcp/4001: nothing listens there")
    assert not is_final(cause)


def test_another_protocol_on_the_port_is_final() -> None:
    cause = dial_cause(wrapped(ParseError("msg_bytes is not delimited")), ADDR)
    assert cause.startswith("the port answered but does not speak libp2p at /ip4/127.0.0.1/tcp/4001")
    assert is_final(cause)


def test_unknown_errors_keep_their_first_line() -> None:
    assert dial_cause(ValueError("odd\nsecond line"), ADDR) == "cannot connect to /ip4/127.0.0.1/tcp/4001: odd"
