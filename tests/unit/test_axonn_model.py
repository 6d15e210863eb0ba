"""The AxoNN communication model, bandwidth rule and configuration search (ALGORITHMS.md §3.4-3.5)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fusionp2p.errors import ConfigError
from fusionp2p.plan.axonn import (
    DIMS,
    BandwidthModel,
    GridShape,
    LinearSpec,
    collectives_time,
    factorizations,
    feasible,
    layer_collectives,
    message_bytes,
    ring_factor,
    ring_volumes,
    script_transformer_time,
    search,
    step_collectives,
    transformer_layers,
)

sizes = st.sampled_from([1, 2, 3, 4])
grids = st.builds(GridShape, g_x=sizes, g_y=sizes, g_z=sizes, g_data=sizes)


@settings(max_examples=60, deadline=None)
@given(grids)
def test_rank_layout_roundtrip_and_groups_partition(grid: GridShape) -> None:
    for r in range(grid.world):
        assert grid.rank(*grid.coords(r)) == r
    assert grid.coords(1 % grid.world)[0] == (1 % grid.world) % grid.g_x   # X fastest
    for dim in DIMS:
        groups = grid.groups(dim)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(grid.world))
        assert all(len(g) == grid.size(dim) for g in groups)
        for r in range(grid.world):
            assert r in grid.group_of(dim, r)
            assert grid.group_of(dim, r) in groups
    if grid.g_x > 1:   # X groups are consecutive ranks
        assert grid.groups("x")[0] == tuple(range(grid.g_x))


def test_rank_formula_matches_the_spec() -> None:
    g = GridShape(g_x=2, g_y=3, g_z=2, g_data=2)
    assert g.rank(1, 2, 1, 1) == 1 + 2 * (2 + 3 * (1 + 2 * 1))
    assert g.inner("x") == 1
    assert g.inner("y") == 2
    assert g.inner("z") == 6
    assert g.inner("data") == 12
    with pytest.raises(ConfigError):
        GridShape(g_x=0)
    with pytest.raises(ConfigError):
        g.coords(g.world)


def test_ring_factors() -> None:
    assert ring_factor("all_reduce", 1) == 0.0
    assert ring_factor("all_reduce", 4) == pytest.approx(1.5)
    assert ring_factor("all_gather", 4) == pytest.approx(0.75)
    assert ring_factor("reduce_scatter", 2) == pytest.approx(0.5)


def _formula_volumes(g: GridShape, n_in: int, n_out: int, T: int, b: int, transposed: bool) -> dict[str, float]:
    """§3.4 restated literally; transposed layers swap the X and Y roles."""
    gx, gy = (g.g_y, g.g_x) if transposed else (g.g_x, g.g_y)
    v_in = 2 * (gx - 1) / gx * T * n_out / gy * b          # AR of the output over the input split
    v_out = 2 * (gy - 1) / gy * T * n_in / gx * b          # AR of dX over the output split
    v_z = 3 * (g.g_z - 1) / g.g_z * n_in * n_out / (gx * gy) * b
    v_d = 2 * (g.g_data - 1) / g.g_data * n_in * n_out / (gx * gy * g.g_z) * 4
    x, y = (v_out, v_in) if transposed else (v_in, v_out)
    return {"x": x, "y": y, "z": v_z, "data": v_d}


@settings(max_examples=80, deadline=None)
@given(grids, st.booleans(), st.sampled_from([2, 4]))
def test_volumes_equal_the_closed_form(grid: GridShape, transposed: bool, b: int) -> None:
    spec = LinearSpec(n_in=48, n_out=96, transposed=transposed)
    assume(spec.fits(grid))
    T = 120
    got = ring_volumes(grid, layer_collectives(grid, spec, T, act_bytes=b, grad_bytes=4))
    want = _formula_volumes(grid, 48, 96, T, b, transposed)
    for d in DIMS:
        assert got[d] == pytest.approx(want[d], rel=1e-12, abs=1e-9)
        if grid.size(d) == 1:
            assert got[d] == 0.0


def test_message_bytes_before_ring_factors_and_zero_grid() -> None:
    g = GridShape(g_x=2, g_y=4, g_z=2, g_data=2)
    m = message_bytes(layer_collectives(g, LinearSpec(n_in=64, n_out=32), 10, act_bytes=2, grad_bytes=4))
    assert m == {"x": 10 * 32 // 4 * 2, "y": 10 * 64 // 2 * 2, "z": 3 * (64 // 2) * (32 // 4) * 2,
                 "data": 64 * 32 // 16 * 4}
    one = GridShape()
    assert layer_collectives(one, LinearSpec(n_in=8, n_out=8, bias=True), 5) == []
    with_bias = layer_collectives(GridShape(g_z=2, g_data=2), LinearSpec(n_in=8, n_out=8, bias=True), 5)
    assert sum(c.nbytes for c in with_bias if c.op == "all_reduce" and c.dim == "z") == 8 * 4


def test_bandwidth_rule() -> None:
    bw = BandwidthModel(devices_per_node=4, inter=60.0, intra=((1, 2, 76.0), (1, 4, 225.0), (2, 2, 76.0)),
                        intra_default=50.0)
    assert bw.beta(1, 2) == 76.0
    assert bw.beta(1, 4) == 225.0
    assert bw.beta(2, 2) == 76.0
    assert bw.beta(1, 3) == 50.0                       # inside the node, not in the table
    assert bw.beta(1, 8) == 60.0 / 1                   # leaves the node: one ring per node
    assert bw.beta(4, 2) == 60.0 / 4                   # 4 rings share the NIC
    assert bw.beta(16, 2) == 60.0 / 4                  # capped by devices_per_node
    with pytest.raises(ConfigError):
        BandwidthModel(devices_per_node=4, inter=1.0).beta(1, 2)   # no intra value at all


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 64))
def test_bandwidth_non_increasing_in_ip_beyond_the_node(node: int, g: int, ip: int) -> None:
    bw = BandwidthModel(devices_per_node=node, inter=100.0, intra_default=1000.0)
    if ip * g > node:
        assert bw.beta(ip, g) == 100.0 / min(node, ip)
        assert bw.beta(ip * 2, g) <= bw.beta(ip, g)


def _brute(world: int, layers: tuple[LinearSpec, ...], batch: int, seq: int, bw: BandwidthModel,
           min_tp: int) -> list[tuple[float, tuple[int, int, int, int]]]:
    out = []
    for t in itertools.product(range(1, world + 1), repeat=4):
        if t[0] * t[1] * t[2] * t[3] != world:
            continue
        g = GridShape(g_x=t[0], g_y=t[1], g_z=t[2], g_data=t[3])
        if feasible(g, layers, batch, min_tp=min_tp):
            out.append((collectives_time(g, step_collectives(g, layers, batch * seq), bw), t))
    return sorted(out)


@pytest.mark.parametrize(("world", "min_tp"), [(1, 1), (2, 1), (4, 1), (8, 1), (8, 4), (16, 2)])
def test_search_equals_brute_force_sorted_and_feasible(world: int, min_tp: int) -> None:
    layers = transformer_layers(64, 256)
    bw = BandwidthModel(devices_per_node=4, inter=25e9, intra_default=200e9, alpha=9e-6)
    ranked = search(world, layers, batch=16, seq_len=32, bw=bw, min_tp=min_tp, top_k=1000, powers_of_two=False)
    brute = _brute(world, layers, 16, 32, bw, min_tp)
    assert [r.grid.as_tuple() for r in ranked] == [t for _, t in brute]
    assert [r.predicted_s for r in ranked] == pytest.approx([c for c, _ in brute])
    assert all(a.predicted_s <= b.predicted_s for a, b in itertools.pairwise(ranked))
    for r in ranked:
        assert r.grid.tp >= min_tp
        assert 16 % r.grid.batch_split == 0
        assert r.grid.world == world
    assert len(search(world, layers, batch=16, seq_len=32, bw=bw, min_tp=min_tp, top_k=3)) <= 3


@pytest.mark.parametrize(("n", "batch", "seq", "min_tp"), [
    (256, 64, 1024, 4),     # activations dominate
    (256, 64, 1024, 8),     # everything tensor parallel, spanning two nodes
    (4096, 8, 16, 2),       # weights dominate
    (1024, 16, 256, 1),
])
def test_search_keeps_the_heaviest_dimension_inside_the_node(n: int, batch: int, seq: int, min_tp: int) -> None:
    layers = (LinearSpec(n_in=n, n_out=4 * n), LinearSpec(n_in=4 * n, n_out=n, transposed=True))
    bw = BandwidthModel(devices_per_node=4, inter=1e9, intra_default=100e9, alpha=0.0)
    best = search(8, layers, batch=batch, seq_len=seq, bw=bw, top_k=1, min_tp=min_tp)[0]
    heaviest = max(best.volumes, key=lambda dv: dv[1])[0]
    assert best.grid.inner(heaviest) * best.grid.size(heaviest) <= 4, best


def test_search_rejects_impossible_jobs() -> None:
    bw = BandwidthModel.uniform(1e9, devices=4)
    with pytest.raises(ConfigError):
        search(4, transformer_layers(64, 256), batch=3, seq_len=1, bw=bw, min_tp=5)
    with pytest.raises(ConfigError):
        search(4, transformer_layers(64, 256), batch=4, seq_len=1, bw=bw, top_k=0)


def test_factorizations_count() -> None:
    assert len(factorizations(4)) == 10
    assert len(factorizations(8)) == 20
    assert len(factorizations(12, powers_of_two=True)) == 0
    assert all(g.world == 6 for g in factorizations(6))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]))
def test_script_variant_agrees_when_x_equals_y_with_one_bandwidth(gxy: int, gz: int, gd: int) -> None:
    grid = GridShape(g_x=gxy, g_y=gxy, g_z=gz, g_data=gd)
    bw = BandwidthModel.uniform(10e9, devices=64, alpha=5e-6)
    principled = collectives_time(grid, step_collectives(grid, transformer_layers(64, 256), 512), bw)
    assert script_transformer_time(grid, 64, 256, 512, bw) == pytest.approx(principled, rel=1e-12)


def test_script_variant_differs_where_the_swap_matters() -> None:
    grid = GridShape(g_x=4, g_y=1)
    bw = BandwidthModel.uniform(10e9, devices=64)
    principled = collectives_time(grid, step_collectives(grid, transformer_layers(64, 256), 512), bw)
    assert script_transformer_time(grid, 64, 256, 512, bw) != pytest.approx(principled, rel=1e-3)
