"""The lag of a job's streaming CO2 rounds (jobs/build.averaging_lag): chosen from the plan and its
snapshot, the same on every replica; 2 where a round would take most of a step on the replicas' link."""

from __future__ import annotations

import torch

from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.build import averaging_lag, build_job, plan_for_snapshot
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.net.identity import Identity
from fusionp2p.plan.snapshot import Link, snapshot_from_records
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.train.config import CO2, TrainConfig


def _built(averaging: CO2 | None) -> object:
    torch.manual_seed(0)
    model = GPT2(GPT2Config.tiny(block_size=16, n_layer=2, n_head=2, n_embd=32))
    me = Identity.generate()
    cfg = TrainConfig(steps=8, micro_batch=2, micro_batches=4, replicas=2, averaging=averaging, compression=None,
                      planner="even_layers")
    return build_job(model, None, BuiltinCorpus(seq_len=16), cfg, publisher=me.peer_id, sign=me.sign, now=1.7e9,
                     nonce=b"\0" * 16)


def _lag(averaging: CO2 | None, bandwidth: float, latency: float = 0.0) -> int:
    built = _built(averaging)
    snap = snapshot_from_records(built.spec.job_id, 0, [("a", TEST_PROFILE), ("b", TEST_PROFILE)],
                                 [("a", "b", Link(bandwidth_bps=bandwidth, latency_s=latency))])
    plan = plan_for_snapshot(built.spec, built.dag, snap)
    assert [len(st.replicas) for st in plan.stages] == [2]
    return averaging_lag(built.spec, built.dag, plan, snap, 0)


def test_a_slow_link_between_the_replicas_applies_rounds_two_steps_late() -> None:
    assert _lag(CO2(), 1.25e9) == 1          # 10 Gbit/s: a round is nothing next to a step
    assert _lag(CO2(), 1e3) == 2             # 8 kbit/s: it takes longer than the step
    assert _lag(CO2(), 1.25e9, latency=1.0) == 2   # or a round trip of a second
    # only streaming rounds are lagged: the whole-vector and blocking forms keep their own schedule
    assert _lag(CO2(stream=False), 1e3) == 1
    assert _lag(CO2(sync=True), 1e3) == 1
    assert _lag(CO2(tau=1), 1e3) == 1        # one fragment: its next snapshot needs the last round applied
