"""User mistakes and diverging training end early with a message that says what happened."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fusionp2p.data import Examples
from fusionp2p.errors import JobError
from fusionp2p.jobs.events import StepProgress
from fusionp2p.sdk import Swarm
from fusionp2p.train.config import TrainConfig


class Exploding(nn.Module):
    """Two blocks (so two stages); the loss turns infinite at the step the data says."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.c = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, poison: torch.Tensor) -> torch.Tensor:
        loss = ((self.c(self.b(self.a(x))).squeeze(-1) - y) ** 2).mean()
        return loss / (poison.mean() * -1.0 + 1.0)      # poison 1.0 -> inf


def _data(poisoned: bool) -> Examples:
    rng = np.random.default_rng(0)
    n = 32
    return Examples({"x": rng.standard_normal((n, 4)).astype(np.float32),
                     "y": rng.standard_normal(n).astype(np.float32),
                     "poison": np.full(n, 1.0 if poisoned else 0.0, dtype=np.float32)})


@pytest.mark.slow   # ~30 s: the swarm re-plans around the failed member before the job ends
def test_infinite_loss_fails_the_job_naming_stage_and_step(tmp_path: Path) -> None:
    cfg = TrainConfig(steps=3, micro_batch=4, micro_batches=2, replicas=1, averaging="none")
    with Swarm.local(n_nodes=2, home=tmp_path / "swarm") as swarm:
        job = swarm.publish(model=Exploding(), dataset=_data(True), config=cfg)
        with pytest.raises(JobError) as info:
            job.wait(timeout=120)
    msg = str(info.value)
    assert re.search(r"stage \d, step 0, micro-batch 0: the loss is inf", msg), msg
    assert "ExceptionGroup" not in msg and "sub-exception" not in msg


def test_skip_on_nonfinite_skips_and_then_fails(tmp_path: Path) -> None:
    cfg = TrainConfig(steps=5, micro_batch=4, micro_batches=2, replicas=1, averaging="none", on_nonfinite="skip")
    with Swarm.local(n_nodes=2, home=tmp_path / "swarm") as swarm:
        job = swarm.publish(model=Exploding(), dataset=_data(True), config=cfg)
        with pytest.raises(JobError, match="non-finite gradients"):
            job.wait(timeout=120)


def test_publish_after_close_raises_the_sdks_error(tmp_path: Path) -> None:
    swarm = Swarm.local(n_nodes=1, home=tmp_path / "swarm")
    swarm.close()
    with pytest.raises(JobError, match="swarm is closed"):
        swarm.publish(model=Exploding(), dataset=_data(False), config=TrainConfig(steps=1, micro_batch=4,
                                                                                   micro_batches=1))


def test_healthy_examples_job_trains(tmp_path: Path) -> None:
    cfg = TrainConfig(steps=3, micro_batch=4, micro_batches=2, replicas=1, averaging="none")
    with Swarm.local(n_nodes=2, home=tmp_path / "swarm") as swarm:
        job = swarm.publish(model=Exploding(), dataset=_data(False), config=cfg)
        job.wait(timeout=120)
    assert len([e for e in job.history if isinstance(e, StepProgress) and e.step < cfg.steps]) == cfg.steps


def test_reference_gpt2_with_a_held_out_split_of_the_builtin_corpus(tmp_path: Path) -> None:
    """Token windows as examples (inputs and next tokens by the model's own argument names) give the
    built-in corpus a held-out split; the download reproduces the held-out loss."""
    from fusionp2p.data import BuiltinCorpus
    from fusionp2p.data.stream import held_out_indices
    from fusionp2p.models import GPT2, GPT2Config

    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = Examples.causal_lm(BuiltinCorpus(seq_len=16).tokens()[:4000], 16, shift=1,
                              names=("idx_BT", "targets_BT"), holdout=0.1)
    assert np.array_equal(data.arrays["idx_BT"][0, 1:], data.arrays["targets_BT"][0, :-1])
    cfg = TrainConfig(steps=3, micro_batch=4, micro_batches=2, replicas=1, averaging="none", lr=1e-3)
    with Swarm.local(n_nodes=2, home=tmp_path / "swarm") as swarm:
        job = swarm.publish(model=GPT2(GPT2Config.tiny(block_size=16, n_layer=2)), dataset=data, config=cfg)
        job.wait(timeout=120)
        fresh = job.load_into(GPT2(GPT2Config.tiny(block_size=16, n_layer=2)))
    man, _ = data.shards()
    with torch.no_grad():
        fresh.eval()
        losses = [float(fresh(*[torch.from_numpy(v) for v in data.batch(held_out_indices(man, 4, mu)).values()])[1])
                  for mu in range(2)]
    assert job.final_loss == pytest.approx(sum(losses) / 2, rel=1e-5)
