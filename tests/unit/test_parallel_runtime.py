"""Rendezvous configuration, grid construction errors and the measured configuration trial."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusionp2p.errors import ConfigError
from fusionp2p.parallel import (
    CommCounter,
    ProcessGrid,
    RendezvousSpec,
    TensorParallel,
    TensorParallelLinear,
    TrialConfig,
    choose_config,
    gather_batch,
    init_distributed,
    launch_local,
    measure_bandwidth,
    select_device,
    shard_batch,
    shard_input,
)
from fusionp2p.plan.axonn import BandwidthModel, GridShape, LinearSpec, layer_collectives, search


def test_rendezvous_spec_validation() -> None:
    ok = RendezvousSpec(master_addr="10.0.0.1", master_port=29500, rank=1, world_size=2)
    assert ok.resolved_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    assert RendezvousSpec(master_addr="h", master_port=1, rank=0, world_size=1, backend="gloo").resolved_backend() == "gloo"
    bad = [
        {"master_addr": "", "master_port": 29500, "rank": 0, "world_size": 1},
        {"master_addr": "h", "master_port": 0, "rank": 0, "world_size": 1},
        {"master_addr": "h", "master_port": 70000, "rank": 0, "world_size": 1},
        {"master_addr": "h", "master_port": 29500, "rank": 2, "world_size": 2},
        {"master_addr": "h", "master_port": 29500, "rank": 0, "world_size": 1, "backend": "mpi"},
        {"master_addr": "h", "master_port": 29500, "rank": 0, "world_size": 1, "timeout_s": 0},
    ]
    for kw in bad:
        with pytest.raises(ConfigError):
            RendezvousSpec(**kw)  # type: ignore[arg-type]


def test_select_device_cpu_and_nccl_without_cuda() -> None:
    assert select_device("gloo", 3) == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError):
            select_device("nccl", 0)


def worker_runtime(rank: int, world: int) -> None:
    # Errors a user can make on a live group.
    with pytest.raises(ConfigError):
        init_distributed(RendezvousSpec(master_addr="127.0.0.1", master_port=1, rank=rank, world_size=world))
    with pytest.raises(ConfigError):
        ProcessGrid(GridShape(g_x=4))
    tp = TensorParallel(ProcessGrid(GridShape(g_x=2)))
    with pytest.raises(ConfigError):
        TensorParallelLinear(tp, 3, 4)                     # 3 input features over G_x = 2

    # The measured trial: every rank gets the same pick, and it is one of the candidates.
    bw = BandwidthModel.uniform(measure_bandwidth(1 << 20), devices=world)
    assert bw.inter > 0
    layers = (LinearSpec(n_in=64, n_out=128), LinearSpec(n_in=128, n_out=64, transposed=True))
    cands = search(world, layers, batch=8, seq_len=4, bw=bw, top_k=4)
    best, results = choose_config(cands, layers, global_tokens=32, top=3, trial=TrialConfig(steps=1, warmup=1))
    assert [r.grid for r in results] == [c.grid for c in cands[:3]]
    assert best in {r.grid for r in results}
    assert all(r.measured_s > 0 for r in results)
    mine = torch.tensor(best.as_tuple())
    picks = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(picks, mine)
    assert all(torch.equal(p, mine) for p in picks)


def _check_bf16(shape: GridShape) -> None:
    """compute_dtype=bf16 (the GPU setting): close to fp32, half-size activation/weight messages."""
    torch.manual_seed(3)
    ref = nn.Linear(32, 16)
    x = torch.randn(8, 32)
    counter = CommCounter()
    tp = TensorParallel(ProcessGrid(shape), counter=counter, compute_dtype=torch.bfloat16)
    layer = TensorParallelLinear.from_linear(tp, ref)
    assert torch.equal(gather_batch(shard_batch(x, tp), tp), x)
    x_loc = shard_input(x, tp).requires_grad_()
    with tp.optimize_communication(layer):
        y = layer(x_loc)
        y.sum().backward()
    tp.sync_gradients(layer)
    assert y.dtype == torch.float32
    assert layer.weight.grad is not None
    assert layer.weight.grad.dtype == torch.float32
    n, c_out = 16 // tp.grid.size("y"), tp.grid.coord("y")
    want = shard_batch(ref(x), tp)[:, c_out * n:(c_out + 1) * n]
    err = (y - want).abs().max().item()
    assert 0 < err < 5e-2, err        # bf16 rounding: close, but not the fp32 result
    model = Counter(layer_collectives(shape, LinearSpec(n_in=32, n_out=16, bias=True), 8 // shape.batch_split,
                                      act_bytes=2, grad_bytes=4))
    assert counter.multiset("layer", "sync") == model


def worker_bf16(rank: int, world: int) -> None:
    for shape in (GridShape(g_x=2), GridShape(g_z=2), GridShape(g_y=2), GridShape(g_data=2)):
        _check_bf16(shape)


def test_bf16_compute_dtype_path() -> None:
    launch_local(worker_bf16, 2)


def test_runtime_errors_and_measured_trial() -> None:
    launch_local(worker_runtime, 2)
