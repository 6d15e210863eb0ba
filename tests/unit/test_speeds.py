"""Speeds measured in training, carried between jobs: a node's running figure (SwarmNode.note_speed), its
own factor against its benchmark (rebalance.own_speed) and the snapshot's profiles scaled by the
members' figures (rebalance.calibrated)."""

from __future__ import annotations

import math

import pytest
import torch
import trio

from fusionp2p.jobs.build import build_job, plan_for_snapshot
from fusionp2p.jobs.rebalance import MAX_SCALE, calibrated, own_speed, scale_profile
from fusionp2p.net.identity import verify
from fusionp2p.net.memory import memory_network
from fusionp2p.plan.snapshot import snapshot_from_records
from fusionp2p.swarm.node import SPEED_WEIGHT, SwarmConfig, SwarmNode
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.wire.records import MAX_SPEED, NodeRecord, decode_signed, encode_signed


def test_calibrated_scales_by_the_announced_speeds_and_the_rest_by_the_typical_one() -> None:
    profiles = dict.fromkeys("abc", TEST_PROFILE)
    out = calibrated(profiles, {"a": 0.5, "b": 0.125, "x": 4.0})    # x: not a member
    assert out["a"].flops_fp32 == pytest.approx(0.5 * TEST_PROFILE.flops_fp32)
    assert out["b"].act_rate == pytest.approx(0.125 * TEST_PROFILE.act_rate)
    # c announced none: the median of the members' figures (of an even count, the geometric mean of the middle two)
    assert out["c"].flops_fp32 == pytest.approx(0.25 * TEST_PROFILE.flops_fp32)
    assert out["a"].memory_bytes == TEST_PROFILE.memory_bytes
    # nobody measured, or figures that are no figures: the profiles as they are
    assert calibrated(profiles, {}) == profiles
    assert calibrated(profiles, {"a": 0.0, "b": math.nan, "c": -1.0}) == profiles
    # a lie is bounded as a re-balance factor is
    assert calibrated({"a": TEST_PROFILE}, {"a": 1e6})["a"].flops_fp32 == pytest.approx(MAX_SCALE * TEST_PROFILE.flops_fp32)


def test_own_speed_is_the_factor_that_makes_the_cost_model_predict_what_was_measured() -> None:
    from fusionp2p.data import BuiltinCorpus
    from fusionp2p.models.gpt2 import GPT2, GPT2Config
    from fusionp2p.net.identity import Identity
    from fusionp2p.train.config import TrainConfig

    torch.manual_seed(0)
    model = GPT2(GPT2Config.tiny(block_size=16, n_layer=2, n_head=2, n_embd=32))
    me = Identity.generate()
    cfg = TrainConfig(steps=2, micro_batch=2, micro_batches=4, replicas=2, averaging=None, compression=None)
    built = build_job(model, None, BuiltinCorpus(seq_len=16), cfg, publisher=me.peer_id, sign=me.sign, now=1.7e9,
                      nonce=b"\0" * 16)
    # the snapshot's figure for "a" is scaled already (by an earlier speed): the factor is against a's own profile
    snap = snapshot_from_records(built.spec.job_id, 0, [("a", scale_profile(TEST_PROFILE, 0.5)), ("b", TEST_PROFILE)], [])
    plan = plan_for_snapshot(built.spec, built.dag, snap)
    assert set(plan.peers) == {"a", "b"}
    fast = own_speed(built.spec, built.dag, plan, snap, "a", TEST_PROFILE, 0.01)
    slow = own_speed(built.spec, built.dag, plan, snap, "a", TEST_PROFILE, 0.03)
    assert fast is not None and slow is not None and slow == pytest.approx(fast / 3)
    half = own_speed(built.spec, built.dag, plan, snap, "a", scale_profile(TEST_PROFILE, 0.5), 0.01)
    assert half == pytest.approx(2 * fast)
    assert own_speed(built.spec, built.dag, plan, snap, "nobody", TEST_PROFILE, 0.01) is None


def test_a_node_announces_the_running_geometric_mean_of_its_speeds_on_one_model() -> None:
    m1, m2 = "a" * 64, "b" * 64

    async def main() -> None:
        async with memory_network() as net:
            t = net.add_host()
            node = SwarmNode(t, SwarmConfig(), TEST_PROFILE)
            assert node.speed == 0.0 and node._record().speed == 0.0
            node.note_speed(0.25, m1)
            assert node.speed == 0.25 and node._beat_now.is_set()     # announced at the next beat, at once
            node.note_speed(1.0, m1)
            assert node.speed == pytest.approx(0.25 ** (1 - SPEED_WEIGHT))
            for bad in (0.0, -1.0, math.nan, math.inf):
                node.note_speed(bad, m1)
            assert node.speed == pytest.approx(0.25 ** (1 - SPEED_WEIGHT)) and node.speed_model == m1
            rec = decode_signed(encode_signed(node._record(), t.sign), verify)
            assert isinstance(rec, NodeRecord)
            assert rec.speed_on(m1) == pytest.approx(node.speed) and rec.speed_on(m2) == 0.0 and rec.speed_on("") == 0.0
            assert node.speed_on(m1) == rec.speed_on(m1) and node.speed_on(m2) == 0.0
            node.note_speed(2.0, m2)                                   # another model: starts over
            assert node.speed == 2.0 and node.speed_model == m2
            for _ in range(60):
                node.note_speed(1e9, m2)                               # bounded whatever a job measured
            assert node.speed == pytest.approx(MAX_SPEED)
            rec = decode_signed(encode_signed(node._record(), t.sign), verify)
            assert isinstance(rec, NodeRecord) and rec.speed_on(m2) == pytest.approx(MAX_SPEED)

    trio.run(main)


def test_a_re_plan_that_changes_only_the_deal_is_left_to_the_replicas() -> None:
    """A one-stage plan with micro-batches by speed under streaming CO2 re-deals them in its rounds
    (train/deal.py): the leader's re-balance keeps such a plan when the better one differs only
    in those counts (``same_layout``); a plan in lockstep, a pipeline or synchronous CO2 does not re-deal."""
    import dataclasses

    from fusionp2p.jobs.rebalance import redeals_in_band, same_layout
    from fusionp2p.plan.plan import Plan, Stage
    from fusionp2p.train.config import CO2, TrainConfig

    one = Plan(job="j", epoch=0, snapshot_hash="s", algorithm="op-fence", seed=0, n_units=2, micro_batches=4,
               stages=(Stage(start=0, end=2, replicas=("a", "b")),), fences=(), micro=(11, 5), micro_period=2)
    cfg = TrainConfig(steps=4, replicas=2, averaging=CO2(tau=2))
    assert redeals_in_band(cfg, one)
    assert not redeals_in_band(cfg, dataclasses.replace(one, micro=(), micro_period=1))
    assert not redeals_in_band(dataclasses.replace(cfg, averaging=CO2(tau=2, sync=True)), one)
    other = dataclasses.replace(one, micro=(5, 3), micro_period=1,
                                stages=(Stage(start=0, end=2, replicas=("b", "a")),))
    assert same_layout(one, other)
    assert not same_layout(one, dataclasses.replace(other, stages=(Stage(start=0, end=2, replicas=("a", "c")),)))
