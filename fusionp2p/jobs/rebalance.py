"""Re-balancing a running job by the speeds its replicas measure while training (pure).

The planner splits a step's micro-batches among replicas of unequal speed in proportion to the FLOP/s
each node measured with its start-up benchmark (``CostModel.split_micro``), and it cuts stages by the
same figures. A node trains at another speed than that benchmark says: on benchmarks.wan's 0.165-core
hosts a replica ran 3-4.8x slower per micro-batch than the 0.33-core ones where the benchmark said
2.3x (the node's own gossip, heartbeats and data-plane threads take a larger share of a small CPU
quota; BENCHMARKS.md), and the fast replicas waited for it at every averaging boundary.

So once an epoch has trained a few steps, its leader (``jobs/lead.py``) asks every member for its
compute seconds per micro-batch (``StageWorker.busy_s / busy_micros``, without the epoch's first
step), scales each member's profile so that the cost model predicts what it measured
(:func:`scaled_profiles`), and re-plans at a step boundary when the plan for the scaled profiles is
predicted ``gain`` faster than the plan in force under the same profiles (:func:`rebalanced`). The
members elect the new plan from the leader's snapshot, which carries the scaled profiles, as for any
re-plan. A member can lie about its speed as it can about its start-up benchmark; the scale is bounded
(``MAX_SCALE``) so that one answer cannot move a profile by more than that factor either way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from fusionp2p.graph import OpDAG, coarsen, to_workload
from fusionp2p.jobs.build import plan_for_snapshot, planned_links, planner_config
from fusionp2p.jobs.spec import JobSpec
from fusionp2p.plan import Plan, Snapshot
from fusionp2p.plan.estimator import CostModel
from fusionp2p.plan.predict import predict
from fusionp2p.types import DeviceProfile

MAX_SCALE = 64.0     # a measured speed moves a member's profile by at most this factor either way
MAX_FLOPS = 1e20     # the wire's bound of a profile's FLOP/s


def scaled_profiles(cm: CostModel, plan: Plan, members: Mapping[str, DeviceProfile],
                    micro_s: Mapping[str, float]) -> dict[str, DeviceProfile]:
    """*members* with each measured one's FLOP/s and element-wise rate scaled by the same factor, so that
    the cost model's time per micro-batch of its stage (``work / flops``, with the replicated stages'
    ``replica_overhead``) equals its measured *micro_s*. Scaling both rates keeps the devices'
    FLOP-per-byte figure (``act_flops``), so the stages' work is unchanged."""
    out = dict(members)
    for st in plan.stages:
        work = cm.range_work(st.start, st.end)
        over = 1.0 + cm.config.replica_overhead if len(st.replicas) > 1 else 1.0
        for peer in st.replicas:
            t, prof = micro_s.get(peer), members.get(peer)
            if prof is None or t is None or not (t > 0 and math.isfinite(t)) or work <= 0:
                continue
            f = min(MAX_SCALE, max(1.0 / MAX_SCALE, work * over / prof.flops_fp32 / t))
            out[peer] = dataclasses.replace(prof, flops_fp32=min(MAX_FLOPS, prof.flops_fp32 * f),
                                            flops_bf16=min(MAX_FLOPS, prof.flops_bf16 * f),
                                            act_rate=min(MAX_FLOPS, prof.act_rate * f))
    return out


def rebalanced(spec: JobSpec, dag: OpDAG, plan: Plan, snap: Snapshot, micro_s: Mapping[str, float],
               ) -> tuple[Snapshot, Plan, float, float]:
    """The snapshot with the measured speeds, its plan, and the predicted throughputs (micro-batches/s)
    of that plan and of *plan*, both under the measured speeds. ValueError or PlanError when *plan* or
    the members do not make a plan."""
    cfg = spec.config
    pc = planner_config(cfg)
    wl = to_workload(coarsen(dag), micro_batch=cfg.micro_batch)
    links = planned_links(snap.members, snap.links)    # as the plan was made: with no link measured, all fast
    members = scaled_profiles(CostModel(wl, dataclasses.replace(snap, links=links), pc), plan, snap.members, micro_s)
    adj = Snapshot(job=snap.job, epoch=snap.epoch, members=members, links=snap.links)
    base = predict(plan, wl, dataclasses.replace(adj, links=links), pc).throughput
    trial = plan_for_snapshot(spec, dag, adj, previous=plan)
    new = predict(trial, wl, dataclasses.replace(adj, links=links), pc).throughput
    return adj, trial, new, base


__all__ = ["MAX_SCALE", "rebalanced", "scaled_profiles"]
