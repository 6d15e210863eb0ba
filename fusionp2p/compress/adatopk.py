"""AdaTopK at a pipeline boundary: autograd semantics and error feedback (ALGORITHMS.md §1.6).

* :class:`TopKLink` — the per-link settings: keep ratio (from the plan or :class:`~fusionp2p.compress.policy.RatioEstimator`),
  per-row or global, fast selection, value dtype, and the backward variant:
  ``"straight_through"`` (the receiver's gradient is top-k'd with the same ratio; the forward mask is
  ignored) or ``"masked"`` (the gradient is also multiplied by the forward keep-mask, the exact
  gradient of the masking function).
* :func:`boundary` — a ``torch.autograd.Function`` that applies both directions in one process (for
  tests, the convergence check and single-host pipelines). Over the network the same maths is done by
  :meth:`TopKLink.encode_act` on the sender, :meth:`TopKLink.encode_grad` on the receiver.
* :class:`ErrorFeedback` — ``e ← e + g; send TopK(e); e ← e − TopK(e)`` for parameter-sized tensors
  (data-parallel gradients), not for activations (residuals of different samples mean nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fusionp2p.compress.codec import Meta, Payload, TopKCodec, decode, kept_mask
from fusionp2p.errors import ConfigError

Backward = Literal["straight_through", "masked"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TopKLink:
    """AdaTopK settings of one link (not the user's ``fusionp2p.AdaTopK`` config, which names the
    smallest ratio; the plan picks each link's ratio from it). ``ratio == 1.0`` is bit-exact identity in both directions."""

    ratio: float = 1.0
    per_row: bool = False
    approx: bool = True
    tolerance: float = 0.05
    value_dtype: Literal["f16", "bf16"] | None = None
    # masked: on GPT-2 at ρ=0.1 it ends within ~1.5% of uncompressed loss, straight-through ~+33%
    # (tests/integration/test_compress_convergence.py)
    backward: Backward = "masked"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.backward not in ("straight_through", "masked"):
            raise ConfigError("TopKLink.backward must be 'straight_through' or 'masked'")
        self.codec()  # validates ratio, tolerance and value dtype

    def codec(self) -> TopKCodec:
        return TopKCodec(ratio=self.ratio, per_row=self.per_row, approx=self.approx, tolerance=self.tolerance,
                         value_dtype=self.value_dtype, seed=self.seed)

    def encode_act(self, x: torch.Tensor) -> tuple[Payload, Meta]:
        """Sender side of the forward: compress an activation."""
        return self.codec().encode(x)

    def encode_grad(self, grad: torch.Tensor, fwd_payload: Sequence[torch.Tensor] = (),
                    fwd_meta: dict[str, Any] | None = None) -> tuple[Payload, Meta]:
        """Receiver side of the backward: compress ``∂L/∂x̂`` with the same ratio; with ``masked``, first
        zero the entries the forward dropped (needs the forward message's payload and meta)."""
        if self.backward == "masked" and fwd_meta is not None:
            mask = kept_mask(fwd_payload, fwd_meta)
            if mask is not None:
                grad = grad * mask
        return self.codec().encode(grad)


class _Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cfg: TopKLink) -> torch.Tensor:
        payload, meta = cfg.encode_act(x)
        ctx.cfg = cfg
        ctx.fwd = (payload, meta) if cfg.backward == "masked" else ((), None)
        return decode(payload, meta).clone() if meta["codec"] == "id" else decode(payload, meta)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        cfg: TopKLink = ctx.cfg
        payload, meta = cfg.encode_grad(grad, *ctx.fwd)
        return decode(payload, meta), None


def boundary(x: torch.Tensor, cfg: TopKLink) -> torch.Tensor:
    """``x̂ = decode(encode(x))`` forward; the backward gradient is compressed the same way (see module doc)."""
    if cfg.ratio >= 1.0:
        return x  # bit-exact identity, and no autograd node at all
    out: torch.Tensor = _Boundary.apply(x, cfg)  # type: ignore[no-untyped-call]
    return out


class ErrorFeedback:
    """Error-feedback residuals per named tensor (not thread-safe; one per sender)."""

    def __init__(self, codec: TopKCodec) -> None:
        self.codec = codec
        self.residual: dict[str, torch.Tensor] = {}

    def encode(self, name: str, grad: torch.Tensor) -> tuple[Payload, Meta]:
        """Compress ``residual + grad`` and keep what was not sent as the new residual."""
        e = grad.detach().to(torch.float32) + self.residual.get(name, 0.0)
        payload, meta = self.codec.encode(e)
        self.residual[name] = e - decode(payload, meta).to(torch.float32)
        return payload, meta

    def reset(self, name: str | None = None) -> None:
        if name is None:
            self.residual.clear()
        else:
            self.residual.pop(name, None)
