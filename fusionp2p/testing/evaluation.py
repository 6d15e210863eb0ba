"""The reference for "the downloaded model reproduces the job's final loss": the mean loss of a module
over the evaluation batches a job of *cfg* reports last (steps ``R*steps + r`` for the R pipelines of its
last plan, every micro-batch),
computed here from scratch, independently of the stage workers."""

from __future__ import annotations

import numpy as np
import torch

from fusionp2p.data import BatchSampler, SamplerConfig, corpus_tokens
from fusionp2p.train.config import TrainConfig


def final_eval_loss(model: torch.nn.Module, cfg: TrainConfig, *, seq_len: int, corpus: str = "pydoc",
                    replicas: int = 2) -> float:
    """Mean loss of *model* (called as ``model(inputs, targets) -> (logits, loss)``) on the final evaluation batches."""
    tokens = corpus_tokens(corpus)
    s = BatchSampler(SamplerConfig(num_tokens=len(tokens), seq_len=seq_len, micro_batch=cfg.micro_batch,
                                   micro_batches=cfg.micro_batches, seed=cfg.seed))
    with torch.no_grad():
        return float(np.mean([float(model(torch.from_numpy(s.inputs(tokens, cfg.steps * replicas + r, mu)),
                                          torch.from_numpy(s.targets(tokens, cfg.steps * replicas + r, mu)))[1])
                              for r in range(replicas) for mu in range(cfg.micro_batches)]))
