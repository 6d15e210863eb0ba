"""CO2 averaging, pure part: the outer optimizer, sharded outer state, and the round state machine.

No trio, no sockets, no clock here (ARCHITECTURE.md); the trio shell is
:mod:`fusionp2p.train.averager`. Design notes: docs/averaging.md.
"""

from fusionp2p.average.allreduce import AllReduceRound, Finished, Reduced, RoundMsg, RoundResult, Send
from fusionp2p.average.outer import (
    OuterConfig,
    OuterOptimizer,
    PenaltyInputs,
    clip_,
    make_penalty,
    ring_allreduce_time,
    suggest_tau,
)
from fusionp2p.average.robust import ClipBook, RobustConfig, robust_mean
from fusionp2p.average.shard import ShardedOuter, shard_bounds, weighted_mean

__all__ = [
    "AllReduceRound",
    "ClipBook",
    "Finished",
    "OuterConfig",
    "OuterOptimizer",
    "PenaltyInputs",
    "RobustConfig",
    "Reduced",
    "RoundMsg",
    "RoundResult",
    "Send",
    "ShardedOuter",
    "clip_",
    "make_penalty",
    "ring_allreduce_time",
    "robust_mean",
    "shard_bounds",
    "suggest_tau",
    "weighted_mean",
]
