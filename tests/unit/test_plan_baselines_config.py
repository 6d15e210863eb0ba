"""The planner override of a job (``TrainConfig.planner``): baselines as configurations of the product.

The WAN benchmark's baselines (even layers, even FLOPs, dense, per-step all-reduce) are jobs like any
other; these tests pin the field's wire form (absent at its default, so older signed specs keep their
bytes), its validation, the baselines' replica groups, and that ``choose_plan`` dispatches on it.
"""

from __future__ import annotations

import pytest

from fusionp2p.errors import ConfigError, RemoteProtocolError
from fusionp2p.plan import PlannerConfig, plan_even_flops, plan_even_layers
from fusionp2p.plan.baselines import id_groups
from fusionp2p.train.config import TrainConfig
from fusionp2p.wire.msg import packb, unpackb
from tests.unit.test_plan_helpers import chain, peers, snapshot


def test_planner_is_left_out_of_the_wire_at_its_default() -> None:
    cfg = TrainConfig(steps=10)
    assert cfg.planner == "opfence"
    assert "planner" not in cfg.to_wire()
    # a map without the key (an older publisher's spec) decodes to the default
    assert TrainConfig.from_wire(unpackb(packb(cfg.to_wire()))) == cfg


@pytest.mark.parametrize("planner", ["even_layers", "even_flops"])
def test_baseline_planner_round_trips(planner: str) -> None:
    cfg = TrainConfig(steps=10, planner=planner, replicas=2, averaging=None, compression=None)
    wire = cfg.to_wire()
    assert wire["planner"] == planner
    assert TrainConfig.from_wire(unpackb(packb(wire))) == cfg


def test_planner_user_errors() -> None:
    with pytest.raises(ConfigError, match="planner must be one of"):
        TrainConfig(steps=1, planner="gpipe")
    with pytest.raises(ConfigError, match="compression=None"):
        TrainConfig(steps=1, planner="even_layers", compression="adatopk")


def test_planner_from_a_peer_is_checked() -> None:
    wire = TrainConfig(steps=10).to_wire()
    for bad in ("gpipe", 3, None, "x" * 1000):
        with pytest.raises(RemoteProtocolError):
            TrainConfig.from_wire({**wire, "planner": bad})
    with pytest.raises(RemoteProtocolError):   # a baseline cannot carry AdaTopK
        TrainConfig.from_wire({**wire, "planner": "even_flops", "compression": {"rho_min": 0.01}})


def test_id_groups() -> None:
    assert id_groups(5, 2) == [(0, 1), (2, 3)]
    assert id_groups(3, 1) == [(0,), (1,), (2,)]
    assert id_groups(2, 4) == [(0, 1)]
    with pytest.raises(ConfigError):
        id_groups(4, 0)


def test_even_layers_with_replicas_groups_peers_in_id_order_and_sends_dense() -> None:
    # peers 0,1 on one site, 2,3 on the other: the baseline pairs (0,1),(2,3) whatever the links
    snap = snapshot(4, bw=lambda a, b: 1.25e9 if (a % 2) == (b % 2) else 1e6)
    plan = plan_even_layers(chain(8), snap, PlannerConfig(micro_batches=4), replicas=2)
    ps = peers(4)
    assert [st.replicas for st in plan.stages] == [(ps[0], ps[1]), (ps[2], ps[3])]
    assert [(st.start, st.end) for st in plan.stages] == [(0, 4), (4, 8)]
    assert all(f.rho == 1.0 for f in plan.fences)
    assert plan.algorithm == "even-layers"


def test_even_flops_with_replicas_balances_group_compute() -> None:
    # group (0,1) is 3x faster than group (2,3): it gets about 3/4 of the units
    snap = snapshot(4, flops=lambda i: 3e10 if i < 2 else 1e10)
    plan = plan_even_flops(chain(8), snap, PlannerConfig(micro_batches=4), replicas=2)
    ps = peers(4)
    assert [st.replicas for st in plan.stages] == [(ps[0], ps[1]), (ps[2], ps[3])]
    assert [(st.start, st.end) for st in plan.stages] == [(0, 6), (6, 8)]
    assert all(f.rho == 1.0 for f in plan.fences)
    one = plan_even_flops(chain(8), snap, PlannerConfig(micro_batches=4))
    assert all(len(st.replicas) == 1 for st in one.stages)


@pytest.mark.parametrize(("planner", "algorithm"), [("opfence", "op-fence"), ("even_layers", "even-layers"),
                                                    ("even_flops", "even-flops")])
def test_choose_plan_follows_the_job_config(planner: str, algorithm: str) -> None:
    import torch

    from fusionp2p.data import BuiltinCorpus
    from fusionp2p.jobs.build import build_job, choose_plan
    from fusionp2p.models.gpt2 import GPT2, GPT2Config
    from fusionp2p.net.identity import Identity

    torch.manual_seed(0)
    model = GPT2(GPT2Config.tiny(block_size=16, n_layer=2, n_head=2, n_embd=32))
    me = Identity.generate()
    cfg = TrainConfig(steps=2, micro_batch=2, micro_batches=2, replicas=2, planner=planner, averaging=None,
                      compression=None)
    built = build_job(model, None, BuiltinCorpus(seq_len=16), cfg, publisher=me.peer_id, sign=me.sign, now=1.7e9,
                      nonce=b"\0" * 16)
    snap = snapshot(4)
    plan = choose_plan(built.spec, built.dag, snap.members, links=snap.links)
    assert plan.algorithm == algorithm
    if planner != "opfence":
        assert {len(st.replicas) for st in plan.stages} == {2}
        assert [p for st in plan.stages for p in st.replicas] == peers(4)[: 2 * len(plan.stages)]
