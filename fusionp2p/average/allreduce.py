"""One averaging round as a sans-IO state machine: parts in, actions out (STYLE.md 1).

Theory of operation. The round is a butterfly (all-to-all) reduce-scatter followed by an
all-gather, over a fixed, ordered replica list (the *epoch*). Replica ``r`` owns shard ``r`` of
:func:`~fusionp2p.average.shard.shard_bounds`:

1. ``start(snap)`` sends slice ``k`` of the snapshot to the owner of shard ``k`` (``Send``).
2. The owner collects the slices of its shard from every peer. When none is outstanding it emits
   ``Reduced`` with the weighted mean, summed in RANK order (not arrival order) so that the result
   is bitwise reproducible. The caller runs the outer step on the owned shard and calls
   ``publish(new_shard, scalar)``, which sends the new anchor shard to every live peer.
3. When every shard has arrived, ``Finished`` carries the full new vector and the rank-ordered sum
   of the owners' scalars (used for ``‖x̃_{t+1} − x̃_t‖²``). Each shard is copied into that vector
   (``out``: the shell may hand in a recycled one) as it arrives, so a peer's message is not held
   until the last one comes.

Per replica each phase moves ``(n−1)/n`` of the vector out and in, the same volume as a ring
all-reduce, in one hop of latency instead of ``n−1``.

Failures. The caller reports a dead or timed-out peer with ``peer_lost`` (the shell enforces the
deadlines; this core has no clock). A part that never came is left out of the mean, whose weights
are renormalised over the parts that did come (correct weights over the survivors). A shard whose
owner died before publishing cannot be known: the round then finishes ``complete=False`` (skipped,
with the reason) and the caller must not load anything from it. A message tagged with another
epoch comes from a live peer that sees a different replica set: it contributes nothing, and the
round is skipped, but the peer is NOT marked lost (no cascade of false deaths).

Fragments. With ``fragment=k`` (streaming CO2) the round averages fragment ``k`` of the parameter
vector as a vector of its own (``n_elems``, shard bounds and ``lo``/``hi`` are within the fragment);
every part it sends names ``k``, and a part naming another fragment (or none) is refused.

Hostile parts. A part is a peer's tensor on its way into every replica's parameters, so
:meth:`AllReduceRound.receive` refuses (RemoteProtocolError; the shell then drops that peer from
the round and counts it) a part holding a NaN or an infinity, and a scatter part whose weight is
not within a factor ``max_weight_ratio`` of this replica's own (a weight of 1e30 let one replica
dictate the mean; 1e39, finite as a double but not as fp32, made the mean raise).

Plausible lies. With ``robust`` (a :class:`~fusionp2p.average.robust.RobustConfig`) the owner reduces its
shard by CenteredClip (``average/robust.py``) instead of the plain mean: the exact weighted mean when no
part is an outlier, else a bounded centre; ``Reduced.clipped`` names the peers whose parts were clipped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fusionp2p.average.robust import RobustConfig, robust_mean
from fusionp2p.average.shard import all_finite, shard_bounds, weighted_mean
from fusionp2p.errors import LocalProtocolError, RemoteProtocolError

PHASES = ("scatter", "gather")
MAX_SPEED_S = 1e6   # a speed (seconds per micro-batch) beyond this is a lie


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundMsg:
    """One part of a round: a slice ``[lo, hi)`` of a snapshot (scatter) or of the new anchor (gather)."""

    round_id: int
    epoch: str
    phase: str
    lo: int
    hi: int
    data: torch.Tensor
    weight: float = 1.0
    scalar: float = 0.0
    speed: float = 0.0            # gather: the owner's seconds per micro-batch (0: not measured; re-dealing)
    fragment: int | None = None   # streaming averaging: which fragment of the vector (lo/hi are within it)
    clipped: tuple[int, ...] = ()  # gather, robust reduction: the ranks whose scatter parts the owner clipped
    # gather, re-dealing replicas: (rank, seconds after the owner's own part) when each rank's scatter part
    # reached the owner: the measurement its speed claim is checked against (train/claims.py)
    arrived: tuple[tuple[int, float], ...] = ()
    base: int | None = None       # on the wire only: the sender's base (a bf16 part is a difference from it)


@dataclass(frozen=True, slots=True, kw_only=True)
class Send:
    peer: str
    msg: RoundMsg


@dataclass(frozen=True, slots=True, kw_only=True)
class Reduced:
    """The owned shard is reduced: run the outer step on ``mean`` and call ``publish``."""

    lo: int
    hi: int
    mean: torch.Tensor
    weight: float
    contributors: tuple[str, ...]
    clipped: tuple[str, ...] = ()   # robust reduction: whose parts were outliers (clipped) in this shard


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundResult:
    round_id: int
    complete: bool
    vector: torch.Tensor | None = None       # the gathered full vector, when complete
    scalar_sum: float = 0.0
    lost: frozenset[str] = frozenset()
    contributors: tuple[str, ...] = ()       # whose snapshot entered THIS replica's shard
    reason: str = ""
    # when complete: every owner's speed as it published its shard, in rank order (the same on every
    # replica whose round completed: the replicas re-deal micro-batches by them, train/worker.py)
    speeds: tuple[tuple[str, float], ...] = ()
    # when complete: every owner's clipped peers (robust reduction) in rank order, the same on every replica
    clipped: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # when complete: every owner's arrival times of the scatter parts (RoundMsg.arrived) in rank order, by
    # peer id, the same on every replica (the replicas check the speeds by them, train/claims.py)
    arrivals: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    result: RoundResult


Action = Send | Reduced | Finished


@dataclass(slots=True)
class _Phase:
    pending: set[str]
    got: dict[str, RoundMsg] = field(default_factory=dict)


class AllReduceRound:
    """Reduce-scatter + all-gather of one flat fp32 vector among ``peers`` (this replica is ``me``)."""

    def __init__(self, *, peers: Sequence[str], me: str, n_elems: int, round_id: int, epoch: str,
                 weight: float = 1.0, max_weight_ratio: float = 4.0, fragment: int | None = None,
                 robust: RobustConfig | None = None, out: torch.Tensor | None = None,
                 alloc: Callable[[int], torch.Tensor] | None = None, reference: torch.Tensor | None = None) -> None:
        if not (weight > 0 and math.isfinite(weight)) or not max_weight_ratio >= 1:
            raise LocalProtocolError("weight must be positive and finite, max_weight_ratio >= 1")
        if out is not None and (out.dim() != 1 or out.numel() != n_elems or out.dtype != torch.float32):
            raise LocalProtocolError(f"out must be a flat fp32 vector of {n_elems} elements")
        # the gathered vector: every shard is copied in as it arrives (Finished's vector)
        self._out = torch.empty(n_elems, dtype=torch.float32) if out is None else out
        # the owned shard's mean goes into alloc(n) (a flat fp32 vector, contents undefined: the shell hands
        # out recycled ones) instead of a fresh tensor, whose pages would all fault in again every round
        self._alloc = alloc
        self.weight = weight
        self.max_weight_ratio = max_weight_ratio
        if len(set(peers)) != len(peers):
            raise LocalProtocolError("replica list has duplicates")
        if me not in peers:
            raise LocalProtocolError(f"{me} is not in the replica list")
        self.peers = tuple(peers)
        self.me = me
        self.rank = self.peers.index(me)
        self.n_elems = n_elems
        self.round_id = round_id
        self.epoch = epoch
        self.fragment = fragment   # None: the whole vector; else the fragment every part must name
        self.robust = robust       # None: the plain weighted mean of the parts
        self.reference = reference   # the last average of the whole vector (robust: the test of direction)
        self.bounds = shard_bounds(n_elems, len(self.peers))
        others = {p for p in self.peers if p != me}
        self._scatter = _Phase(pending=set(others))
        self._gather = _Phase(pending=set(others))
        self._lost: set[str] = set()
        self._mismatch: set[str] = set()
        self._own_part: RoundMsg | None = None
        self._own_shard: RoundMsg | None = None
        self._reduced = False
        self._finished = False

    # ------------------------------------------------------------------ queries
    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def my_bounds(self) -> tuple[int, int]:
        return self.bounds[self.rank]

    def awaiting(self) -> frozenset[str]:
        """Peers this replica still waits on (the shell declares them lost at the deadline)."""
        if self._finished:
            return frozenset()
        if not self._reduced:
            return frozenset(self._scatter.pending)
        return frozenset(self._gather.pending)

    # ------------------------------------------------------------------ inputs
    def start(self, snap: torch.Tensor, weight: float | None = None) -> list[Action]:
        """Send the slices of the snapshot *snap* (flat, fp32) to their owners, with *weight* (default: the
        round's ``weight``; the peers' weights are judged against it)."""
        if self._own_part is not None:
            raise LocalProtocolError("round already started")
        if snap.dim() != 1 or snap.numel() != self.n_elems or snap.dtype != torch.float32:
            raise LocalProtocolError(f"snapshot must be a flat fp32 vector of {self.n_elems} elements")
        weight = self.weight if weight is None else weight
        if not (weight > 0 and math.isfinite(weight)):
            raise LocalProtocolError("weight must be positive and finite")
        self.weight = weight
        actions: list[Action] = []
        for k, peer in enumerate(self.peers):
            lo, hi = self.bounds[k]
            msg = RoundMsg(round_id=self.round_id, epoch=self.epoch, phase="scatter", lo=lo, hi=hi, data=snap[lo:hi], weight=weight,
                           fragment=self.fragment)
            if peer == self.me:
                self._own_part = msg
            elif peer not in self._lost:
                actions.append(Send(peer=peer, msg=msg))
        return actions + self._advance()

    def receive(self, peer: str, msg: RoundMsg) -> list[Action]:
        """Handle one message from *peer*. Malformed content raises RemoteProtocolError."""
        if msg.round_id != self.round_id:
            raise LocalProtocolError(f"round {msg.round_id} message routed to round {self.round_id}")
        if peer not in self.peers or peer == self.me:
            raise RemoteProtocolError(f"{peer} is not a replica of this round")
        if msg.phase not in PHASES:
            raise RemoteProtocolError(f"unknown averaging phase {msg.phase!r}")
        if msg.fragment != self.fragment:
            raise RemoteProtocolError(f"{msg.phase} part from {peer} is for fragment {msg.fragment}, "
                                      f"round {self.round_id} averages fragment {self.fragment}")
        phase = self._scatter if msg.phase == "scatter" else self._gather
        if peer in phase.got or (peer in self._mismatch and peer not in phase.pending):
            raise RemoteProtocolError(f"duplicate {msg.phase} part from {peer}")
        if peer in self._lost:
            return []  # declared lost already (deadline); a straggler changes nothing
        if msg.epoch != self.epoch:
            self._mismatch.add(peer)
            phase.pending.discard(peer)
            return self._advance()
        want = self.my_bounds if msg.phase == "scatter" else self.bounds[self.peers.index(peer)]
        if (msg.lo, msg.hi) != want:
            raise RemoteProtocolError(f"{msg.phase} part [{msg.lo},{msg.hi}) from {peer}, expected {list(want)}")
        if msg.data.dtype != torch.float32 or msg.data.dim() != 1 or msg.data.numel() != msg.hi - msg.lo:
            raise RemoteProtocolError(f"{msg.phase} part from {peer} has the wrong dtype or shape")
        if not (msg.weight > 0 and math.isfinite(msg.weight)) or not math.isfinite(msg.scalar) \
                or not 0 <= msg.speed <= MAX_SPEED_S:
            raise RemoteProtocolError(f"{msg.phase} part from {peer} has a bad weight, scalar or speed")
        if msg.clipped and (msg.phase != "gather" or len(set(msg.clipped)) != len(msg.clipped)
                            or not all(0 <= r < len(self.peers) for r in msg.clipped)):
            raise RemoteProtocolError(f"{msg.phase} part from {peer} names bad clipped ranks")
        if msg.arrived and (msg.phase != "gather" or len({r for r, _ in msg.arrived}) != len(msg.arrived)
                            or not all(0 <= r < len(self.peers) and math.isfinite(t) and abs(t) <= MAX_SPEED_S
                                       for r, t in msg.arrived)):
            raise RemoteProtocolError(f"{msg.phase} part from {peer} names bad arrival times")
        r = self.max_weight_ratio
        if msg.phase == "scatter" and not self.weight / r <= msg.weight <= self.weight * r:
            raise RemoteProtocolError(f"scatter part from {peer} has weight {msg.weight:g}, not within a factor "
                                      f"{r:g} of this replica's {self.weight:g}")
        if not all_finite(msg.data):
            raise RemoteProtocolError(f"{msg.phase} part from {peer} holds NaN or infinite values")
        if phase is self._gather:   # into the result now: the message's buffer is free for the next one
            msg = dataclasses.replace(msg, data=self._out[msg.lo:msg.hi].copy_(msg.data))
        phase.got[peer] = msg
        phase.pending.discard(peer)
        return self._advance()

    def unusable(self, peer: str, phase: str) -> list[Action]:
        """*peer*'s part of *phase* cannot be used (the shell could not decode it against its own state):
        like a part of another epoch, it contributes nothing, the round is skipped, the peer stays live."""
        if phase not in PHASES:
            raise LocalProtocolError(f"unknown phase {phase!r}")
        p = self._scatter if phase == "scatter" else self._gather
        if peer == self.me or peer not in self.peers or peer in p.got or peer in self._lost or self._finished:
            return []
        self._mismatch.add(peer)
        p.pending.discard(peer)
        return self._advance()

    def peer_lost(self, peer: str) -> list[Action]:
        """*peer* is dead or missed the deadline: stop waiting for it in this round."""
        if peer == self.me or peer not in self.peers or self._finished:
            return []
        self._lost.add(peer)
        self._scatter.pending.discard(peer)
        self._gather.pending.discard(peer)
        return self._advance()

    def publish(self, shard: torch.Tensor, scalar: float = 0.0, speed: float = 0.0,
                clipped: tuple[str, ...] = (), arrived: Sequence[tuple[str, float]] = ()) -> list[Action]:
        """Send this replica's new anchor shard (the outer step's result) to every live peer, with its
        *speed* (seconds per micro-batch; 0: not measured), the peers it *clipped* (``Reduced.clipped``) and
        when the scatter parts *arrived* (peer, seconds after its own part; the shell's clock)."""
        if not 0 <= speed <= MAX_SPEED_S:
            raise LocalProtocolError(f"speed {speed} out of [0, {MAX_SPEED_S}]")
        if not all(p in self.peers and math.isfinite(t) for p, t in arrived):
            raise LocalProtocolError(f"arrival times {list(arrived)} name other peers or are not finite")
        if not self._reduced:
            raise LocalProtocolError("publish before the owned shard was reduced")
        if self._own_shard is not None:
            raise LocalProtocolError("shard already published")
        lo, hi = self.my_bounds
        if shard.dim() != 1 or shard.numel() != hi - lo:
            raise LocalProtocolError("published shard has the wrong size")
        msg = RoundMsg(round_id=self.round_id, epoch=self.epoch, phase="gather", lo=lo, hi=hi, data=shard.to(torch.float32), scalar=scalar,
                       speed=speed, fragment=self.fragment, clipped=tuple(self.peers.index(p) for p in clipped),
                       arrived=tuple((self.peers.index(p), max(-MAX_SPEED_S, min(MAX_SPEED_S, t))) for p, t in arrived))
        self._out[lo:hi].copy_(shard)   # not a view of it in the sends: the caller may change the vector
        self._own_shard = msg
        sends: list[Action] = [Send(peer=p, msg=msg) for p in self.peers if p != self.me and p not in self._lost]
        return sends + self._advance()

    # ------------------------------------------------------------------ transitions
    def _advance(self) -> list[Action]:
        out: list[Action] = []
        if self._own_part is None or self._finished:
            return out
        if not self._reduced and not self._scatter.pending:
            self._reduced = True
            got = {**self._scatter.got, self.me: self._own_part}
            order = [p for p in self.peers if p in got]  # rank order: bitwise reproducible
            parts, weights = [got[p].data for p in order], [got[p].weight for p in order]
            clipped: tuple[str, ...] = ()
            if self.robust is None:
                lo, hi = self.my_bounds
                mean = weighted_mean(parts, weights, None if self._alloc is None else self._alloc(hi - lo))
            else:
                lo, hi = self.my_bounds
                ref = None if self.reference is None else self.reference[lo:hi]
                rm = robust_mean(parts, weights, self.robust, reference=ref)
                mean, clipped = rm.mean, tuple(order[i] for i in rm.clipped)
            lo, hi = self.my_bounds
            out.append(Reduced(lo=lo, hi=hi, mean=mean, weight=sum(weights), contributors=tuple(order), clipped=clipped))
        if self._reduced and self._own_shard is not None and not self._gather.pending:
            self._finished = True
            out.append(Finished(result=self._result()))
        return out

    def _result(self) -> RoundResult:
        assert self._own_shard is not None
        shards = {**self._gather.got, self.me: self._own_shard}
        contributors = tuple(p for p in self.peers if p == self.me or p in self._scatter.got)
        missing = [p for p in self.peers if p not in shards]
        lost = frozenset(self._lost)
        if missing or self._mismatch:
            why = []
            if missing:
                why.append(f"no anchor shard from {', '.join(missing)}")
            if self._mismatch:
                why.append(f"epoch or base mismatch with {', '.join(sorted(self._mismatch))}")
            return RoundResult(round_id=self.round_id, complete=False, lost=lost, contributors=contributors, reason="; ".join(why))
        vector = self._out   # every shard was copied in as it came
        scalar = 0.0
        for p in self.peers:  # rank order: every replica gets the same float
            scalar += shards[p].scalar
        return RoundResult(round_id=self.round_id, complete=True, vector=vector, scalar_sum=scalar, lost=lost, contributors=contributors,
                           speeds=tuple((p, shards[p].speed) for p in self.peers),
                           clipped=tuple((p, tuple(self.peers[r] for r in shards[p].clipped)) for p in self.peers),
                           arrivals=tuple((p, tuple((self.peers[r], t) for r, t in shards[p].arrived))
                                          for p in self.peers if shards[p].arrived))
