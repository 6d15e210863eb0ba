"""The planner prices each stage with the micro-batches its schedule holds at once (1F1B: ``min(S - stage, M)``),
the bound the stage workers run under and the nodes hold a stage against: one function, ``plan/config.py:
in_flight_limit`` (issue 37)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.data import BuiltinCorpus
from fusionp2p.errors import ConfigError
from fusionp2p.jobs.build import AcceptedJob, build_job, choose_plan, job_cost_model
from fusionp2p.jobs.weights import stage_memory, stage_recompute
from fusionp2p.models import GPT2, GPT2Config
from fusionp2p.net.identity import Identity
from fusionp2p.plan.cluster import device_order
from fusionp2p.plan.config import PlannerConfig, in_flight_limit
from fusionp2p.plan.estimator import CostModel
from fusionp2p.plan.opfence import InfeasiblePlanError, make_plan
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.sdk import LOCAL_PROFILE
from fusionp2p.train.config import TrainConfig
from fusionp2p.train.schedule import ScheduleConfig
from fusionp2p.types import Edge, Unit, WorkloadGraph
from tests.unit.test_plan_helpers import assert_matches_brute_force, chain, snapshot

ONE_F_ONE_B = PlannerConfig(compression=False, replicas=False, schedule="1f1b")


def test_the_schedule_and_the_planner_share_one_bound() -> None:
    for kind in ("gpipe", "1f1b"):
        for stages, m in ((1, 8), (4, 8), (4, 2), (12, 8)):
            cm = CostModel(chain(stages), snapshot(stages), dataclasses.replace(ONE_F_ONE_B, schedule=kind, micro_batches=m))
            for s in range(stages):
                want = ScheduleConfig(kind=kind, stages=stages, micro_batches=m, stage=s).in_flight_limit
                assert cm.in_flight(s, stages) == in_flight_limit(kind, stages, s, m) == want
    with pytest.raises(ConfigError, match="schedule must be one of"):
        PlannerConfig(schedule="zero-bubble")


def test_a_model_that_fits_only_under_the_1f1b_bound_is_planned_with_it() -> None:
    # activation-heavy units (2 MB of parameter state + 1 MB per micro-batch each): with every micro-batch in
    # flight (GPipe) a unit needs 10 MB and no two fit one device of 14.5 MB (13 MB usable), so 8 units do not
    # fit 4 devices; under 1F1B (4, 3, 2, 1 micro-batches in flight down the pipeline) two a stage do
    w = chain(8, params=500_000, act=1_000_000)
    snap = snapshot(4, memory=lambda i: 14_500_000)
    gpipe = dataclasses.replace(ONE_F_ONE_B, schedule="gpipe")
    with pytest.raises(InfeasiblePlanError, match="micro-batches in flight"):
        make_plan(w, snap, gpipe)
    plan = make_plan(w, snap, ONE_F_ONE_B)
    n_s = len(plan.stages)
    assert n_s == 4
    for s, stage in enumerate(plan.stages):
        units = stage.end - stage.start
        assert stage.memory_bytes == pytest.approx(units * (4 * 500_000 + min(n_s - s, 8) * 1_000_000))
        assert stage.memory_bytes <= 14_500_000 * ONE_F_ONE_B.memory_headroom
    assert [st.end - st.start for st in plan.stages] == [2, 2, 2, 2]
    # a 9th unit: the last stage (one micro-batch in flight) can take 3 units (9 MB), the first (4) cannot
    nine = make_plan(chain(9, params=500_000, act=1_000_000), snap, ONE_F_ONE_B)
    assert nine.stages[0].end - nine.stages[0].start == 2
    assert all(st.memory_bytes <= 14_500_000 * 0.9 for st in nine.stages)


def test_where_memory_never_binds_the_plan_is_the_same_whatever_the_schedule() -> None:
    w = chain(12, params=10_000, act=10_000)
    snap = snapshot(4)
    a = make_plan(w, snap, ONE_F_ONE_B)
    b = make_plan(w, snap, dataclasses.replace(ONE_F_ONE_B, schedule="gpipe"))
    assert [(s.start, s.end, s.replicas) for s in a.stages] == [(s.start, s.end, s.replicas) for s in b.stages]
    # ... but each stage is priced with what it holds
    assert a.stages[-1].memory_bytes < b.stages[-1].memory_bytes


def _activation_heavy(data: st.DataObject, n_max: int, d_max: int) -> tuple[WorkloadGraph, Snapshot]:
    n = data.draw(st.integers(1, n_max))
    d = data.draw(st.integers(1, d_max))
    units = tuple(Unit(name=f"u{i}", kind="a", fwd_flops=data.draw(st.floats(1e6, 1e9)), bwd_flops=2e8,
                       param_bytes=data.draw(st.integers(0, 10**6)), act_bytes=data.draw(st.integers(0, 2 * 10**6)))
                  for i in range(n))
    edges = tuple(Edge(src=i, dst=i + 1, nbytes=data.draw(st.integers(0, 10**6))) for i in range(n - 1))
    mem = [data.draw(st.integers(5 * 10**6, 6 * 10**7)) for _ in range(d)]
    bws = {(a, b): data.draw(st.floats(1e6, 1e9)) for a in range(d) for b in range(a + 1, d)}
    snap = snapshot(d, bw=lambda a, b: bws[(a, b)], memory=lambda i: mem[i])
    return WorkloadGraph(units=units, edges=edges), snap


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_1f1b_search_is_exact_against_brute_force(data: st.DataObject) -> None:
    """The least bottleneck over every contiguous partition and assignment, each stage priced with
    ``min(S - stage, M)`` micro-batches, and infeasible exactly when no such layout fits."""
    w, snap = _activation_heavy(data, 8, 4)
    m = data.draw(st.integers(1, 8))
    cfg = dataclasses.replace(ONE_F_ONE_B, micro_batches=m, exact_search_devices=data.draw(st.sampled_from([0, 5])))
    orders = None
    if cfg.exact_search_devices == 0:   # the cluster order: exact over its subsequences
        cm = CostModel(w, snap, cfg)
        orders = [device_order(cm.bw, cm.flops, cfg.cluster_theta, 0)[1]]
    assert_matches_brute_force(w, snap, cfg, orders=orders, memory=True)


def test_a_node_holds_its_stage_against_the_planners_own_figure() -> None:
    """The stage a node checks (``jobs/weights.stage_memory``) is the plan's figure, and a GPT-2 that does not
    fit 4 nodes with every micro-batch in flight is planned on them under 1F1B without recomputation."""
    cfg = TrainConfig(steps=1, micro_batch=8, micro_batches=8, replicas=1, averaging="none", compression="none",
                      schedule="1f1b", recompute="never")
    me = Identity.generate()
    torch.manual_seed(0)
    built = build_job(GPT2(GPT2Config.tiny(block_size=32)), None, BuiltinCorpus(seq_len=32), cfg,
                      publisher=me.peer_id, sign=me.sign, now=1.0, nonce=b"f" * 16, piece_bytes=4096)
    acc = AcceptedJob(spec=built.spec, dag=built.dag, tokens=None)
    peers = [f"n{i}" for i in range(4)]
    whole = job_cost_model(built.spec, built.dag, Snapshot(job=built.spec.job_id, epoch=0,
                                                           members=dict.fromkeys(peers, LOCAL_PROFILE), links={}))[0]
    # a quarter of the state with every micro-batch in flight, and some room: GPipe's pricing does not fit
    offer = int(whole.mem[-1] / 4 * 1.15 / 0.9)
    members = dict.fromkeys(peers, dataclasses.replace(LOCAL_PROFILE, memory_bytes=offer))
    gpipe = dataclasses.replace(built.spec, config=dataclasses.replace(cfg, schedule="gpipe"))
    with pytest.raises(InfeasiblePlanError):
        choose_plan(gpipe, built.dag, members)
    plan = choose_plan(built.spec, built.dag, members)
    snap = Snapshot(job=built.spec.job_id, epoch=0, members=members, links={})
    assert len(plan.stages) > 1
    for s, stage in enumerate(plan.stages):
        assert not stage_recompute(acc, plan, snap, s)
        assert stage_memory(acc, plan, snap, s) == pytest.approx(stage.memory_bytes)
        assert stage.memory_bytes <= offer
