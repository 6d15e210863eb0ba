"""AdaTopK at a boundary: ratio 1.0 bit-exact both ways, backward variants, error feedback sums."""

from __future__ import annotations

import pytest
import torch

from fusionp2p.compress import ErrorFeedback, TopKCodec, TopKLink, boundary, decode, kept_mask
from fusionp2p.errors import ConfigError

torch.set_num_threads(1)


def _net(seed: int) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.nn.Linear(16, 32), torch.nn.Linear(32, 4), torch.randn(8, 16)


def _grads(cfg: TopKLink | None, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    a, b, x = _net(seed)
    h = a(x)
    if cfg is not None:
        h = boundary(h, cfg)
    loss = b(torch.relu(h)).pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in (*a.parameters(), *b.parameters())]  # type: ignore[union-attr]


def test_ratio_one_bitwise_identical_forward_and_backward() -> None:
    loss0, g0 = _grads(None)
    loss1, g1 = _grads(TopKLink(ratio=1.0))
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(u, v) for u, v in zip(g0, g1))


@pytest.mark.parametrize("per_row", [False, True])
def test_straight_through_gradient_is_topk_of_grad(per_row: bool) -> None:
    cfg = TopKLink(ratio=0.25, per_row=per_row, approx=False, backward="straight_through")
    x = torch.randn(8, 32, requires_grad=True, generator=torch.Generator().manual_seed(1))
    y = boundary(x, cfg)
    assert torch.equal(y, decode(*TopKCodec(ratio=0.25, per_row=per_row).encode(x)))
    g = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    y.backward(g)
    assert torch.equal(x.grad, decode(*TopKCodec(ratio=0.25, per_row=per_row).encode(g)))  # type: ignore[arg-type]


def test_masked_gradient_stays_inside_forward_mask() -> None:
    cfg = TopKLink(ratio=0.25, backward="masked", approx=False)
    x = torch.randn(64, requires_grad=True, generator=torch.Generator().manual_seed(3))
    y = boundary(x, cfg)
    y.backward(torch.ones(64))
    mask = y.detach() != 0
    assert x.grad is not None
    assert torch.all(x.grad[~mask] == 0)
    assert torch.all(x.grad[mask] == 1)
    payload, meta = cfg.encode_act(x.detach())
    assert torch.equal(kept_mask(payload, meta), mask)  # type: ignore[arg-type]
    assert kept_mask(*TopKLink(ratio=1.0).encode_act(x.detach())) is None


def test_bad_backward_rejected() -> None:
    with pytest.raises(ConfigError):
        TopKLink(ratio=0.1, backward="exact")  # type: ignore[arg-type]


def test_error_feedback_residuals_sum_correctly() -> None:
    ef = ErrorFeedback(TopKCodec(ratio=0.05))
    g = torch.Generator().manual_seed(7)
    total_in = torch.zeros(500, dtype=torch.float64)
    total_sent = torch.zeros(500, dtype=torch.float64)
    for _ in range(30):
        grad = torch.randn(500, generator=g)
        total_in += grad.double()
        total_sent += decode(*ef.encode("w", grad)).double()
    # everything not yet sent is exactly what the residual holds
    assert torch.allclose(total_sent + ef.residual["w"].double(), total_in, atol=1e-4)
    # and error feedback eventually transmits every coordinate
    assert ef.residual["w"].abs().max() < total_in.abs().max()
    ef.reset("w")
    assert "w" not in ef.residual
