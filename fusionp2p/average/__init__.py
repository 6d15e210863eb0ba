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
from fusionp2p.average.shard import ShardedOuter, shard_bounds, weighted_mean

__all__ = [
    "AllReduceRound",
    "Finished",
    "OuterConfig",
    "OuterOptimizer",
    "PenaltyInputs",
    "Reduced",
    "RoundMsg",
    "RoundResult",
    "Send",
    "ShardedOuter",
    "clip_",
    "make_penalty",
    "ring_allreduce_time",
    "shard_bounds",
    "suggest_tau",
    "weighted_mean",
]
