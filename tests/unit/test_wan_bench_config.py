"""benchmarks/wan.py's pure parts: the scenarios it builds and the job configurations of its systems."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from benchmarks.wan import CONTROL, SYSTEMS, RunConfig, caps_sum, scenario_spec, speedup
from benchmarks.wan_client import make_config, training_rate
from fusionp2p.errors import ConfigError


def test_scenarios_add_an_unshaped_control_host_and_hand_the_slowdown_to_the_node() -> None:
    """A host's slowdown reaches its node (FUSIONP2P_COMPUTE_SLOWDOWN) at the spec's CPU cap; the older
    emulation (``--slowdown-as-cap``) divides the cap instead."""
    spec = scenario_spec("mixed")
    assert spec.bootstrap == CONTROL
    ctl = spec.hosts[-1]
    assert ctl.name == CONTROL and ctl.up_bps is None and ctl.cpus is None
    by = {h.name: h for h in spec.hosts}
    assert by["fast1"].cpus == pytest.approx(0.33) and by["mid1"].cpus == pytest.approx(0.33)
    assert by["mid1"].slowdown == 2.0 and by["fast1"].slowdown == 1.0
    capped = {h.name: h for h in scenario_spec("mixed", slowdown_as_cap=True).hosts}
    assert capped["fast1"].cpus == pytest.approx(0.33) and capped["mid1"].cpus == pytest.approx(0.165)
    assert all(h.slowdown == 1.0 for h in capped.values())
    # what the hosts may use together (the benchmark warns when it nears the machine's cores)
    assert caps_sum(spec) == pytest.approx(6 * 0.33) and caps_sum(scenario_spec("mixed", slowdown_as_cap=True)) == pytest.approx(1.65)
    with pytest.raises(ConfigError):
        scenario_spec("moon")


def test_every_system_is_a_valid_job_configuration() -> None:
    run = dataclasses.asdict(RunConfig(steps=3))
    cfgs = {s["name"]: make_config(run, s) for s in SYSTEMS}
    assert [s["name"] for s in SYSTEMS] == ["A", "B", "OPF", "OPF+TopK", "OPF+TopK+CO2"]
    assert cfgs["A"].planner == "even_layers" and cfgs["B"].planner == "even_flops"
    assert all(cfgs[k].adatopk is None and cfgs[k].co2 is None for k in ("A", "B", "OPF"))
    assert cfgs["OPF+TopK"].adatopk is not None and cfgs["OPF+TopK"].co2 is None
    full = cfgs["OPF+TopK+CO2"]
    assert full.planner == "opfence" and full.adatopk is not None and full.co2 is not None
    # the baselines run exactly 2 replicas; OP-Fence chooses its own count (a hint is never a handicap)
    assert cfgs["A"].replicas == cfgs["B"].replicas == 2
    assert all(cfgs[k].replicas is None for k in ("OPF", "OPF+TopK", "OPF+TopK+CO2"))
    # the same model, data and optimizer everywhere: only the planner, replicas, compression and averaging differ
    strip = {"planner", "replicas", "compression", "averaging"}
    assert len({repr({k: v for k, v in c.to_wire().items() if k not in strip}) for c in cfgs.values()}) == 1


def test_training_rate_counts_the_steps_after_the_first() -> None:
    run = dataclasses.asdict(RunConfig())
    # steps 0..4 heard 0.5 s apart: 4 steps of 2 pipelines x 8 x 4 samples in 2 s
    r = training_rate({s: 10.0 + 0.5 * s for s in range(5)}, 2, run)
    assert r["samples_per_s"] == pytest.approx(4 * 64 / 2.0)
    assert training_rate({0: 1.0}, 2, run)["samples_per_s"] is None


def test_speedup_needs_both_rates() -> None:
    res = {"systems": [{"system": "A", "samples_per_s": 10.0}, {"system": "OPF+TopK+CO2", "samples_per_s": 95.0}]}
    assert speedup(res) == pytest.approx(9.5)
    with pytest.raises(RuntimeError):
        speedup({"systems": [{"system": "A", "error": "x"}]})


def test_each_scenario_host_has_the_same_identity_every_run(tmp_path: Path) -> None:
    """The baselines place replica pairs in peer-id order: fixed identities give every run the same
    placement (random ones moved baseline A 2x between runs on `mixed`)."""
    from benchmarks.wan import seed_identity
    from fusionp2p.net.identity import Identity

    def peer(run: str, scenario: str, host: str) -> str:
        home = tmp_path / run / host
        seed_identity(home, scenario, host)
        return Identity.load_or_create(home).peer_id

    assert peer("r1", "mixed", "fast1") == peer("r2", "mixed", "fast1")
    assert len({peer("r1", "mixed", "fast1"), peer("r1", "mixed", "fast2"), peer("r1", "slow", "fast1")}) == 3
