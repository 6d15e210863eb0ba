"""The tensor-parallel linear and MLP against torch.nn.Linear on gloo processes (ALGORITHMS.md §3.5).

One launch of 4 processes checks every (G_x, G_y, G_z, G_data) with product 4, with and without
bias, overlaps on and off: forward outputs, input gradients, gathered weight/bias gradients,
overlap transparency and the counted collectives against the communication model. The product-8
suite is marked slow.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusionp2p.parallel import (
    CommCounter,
    OverlapConfig,
    ProcessGrid,
    TensorParallel,
    TensorParallelLinear,
    gather_full_weight,
    launch_local,
    shard_batch,
    shard_input,
)
from fusionp2p.plan.axonn import GridShape, LinearSpec, factorizations, layer_collectives

B, S, N_IN, N_HID = 8, 3, 16, 24
TOL = 1e-5


def _reference(seed: int, bias: bool) -> tuple[nn.Linear, nn.Linear, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    fc1, fc2 = nn.Linear(N_IN, N_HID, bias=bias), nn.Linear(N_HID, N_IN, bias=bias)
    with torch.no_grad():
        for lin in (fc1, fc2):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.2)
            if lin.bias is not None:
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.2)
    x = torch.randn(B, S, N_IN, generator=g)
    r1 = torch.randn(B, S, N_HID, generator=g)     # dL/dY of the single layer
    r2 = torch.randn(B, S, N_IN, generator=g)      # dL/dY of the MLP
    return fc1, fc2, x, r1, r2


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = TOL) -> None:
    err = (a - b).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol}"


def _slice(t: torch.Tensor, tp: TensorParallel, dim: str) -> torch.Tensor:
    g, c = tp.grid.size(dim), tp.grid.coord(dim)  # type: ignore[arg-type]
    n = t.shape[-1] // g
    return t[..., c * n:(c + 1) * n]


def _run_case(shape: GridShape, grid: ProcessGrid, bias: bool, overlap: OverlapConfig,
              seed: int) -> dict[str, torch.Tensor]:
    """One step of the single layer and of the MLP; checks against the reference; returns the values."""
    fc1, fc2, x_full, r1, r2 = _reference(seed, bias)
    out: dict[str, torch.Tensor] = {}
    counter = CommCounter()
    tp = TensorParallel(grid, overlap=overlap, counter=counter)

    # --- single normal layer -------------------------------------------------------------
    ref_x = x_full.clone().requires_grad_()
    ref_y = fc1(ref_x)
    (ref_y * r1).sum().backward()
    layer = TensorParallelLinear.from_linear(tp, fc1)
    x_loc = shard_input(x_full, tp).detach().requires_grad_()
    with tp.optimize_communication(layer):
        y_loc = layer(x_loc)
        (y_loc * _slice(shard_batch(r1, tp), tp, "y")).sum().backward()
        if overlap.ors:
            assert layer.weight.grad is None, "ORS: the weight gradient must wait for the context exit"
    tp.sync_gradients(layer)
    _close(y_loc, _slice(shard_batch(ref_y.detach(), tp), tp, "y"), "linear forward")
    assert x_loc.grad is not None
    _close(x_loc.grad, _slice(shard_batch(ref_x.grad, tp), tp, "x"), "linear dX")  # type: ignore[arg-type]
    dw = gather_full_weight(layer, grad=True)
    _close(dw, fc1.weight.grad, "linear dW")  # type: ignore[arg-type]
    if bias:
        assert layer.bias is not None
        assert layer.bias.grad is not None
        assert fc1.bias is not None
        _close(layer.bias.grad, _slice(fc1.bias.grad, tp, "y"), "linear db")  # type: ignore[arg-type]
    spec = LinearSpec(n_in=N_IN, n_out=N_HID, bias=bias)
    want = Counter(layer_collectives(shape, spec, B * S // shape.batch_split, act_bytes=4, grad_bytes=4))
    assert counter.multiset("layer", "sync") == want, f"{shape}: counted {counter.multiset()} != model {want}"
    out.update(lin_y=y_loc.detach(), lin_dx=x_loc.grad.clone(), lin_dw=dw)

    # --- MLP: normal + transposed ----------------------------------------------------------
    for lin in (fc1, fc2):
        lin.zero_grad()
    counter.clear()
    ref_x = x_full.clone().requires_grad_()
    ref_y = fc2(F.gelu(fc1(ref_x)))
    (ref_y * r2).sum().backward()
    p1, p2 = TensorParallelLinear.from_linear(tp, fc1), TensorParallelLinear.from_linear(tp, fc2, transposed=True)
    mlp = nn.Sequential(p1, nn.GELU(), p2)
    x_loc = shard_input(x_full, tp).detach().requires_grad_()
    with tp.optimize_communication(mlp):
        y_loc = mlp(x_loc)
        (y_loc * _slice(shard_batch(r2, tp), tp, "x")).sum().backward()
    tp.sync_gradients(mlp)
    _close(y_loc, _slice(shard_batch(ref_y.detach(), tp), tp, "x"), "mlp forward")
    assert x_loc.grad is not None
    _close(x_loc.grad, _slice(shard_batch(ref_x.grad, tp), tp, "x"), "mlp dX")  # type: ignore[arg-type]
    for name, p, lin in (("fc1", p1, fc1), ("fc2", p2, fc2)):
        g = gather_full_weight(p, grad=True)
        _close(g, lin.weight.grad, f"mlp {name} dW")  # type: ignore[arg-type]
        out[f"mlp_dw_{name}"] = g
    want = Counter()
    for s in (spec, LinearSpec(n_in=N_HID, n_out=N_IN, transposed=True, bias=bias)):
        want.update(layer_collectives(shape, s, B * S // shape.batch_split, act_bytes=4, grad_bytes=4))
    assert counter.multiset("layer", "sync") == want, f"{shape}: MLP counted != model"
    out.update(mlp_y=y_loc.detach(), mlp_dx=x_loc.grad.clone())
    return out


def worker_equivalence(rank: int, world: int, shapes: list[tuple[int, int, int, int]]) -> None:
    for i, t in enumerate(shapes):
        shape = GridShape(g_x=t[0], g_y=t[1], g_z=t[2], g_data=t[3])
        grid = ProcessGrid(shape)
        for bias in (False, True):
            off = _run_case(shape, grid, bias, OverlapConfig.off(), seed=100 + i)
            on = _run_case(shape, grid, bias, OverlapConfig(), seed=100 + i)
            for k in off:
                _close(on[k], off[k], f"{shape} overlap on/off {k}", tol=1e-6)


def _shapes(world: int) -> list[tuple[int, int, int, int]]:
    return [s.as_tuple() for s in factorizations(world)]


def test_product4_linear_and_mlp_match_torch() -> None:
    shapes = _shapes(4)
    assert len(shapes) == 10
    launch_local(worker_equivalence, 4, shapes)


def test_product2_linear_and_mlp_match_torch() -> None:
    launch_local(worker_equivalence, 2, _shapes(2))


@pytest.mark.slow
def test_product8_linear_and_mlp_match_torch() -> None:
    launch_local(worker_equivalence, 8, _shapes(8), timeout_s=300.0)
