"""The in-band re-deal (train/deal.py) moves on a real speed difference, not on the noise of the figures."""

from __future__ import annotations

from fusionp2p.train.deal import REDEAL_PERIOD, Deal

M = 4
# the measured ms per micro-batch the two equal replicas of benchmarks.churn's full-rate run carried in the
# rounds its last epoch re-dealt at (18:09-18:10 UTC, 2026-11-29): six re-deals in 140 steps at a 5% bar
MEASURED = [(0.147, 0.128), (0.150, 0.163), (0.175, 0.160), (0.160, 0.159), (0.159, 0.141)]


def _deal(micro: tuple[float, float]) -> Deal:
    return Deal(tuple(int(m * REDEAL_PERIOD) for m in micro), REDEAL_PERIOD, replica=0, replicas=2, micro_batches=M)


def test_equal_replicas_noise_moves_the_deal_once_and_then_not_at_all() -> None:
    """Issue 41: from the plan's 4.5/3.5 the first round moves the deal near even; the noise of the next
    four rounds (up to 13% apart) keeps it, where the 5% bar swung it on every one of them."""
    deal = _deal((4.5, 3.5))
    shares = []
    for v in MEASURED:
        deal.redeal([("r0", v[0]), ("r1", v[1])])
        shares.append(tuple(c / deal.period for c in deal.micro))
    assert deal.redeals == 1
    assert shares == [(3.75, 4.25)] * len(MEASURED)


def test_a_replica_a_quarter_slower_still_moves_an_even_deal() -> None:
    deal = _deal((4.0, 4.0))
    assert deal.redeal([("r0", 0.130), ("r1", 0.100)]) is not None
    assert deal.micro[0] < deal.micro[1] and deal.redeals == 1
    deal = _deal((4.0, 4.0))
    assert deal.redeal([("r0", 0.108), ("r1", 0.100)]) is None   # 8% apart: noise on one host
