"""Re-plans of a running job: who leads them, where each stage's state comes from, and the step to resume.

Pure (no trio, no clock): the job runner (``jobs/run.py``) feeds it what the members answered and acts
on its results. The protocol around it is in docs/jobs.md "Elastic jobs"; in short:

1. The **leader** of a job is its lowest peer id among the current plan's members that are alive in the
   node's membership view (:func:`leader_of`); when every one of them died, the lowest live node of the
   job's snapshots (a standby: the plan had no role for it, and it holds the job). Every member
   computes it from its own view; views
   agree within a heartbeat, and two nodes that both believe they lead propose for the same epoch and
   are told apart by the election (the lower id's proposal is taken first, a second start for an epoch
   already started is refused).
2. The leader asks every live member (and every joiner that accepted the job) to **halt**: at once when
   a member died or left (the pipeline is broken), or at an agreed step boundary when only a joiner is
   to be taken in. Each answers with a :class:`Halted`: the stage it held, the steps it completed, and
   the content hash of its handed-over state (parameters, optimizer state, CO2 momentum shard).
3. :func:`plan_resume` turns the answers into a :class:`Resume`. A state covers a range of the model's
   coarse units (its stage's ``[start, end)``; states of different epochs may cut the model at
   different fences). If the live states cover every unit, the new epoch starts at the smallest of
   the per-unit best steps and loses nothing (a stage whose best replica was a step ahead keeps that
   step's weights); the sources are listed most advanced first. If some units lost every live state,
   each of them comes from the newest stage file that a live node holds for it (a **shadow copy**,
   which every single-replica stage keeps on another node every few steps: ``jobs/shadow.py``, or a
   checkpoint), the other units keep their live states, and the job resumes at the oldest of those
   steps; with no file for some unit, at step 0 and the published weights. Losing at most the steps
   since the dead stage's newest copy is the contract.
4. The leader sends the new snapshot with the resume to every member of the new epoch (``start``), the
   members elect the plan as for epoch 0, and each new holder builds its stage's state from the sources
   (``train/state.merge_states``: the names its program holds, wherever the old fences put them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from fusionp2p.data.stream import MAX_HISTORY, check_history
from fusionp2p.errors import PlanError, RemoteProtocolError
from fusionp2p.plan.snapshot import Link
from fusionp2p.wire.check import as_map


@dataclass(frozen=True, slots=True, kw_only=True)
class Halted:
    """A member's answer to ``halt``: stage -1 (and no state) when it held no role in the epoch."""

    peer: str
    epoch: int           # the epoch the member was in when it halted
    stage: int
    replica: int
    step: int            # steps completed: the first step it would run next
    state: str = ""      # content hash of its stage state blob
    start: int = -1      # the coarse units its state covers: [start, end)
    end: int = -1

    def to_wire(self) -> dict[str, object]:
        return {"peer": self.peer, "epoch": self.epoch, "stage": self.stage, "replica": self.replica,
                "step": self.step, "state": self.state, "units": [self.start, self.end]}

    @classmethod
    def from_wire(cls, obj: object) -> Halted:
        m = as_map(obj, "halt answer")
        try:
            units = m.get("units", [-1, -1])
            if not isinstance(units, list) or len(units) != 2:
                raise TypeError("units must be [start, end]")
            h = cls(peer=_s(m["peer"]), epoch=_i(m["epoch"]), stage=_i(m["stage"]), replica=_i(m["replica"]),
                    step=_i(m["step"]), state=_s(m.get("state", "")), start=_i(units[0]), end=_i(units[1]))
        except (KeyError, TypeError) as exc:
            raise RemoteProtocolError(f"halt answer: {exc}") from None
        if h.stage < -1 or h.step < 0 or h.epoch < 0 or bool(h.state) != (0 <= h.start < h.end):
            raise RemoteProtocolError("halt answer: inconsistent fields")
        return h


@dataclass(frozen=True, slots=True, kw_only=True)
class Source:
    """A stage state blob to read from: a live replica's hand-off or a replicated checkpoint."""

    start: int           # the coarse units it covers: [start, end)
    end: int
    step: int
    state: str           # content hash
    holders: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    """Where the new epoch starts. ``sources`` are listed preferred first within each old stage."""

    step: int
    sources: tuple[Source, ...]
    from_checkpoint: bool = False
    lost_steps: int = 0          # steps whose training is thrown away (a checkpoint restore)
    # the data history so far, (first step, micro-batch slots a step) per plan (data/stream.py): where each
    # kept step's samples lie in the epoch's order, so that a re-plan continues it exactly
    data: tuple[tuple[int, int], ...] = ()

    @property
    def initial(self) -> bool:
        """No state survived: start from the published weights."""
        return not self.sources

    def to_wire(self) -> dict[str, object]:
        out: dict[str, object] = {"step": self.step, "ckpt": self.from_checkpoint, "lost": self.lost_steps,
                                  "sources": [[s.start, s.end, s.step, s.state, list(s.holders)] for s in self.sources]}
        if self.data:   # absent from a leader that knows none (and from the golden bytes of older ones)
            out["data"] = [list(d) for d in self.data]
        return out

    @classmethod
    def from_wire(cls, obj: object) -> Resume:
        m = as_map(obj, "resume")
        try:
            raw = m["sources"]
            if not isinstance(raw, list) or len(raw) > 4096:
                raise TypeError("sources must be a short list")
            sources = []
            for r in raw:
                if not isinstance(r, list) or len(r) != 5 or not isinstance(r[4], list) or len(r[4]) > 64:
                    raise TypeError("bad source")
                src = Source(start=_i(r[0]), end=_i(r[1]), step=_i(r[2]), state=_s(r[3]),
                             holders=tuple(_s(h) for h in r[4]))
                if not 0 <= src.start < src.end:
                    raise TypeError("bad source units")
                sources.append(src)
            ckpt = m["ckpt"]
            if not isinstance(ckpt, bool):
                raise TypeError("ckpt must be a bool")
            data = m.get("data", [])
            if not isinstance(data, list) or len(data) > MAX_HISTORY or not all(isinstance(d, list) and len(d) == 2 for d in data):
                raise TypeError("data must be a list of [step, slots]")
            hist = tuple((_i(d[0]), _i(d[1])) for d in data)
            if hist:
                check_history(hist)
            out = cls(step=_i(m["step"]), sources=tuple(sources), from_checkpoint=ckpt, lost_steps=_i(m["lost"]),
                      data=hist)
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"resume: {exc}") from None
        if out.step < 0 or out.lost_steps < 0:
            raise RemoteProtocolError("resume: negative step")
        return out


def _i(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not -(2**62) < v < 2**62:
        raise TypeError(f"expected an int, got {type(v).__name__}")
    return v


def _s(v: object) -> str:
    if not isinstance(v, str) or len(v) > 256:
        raise TypeError("expected a short string")
    return v


def leader_of(members: Iterable[str], alive: Callable[[str], bool], *, standbys: Iterable[str] = ()) -> str | None:
    """The lowest peer id of *members* that is alive; when none is, the lowest live one of *standbys*
    (every node the job's snapshots named: they hold the job and carry it on); or None."""
    for group in (members, standbys):
        live = sorted(p for p in group if alive(p))
        if live:
            return live[0]
    return None


def announcer(members: Iterable[str], previous: Iterable[str] | None) -> str:
    """The member that announces an epoch's plan to the publisher (its ``PlanChanged``): the lowest peer id
    of the epoch's *members* (the snapshot's: standbys included) that held a role
    in the *previous* plan, which the publisher heard of; the lowest member at the first epoch or when none
    did. The publisher believes plans only from members it knows, so a joiner it never heard of must not
    announce: choosing among the new plan's role holders alone picked one whenever the plan gave every role
    to joiners and left the old members standing by (three of three benchmarks.churn runs lost an epoch's
    plan event that way)."""
    ms = sorted(set(members))
    if not ms:
        raise ValueError("an epoch without members has no announcer")
    held = set(previous or ())
    return next((p for p in ms if p in held), ms[0])


# checkpoints known to a node: {step: {(start, end): (hash, holders)}}
Checkpoints = Mapping[int, Mapping[tuple[int, int], tuple[str, Sequence[str]]]]


def _covers(ranges: Iterable[tuple[int, int]], n_units: int) -> bool:
    got = [False] * n_units
    for a, b in ranges:
        for u in range(max(0, a), min(n_units, b)):
            got[u] = True
    return all(got)


def complete_checkpoint(checkpoints: Checkpoints, n_units: int,
                        alive: Callable[[str], bool]) -> tuple[int, list[Source]] | None:
    """The newest step whose stage files held by live nodes cover every unit, with those files."""
    for step in sorted(checkpoints, reverse=True):
        files = []
        for (a, b), (h, holders) in sorted(checkpoints[step].items()):
            live = tuple(sorted(p for p in holders if alive(p)))
            if live:
                files.append(Source(start=a, end=b, step=step, state=h, holders=live))
        if _covers(((f.start, f.end) for f in files), n_units):
            return step, files
    return None


def plan_resume(n_units: int, halted: Iterable[Halted], checkpoints: Checkpoints,
                alive: Callable[[str], bool], *, reached: int = 0) -> Resume:
    """Where the next epoch starts (see the module docstring). *reached* is the most advanced step the
    job is known to have completed (to count the steps a checkpoint restore throws away)."""
    live = [h for h in halted if h.state and 0 <= h.start < h.end <= n_units]
    best = max([reached, *(h.step for h in live)])
    if live and _covers(((h.start, h.end) for h in live), n_units):
        ordered = sorted(live, key=lambda h: (-h.step, h.peer))
        step = min(max(h.step for h in live if h.start <= u < h.end) for u in range(n_units))
        return Resume(step=step, sources=tuple(Source(start=h.start, end=h.end, step=h.step, state=h.state,
                                                      holders=(h.peer,)) for h in ordered))
    # Units that lost every live state come from the newest stage file a live node holds for each (a
    # shadow copy, jobs/shadow.py, or a checkpoint); the others keep their live states. The job resumes at
    # the oldest of the per-unit newest steps: never before the newest complete checkpoint, since its
    # files are among the candidates of every unit.
    sources = [Source(start=h.start, end=h.end, step=h.step, state=h.state, holders=(h.peer,)) for h in live]
    for u in range(n_units):
        if any(h.start <= u < h.end for h in live):
            continue
        f = _newest_file(checkpoints, u, alive)
        if f is None:
            return Resume(step=0, sources=(), from_checkpoint=True, lost_steps=best)
        if f not in sources:
            sources.append(f)
    step = min(max(s.step for s in sources if s.start <= u < s.end) for u in range(n_units))
    return Resume(step=step, from_checkpoint=True, lost_steps=max(0, best - step),
                  sources=tuple(sorted(sources, key=lambda s: (-s.step, s.holders, s.start))))


def _newest_file(checkpoints: Checkpoints, unit: int, alive: Callable[[str], bool]) -> Source | None:
    """The newest stage file covering *unit* that a live node holds (the widest of a step's, on a tie)."""
    for step in sorted(checkpoints, reverse=True):
        files = [(b - a, a, b, h, tuple(sorted(p for p in holders if alive(p))))
                 for (a, b), (h, holders) in checkpoints[step].items() if a <= unit < b]
        files = [f for f in files if f[4]]
        if files:
            _, a, b, h, live = max(files)
            return Source(start=a, end=b, step=step, state=h, holders=live)
    return None


def still_taking_off(*, proposed: bool, since: float, retry: float, stalled: bool, broken: bool, fresh: bool,
                     gone: bool, trained: bool, reported: bool = False) -> bool:
    """Whether a leader that finds its epoch broken or stalled waits instead of re-planning now: only while
    the epoch it *proposed* is younger than *retry* seconds (its members may still be fetching state and
    opening links, and a re-plan then would throw that away), and only for the take-off's own troubles. It
    re-plans at once when a newcomer accepted the job (*fresh*, for a *stalled* epoch), when a member of the
    plan is *gone* (the epoch cannot take off without it), when a member *reported* that its own run of the
    epoch ended (``op: replan`` naming it: a state fetch failed, a link never came up; the epoch cannot take
    off either), or when the epoch *trained* a step here: a break after that is a new failure (before issue
    41 a second kill within ``replan_retry`` of the last re-plan, or one member's failed fetch during the
    take-off, waited out the rest of it: up to 20 s)."""
    if not proposed or since >= retry or not (stalled or broken):
        return False
    if stalled and fresh:
        return False
    return not (gone or trained or reported)


def fill_unmeasured(members: Sequence[str],
                    links: Sequence[tuple[str, str, Link]]) -> tuple[list[tuple[str, str, Link]], int]:
    """*links* (measured or estimated, between *members*) and, for each pair of *members* without one, the
    slowest of them (the smallest bandwidth, the largest latency); with how many pairs were filled. None is
    filled when nothing was measured.

    For the re-plan after a loss: a node's probe server refuses probes while it trains (swarm/prober.py), so a
    standby that joined during training, or whose first probes lost to the job's start, has no link figure,
    and the planner's ``missing_link`` (125 kB/s) left it out. The job then shrank at each death instead of
    taking the standby in, every fence moved and every member fetched every state file (benchmarks.churn:
    one stage x 2 replicas on 4 live nodes; later one node alone). The slowest link the job's own nodes
    measured is a guess, but a conservative one among them; planned re-plans (joiners, re-balancing) keep
    the planner's rule, since nothing forces them."""
    if not links:
        return list(links), 0
    have = {frozenset((a, b)) for a, b, _ in links}
    slow = Link(bandwidth_bps=min(lk.bandwidth_bps for _, _, lk in links), latency_s=max(lk.latency_s for _, _, lk in links))
    out = list(links)
    for i, a in enumerate(members):
        out += [(a, b, slow) for b in members[i + 1:] if frozenset((a, b)) not in have]
    return out, len(out) - len(links)


def halt_step(current: Iterable[int], *, tau: int = 1, margin: int = 2, steps: int) -> int:
    """The step boundary at which a planned re-plan halts every member: past every member's current
    step by *margin*, on a multiple of *tau* (a CO2 round boundary), at most the job's end."""
    base = max(current, default=0) + margin
    at = -(-base // tau) * tau if tau > 1 else base
    if at > steps:
        raise PlanError("too close to the end of the job for a planned re-plan")
    return at


__all__ = ["Checkpoints", "Halted", "Resume", "Source", "announcer", "complete_checkpoint", "fill_unmeasured", "halt_step", "leader_of",
           "plan_resume", "still_taking_off"]
