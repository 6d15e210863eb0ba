"""Convergence with AdaTopK on the pipeline link (issue 5; ALGORITHMS.md §1.7 test 11).

The GPT-2 reference model is split by hand into 2 stages (embedding + first block | the rest + head);
the activation crossing the link is compressed with AdaTopK at ratio 0.1 (per-row top-k, as
recommended for transformer activations) and the backward gradient with the same ratio, using the
``masked`` backward (the exact gradient of the forward mask). Trained for 300 steps on the built-in
corpus from the same initialisation and data order as uncompressed training, the final loss must be
within 5%.

Measured (2 layers, width 64, batch 16 x 64 tokens, AdamW 3e-3; mean loss of the last 30 steps):
uncompressed 2.360; AdaTopK 0.1 masked per-row 2.391 (+1.3%), masked global 2.394 (+1.4%);
straight-through per-row 3.151 (+33%), straight-through global 3.229 (+37%). So the default
backward of ``TopKLink`` is ``masked``; straight-through stays selectable.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fusionp2p.compress import TopKLink, boundary
from fusionp2p.data.corpus import corpus_tokens
from fusionp2p.models.gpt2 import GPT2, GPT2Config

STEPS = 300
BATCH, SEQ = 16, 64


def _train(model: GPT2, link: TopKLink | None, tokens: np.ndarray) -> list[float]:
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(STEPS):
        starts = rng.integers(0, len(tokens) - SEQ - 1, BATCH)
        x = torch.from_numpy(np.stack([tokens[s : s + SEQ] for s in starts]).astype(np.int64))
        y = torch.from_numpy(np.stack([tokens[s + 1 : s + SEQ + 1] for s in starts]).astype(np.int64))
        # stage 0: embedding + first block
        h_BTD = model.blocks[0](model.embed(x))
        # the link between the stages
        if link is not None:
            h_BTD = boundary(h_BTD, link)
        # stage 1: the remaining blocks + head
        for block in model.blocks[1:]:
            h_BTD = block(h_BTD)
        logits = model.head(h_BTD)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.slow
def test_adatopk_ratio_0_1_converges_within_5_percent() -> None:
    torch.set_num_threads(1)
    tokens = corpus_tokens("pydoc")
    torch.manual_seed(0)
    base = GPT2(GPT2Config.tiny(n_layer=2, n_embd=64, block_size=SEQ))
    comp = copy.deepcopy(base)
    dense = _train(base, None, tokens)
    sparse = _train(comp, TopKLink(ratio=0.1, per_row=True, backward="masked"), tokens)
    final_dense = float(np.mean(dense[-30:]))
    final_sparse = float(np.mean(sparse[-30:]))
    print(f"\nstart loss {dense[0]:.3f}; final (mean of last 30 of {STEPS} steps): "
          f"uncompressed {final_dense:.4f}, AdaTopK 0.1 (masked, per row) {final_sparse:.4f} ({(final_sparse / final_dense - 1) * 100:+.2f}%)")
    assert final_dense < 0.8 * dense[0]  # training did happen
    assert final_sparse <= 1.05 * final_dense
