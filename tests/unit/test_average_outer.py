"""CO2 outer optimizer: reductions to DDP / Local-SGD / SlowMo, staleness, penalty, clipping, τ."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.average.outer import OuterConfig, OuterOptimizer, clip_, ring_allreduce_time, suggest_tau
from fusionp2p.average.shard import weighted_mean
from fusionp2p.errors import ConfigError

torch.set_num_threads(1)

N_REPLICAS = 3


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batches(replicas: int, steps: int, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(steps)] for _ in range(replicas)]


def _flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def _load(m: torch.nn.Module, flat: torch.Tensor) -> None:
    off = 0
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(flat[off : off + p.numel()].view_as(p))
            off += p.numel()


def _loss(m: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(m(xb), yb)


def _make_opt(kind: str, m: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(m.parameters(), lr=0.1)
    if kind == "sgd_momentum":
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(m.parameters(), lr=0.01)


def _co2_sync(cfg: OuterConfig, inner: str, steps: int) -> torch.Tensor:
    """n replicas, each its own model + inner optimizer; the outer step every cfg.tau steps."""
    models = [_model() for _ in range(N_REPLICAS)]
    opts = [_make_opt(inner, m) for m in models]
    data = _batches(N_REPLICAS, steps)
    outer = OuterOptimizer(cfg, _flat(models[0]))
    for s in range(steps):
        for m, o, d in zip(models, opts, data):
            o.zero_grad()
            _loss(m, *d[s]).backward()
            o.step()
        if (s + 1) % cfg.tau == 0:
            new = outer.step(weighted_mean([_flat(m) for m in models], [1.0] * N_REPLICAS)).anchor
            for m in models:
                _load(m, new)
    return outer.anchor


def _ddp_reference(inner: str, steps: int) -> torch.Tensor:
    """Exact single-process DDP: one model, gradient = mean of the replicas' gradients."""
    model = _model()
    opt = _make_opt(inner, model)
    data = _batches(N_REPLICAS, steps)
    for s in range(steps):
        opt.zero_grad()
        grads = []
        for d in data:
            model.zero_grad()
            _loss(model, *d[s]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / N_REPLICAS  # type: ignore[assignment]
        opt.step()
    return _flat(model)


@pytest.mark.parametrize("inner", ["sgd", "sgd_momentum"])
def test_sync_tau1_equals_ddp(inner: str) -> None:
    got = _co2_sync(OuterConfig(tau=1, outer_lr=1.0, outer_momentum=0.0), inner, steps=8)
    ref = _ddp_reference(inner, steps=8)
    assert torch.allclose(got, ref, atol=1e-6, rtol=0)


def test_adam_guard_is_not_ddp() -> None:
    got = _co2_sync(OuterConfig(tau=1), "adam", steps=8)
    ref = _ddp_reference("adam", steps=8)
    assert (got - ref).abs().max() > 1e-5


def test_sync_tau_gt1_equals_local_sgd() -> None:
    tau, steps = 3, 9
    got = _co2_sync(OuterConfig(tau=tau), "sgd_momentum", steps)
    # Reference: periodic parameter averaging, written out directly.
    models = [_model() for _ in range(N_REPLICAS)]
    opts = [_make_opt("sgd_momentum", m) for m in models]
    data = _batches(N_REPLICAS, steps)
    for s in range(steps):
        for m, o, d in zip(models, opts, data):
            o.zero_grad()
            _loss(m, *d[s]).backward()
            o.step()
        if (s + 1) % tau == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models)):
                    avg = sum(p.clone() for p in ps) / N_REPLICAS
                    for p in ps:
                        p.copy_(avg)
    assert torch.allclose(got, _flat(models[0]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sync_momentum_equals_slowmo(nesterov: bool) -> None:
    beta, alpha, tau, steps = 0.6, 0.8, 2, 10
    got = _co2_sync(OuterConfig(tau=tau, outer_lr=alpha, outer_momentum=beta, nesterov=nesterov), "sgd", steps)
    # Reference SlowMo (Wang et al. 2020): u ← βu + (x_anchor − x̄)/γ; x_anchor ← x_anchor − αγu (γ = 1 here).
    models = [_model() for _ in range(N_REPLICAS)]
    opts = [_make_opt("sgd", m) for m in models]
    data = _batches(N_REPLICAS, steps)
    anchor = _flat(models[0])
    u = torch.zeros_like(anchor)
    for s in range(steps):
        for m, o, d in zip(models, opts, data):
            o.zero_grad()
            _loss(m, *d[s]).backward()
            o.step()
        if (s + 1) % tau == 0:
            xbar = sum(_flat(m) for m in models) / N_REPLICAS
            d_ = anchor - xbar
            u = beta * u + d_
            anchor = anchor - alpha * ((d_ + beta * u) if nesterov else u)
            for m in models:
                _load(m, anchor)
    assert torch.allclose(got, anchor, atol=1e-6, rtol=0)


def test_async_consumes_previous_round_average() -> None:
    """x̃_{t+1} = x̃_t − (x̃_{t−1} − x̄_{t−1}) with α=1, β=0, against a simulator of n replicas."""
    g = torch.Generator().manual_seed(3)
    dim, rounds = 11, 6
    opt = OuterOptimizer(OuterConfig(sync=False), torch.zeros(dim))
    anchors = [torch.zeros(dim)]       # x̃_0, x̃_1, ...
    in_flight: tuple[int, torch.Tensor] | None = None   # (round id, averaged snapshot)
    for t in range(rounds):
        start = anchors[t]
        snaps = [start + torch.randn(dim, generator=g) for _ in range(N_REPLICAS)]  # τ local steps
        if in_flight is None:
            new = opt.hold().anchor.clone()
            assert torch.equal(new, anchors[t])
        else:
            rid, xbar = in_flight
            assert rid == t - 1                       # the buffer consumed at round t is t−1's
            new = opt.step(xbar).anchor.clone()
            expect = anchors[t] - (anchors[t - 1] - xbar)
            assert torch.allclose(new, expect, atol=1e-6, rtol=0)
        in_flight = (t, weighted_mean(snaps, [1.0] * N_REPLICAS))
        anchors.append(new)


def test_penalty_one_identical_to_none() -> None:
    g = torch.Generator().manual_seed(5)
    base = {"outer_lr": 0.9, "outer_momentum": 0.5, "sync": False}
    a = OuterOptimizer(OuterConfig(**base), torch.zeros(20))  # type: ignore[arg-type]
    b = OuterOptimizer(OuterConfig(penalty="constant", penalty_value=1.0, **base), torch.zeros(20))  # type: ignore[arg-type]
    for _ in range(6):
        avg = torch.randn(20, generator=g)
        assert torch.equal(a.step(avg).anchor, b.step(avg).anchor)


def test_elementwise_penalty_shrinks_every_coordinate() -> None:
    g = torch.Generator().manual_seed(6)
    plain = OuterOptimizer(OuterConfig(sync=False), torch.zeros(30))
    pen = OuterOptimizer(OuterConfig(sync=False, penalty="elementwise", penalty_value=2.0), torch.zeros(30))
    for _ in range(5):
        avg = torch.randn(30, generator=g)
        before = pen.anchor.clone()
        plain_step = plain.anchor - plain.step(avg).anchor
        pen_step = before - pen.step(avg).anchor
        # with β=0 the step is Δ/Λ; Λ ≥ 1 element-wise
        assert bool((pen_step.abs() <= plain_step.abs() + 1e-7).all())
        plain = OuterOptimizer(OuterConfig(sync=False), pen.anchor)  # same state for the next comparison
        plain.prev_anchor = pen.prev_anchor.clone()


def test_lr_ratio_penalty() -> None:
    opt = OuterOptimizer(OuterConfig(penalty="lr_ratio"), torch.zeros(4))
    opt.step(torch.full((4,), -1.0), lr=0.2)
    assert torch.allclose(opt.anchor, torch.full((4,), -1.0))  # first step: no previous lr, Λ = 1
    out = opt.step(opt.anchor - 1.0, lr=0.1)   # Δ = 1, Λ = 0.2/0.1 = 2
    assert torch.allclose(out.anchor, torch.full((4,), -1.5))
    out = opt.step(opt.anchor - 1.0, lr=0.2)   # lr grew: Λ = max(1, 0.5) = 1
    assert torch.allclose(out.anchor, torch.full((4,), -2.5))


@settings(max_examples=30, deadline=None)
@given(phi=st.floats(0.01, 2.0), seed=st.integers(0, 1000), beta=st.floats(0.0, 0.95))
def test_elementwise_clip_bounds_momentum_every_step(phi: float, seed: int, beta: float) -> None:
    g = torch.Generator().manual_seed(seed)
    opt = OuterOptimizer(OuterConfig(outer_momentum=beta, clip="elementwise", clip_threshold=phi, sync=False), torch.zeros(50))
    for _ in range(5):
        opt.step(3 * torch.randn(50, generator=g))
        assert float(opt.momentum.abs().max()) <= phi + 1e-7


def test_global_norm_clip_and_infinite_threshold() -> None:
    g = torch.Generator().manual_seed(8)
    opt = OuterOptimizer(OuterConfig(outer_momentum=0.5, clip="global_norm", clip_threshold=0.5), torch.zeros(40))
    free = OuterOptimizer(OuterConfig(outer_momentum=0.5, clip="elementwise", clip_threshold=math.inf), torch.zeros(40))
    none = OuterOptimizer(OuterConfig(outer_momentum=0.5), torch.zeros(40))
    for _ in range(4):
        avg = 5 * torch.randn(40, generator=g)
        opt.step(avg)
        assert float(opt.momentum.norm()) <= 0.5 + 1e-6
        assert torch.equal(free.step(avg).anchor, none.step(avg).anchor)
    m = torch.tensor([3.0, -4.0])
    assert clip_(m, "elementwise", 1.0) is m
    assert m.tolist() == [1.0, -1.0]


def test_suggest_tau() -> None:
    assert suggest_tau(1.0, 0.25) == 4
    assert suggest_tau(1.01, 0.25) == 5
    assert suggest_tau(0.0, 0.1) == 1
    assert suggest_tau(1.0, 0.25, margin=1.5) == 6
    with pytest.raises(ConfigError):
        suggest_tau(1.0, 0.0)
    # 25M floats, 4 replicas, 100 Mbit/s, 5 ms: 2·3/4·100 MB/12.5 MB/s + 6·5 ms = 12.03 s
    t = ring_allreduce_time(25_000_000, 4, bytes_per_s=12.5e6, latency_s=0.005)
    assert t == pytest.approx(12.03)
    assert suggest_tau(t, 0.5) == 25
    assert ring_allreduce_time(10, 1, bytes_per_s=1.0, latency_s=1.0) == 0.0


@pytest.mark.parametrize(
    "kw",
    [{"tau": 0}, {"outer_lr": 0.0}, {"outer_momentum": 1.0}, {"clip": "x"}, {"penalty": "x"},
     {"penalty": "constant", "penalty_value": 0.5}, {"max_staleness": 0}, {"clip_threshold": 0.0}],
)
def test_config_rejects_bad_values(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        OuterConfig(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("beta", "lr", "nesterov"), [(0.0, 1.0, False), (0.0, 0.7, True), (0.5, 1.0, False), (0.5, 0.7, True)])
def test_step_writes_into_the_handed_buffer_and_follows_the_formula(beta: float, lr: float, nesterov: bool) -> None:
    """With an allocator the new anchor lands in the vector it hands out (the averager's recycled ones),
    whatever that held; beta = 0 (no momentum pass) and lr = 1 (no scaling) still follow SlowMo's update."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1000, generator=g)
    handed: list[torch.Tensor] = []

    def alloc(n: int) -> torch.Tensor:
        handed.append(torch.full((n,), float("nan")))
        return handed[-1]

    opt = OuterOptimizer(OuterConfig(outer_lr=lr, outer_momentum=beta, nesterov=nesterov), x0, alloc=alloc)
    anchor, u = x0.clone(), torch.zeros(1000)
    for _ in range(3):
        avg = torch.randn(1000, generator=g)
        res = opt.step(avg)
        d = anchor - avg
        u = beta * u + d
        new = anchor - lr * ((d + beta * u) if nesterov else u)
        if beta == 0.0 and lr == 1.0:   # x - (x - avg), bit for bit
            assert torch.equal(res.anchor, anchor - (anchor - avg))
        anchor = new
        assert res.anchor.data_ptr() == handed[-1].data_ptr()
        assert torch.allclose(res.anchor, anchor, atol=1e-6, rtol=0)
        assert torch.allclose(opt.momentum, u, atol=1e-6, rtol=0)
        assert torch.equal(opt.anchor, res.anchor)


def test_weighted_mean_into_a_buffer_is_the_same_float() -> None:
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(257, generator=g) for _ in range(3)]
    buf = torch.full((257,), float("nan"))
    got = weighted_mean(parts, [2.0, 2.0, 2.0], out=buf)
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(got, (parts[0] + parts[1] + parts[2]) / 3)
    assert torch.equal(weighted_mean(parts[:1], [1.0], out=torch.empty(257)), parts[0])
    assert torch.equal(weighted_mean(parts, [1.0, 2.0, 4.0], out=torch.empty(257)), weighted_mean(parts, [1.0, 2.0, 4.0]))
