"""The spot checks' memory is planned for (issue 46): with ``TrainConfig.spot_rate`` > 0 every replica of a
replicated stage keeps the ledger's state copies and transcripts and a checker's copy of its stage
(``jobs/verified.py``: ``SPOT_STATE_COPIES``, ``SPOT_BOUNDARY_STEPS``), and the planner and the nodes' check of
a stage (``jobs/weights.py:stage_memory``) price them, so a job that fits only without them is refused by the
planner instead of being run past the nodes' offers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.build import AcceptedJob, build_job, choose_plan, job_cost_model, planner_config
from fusionp2p.jobs.verified import KEEP, SPOT_BOUNDARY_STEPS, SPOT_STATE_COPIES
from fusionp2p.jobs.weights import stage_memory
from fusionp2p.models import GPT2, GPT2Config
from fusionp2p.net.identity import Identity
from fusionp2p.plan.config import PlannerConfig
from fusionp2p.plan.estimator import CostModel
from fusionp2p.plan.opfence import InfeasiblePlanError
from fusionp2p.plan.snapshot import Snapshot
from fusionp2p.sdk import LOCAL_PROFILE
from fusionp2p.train.config import CO2, TrainConfig
from tests.unit.test_plan_helpers import chain, snapshot

MiB = 2**20


def test_the_planner_prices_the_checks_state_copies_and_transcripts_on_replicated_stages_only() -> None:
    off = planner_config(TrainConfig(steps=1, micro_batches=4, averaging=CO2()))
    on = planner_config(TrainConfig(steps=1, micro_batches=4, averaging=CO2(), spot_rate=0.01))
    assert on.replica_memory_factor == off.replica_memory_factor + SPOT_STATE_COPIES
    assert (on.replica_boundary_steps, off.replica_boundary_steps) == (SPOT_BOUNDARY_STEPS, 0)
    assert SPOT_STATE_COPIES >= KEEP + 1 and SPOT_BOUNDARY_STEPS == KEEP   # the ledger's copies, the checker's
    w, snap = chain(4, params=1_000_000, act=300_000), snapshot(4)
    base = PlannerConfig(micro_batches=4, compression=False)
    a = CostModel(w, snap, base)
    b = CostModel(w, snap, dataclasses.replace(base, replica_memory_factor=base.replica_memory_factor + 7,
                                               replica_boundary_steps=3))
    # a middle range: 2 units of parameters, and its two fences' activations and gradients, 3 steps x 4
    assert b.range_memory(1, 3, replicated=True) - a.range_memory(1, 3, replicated=True) == pytest.approx(
        7 * 2_000_000 + 3 * 4 * 2 * (300_000 + 300_000))
    assert b.range_memory(1, 3, replicated=False) == a.range_memory(1, 3, replicated=False)


@pytest.fixture(scope="module")
def jobs() -> tuple[AcceptedJob, AcceptedJob]:
    """GPT-2 tiny in 2 stages x 2 replicas, without the checks and with them (the same DAG)."""
    cfg = TrainConfig(steps=1, micro_batch=8, micro_batches=4, stages=2, replicas=2, averaging=CO2(),
                      recompute="never")
    me = Identity(b"\x07" * 32)
    torch.manual_seed(0)
    built = build_job(GPT2(GPT2Config.tiny(block_size=32)), None, BuiltinCorpus(seq_len=32), cfg,
                      publisher=me.peer_id, sign=me.sign, now=1.0, nonce=b"f" * 16, piece_bytes=4096)
    checked = dataclasses.replace(built.spec, config=dataclasses.replace(cfg, spot_rate=0.01))
    return (AcceptedJob(spec=built.spec, dag=built.dag, tokens=None),
            AcceptedJob(spec=checked, dag=built.dag, tokens=None))


def test_a_job_that_fits_replicated_only_without_the_checks_is_not_planned_past_the_offers(
        jobs: tuple[AcceptedJob, AcceptedJob]) -> None:
    peers = [f"n{i}" for i in range(4)]
    plain, checked = jobs

    def members(offer: int) -> dict[str, object]:
        return dict.fromkeys(peers, dataclasses.replace(LOCAL_PROFILE, memory_bytes=offer))

    # 8 MiB each: 2 stages x 2 replicas fit without the checks (5.8 and 4.2 MiB)...
    plan = choose_plan(plain.spec, plain.dag, members(8 * MiB))  # type: ignore[arg-type]
    snap = Snapshot(job=plain.spec.job_id, epoch=0, members=members(8 * MiB), links={})  # type: ignore[arg-type]
    assert [len(st.replicas) for st in plan.stages] == [2, 2]
    # ... and the same layout with the checks' copies would not: a node would run past its offer
    judged = Snapshot(job=checked.spec.job_id, epoch=0, members=snap.members, links={})
    assert max(stage_memory(checked, plan, judged, s) for s in range(2)) > 8 * MiB
    with pytest.raises(InfeasiblePlanError, match="fits their memory"):
        choose_plan(checked.spec, checked.dag, members(8 * MiB))  # type: ignore[arg-type]
    # with room, the checked plan's figure is what a node holds its stage against, the priced copies over
    # the plain one: SPOT_STATE_COPIES of its parameters (a tied weight's copy too) and its kept boundary
    roomy = members(64 * MiB)
    plan = choose_plan(checked.spec, checked.dag, roomy)  # type: ignore[arg-type]
    snap = Snapshot(job=checked.spec.job_id, epoch=0, members=roomy, links={})  # type: ignore[arg-type]
    cm = job_cost_model(checked.spec, checked.dag, snap)[0]
    for s, st in enumerate(plan.stages):
        assert len(st.replicas) == 2
        assert stage_memory(checked, plan, snap, s) == pytest.approx(st.memory_bytes)
        extra = stage_memory(checked, plan, snap, s) - stage_memory(plain, plan, snap, s)
        assert extra == pytest.approx(SPOT_STATE_COPIES * cm.range_params(st.start, st.end)
                                      + float(cm.replica_boundary(st.start, st.end)))
