"""Stage checkpoints: save, assemble into the original model, resume from the latest complete step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusionp2p.jobs.checkpoint import (
    CheckpointError,
    StageCheckpointMeta,
    assemble,
    latest_complete_step,
    load_stage,
    save_model,
    save_stage,
    stage_path,
)
from fusionp2p.train.state import load_optimizer_tensors, optimizer_tensors

torch.set_num_threads(1)


class Tied(torch.nn.Module):
    """A tiny LM with tied input/output embeddings (like GPT-2)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def split(model: Tied) -> list[dict[str, torch.Tensor]]:
    sd = model.state_dict()
    return [{k: v for k, v in sd.items() if k.startswith("emb")}, {k: v for k, v in sd.items() if not k.startswith("emb")}]


def meta(stage: int, step: int, *, n: int = 2, plan: str = "p1", job: str = "job1") -> StageCheckpointMeta:
    return StageCheckpointMeta(job=job, stage=stage, num_stages=n, step=step, plan_hash=plan)


def test_save_assemble_loads_into_the_original_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tied()
    for s, part in enumerate(split(model)):
        save_stage(tmp_path, meta(s, 10), part)
    merged = assemble(tmp_path, "job1")
    fresh = Tied()
    fresh.load_state_dict(merged)
    x = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)
    out = save_model(tmp_path / "out" / "model.safetensors", merged, metadata={"job": "job1"})
    again = Tied()
    again.load_state_dict(load_file(str(out)))
    torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)


def test_resume_picks_latest_complete_step(tmp_path: Path) -> None:
    model = Tied()
    a, b = split(model)
    for step in (5, 10):
        save_stage(tmp_path, meta(0, step), a)
        save_stage(tmp_path, meta(1, step), b)
    save_stage(tmp_path, meta(0, 15), a)                       # stage 1 never saved step 15
    save_stage(tmp_path, meta(0, 20), a)
    save_stage(tmp_path, meta(1, 20, plan="p2"), b)            # stages disagree on the plan
    stage_path(tmp_path, "job1", 25, 0).parent.mkdir(parents=True)
    stage_path(tmp_path, "job1", 25, 0).write_bytes(b"garbage")  # a torn or foreign file
    stage_path(tmp_path, "job1", 25, 1).write_bytes(b"garbage")
    assert latest_complete_step(tmp_path, "job1") == 10
    assert latest_complete_step(tmp_path, "other") is None
    with pytest.raises(CheckpointError, match="incomplete"):
        assemble(tmp_path, "job1", 15)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        assemble(tmp_path, "nojob")
    assert set(assemble(tmp_path, "job1", 5)) == set(model.state_dict())


def test_tensor_in_two_stages_must_be_equal(tmp_path: Path) -> None:
    """A tied parameter's copies (and a buffer copied to two stages) are one tensor in the download;
    copies that differ are an error."""
    save_stage(tmp_path, meta(0, 1), {"w": torch.ones(2)})
    save_stage(tmp_path, meta(1, 1), {"w": torch.ones(2), "b": torch.zeros(1)})
    assert set(assemble(tmp_path, "job1", 1)) == {"w", "b"}
    save_stage(tmp_path, meta(1, 2), {"w": torch.ones(2)})
    save_stage(tmp_path, meta(0, 2), {"w": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="two stages"):
        assemble(tmp_path, "job1", 2)


def test_metadata_and_validation(tmp_path: Path) -> None:
    p = save_stage(tmp_path, meta(1, 7, n=3), {"w": torch.zeros(3)})
    ck = load_stage(p)
    assert ck.meta == meta(1, 7, n=3)
    with pytest.raises(CheckpointError):
        StageCheckpointMeta(job="../x", stage=0, num_stages=1, step=0, plan_hash="")
    with pytest.raises(CheckpointError):
        StageCheckpointMeta(job="j", stage=3, num_stages=3, step=0, plan_hash="")
    with pytest.raises(CheckpointError, match="must not start"):
        save_stage(tmp_path, meta(0, 1), {"__optim__::x": torch.zeros(1)})
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_optimizer_state_round_trip_continues_identically(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    names = {p: n for n, p in model.named_parameters()}

    def make(m: torch.nn.Module) -> torch.optim.Optimizer:
        if kind == "adamw":
            return torch.optim.AdamW(m.parameters(), lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    opt = make(model)
    x = torch.randn(8, 4)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()

    for _ in range(3):
        step(model, opt)
    tensors, groups = optimizer_tensors(opt, names)
    save_stage(tmp_path, meta(0, 3, n=1), dict(model.state_dict()), optimizer=tensors, optimizer_groups=groups)

    ck = load_stage(stage_path(tmp_path, "job1", 3, 0))
    clone = torch.nn.Linear(4, 3)
    clone.load_state_dict(ck.params)
    opt2 = make(clone)
    load_optimizer_tensors(opt2, {p: n for n, p in clone.named_parameters()}, ck.optimizer, ck.optimizer_groups)
    step(model, opt)
    step(clone, opt2)
    for a, b in zip(model.parameters(), clone.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Restarting without the optimizer state would have diverged (guards the test itself).
    bare = torch.nn.Linear(4, 3)
    bare.load_state_dict(ck.params)
    opt3 = make(bare)
    step(bare, opt3)
    assert not torch.equal(bare.weight, model.weight)


@pytest.mark.parametrize("off", ["\u00b2", "\u0663", "9" * 5000])
def test_a_momentum_offset_that_is_not_ascii_digits_is_a_protocol_error(off: str) -> None:
    """Regression (issue 15): a peer's state file whose momentum key ends in ``@²`` (``isdigit()`` is
    true, ``int()`` raises ValueError) or in 5000 digits (over int()'s 4300-digit limit) made
    ``decode_state`` raise ValueError instead of RemoteProtocolError; ``@٣`` was read as offset 3."""
    import json
    import struct

    from fusionp2p.errors import RemoteProtocolError
    from fusionp2p.jobs.checkpoint import StageCheckpointMeta, decode_state, encode_state
    from fusionp2p.train.state import StageState

    meta = StageCheckpointMeta(job="job1", stage=0, num_stages=2, step=5, plan_hash="p" * 16)
    st = StageState(step=5, tensors={"w": torch.ones(2, 2)}, optimizer={}, momentum={"w": ((0, torch.zeros(2)),)})
    data = encode_state(meta, st)
    n = struct.unpack("<Q", data[:8])[0]
    hdr = json.loads(data[8 : 8 + n])
    hdr[f"__momentum__::w@{off}"] = hdr.pop("__momentum__::w@0")
    hb = json.dumps(hdr).encode()
    with pytest.raises(RemoteProtocolError, match="momentum"):
        decode_state(struct.pack("<Q", len(hb)) + hb + data[8 + n :], job="job1")
