"""The members a publisher offers a job to in a large swarm (issue 40: jobs on a big swarm).

Offering a job to every live member makes each of them verify it and fetch its blobs, and hands the
planner a snapshot of the whole swarm: fine at 20 members, not at hundreds. So the publisher offers it to
``DriverConfig.candidates`` members at most, chosen here by capacity and links; the election and every
later message of the job then involve those members (the ones that accepted) only.

A member's score is the smaller of its compute and its link, each over the median of the members: compute
is the better of its measured fp32 and bf16 FLOP/s (its signed profile), its link the median bandwidth that
*other* members measured on their links to it (the reports' measurements whose destination it is; its own
reports do not rank it, so a node that inflates its own figures gains nothing here). The smaller of the two
because a pipeline stage or a replica waits on the slower of its compute and its transfers: a fast GPU
behind a home uplink ranks with the home uplink. Members nobody measured yet rank after every measured one,
by compute. Members without a profile yet (a node defers its device benchmark until a job request or its
first probe round: swarm/startup.py) rank after every member with one, by their links: their compute is
unknown, and an offer to one waits for its start-up. In a swarm of at most *k* live members they are
offered the job like the rest (jobs/publisher.py: a swarm started moments before a job is submitted would
otherwise run it on whichever nodes happened to have measured). Ties: by peer id, so every run over the
same view makes the same choice.

Not considered: which pairs of candidates are near each other (the planner sees the pairs' links and lays
the stages out; a candidate it cannot use costs only its offer), and a member's memory (the planner checks
the fit, and the candidates are a superset of what a plan needs). A lying profile (absurd FLOP/s) buys a
slot among the candidates; the job's speed checks (train/claims.py) catch it once it runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.plan.snapshot import Link
from fusionp2p.types import DeviceProfile
from fusionp2p.wire.records import decode_profile


def compute_of(profile: DeviceProfile) -> float:
    """A member's compute for ranking: the better of its fp32 and bf16 FLOP/s."""
    return max(profile.flops_fp32, profile.flops_bf16)


def choose_candidates(members: Mapping[str, DeviceProfile | None], links: Iterable[tuple[str, str, Link]],
                      k: int) -> list[str]:
    """The *k* best members (the module docstring; None: no profile yet), sorted by peer id; every member
    when there are at most *k*."""
    if k < 1:
        raise ValueError("a job needs at least one candidate")
    if len(members) <= k:
        return sorted(members)
    seen: dict[str, list[float]] = {}
    for src, dst, link in links:
        if src != dst and src in members and dst in members:
            seen.setdefault(dst, []).append(link.bandwidth_bps)
    link_of = {p: statistics.median(v) for p, v in seen.items()}
    compute = {p: compute_of(prof) for p, prof in members.items() if prof is not None}
    c_med = statistics.median(compute.values()) if compute else 1.0
    l_med = statistics.median(link_of.values()) if link_of else 1.0

    def rank(p: str) -> tuple[int, float, str]:
        if p not in compute:
            return (2, -link_of[p] / l_med if p in link_of else 0.0, p)
        if p not in link_of:
            return (1, -compute[p] / c_med, p)
        return (0, -min(compute[p] / c_med, link_of[p] / l_med), p)

    return sorted(sorted(members, key=rank)[:k])


def accepted_profile(reply: dict[str, Any], known: DeviceProfile | None) -> DeviceProfile:
    """The profile a member accepted an offer with (the publisher's, or a re-plan leader's to a joiner): the one
    its reply carries (measured by its start-up, perhaps after the view we ranked it by), else *known* (its
    record's; a node of an older version sends none). RemoteProtocolError when the reply's is malformed, or
    there is none for a member whose record had none."""
    raw = reply.get("profile")
    if raw is not None:
        return decode_profile(raw, "profile of an accept")
    if known is None:
        raise RemoteProtocolError("accepted the job without a device profile (none in its record either)")
    return known


__all__ = ["accepted_profile", "choose_candidates", "compute_of"]
