"""to_workload: the planner's units and edges, consistent with the DAG and with real stage boundaries."""

from __future__ import annotations

import pytest
import torch

from fusionp2p.errors import ConfigError
from fusionp2p.graph import coarsen, partition, stages_from_fences, to_workload, trace
from fusionp2p.models import GPT2, MLP, GPT2Config, MLPConfig
from fusionp2p.types import WorkloadGraph

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gpt_coarse():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    m = GPT2(GPT2Config.tiny(n_layer=3, n_embd=32))
    idx = torch.randint(0, 256, (2, 8))
    return coarsen(trace(m, (idx, idx.clone())))


def test_units_and_edges(gpt_coarse) -> None:  # type: ignore[no-untyped-def]
    wl = to_workload(gpt_coarse, micro_batch=2)
    assert isinstance(wl, WorkloadGraph)
    assert [u.name for u in wl.units] == [u.name for u in gpt_coarse.units]
    blocks = [u for u in wl.units if u.kind == "block"]
    assert len(blocks) == 3
    assert len({u.fwd_flops for u in blocks}) == 1
    assert blocks[0].fwd_flops > 0
    assert all(u.bwd_flops == 2 * u.fwd_flops for u in wl.units)
    # all parameters counted exactly once
    dag = gpt_coarse.dag
    assert sum(u.param_bytes for u in wl.units) == sum(i.meta.nbytes for i in dag.inputs if i.kind != "input")
    # a chain: the residual stream (B=2, T=8, D=32 floats) crosses each fence between blocks
    assert wl.cut_bytes(2) == 2 * 8 * 32 * 4


def test_cut_bytes_equal_partition_boundaries(gpt_coarse) -> None:  # type: ignore[no-untyped-def]
    wl = to_workload(gpt_coarse, micro_batch=gpt_coarse.dag.batch_size)
    n = len(gpt_coarse.units)
    for fence in range(1, n):
        programs = partition(gpt_coarse, stages_from_fences(n, [fence]))
        sent = sum(o.meta.nbytes for o in programs[0].send)
        assert wl.cut_bytes(fence) == sent


def test_scales_linearly_with_micro_batch(gpt_coarse) -> None:  # type: ignore[no-untyped-def]
    a, b = to_workload(gpt_coarse, 2), to_workload(gpt_coarse, 8)
    for ua, ub in zip(a.units, b.units):
        assert ub.fwd_flops == pytest.approx(4 * ua.fwd_flops)
        assert ub.param_bytes == ua.param_bytes
    assert [e.nbytes * 4 for e in a.edges] == [e.nbytes for e in b.edges]
    with pytest.raises(ConfigError):
        to_workload(gpt_coarse, 0)


def test_linear_flops_are_2mkn() -> None:
    m = MLP(MLPConfig(in_features=10, hidden=(20,), out_features=5))
    wl = to_workload(trace(m, (torch.randn(4, 10),)), micro_batch=4)
    assert [u.name for u in wl.units] == ["layers.0", "top", "out"]
    assert wl.units[0].fwd_flops == 2 * 4 * 10 * 20
    assert wl.units[2].fwd_flops == 2 * 4 * 20 * 5
