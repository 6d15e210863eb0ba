"""The planner prices a stage's largest trainable tensor once more (issue 37): from a step's second
micro-batch on, autograd holds each parameter's new gradient whole before adding it into ``.grad``, so a
stage peaks at its state plus its largest tensor (measured: the node holding a 94 MiB embedding went
94 MiB over the stage figure in ``benchmarks/model_scale``). A range's maximum is not a prefix sum: the
search lowers each start's memory limit until the maximum fits too, exact against brute force."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.graph import trace
from fusionp2p.graph.workload import to_workload
from fusionp2p.plan.config import PlannerConfig
from fusionp2p.plan.estimator import CostModel
from fusionp2p.plan.opfence import InfeasiblePlanError, make_plan
from fusionp2p.types import Edge, Unit, WorkloadGraph
from tests.unit.test_plan_helpers import assert_matches_brute_force, snapshot

CFG = PlannerConfig(compression=False, replicas=False, schedule="1f1b", micro_batches=4)


class _Embed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 16)   # 64000 bytes: the largest tensor
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.emb(x)).pow(2).mean()
        return out


def test_each_unit_knows_its_largest_trainable_tensor() -> None:
    w = to_workload(trace(_Embed(), torch.zeros(2, 4, dtype=torch.long)), 2)
    assert max(u.max_param_bytes for u in w.units) == 1000 * 16 * 4
    assert all(u.max_param_bytes <= u.param_bytes for u in w.units)


def _units(largest: list[int]) -> WorkloadGraph:
    units = tuple(Unit(name=f"u{i}", kind="a", fwd_flops=1e8, bwd_flops=2e8, param_bytes=1_000_000, act_bytes=0,
                       max_param_bytes=b) for i, b in enumerate(largest))
    return WorkloadGraph(units=units, edges=tuple(Edge(src=i, dst=i + 1, nbytes=1000) for i in range(len(units) - 1)))


def test_a_stage_is_priced_with_its_largest_tensor_when_a_step_accumulates() -> None:
    w, snap = _units([900_000, 10_000, 10_000, 10_000]), snapshot(2)
    cm = CostModel(w, snap, CFG)
    assert cm.range_memory(0, 2, replicated=False) == 2 * 4 * 1_000_000 + 900_000
    assert cm.range_memory(1, 4, replicated=False) == 3 * 4 * 1_000_000 + 10_000
    one = CostModel(w, snap, dataclasses.replace(CFG, micro_batches=1))
    assert one.range_memory(0, 2, replicated=False) == 2 * 4 * 1_000_000   # nothing accumulates


def test_the_search_cuts_where_the_largest_tensor_does_not_fit() -> None:
    # 4 units of 4 MB of state; two devices of 10 MB usable. Without the transient, [0, 2) and [2, 4) fit
    # (8 MB each); the first unit's 2.5 MB tensor makes [0, 2) 10.5 MB: no plan over two devices fits
    w = _units([2_500_000, 10_000, 10_000, 10_000])
    with pytest.raises(InfeasiblePlanError):
        make_plan(w, snapshot(2, memory=lambda i: 11_111_112), CFG)
    plan = make_plan(w, snapshot(3, memory=lambda i: 11_111_112), CFG)
    assert plan.stages[0].end == 1
    for s in plan.stages:
        assert s.memory_bytes <= 11_111_112 * 0.9


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_search_with_the_transient_is_exact_against_brute_force(data: st.DataObject) -> None:
    n, d = data.draw(st.integers(1, 7)), data.draw(st.integers(1, 4))
    units = []
    for i in range(n):
        p = data.draw(st.integers(0, 10**6))
        units.append(Unit(name=f"u{i}", kind="a", fwd_flops=data.draw(st.floats(1e6, 1e9)), bwd_flops=2e8,
                          param_bytes=p, act_bytes=data.draw(st.integers(0, 10**6)),
                          max_param_bytes=data.draw(st.integers(0, p))))
    edges = tuple(Edge(src=i, dst=i + 1, nbytes=data.draw(st.integers(0, 10**6))) for i in range(n - 1))
    mem = [data.draw(st.integers(4 * 10**6, 3 * 10**7)) for _ in range(d)]
    snap = snapshot(d, memory=lambda i: mem[i])
    w = WorkloadGraph(units=tuple(units), edges=edges)
    cfg = dataclasses.replace(CFG, micro_batches=data.draw(st.integers(1, 6)), exact_search_devices=5)
    assert_matches_brute_force(w, snap, cfg, memory=True)
