"""Peer tensors that would corrupt the parameters (issue 15, item 4) and unbounded queues (item 8).

Policies, one per case:

* an averaging part holding NaN/inf, or a scatter weight out of range: refused, counted against
  the peer, which leaves the round (the survivors average among themselves);
* a gradient from the next stage (or an averaged one) that is not finite: the optimizer step is
  skipped with a warning (``StageReport.skipped``); ``StepGuard.max_consecutive`` such steps in a row
  fail the job with the reason;
* a neighbour that sends more than two steps' worth of messages: a protocol error that fails the job.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import pytest
import torch
import trio
import trio.testing
from torch import nn

from fusionp2p.average.allreduce import AllReduceRound, RoundMsg
from fusionp2p.average.outer import OuterConfig
from fusionp2p.average.shard import weighted_mean
from fusionp2p.errors import JobError, RemoteProtocolError, leaf_errors
from fusionp2p.graph import StageExecutor, coarsen, partition, stages_from_fences, trace
from fusionp2p.graph.program import StageProgram
from fusionp2p.net.channel import TensorMessage
from fusionp2p.testing.channels import memory_channel_pair
from fusionp2p.train.averager import AveragerConfig, open_replica_averager
from fusionp2p.train.config import TrainConfig
from fusionp2p.train.worker import StageContext, StageReport, StageWorker

torch.set_num_threads(1)
NAN = float("nan")


# ------------------------------------------------------------------------------ averaging parts
def _round(weight: float = 1.0) -> AllReduceRound:
    sm = AllReduceRound(peers=["a", "b"], me="a", n_elems=4, round_id=0, epoch="e")
    sm.start(torch.zeros(4), weight)
    return sm


@pytest.mark.parametrize("value", [NAN, math.inf, -math.inf])
def test_a_non_finite_part_is_refused_in_both_phases(value: float) -> None:
    bad = torch.tensor([0.0, value])
    with pytest.raises(RemoteProtocolError, match="NaN or infinite"):
        _round().receive("b", RoundMsg(round_id=0, epoch="e", phase="scatter", lo=0, hi=2, data=bad))
    sm = _round()
    sm.receive("b", RoundMsg(round_id=0, epoch="e", phase="scatter", lo=0, hi=2, data=torch.zeros(2)))
    sm.publish(torch.zeros(2))
    with pytest.raises(RemoteProtocolError, match="NaN or infinite"):
        sm.receive("b", RoundMsg(round_id=0, epoch="e", phase="gather", lo=2, hi=4, data=bad))


@pytest.mark.parametrize("weight", [1e30, 1e39, 4.5, 0.2])
def test_a_weight_out_of_range_is_refused(weight: float) -> None:
    with pytest.raises(RemoteProtocolError, match="not within a factor 4"):
        _round().receive("b", RoundMsg(round_id=0, epoch="e", phase="scatter", lo=0, hi=2, data=torch.ones(2),
                                       weight=weight))
    # within the ratio of our own weight: fine (a replica with 4x the samples of another)
    _round(weight=weight / 2).receive("b", RoundMsg(round_id=0, epoch="e", phase="scatter", lo=0, hi=2,
                                                    data=torch.ones(2), weight=weight))


def test_the_weighted_mean_never_overflows_fp32() -> None:
    # 1e39 is a finite double but not a float: add_(alpha=1e39) raised RuntimeError and failed the round
    got = weighted_mean([torch.ones(3), torch.full((3,), 3.0)], [1e39, 1e39 / 2])
    assert torch.allclose(got, torch.full((3,), 5.0 / 3.0))


async def _averaging_with_a_hostile_replica(hostile: str) -> tuple[list[torch.Tensor], dict[str, int]]:
    """Three replicas; "c" averages NaN parameters ("nan") or claims a weight of 1e30 ("weight")."""
    peers = ["a", "b", "c"]
    chans: dict[str, dict[str, object]] = {p: {} for p in peers}
    for i, x in enumerate(peers):
        for y in peers[i + 1:]:
            chans[x][y], chans[y][x] = memory_channel_pair(x, y, window=16)
    outer = OuterConfig(outer_lr=1.0, outer_momentum=0.0, sync=True)
    anchors: list[torch.Tensor] = []
    refused: dict[str, int] = {}

    async def replica(me: str) -> None:
        bad = me == "c"
        params = torch.full((6,), NAN) if bad and hostile == "nan" else torch.arange(6.0) + peers.index(me)
        cfg = AveragerConfig(outer=outer, job="j", round_timeout=5.0,
                             weight=1e30 if bad and hostile == "weight" else 1.0)
        async with open_replica_averager(cfg, peers=peers, me=me, channels=chans[me],  # type: ignore[arg-type]
                                         initial=torch.arange(6.0)) as avg:
            for _ in range(3):
                res = await avg.round_boundary(params)
                if not bad and res.anchor is not None:
                    anchors.append(res.anchor)
            if not bad:
                refused.update(avg.refused)

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            for p in peers:
                n.start_soon(replica, p)
    return anchors, refused


@pytest.mark.parametrize("hostile", ["nan", "weight"])
def test_a_hostile_replica_never_reaches_the_anchor(hostile: str) -> None:
    anchors, refused = trio.run(_averaging_with_a_hostile_replica, hostile)
    assert anchors, "the honest replicas went on averaging among themselves"
    assert all(bool(torch.isfinite(a).all()) for a in anchors)
    # honest a=[0..5], b=[1..6]: every mean they adopt lies between them (c's 1e30 weight would pull it to c's)
    assert all(bool(((a >= torch.arange(6.0)) & (a <= torch.arange(6.0) + 1)).all()) for a in anchors)
    assert refused.get("c", 0) >= 1


# ------------------------------------------------------------------------------ pipeline stages
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.l2(torch.tanh(self.l1(x))), y)


def _programs() -> list[StageProgram]:
    torch.manual_seed(0)
    dag = trace(_Net(), (torch.randn(2, 4), torch.tensor([0, 2])))
    c = coarsen(dag)
    return partition(c, stages_from_fences(len(c.units), [1]))


async def _run_stage0(neighbour: Callable[[object, StageProgram], Awaitable[None]], *, steps: int = 3
                      ) -> tuple[list[StageReport], dict[str, torch.Tensor], BaseException | None]:
    """Stage 0 of ``_Net`` for real, against a hand-written stage 1 (*neighbour*)."""
    progs = _programs()
    p0, p1 = progs
    a, b = memory_channel_pair("s0", "s1", window=8)
    reports: list[StageReport] = []
    names = [r.name for r in p0.recv]

    def data(step: int, micro: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 10 + micro)
        return {names[0]: torch.randn(2, 4, generator=g), **{n: torch.tensor([0, 1]) for n in names[1:]}}

    async def report(rep: StageReport) -> None:
        reports.append(rep)

    ex = StageExecutor(p0)
    cfg = TrainConfig(steps=steps, micro_batch=2, micro_batches=2, lr=0.1)
    ctx = StageContext(job="j", executor=ex, config=cfg, replica=0, replicas=1, links={1: a}, data=data,
                       tokens_per_micro=2, report=report, recv_timeout=10.0)
    err: BaseException | None = None
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(neighbour, b, p1)
                await StageWorker(ctx).run()
                n.cancel_scope.cancel()
    except Exception as exc:
        err = exc
    return reports, {k: v.detach().clone() for k, v in ex.parameters().items()}, err


def _nan_grads(bad_steps: set[int]) -> Callable[[object, StageProgram], Awaitable[None]]:
    """A stage 1 that answers every activation with a gradient, NaN on *bad_steps*."""
    async def stage1(ch: object, p1: StageProgram) -> None:
        while True:
            msg: TensorMessage = await ch.receive()  # type: ignore[attr-defined]
            if msg.kind != "act" or msg.step >= 1000:
                continue
            g = torch.full_like(msg.tensors[0], NAN if msg.step in bad_steps else 0.01)
            if msg.step == _EVAL:
                continue
            await ch.send(TensorMessage(job="j", kind="grad", stage=0, step=msg.step, micro=msg.micro,  # type: ignore[attr-defined]
                                        name=msg.name, tensors=(g,)))
    return stage1


_EVAL = 3   # steps=3: the evaluation pass runs as step 3 (forward only)


def test_a_nan_gradient_from_the_next_stage_skips_the_step() -> None:
    reports, params, err = trio.run(_run_stage0, _nan_grads({1}))
    assert err is None
    assert all(bool(torch.isfinite(p).all()) for p in params.values())   # one AdamW step on it made all NaN
    skipped = {r.step: r.skipped for r in reports if not r.eval}
    assert skipped[0] == "" and skipped[2] == ""
    assert "non-finite gradients" in skipped[1]


def test_non_finite_gradients_in_a_row_fail_the_job_with_the_reason() -> None:
    _, params, err = trio.run(_run_stage0, _nan_grads({0, 1, 2}))
    assert err is not None
    jobs = [e for e in leaf_errors(err) if isinstance(e, JobError)]
    assert jobs and "3 steps in a row" in str(jobs[0])
    assert all(bool(torch.isfinite(p).all()) for p in params.values())


def test_a_neighbour_flooding_future_steps_is_a_protocol_error() -> None:
    async def flood(ch: object, p1: StageProgram) -> None:
        g = torch.zeros(2, 8)
        for i in range(10_000):   # gradients of "step 1" before step 0 even ended: held for later, unbounded
            await ch.send(TensorMessage(job="j", kind="grad", stage=0, step=1, micro=i,  # type: ignore[attr-defined]
                                        name=p1.recv[0].name, tensors=(g,)))
        await trio.sleep_forever()

    _, _, err = trio.run(_run_stage0, flood)
    assert err is not None
    msgs = [str(e) for e in leaf_errors(err) if isinstance(e, RemoteProtocolError)]
    assert msgs and "messages" in msgs[0] and "unused" in msgs[0]


def test_a_skipped_step_is_a_progress_event() -> None:
    from fusionp2p.jobs.events import StepSkipped, decode_event, encode_event

    ev = StepSkipped(job="j", step=3, stage=1, peer="p", reason="stage 1, step 3: non-finite gradients", at=1.0)
    assert decode_event(encode_event(ev)) == ev


# ------------------------------------------------------------------------------ tied weights
class _TiedNet(nn.Module):
    """l1's weight is read again by the head: after the cut, stage 0 and stage 1 both hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l2(torch.tanh(self.l1(x))))
        return ((nn.functional.linear(h, self.l1.weight.t()) - x) ** 2).mean() + 0.0 * y.sum()


async def _run_tied_stage0(answer: Callable[[TensorMessage, StageProgram], TensorMessage | None]
                           ) -> tuple[list[StageReport], dict[str, torch.Tensor], BaseException | None]:
    """Stage 0 of ``_TiedNet`` against a stage 1 that answers gradients and sends ``answer``'s tied message."""
    torch.manual_seed(0)
    dag = trace(_TiedNet(), (torch.randn(2, 4), torch.zeros(2)))
    c = coarsen(dag)
    p0, p1 = partition(c, stages_from_fences(len(c.units), [1]))
    assert p0.tied and p0.tied[0].stages == (0, 1)
    a, b = memory_channel_pair("s0", "s1", window=64)
    reports: list[StageReport] = []

    def data(step: int, micro: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 10 + micro)
        return {r.name: torch.randn(2, 4, generator=g) if r.meta.shape == (2, 4) else torch.zeros(2)
                for r in p0.recv}

    async def report(rep: StageReport) -> None:
        reports.append(rep)

    async def stage1() -> None:
        sent: set[int] = set()
        while True:
            msg = await b.receive()
            if msg.kind == "act":
                await b.send(TensorMessage(job="j", kind="grad", stage=0, step=msg.step, micro=msg.micro,
                                           name=msg.name, tensors=(torch.full_like(msg.tensors[0], 0.01),)))
            if msg.kind in ("act", "tied") and msg.step not in sent and msg.step < 3:
                sent.add(msg.step)
                tied = answer(msg, p1)
                if tied is not None:
                    await b.send(tied)

    ex = StageExecutor(p0)
    ctx = StageContext(job="j", executor=ex, config=TrainConfig(steps=3, micro_batch=2, micro_batches=2, lr=0.1),
                       replica=0, replicas=1, links={1: a}, data=data, tokens_per_micro=2, report=report,
                       recv_timeout=10.0)
    err: BaseException | None = None
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(stage1)
                await StageWorker(ctx).run()
                n.cancel_scope.cancel()
    except Exception as exc:
        err = exc
    return reports, {k: v.detach().clone() for k, v in ex.parameters().items()}, err


def _tied(msg: TensorMessage, p1: StageProgram, grad: torch.Tensor | None = None, ok: float = 1.0) -> TensorMessage:
    name = p1.tied[0].name
    shape = next(s.meta.shape for s in p1.inputs if s.name == name)
    g = torch.full(shape, 0.01) if grad is None else grad
    return TensorMessage(job="j", kind="tied", stage=0, step=msg.step, name=name, tensors=(g, torch.tensor([ok])))


def test_tied_gradient_of_the_wrong_shape_is_a_protocol_error() -> None:
    _, _, err = trio.run(_run_tied_stage0, lambda m, p1: _tied(m, p1, grad=torch.zeros(3)))
    assert err is not None
    msgs = [str(e) for e in leaf_errors(err) if isinstance(e, RemoteProtocolError)]
    assert msgs and "tied gradient" in msgs[0], [str(e) for e in leaf_errors(err)]


def test_a_non_finite_tied_gradient_or_a_skipping_holder_skips_the_step_everywhere() -> None:
    def answer(m: TensorMessage, p1: StageProgram) -> TensorMessage:
        if m.step == 0:
            return _tied(m, p1, grad=torch.full((8, 4), NAN))
        return _tied(m, p1, ok=0.0 if m.step == 1 else 1.0)    # step 1: the holder itself will skip

    reports, params, err = trio.run(_run_tied_stage0, answer)
    assert err is None
    skipped = {r.step: r.skipped for r in reports if not r.eval}
    assert skipped[0] and skipped[1] and not skipped[2]
    assert all(bool(torch.isfinite(p).all()) for p in params.values())
