"""Planning: workload estimator, bandwidth clustering, OP-Fence, baselines, and the Plan type.

Pure code (no trio, no sockets, no wall clock). The entry points::

    plan = make_plan(workload, snapshot, PlannerConfig(), seed=0)      # OP-Fence + AdaTopK ratios
    plan = plan_joint(workload, snapshot, cfg, replicas=2, seed=0)     # stages x replicas x ratios, scored
    plan_even_layers(...), plan_even_flops(...)                        # baselines, same signature
    predict(plan, workload, snapshot)                                  # predicted times of any plan

The AxoNN communication model lives in :mod:`fusionp2p.plan.axonn`.
"""

from fusionp2p.plan.baselines import plan_even_flops, plan_even_layers
from fusionp2p.plan.config import PlannerConfig
from fusionp2p.plan.joint import plan_joint
from fusionp2p.plan.opfence import InfeasiblePlanError, make_plan
from fusionp2p.plan.plan import Candidate, Fence, Plan, Stage
from fusionp2p.plan.predict import Prediction, predict
from fusionp2p.plan.snapshot import Link, Snapshot, snapshot_from_records

__all__ = [
    "Candidate",
    "Fence",
    "InfeasiblePlanError",
    "Link",
    "Plan",
    "PlannerConfig",
    "Prediction",
    "Snapshot",
    "Stage",
    "make_plan",
    "plan_even_flops",
    "plan_even_layers",
    "plan_joint",
    "predict",
    "snapshot_from_records",
]
