"""A publisher's candidate set in a large swarm (jobs/candidates.py): the members best by the smaller of
their compute and their links as others measured them, a node's own figures never ranking it."""

from __future__ import annotations

import pytest

from fusionp2p.errors import ConfigError
from fusionp2p.jobs.candidates import choose_candidates
from fusionp2p.jobs.publisher import DriverConfig
from fusionp2p.plan.snapshot import Link
from fusionp2p.types import DeviceProfile


def _prof(flops: float) -> DeviceProfile:
    return DeviceProfile(device="cpu", kind="cpu", name="t", flops_fp32=flops, flops_bf16=0.0, memory_bytes=1 << 30)


def _swarm() -> tuple[dict[str, DeviceProfile], list[tuple[str, str, Link]]]:
    """p00..p19: compute 1e10 each; p00-p04 on 1 Gbit/s-class links, p05-p14 on 100 Mbit/s, p15-p19 on 10;
    each measured by the next two members."""
    members = {f"p{i:02d}": _prof(1e10) for i in range(20)}
    rate = {f"p{i:02d}": (1.25e8 if i < 5 else 1.25e7 if i < 15 else 1.25e6) for i in range(20)}
    ids = sorted(members)
    links = [(ids[(i + d) % 20], p, Link(bandwidth_bps=rate[p])) for i, p in enumerate(ids) for d in (1, 2)]
    return members, links


def test_small_swarm_offers_to_everyone() -> None:
    members, links = _swarm()
    assert choose_candidates(members, links, 20) == sorted(members)
    assert choose_candidates({}, [], 4) == []
    with pytest.raises(ValueError):
        choose_candidates(members, links, 0)
    with pytest.raises(ConfigError):
        DriverConfig(candidates=0)


def test_best_links_at_equal_compute_and_the_slower_side_counts() -> None:
    members, links = _swarm()
    assert choose_candidates(members, links, 5) == ["p00", "p01", "p02", "p03", "p04"]
    # a node 100x as fast behind the slowest link ranks with its link, below every 100 Mbit/s node...
    members["p19"] = _prof(1e12)
    assert "p19" not in choose_candidates(members, links, 15)
    # ...and a fast link on a slow CPU ranks with its CPU
    members["p00"] = _prof(1e8)
    assert "p00" not in choose_candidates(members, links, 14)


def test_own_figures_do_not_rank_a_node_and_unmeasured_rank_last() -> None:
    members, links = _swarm()
    liar = "p19"
    # the liar's reports say it measured 1 Tbit/s to everyone: its own measurements are not its rank
    links += [(liar, p, Link(bandwidth_bps=1.25e11)) for p in members if p != liar]
    assert liar not in choose_candidates(members, links, 15)
    # a member nobody measured comes after every measured one, whatever its compute
    members["new"] = _prof(1e15)
    assert "new" not in choose_candidates(members, links, 20)
    assert "new" in choose_candidates(members, links, 21)


def test_members_without_a_profile_are_candidates_after_every_member_with_one() -> None:
    members: dict[str, DeviceProfile | None] = dict(_swarm()[0])
    _, links = _swarm()
    members |= {"u1": None, "u2": None}
    # a small swarm: everyone, measured or not
    assert choose_candidates(members, links, 22) == sorted(members)
    # a big one: after every member with a profile, the one others measured a link to first
    links.append(("p00", "u2", Link(bandwidth_bps=1e6)))
    assert choose_candidates(members, links, 21) == sorted([*_swarm()[0], "u2"])
    assert "u1" not in choose_candidates(members, links, 21)
    # a swarm of none measured yet (all started moments ago) still has candidates
    assert choose_candidates({"a": None, "b": None, "c": None}, [], 2) == ["a", "b"]


def test_the_profile_an_accept_carries_is_the_one_planned_with() -> None:
    from fusionp2p.errors import RemoteProtocolError
    from fusionp2p.jobs.publisher import accepted_profile

    known, measured = _prof(1e10), _prof(3e10)
    assert accepted_profile({"ok": True, "profile": measured.to_wire()}, None) == measured
    assert accepted_profile({"ok": True, "profile": measured.to_wire()}, known) == measured
    assert accepted_profile({"ok": True}, known) == known          # a node of an older version: its record's
    with pytest.raises(RemoteProtocolError, match="without a device profile"):
        accepted_profile({"ok": True}, None)
    for bad in ({"flops_fp32": -1.0}, "x", {"flops_fp32": float("inf")}):
        raw = measured.to_wire() | bad if isinstance(bad, dict) else bad
        with pytest.raises(RemoteProtocolError):
            accepted_profile({"ok": True, "profile": raw}, known)
