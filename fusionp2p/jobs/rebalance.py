"""Re-balancing a running job by the speeds its replicas measure while training (pure).

The planner splits a step's micro-batches among replicas of unequal speed in proportion to the FLOP/s
each node measured with its start-up benchmark (``CostModel.split_micro``), and it cuts stages by the
same figures. A node trains at another speed than that benchmark says: on benchmarks.wan's 0.165-core
hosts a replica ran 3-4.8x slower per micro-batch than the 0.33-core ones where the benchmark said
2.3x (the node's own gossip, heartbeats and data-plane threads take a larger share of a small CPU
quota; BENCHMARKS.md), and the fast replicas waited for it at every averaging boundary.

So once an epoch has trained a few steps, its leader (``jobs/lead.py``) asks every member for its
forward and backward seconds per micro-batch (``StageWorker.busy_s / busy_micros``, without the
epoch's first step), scales each member's profile so that the cost model predicts what it measured
(:func:`speed_factors`; nodes not measured yet by the members' median factor, :func:`typical`), and
re-plans at a step boundary when the plan for the scaled profiles is
predicted ``gain`` faster than the plan in force under the same profiles (:func:`rebalanced`). The
members elect the new plan from the leader's snapshot, which carries the scaled profiles, as for any
re-plan. A member can lie about its speed as it can about its start-up benchmark; the scale is bounded
(``MAX_SCALE``) so that one answer cannot move a profile by more than that factor either way, and a
member's own figure is not taken over its neighbours' measurement (:func:`bounded`): replicas of a stage
that re-deal in band measure each other's seconds per micro-batch from when their averaging parts arrive
(``train/claims.py``) and answer them too (``peers_s``); a member whose own figure the lower median of the
others' contradicts (faster by more than ``claims.SLACK``) is planned by the measured one.

A speed measured in one job also serves the next ones of the same model: when a member's job ends on a
single-stage plan (:func:`epoch_speed` says why not a pipeline stage), it works out its own factor
against its start-up benchmark (:func:`own_speed`) and announces it in its node record with the job's
``model_hash`` (``NodeRecord.speed``, a running geometric mean over its jobs of that model:
``SwarmNode.note_speed``). Whoever makes a snapshot for a plan (the publisher for epoch 0, a leader for a
re-plan) scales each member's profile by the factor it announces for the job's model, and the members
that announce none by the typical one (:func:`calibrated`). A
job's first plan then deals micro-batches and stages by the speeds nodes train at, not by a benchmark
that runs before a node has any services to run; benchmarks.wan's 0.165-core hosts trained at
0.42-0.58 of what theirs said.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from fusionp2p.graph import OpDAG
from fusionp2p.jobs.build import job_cost_model, plan_for_snapshot
from fusionp2p.jobs.spec import JobSpec
from fusionp2p.plan import Plan, Snapshot
from fusionp2p.plan.estimator import CostModel, compute_rate
from fusionp2p.plan.predict import predict
from fusionp2p.train import deal
from fusionp2p.train.claims import SLACK
from fusionp2p.train.config import TrainConfig
from fusionp2p.types import DeviceProfile

MAX_SCALE = 64.0     # a measured speed moves a member's profile by at most this factor either way
MAX_FLOPS = 1e20     # the wire's bound of a profile's FLOP/s


def scale_profile(prof: DeviceProfile, f: float) -> DeviceProfile:
    """*prof* with its FLOP/s and element-wise rate scaled by *f* (bounded by ``MAX_SCALE`` and the wire's
    ``MAX_FLOPS``). Scaling both rates keeps the devices' FLOP-per-byte figure (``act_flops``), so the
    stages' work in the cost model is unchanged and only the time of this device moves."""
    f = min(MAX_SCALE, max(1.0 / MAX_SCALE, f))
    if f == 1.0:
        return prof
    return dataclasses.replace(prof, flops_fp32=min(MAX_FLOPS, prof.flops_fp32 * f),
                               flops_bf16=min(MAX_FLOPS, prof.flops_bf16 * f), act_rate=min(MAX_FLOPS, prof.act_rate * f))


def speed_factors(cm: CostModel, plan: Plan, members: Mapping[str, DeviceProfile],
                  micro_s: Mapping[str, float]) -> dict[str, float]:
    """Per measured member, the factor by which its profile's rates must be scaled for the cost model's
    time per micro-batch of its stage (``work / flops``, with a replicated stage's ``replica_overhead``)
    to equal its measured *micro_s*."""
    out: dict[str, float] = {}
    for st in plan.stages:
        work = cm.range_work(st.start, st.end)
        over = 1.0 + cm.config.replica_overhead if len(st.replicas) > 1 else 1.0
        for peer in st.replicas:
            t, prof = micro_s.get(peer), members.get(peer)
            if prof is not None and t is not None and t > 0 and math.isfinite(t) and work > 0:
                out[peer] = min(MAX_SCALE, max(1.0 / MAX_SCALE, work * over / compute_rate(prof, cm.config) / t))
    return out


MAX_REPORTED = 1024   # peers one member's answer may report figures of


def bounded(own: Mapping[str, float], answers: Mapping[str, Mapping[str, Any]], *, slack: float = SLACK
            ) -> tuple[dict[str, float], tuple[str, ...]]:
    """Each member's seconds per micro-batch to plan by: its *own* figure, unless the lower median of what the
    other members measured of it (``peers_s`` in their status *answers*) is slower by more than *slack*; and
    the members so contradicted. Bounded trust: a claim never outweighs the measurements of it."""
    seen: dict[str, list[float]] = {}
    for reporter, ans in answers.items():
        peers = ans.get("peers_s")
        if not isinstance(peers, dict):
            continue
        for p, s in list(peers.items())[:MAX_REPORTED]:
            if p != reporter and p in own and isinstance(s, float) and math.isfinite(s) and s > 0:
                seen.setdefault(p, []).append(s)
    out, liars = dict(own), []
    for p, v in seen.items():
        m = sorted(v)[(len(v) - 1) // 2]
        if m > own[p] * (1.0 + slack):
            out[p] = m
            liars.append(p)
    return out, tuple(sorted(liars))


def typical(factors: Mapping[str, float]) -> float:
    """The median factor: what a node not measured yet is assumed to train at, against its benchmark (the
    members' scaled speeds beside the joiners' start-up figures would make every joiner look fast)."""
    vals = sorted(factors.values())
    if not vals:
        return 1.0
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else math.sqrt(vals[mid - 1] * vals[mid])


def calibrated(profiles: Mapping[str, DeviceProfile], speeds: Mapping[str, float]) -> dict[str, DeviceProfile]:
    """*profiles* scaled by the speeds their nodes announce (``NodeRecord.speed``, measured in their earlier
    jobs: :func:`own_speed`); those that announce none by the typical factor of those that do (:func:`typical`)."""
    known = {p: f for p, f in speeds.items() if p in profiles and math.isfinite(f) and f > 0}
    t = typical(known)
    return {p: scale_profile(prof, known.get(p, t)) for p, prof in profiles.items()}


def own_speed(spec: JobSpec, dag: OpDAG, plan: Plan, snap: Snapshot, me: str, profile: DeviceProfile,
              micro_s: float) -> float | None:
    """The factor by which *profile* (this node's start-up benchmark: the snapshot's figure for it may be
    scaled already) must be scaled for the cost model to predict the *micro_s* it measured in its stage
    of *plan* (:func:`speed_factors`); None when *plan* gave it no stage."""
    return speed_factors(job_cost_model(spec, dag, snap)[0], plan, {me: profile}, {me: micro_s}).get(me)


SPEED_MIN_MICROS = 4   # micro-batches an epoch must time (after its first step) to announce a speed


def epoch_speed(spec: JobSpec, dag: OpDAG, plan: Plan, snap: Snapshot, me: str, profile: DeviceProfile,
                busy_s: float, busy_micros: int) -> float | None:
    """The speed factor a member announces after an epoch of *plan* that timed *busy_micros* micro-batches in
    *busy_s* seconds (:func:`own_speed`); None when the epoch gives no figure: under ``SPEED_MIN_MICROS``
    timed, or a pipeline. A pipeline stage computes in bursts between messages, and under a CPU quota (a
    container's, benchmarks.wan's hosts') a burst shorter than the quota runs at a whole core's speed:
    stages of benchmarks.wan's pipelines trained at 1.1-2.6x their benchmark's speed, the same hosts at
    0.55-0.85x on the whole model; the cost model's error also differs from stage to stage."""
    if len(plan.stages) != 1 or busy_micros < SPEED_MIN_MICROS:
        return None
    return own_speed(spec, dag, plan, snap, me, profile, busy_s / busy_micros)


def redeals_in_band(cfg: TrainConfig, plan: Plan) -> bool:
    """Whether *plan*'s replicas re-deal their micro-batches among themselves by the speeds their streaming
    CO2 rounds carry (:func:`train.deal.redeals_in_band`). A re-plan that would change only those counts
    is then not worth its halt."""
    return deal.redeals_in_band(cfg.co2, plan.micro, len(plan.stages))


def same_layout(a: Plan, b: Plan) -> bool:
    """The same stages served by the same peers (micro-batches per replica aside)."""
    return [(s.start, s.end, sorted(s.replicas)) for s in a.stages] == [(s.start, s.end, sorted(s.replicas))
                                                                         for s in b.stages]


def rebalanced(spec: JobSpec, dag: OpDAG, plan: Plan, snap: Snapshot, micro_s: Mapping[str, float],
               ) -> tuple[dict[str, float], Plan, float, float]:
    """The members' speed factors (:func:`speed_factors`, against *snap*'s profiles), the plan for the
    profiles scaled by them, and the predicted throughputs (micro-batches/s) of that plan and of *plan*,
    both under the scaled profiles. ValueError or PlanError when *plan* or the members make no plan."""
    cm, wl, judged = job_cost_model(spec, dag, snap)
    factors = speed_factors(cm, plan, snap.members, micro_s)
    adj = dataclasses.replace(snap, members={p: scale_profile(prof, factors.get(p, 1.0))
                                             for p, prof in snap.members.items()})
    trial = plan_for_snapshot(spec, dag, adj, previous=plan)    # choose_plan fills in the links itself
    judged = dataclasses.replace(judged, members=adj.members)
    base, new = predict(plan, wl, judged, cm.config).throughput, predict(trial, wl, judged, cm.config).throughput
    return factors, trial, new, base


__all__ = ["MAX_SCALE", "bounded", "SPEED_MIN_MICROS", "calibrated", "epoch_speed", "own_speed", "rebalanced", "redeals_in_band",
           "same_layout", "scale_profile", "speed_factors", "typical"]
