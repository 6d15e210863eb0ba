"""Shadow copies' pure parts (fusionp2p/jobs/shadow.py): the cadence rule, the keeper, and a re-plan's
resume from per-stage copies (jobs/replan.plan_resume); the store's discard of superseded copies; and the
death probes of jobs/liveness.py."""

from __future__ import annotations

import pytest

from fusionp2p.errors import ConfigError
from fusionp2p.jobs.replan import Halted, plan_resume
from fusionp2p.jobs.shadow import Cadence, ShadowConfig, keeper_for
from fusionp2p.jobs.store import ContentStore
from fusionp2p.plan.plan import Fence, Plan, Stage

ALL = lambda p: True  # noqa: E731


def _cadence(step_s: float, copy_s: float, cfg: ShadowConfig | None = None) -> Cadence:
    c = Cadence(cfg or ShadowConfig())
    for i in range(3):
        c.on_step(i * step_s)
    c.on_copy(1_000_000, 0.0, copy_s)
    return c


def test_the_first_copy_goes_at_the_first_boundary() -> None:
    c = Cadence(ShadowConfig())
    assert c.every == 1 and c.due(1)


@pytest.mark.parametrize(("step_s", "copy_s", "every"), [
    (1.0, 0.1, 1),     # a copy takes 10% of a step: every step (share 25%)
    (1.0, 0.5, 2),     # half a step: every 2 steps
    (0.4, 0.3, 3),     # ceil(0.3 / (0.25 * 0.4)) = 3
    (0.1, 5.0, 4),     # a copy far slower than a step: capped at max_every
])
def test_the_cadence_keeps_copies_within_their_share_of_the_step_time(step_s: float, copy_s: float, every: int) -> None:
    c = _cadence(step_s, copy_s)
    assert c.every == every
    assert c.link_Bps == pytest.approx(1_000_000 / copy_s)
    c.copied = 10
    assert not c.due(10 + every - 1) and c.due(10 + every)


def test_shadow_config_is_checked() -> None:
    with pytest.raises(ConfigError):
        ShadowConfig(share=0.0)
    with pytest.raises(ConfigError):
        ShadowConfig(max_every=0)


def _plan(*stages: tuple[str, ...]) -> Plan:
    n = len(stages)
    return Plan(job="j", epoch=0, snapshot_hash="h", algorithm="op-fence", seed=0, n_units=n, micro_batches=1,
                stages=tuple(Stage(start=i, end=i + 1, replicas=r) for i, r in enumerate(stages)),
                fences=tuple(Fence(index=i, unit=i + 1, dense_bytes=1.0, rho=1.0) for i in range(n - 1)))


def test_the_keeper_is_a_standby_else_the_next_stage() -> None:
    plan = _plan(("a",), ("b",), ("c",))
    assert keeper_for(plan, 0, "a", {"a", "b", "c", "s1", "s2"}, ALL) == "s1"
    assert keeper_for(plan, 1, "b", {"a", "b", "c", "s1", "s2"}, ALL) == "s2"     # spread over the standbys
    assert keeper_for(plan, 2, "c", set(), ALL) == "a"                            # round the pipeline
    assert keeper_for(plan, 0, "a", set(), lambda p: p != "b") == "c"             # a dead one is skipped
    assert keeper_for(_plan(("a",)), 0, "a", set(), ALL) is None


def _halted(peer: str, start: int, end: int, step: int) -> Halted:
    return Halted(peer=peer, epoch=0, stage=start, replica=0, step=step, state=f"live-{peer}", start=start, end=end)


def test_a_lost_stage_comes_from_its_newest_shadow_and_the_others_keep_their_live_state() -> None:
    # 3 single-replica stages; the holder of units [1, 2) died at step 14; its copies are of steps 8 and 12
    ckpts = {8: {(1, 2): ("old", ["k"])}, 12: {(1, 2): ("new", ["k", "dead"])}}
    r = plan_resume(3, [_halted("a", 0, 1, 14), _halted("c", 2, 3, 14)], ckpts, lambda p: p != "dead", reached=14)
    assert r.step == 12 and r.from_checkpoint and r.lost_steps == 2
    assert [(s.state, s.step, s.holders) for s in r.sources] == [("live-a", 14, ("a",)), ("live-c", 14, ("c",)),
                                                                 ("new", 12, ("k",))]


def test_a_copy_held_only_by_dead_nodes_is_passed_over_for_an_older_one() -> None:
    ckpts = {8: {(1, 2): ("old", ["k2"])}, 12: {(1, 2): ("new", ["k", "dead"])}}
    r = plan_resume(3, [_halted("a", 0, 1, 14), _halted("c", 2, 3, 14)], ckpts, lambda p: p not in ("dead", "k"))
    assert r.step == 8 and [s.state for s in r.sources][-1] == "old"


def test_with_no_copy_of_a_lost_unit_the_job_restarts_from_the_published_weights() -> None:
    r = plan_resume(3, [_halted("a", 0, 1, 14)], {12: {(1, 2): ("new", ["k"])}}, ALL, reached=14)
    assert r.initial and r.step == 0 and r.lost_steps == 14


def test_live_states_that_cover_every_unit_ignore_the_copies() -> None:
    r = plan_resume(2, [_halted("a", 0, 1, 14), _halted("b", 1, 2, 13)], {12: {(0, 2): ("c", ["k"])}}, ALL)
    assert r.step == 13 and not r.from_checkpoint and {s.state for s in r.sources} == {"live-a", "live-b"}


def test_a_whole_model_checkpoint_covers_units_newer_shadows_do_not() -> None:
    # an old complete checkpoint of the whole model, a newer shadow of unit 1 only: each unit its newest
    ckpts = {4: {(0, 3): ("full", ["k"])}, 12: {(1, 2): ("s1", ["k"])}}
    r = plan_resume(3, [_halted("c", 2, 3, 14)], ckpts, ALL, reached=14)
    assert r.step == 4 and [s.state for s in r.sources] == ["live-c", "s1", "full"]


def test_discard_drops_a_superseded_copy_unless_another_owner_pins_it() -> None:
    store = ContentStore()
    with store.pinned_to("job"):
        h = store.put(b"x" * 100)
        g = store.put(b"y" * 100)
    store.pin("other", g)
    store.discard("job", h)
    store.discard("job", g)
    assert not store.has(h) and store.has(g)
    assert store.stats()["pinned_bytes"] == 100 and store.stats()["evicted"] == 0
    store.discard("other", g)
    assert not store.has(g) and store.stats()["held_bytes"] == 0

