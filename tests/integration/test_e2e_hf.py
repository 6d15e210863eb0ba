"""A Hugging Face transformers GPT-2 (built from a config, nothing downloaded) trains through the SDK."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.events import PlanChanged, StepProgress
from fusionp2p.sdk import Swarm
from fusionp2p.train.config import TrainConfig

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

SEQ = 32


class HFGPT2(torch.nn.Module):
    """``GPT2LMHeadModel`` from a small config; ``forward(x, y)`` returns the next-byte loss."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=SEQ, use_cache=False,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                      tie_word_embeddings=False)   # a tied weight cannot span two stages
        cfg._attn_implementation = "eager"
        self.m = transformers.GPT2LMHeadModel(cfg)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.m(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def test_hf_gpt2_trains_as_a_two_stage_pipeline(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=20, micro_batch=4, micro_batches=2, lr=3e-3, replicas=1, averaging="none",
                      compression="adatopk", seed=0)
    with Swarm.local(n_nodes=2, home=tmp_path / "swarm") as swarm:
        job = swarm.publish(model=HFGPT2(), dataset=BuiltinCorpus(seq_len=SEQ), config=cfg, name="hf-gpt2")
        events = list(job.events(timeout=300))
        job.wait(timeout=1)
        path = job.download(tmp_path / "out")
    assert next(e for e in events if isinstance(e, PlanChanged)).stage_sizes == (1, 1)
    losses = [e.loss for e in events if isinstance(e, StepProgress) and e.loss is not None and e.step < cfg.steps]
    assert len(losses) == cfg.steps
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5, losses
    # the download loads into a fresh HF model: every parameter
    fresh = HFGPT2(seed=7)
    state = safetensors.torch.load_file(str(path))
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected
    assert not [k for k in missing if k in dict(fresh.named_parameters())]
    assert torch.equal(fresh.m.lm_head.weight, state["m.lm_head.weight"])
