"""The bf16 wire of CO2 rounds where it pays (plan/estimator.bf16_pays, jobs/build.averaging_bf16): priced
per link, its CPU against the bytes it saves; fp32 on fast links, bf16 on slow ones, the same on both
ends of a link; the planner prices a round at the wire its slowest link will carry."""

from __future__ import annotations

import dataclasses

import torch

from fusionp2p.data import BuiltinCorpus
from fusionp2p.jobs.build import averaging_bf16, build_job, plan_for_snapshot, planner_config
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.net.identity import Identity
from fusionp2p.plan.estimator import BF16_WIRE_CPU_S, CostModel, bf16_pays
from fusionp2p.plan.snapshot import Link, Snapshot, snapshot_from_records
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.train.config import CO2, TrainConfig
from tests.unit.test_plan_helpers import chain


def test_bf16_pays_below_the_break_even_bandwidth() -> None:
    edge = 2.0 / BF16_WIRE_CPU_S          # bytes/s at which 2 bytes take as long to send as the CPU the wire spends
    assert bf16_pays(edge / 1.1) and not bf16_pays(edge * 1.1)
    assert bf16_pays(100e6 / 8)           # a 100 Mbit/s WAN link
    assert not bf16_pays(10e9 / 8)        # a 10 Gbit/s LAN
    assert not bf16_pays(3e9)             # loopback, as the probes measure it
    assert not bf16_pays(float("inf"))


def _built(averaging: CO2 | None, replicas: int) -> object:
    torch.manual_seed(0)
    model = GPT2(GPT2Config.tiny(block_size=16, n_layer=2, n_head=2, n_embd=32))
    me = Identity.generate()
    cfg = TrainConfig(steps=8, micro_batch=2, micro_batches=4, replicas=replicas, averaging=averaging, compression=None,
                      planner="even_layers")
    return build_job(model, None, BuiltinCorpus(seq_len=16), cfg, publisher=me.peer_id, sign=me.sign, now=1.7e9,
                     nonce=b"\0" * 16)


def _choices(averaging: CO2 | None, bw: dict[tuple[str, str], float]) -> dict[str, frozenset[str] | None]:
    """Every replica's bf16 peers, by host name."""
    hosts = sorted({h for pair in bw for h in pair})
    built = _built(averaging, len(hosts))
    snap = snapshot_from_records(built.spec.job_id, 0, [(h, TEST_PROFILE) for h in hosts],
                                 [(a, b, Link(bandwidth_bps=v, latency_s=0.0)) for (a, b), v in bw.items()])
    plan = plan_for_snapshot(built.spec, built.dag, snap)
    st = plan.stages[0]
    assert len(plan.stages) == 1 and sorted(st.replicas) == hosts
    out: dict[str, frozenset[str] | None] = {}
    for r, host in enumerate(st.replicas):
        got = averaging_bf16(built.spec, built.dag, plan, snap, 0, r)
        out[host] = None if got is None else frozenset(st.replicas[k] for k in got)
    return out


def test_the_job_chooses_bf16_per_link_and_both_ends_agree() -> None:
    slow, fast = 100e6 / 8, 3e9
    got = _choices(CO2(), {("a", "b"): slow, ("a", "c"): fast, ("b", "c"): fast})
    assert got == {"a": frozenset({"b"}), "b": frozenset({"a"}), "c": frozenset()}
    assert _choices(CO2(), {("a", "b"): fast}) == {"a": frozenset(), "b": frozenset()}
    assert _choices(CO2(), {("a", "b"): slow}) == {"a": frozenset({"b"}), "b": frozenset({"a"})}
    # the fp32 wire, asked for: no choice to make
    assert _choices(CO2(wire="fp32"), {("a", "b"): slow}) == {"a": None, "b": None}


def test_the_planner_prices_a_round_at_the_wire_its_slowest_link_carries() -> None:
    cfg = dataclasses.replace(planner_config(TrainConfig(steps=8, averaging="co2")), averaging_wire=0.5)
    wl = chain(1, act=1000, params=4_000_000)

    def round_bytes_s(bw: float) -> float:
        snap = Snapshot(job="j", epoch=0, members=dict.fromkeys("ab", TEST_PROFILE),
                        links={("a", "b"): Link(bandwidth_bps=bw, latency_s=0.0)})
        cm = CostModel(wl, snap, cfg)
        return cm.round_times(4e6, [0, 1])[0]

    assert round_bytes_s(100e6 / 8) == 2 * 1 / 2 * 4e6 * 0.5 / (100e6 / 8)   # bf16: half the bytes
    assert round_bytes_s(3e9) == 2 * 1 / 2 * 4e6 * 1.0 / 3e9                  # fp32 on a fast link
