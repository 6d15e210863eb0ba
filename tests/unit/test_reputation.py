"""Work receipts and the standing counted from them (jobs/reputation.py), and the admission they drive
(jobs/suspects.py): only receipts of trusted issuers count, so Sybils minting receipts for each other
gain nothing; a peer's bytes decode within bounds or raise RemoteProtocolError."""

from __future__ import annotations

import dataclasses

import pytest

from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.jobs import reputation
from fusionp2p.jobs.reputation import (
    MAX_KEPT,
    MAX_SHOWN,
    Admission,
    ReceiptBook,
    WorkReceipt,
    decode_receipt,
    standing,
)
from fusionp2p.jobs.suspects import Suspects
from fusionp2p.net.identity import Identity
from fusionp2p.train.config import TrainConfig
from fusionp2p.wire.msg import packb

PUB, OTHER = Identity.generate(), Identity.generate()
MEMBER = Identity.generate().peer_id


def _r(issuer: Identity, *, job: str = "j", member: str = MEMBER, work: int = 10, at: float = 1.0) -> WorkReceipt:
    r = WorkReceipt(job=job, member=member, issuer=issuer.peer_id, steps=5, work=work, at=at)
    return dataclasses.replace(r, signature=issuer.sign(r.body()))


def test_a_receipt_round_trips_and_a_changed_one_does_not_verify() -> None:
    r = _r(PUB)
    assert decode_receipt(r.encode()) == r and r.valid()
    assert not dataclasses.replace(r, work=11).valid()
    assert not dataclasses.replace(r, member=OTHER.peer_id).valid()
    assert not dataclasses.replace(r, issuer=OTHER.peer_id).valid()


@pytest.mark.parametrize("data", [
    b"", b"\x00" * 2000, packb([1, 2, 3]), packb(["j", "m", "i", -1, 10, 1.0, b""]),
    packb(["j", "m", "i", 1, 10, float("nan"), b""]), packb(["j", "m", "i", 1, 10, 1.0, b"x" * 65]), 7,
])
def test_malformed_receipts_raise_remote_protocol_error(data: object) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_receipt(data)


def test_only_receipts_of_trusted_issuers_count_once_per_job() -> None:
    mine = [_r(PUB, job="a"), _r(PUB, job="a"), _r(PUB, job="b", work=7)]
    assert standing(mine, MEMBER, {PUB.peer_id}) == 17                 # the duplicate of job a counted once
    assert standing(mine, OTHER.peer_id, {PUB.peer_id}) == 0           # about someone else
    forged = dataclasses.replace(_r(PUB, job="c"), work=10**6)         # a bigger figure under PUB's signature
    assert standing([forged], MEMBER, {PUB.peer_id}) == 0
    # Sybils: identities that publish jobs to each other and sign each other huge receipts
    sybils = [Identity.generate() for _ in range(5)]
    minted = [_r(s, job=f"s{k}", work=10**9) for k, s in enumerate(sybils)]
    assert standing(minted, MEMBER, {PUB.peer_id}) == 0
    assert standing([*minted, *mine], MEMBER, {PUB.peer_id, OTHER.peer_id}) == 17
    assert standing(minted[:1], MEMBER, {sybils[0].peer_id}) == 10**9  # a publisher that trusts a Sybil takes its word


def test_a_book_keeps_its_own_receipts_the_most_work_first_within_bounds() -> None:
    book = ReceiptBook(MEMBER)
    assert not book.add(_r(PUB, member=OTHER.peer_id))                  # not about this node
    assert not book.add(dataclasses.replace(_r(PUB), work=99))         # signature does not hold
    for k in range(MAX_KEPT + 10):
        book.add(_r(PUB, job=f"j{k}", work=k))
    shown = [decode_receipt(b) for b in book.shown()]
    assert len(shown) == MAX_SHOWN and [r.work for r in shown] == list(range(MAX_KEPT + 9, MAX_KEPT + 9 - MAX_SHOWN, -1))
    assert len(book._kept) == MAX_KEPT and min(r.work for r in book._kept.values()) == 10


def test_suspects_admit_by_standing_shown_or_vouched() -> None:
    s = Suspects(admission=Admission(min_work=20, trusted=frozenset({PUB.peer_id})))
    assert not s.admits("x") and s.eligible("x")          # may be asked, not admitted before it shows its work
    assert not s.proven("x", 19) and not s.admits("x")
    assert s.proven("x", 20) and s.admits("x")
    assert s.starting(["y", "z"]) == [] and s.admits("y")  # the members of a snapshot this node starts
    s.excluded.add("x")
    assert not s.admits("x") and not s.eligible("x")
    free = Suspects()
    assert free.admits("anyone")
    listed = Suspects(["a"], Admission(min_work=5, trusted=frozenset({PUB.peer_id})))
    assert listed.starting(["a", "b"]) == ["b"] and not listed.admits("b")   # nothing vouched for when refused


def test_the_config_takes_min_work_and_trusted_issuers() -> None:
    cfg = TrainConfig(steps=2, min_work=100, trust_issuers=(OTHER.peer_id,))
    back = TrainConfig.from_wire(cfg.to_wire())
    assert (back.min_work, back.trust_issuers) == (100, (OTHER.peer_id,))
    assert "min_work" not in TrainConfig(steps=2).to_wire() and "trust_issuers" not in TrainConfig(steps=2).to_wire()
    with pytest.raises(ConfigError, match="min_work"):
        TrainConfig(steps=2, min_work=-1)
    with pytest.raises(ConfigError, match="trust_issuers"):
        TrainConfig(steps=2, trust_issuers=("a", "a"))
    assert reputation.Admission(min_work=0).required is False
