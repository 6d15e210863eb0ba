"""The safetensors layout written from the tensors' own bytes (wire/stfile.py, issue 37): what the reference
reader loads, of the exact size announced, and no copy of a contiguous tensor."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import safetensors.torch
import torch
from hypothesis import given, settings

from fusionp2p.jobs.checkpoint import StageCheckpointMeta, decode_state, encode_state, state_layout
from fusionp2p.train.state import StageState
from fusionp2p.wire.stfile import CHUNK, chunks, layout

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3)), min_size=1, max_size=6),
       st.booleans())
def test_any_tensors_load_back_with_the_reference_reader(specs: list[tuple[torch.dtype, list[int]]], meta: bool) -> None:
    g = torch.Generator().manual_seed(len(specs))
    tensors = {f"t{i}.w": (torch.randn(shape, generator=g) * 50).to(dtype) for i, (dtype, shape) in enumerate(specs)}
    lay = layout(tensors, {"k": "v"} if meta else None)
    blob = b"".join(chunks(lay))
    assert len(blob) == lay.size and len(lay.head) % 8 == 0
    back = safetensors.torch.load(blob)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)


def test_views_not_copies_and_bounded_chunks() -> None:
    big = torch.arange(CHUNK // 4 * 2 + 3, dtype=torch.float32)
    parts = list(chunks(layout({"big": big, "t": torch.ones(3, 2).t()})))   # a transposed one is made contiguous
    views = parts[1:]
    assert max(len(p) for p in views) <= CHUNK
    assert views[0].obj is not None and torch.frombuffer(views[0], dtype=torch.float32)[0].item() == 0.0
    big[0] = 7.0                                                           # the view sees the live tensor
    assert torch.frombuffer(views[0], dtype=torch.float32)[0].item() == 7.0


def test_a_stage_state_encodes_as_it_decodes() -> None:
    meta = StageCheckpointMeta(job="j1", stage=1, num_stages=3, step=4, plan_hash="ab" * 32)
    state = StageState(step=4, tensors={"w": torch.randn(4, 4), "b": torch.zeros(4)},
                       optimizer={"w::exp_avg": torch.randn(4, 4)}, optimizer_groups='[{"lr": 0.1}]',
                       momentum={"w": ((0, torch.randn(8)), (8, torch.randn(8)))})
    blob = encode_state(meta, state)
    assert len(blob) == state_layout(meta, state).size
    got_meta, got = decode_state(blob, job="j1")
    assert got_meta == meta and got.optimizer_groups == state.optimizer_groups
    assert all(torch.equal(got.tensors[k], v) for k, v in state.tensors.items())
    assert torch.equal(got.optimizer["w::exp_avg"], state.optimizer["w::exp_avg"])


def test_a_tensor_off_the_cpu_or_of_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        layout({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="CPU"):
        layout({"m": torch.zeros(2, device="meta")})
