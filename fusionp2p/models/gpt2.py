"""A GPT-2-family decoder language model in plain PyTorch (tiny to 124M parameters).

Layout (kept stable so that a model can be split by hand as well as traced): ``embed`` (token and
position embeddings), ``blocks`` (an ``nn.ModuleList`` of pre-norm transformer blocks), ``head``
(final layer norm + tied-free LM projection). ``forward(idx, targets=None)`` returns the logits, or
``(logits, loss)`` when targets are given (mean cross-entropy over every position).

Legend: B batch, T sequence, D width (n_embd), H heads, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fusionp2p.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class GPT2Config:
    """Size of a GPT-2 decoder. The defaults are GPT-2 small (124M); see :meth:`tiny`."""

    vocab_size: int = 50257
    block_size: int = 1024      # maximum sequence length
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    # GPT-2 ties the LM head to the token embedding (124M with tying, 163M without). Off by default:
    # a tied weight would be shared by the first and the last pipeline stage.
    tie_weights: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"GPT2Config.{name} must be positive")
        if self.n_embd % self.n_head:
            raise ConfigError(f"GPT2Config: n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("GPT2Config.dropout must be in [0, 1)")

    @classmethod
    def tiny(cls, *, vocab_size: int = 256, block_size: int = 64, n_layer: int = 2, n_head: int = 2,
             n_embd: int = 64) -> GPT2Config:
        """A model small enough for unit tests (about 0.1M parameters)."""
        return cls(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.c_attn(x_BTD).split(D, dim=2)
        # (B, H, T, D/H)
        q = q.view(B, T, self.n_head, D // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, D // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, D // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y_BTD = y.transpose(1, 2).contiguous().view(B, T, D)
        out: torch.Tensor = self.c_proj(y_BTD)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.c_proj(F.gelu(self.c_fc(x_BTD), approximate="tanh"))
        return out


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.ln_1(x_BTD))
        out: torch.Tensor = x_BTD + self.mlp(self.ln_2(x_BTD))
        return out


class Embedding(nn.Module):
    """Token + learned position embeddings."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.block_size = cfg.block_size

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        T = idx_BT.shape[1]
        pos = torch.arange(T, dtype=torch.long, device=idx_BT.device)
        out: torch.Tensor = self.wte(idx_BT) + self.wpe(pos)
        return out


class Head(nn.Module):
    """Final layer norm and the LM projection to the vocabulary."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.ln_f(x_BTD))
        return out


class GPT2(nn.Module):
    """GPT-2 decoder LM. ``forward(idx, targets=None)`` -> logits, or (logits, loss)."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.head = Head(cfg)
        self.apply(self._init_weights)
        if cfg.tie_weights:
            self.head.lm_head.weight = self.embed.wte.weight
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if idx_BT.shape[1] > self.config.block_size:
            raise ConfigError(f"sequence of {idx_BT.shape[1]} tokens exceeds block_size={self.config.block_size}")
        x_BTD = self.embed(idx_BT)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        logits_BTV: torch.Tensor = self.head(x_BTD)
        if targets_BT is None:
            return logits_BTV
        loss = F.cross_entropy(logits_BTV.view(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1))
        return logits_BTV, loss
