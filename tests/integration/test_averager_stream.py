"""Streaming CO2 over in-memory channels: n replicas in one trio.run, each averaging one fragment per
local step and applying it one step late (train/averager.py, "streaming").

Checked against a single-process simulator of the same algorithm (unsharded per-fragment outer state,
the jump ``live_f + (anchor_f - snap_f)``, and the plain-mean finalize), and for the end states the
product relies on: identical parameters after finalize, no lost progress alone, a dead peer dropped.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable

import pytest
import torch
import trio
import trio.lowlevel
import trio.testing

from fusionp2p.average.outer import OuterConfig, OuterOptimizer
from fusionp2p.average.shard import shard_bounds, weighted_mean
from fusionp2p.train.averager import (
    AveragerConfig,
    BoundaryResult,
    ReplicaAverager,
    load_anchor_,
    load_flat_,
    open_replica_averager,
    read_ranges,
    stream_fragments,
)
from tests.integration.test_averager import PEERS, Mesh, _data, _flat, _model, run_on_mesh

torch.set_num_threads(1)
LR = 0.05


def _local_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, s: int) -> None:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(_data(rank, s)[0]), _data(rank, s)[1]).backward()
    opt.step()


async def _train(avg: ReplicaAverager, rank: int, steps: int, *,
                 before_boundary: Callable[[int], Awaitable[None]] | None = None
                 ) -> tuple[torch.nn.Module, list[BoundaryResult]]:
    """*rank*'s local steps, each followed by its round boundary (the last by finalize); *before_boundary*
    (the step) is awaited between a step and its boundary."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    params = list(model.parameters())
    out: list[BoundaryResult] = []
    for s in range(steps):
        _local_step(model, opt, rank, s)
        await trio.lowlevel.checkpoint()   # the training loop yields between steps; averaging runs meanwhile
        if before_boundary is not None:
            await before_boundary(s)
        if s + 1 < steps:
            res = await avg.round_boundary(params, lr=LR)
            out.append(res)
            if res.anchor is not None:
                load_anchor_(params, res.anchor, res.ranges)
        else:
            fin = await avg.finalize(params)
            assert fin is not None and fin.anchor is not None
            out.append(fin)
            load_flat_(params, fin.anchor)
    return model, out


def _run(cfg: OuterConfig, steps: int, n: int, segments: list[tuple[int, int]] | None = None, *, wire: str = "fp32",
         bf16_peers: dict[str, frozenset[str]] | None = None
         ) -> tuple[list[torch.Tensor], list[list[BoundaryResult]], list[ReplicaAverager]]:
    peers = PEERS[:n]
    finals: dict[str, torch.Tensor] = {}
    results: dict[str, list[BoundaryResult]] = {}
    avgs: list[ReplicaAverager] = []

    async def replica(mesh: Mesh, i: int, p: str) -> None:
        acfg = AveragerConfig(outer=cfg, job="j", stage=1, round_timeout=5.0, wire=wire,
                              bf16_peers=None if bf16_peers is None else bf16_peers[p])
        async with open_replica_averager(acfg, peers=peers, me=p, channels=mesh.ch[p], initial=list(_model().parameters()),
                                         segments=segments) as avg:
            avgs.append(avg)
            m, res = await _train(avg, i, steps)
            finals[p], results[p] = _flat(m), res

    run_on_mesh(peers, replica)
    return [finals[p] for p in peers], [results[p] for p in peers], avgs


def _reference(cfg: OuterConfig, steps: int, n: int, segments: list[tuple[int, int]] | None = None) -> list[torch.Tensor]:
    """n replicas in one loop: fragment s mod tau averaged after step s (sync-form outer step on its
    fresh mean), applied after step s + 1 as a jump; the last step averages every fragment plainly."""
    models = [_model() for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.5) for m in models]
    x0 = _flat(models[0])
    if segments is None:   # one segment: contiguous balanced slices
        frags = tuple(((lo, hi),) for lo, hi in shard_bounds(x0.numel(), min(cfg.tau, x0.numel())))
    else:
        frags = stream_fragments(x0.numel(), cfg.tau, segments)
    fcfg = dataclasses.replace(cfg, sync=True, lag=1)
    outers = [OuterOptimizer(fcfg, read_ranges(x0, fr)) for fr in frags]
    pending: list[tuple[int, int, list[torch.Tensor], torch.Tensor]] = []   # (step launched, fragment, snaps, anchor)

    def apply(p: tuple[int, int, list[torch.Tensor], torch.Tensor]) -> None:
        _, f, snaps, anchor = p
        for m, snap in zip(models, snaps):
            load_anchor_(list(m.parameters()), read_ranges(_flat(m), frags[f]).add_(anchor - snap), frags[f])

    for s in range(steps):
        for i, (m, o) in enumerate(zip(models, opts)):
            _local_step(m, o, i, s)
        while pending and (s + 1 == steps or s - pending[0][0] >= cfg.lag):   # the last step applies every round
            apply(pending.pop(0))
        if s + 1 < steps:
            f = s % cfg.tau
            if f < len(frags):
                snaps = [read_ranges(_flat(m), frags[f]) for m in models]
                pending.append((s, f, snaps, outers[f].step(weighted_mean(snaps, [1.0] * n), lr=LR).anchor))
    final = _flat(models[0])
    for fr in frags:
        load_anchor_(final, weighted_mean([read_ranges(_flat(m), fr) for m in models], [1.0] * n), fr)
    return [final] * n


@pytest.mark.parametrize(
    ("n", "cfg"),
    [
        (2, OuterConfig(tau=4, sync=False, stream=True)),
        (3, OuterConfig(tau=3, outer_lr=0.8, outer_momentum=0.5, sync=False, stream=True)),
        (3, OuterConfig(tau=1, outer_lr=0.9, outer_momentum=0.3, nesterov=True, sync=False, stream=True)),
        (2, OuterConfig(tau=5, outer_momentum=0.4, clip="elementwise", clip_threshold=0.05, sync=False, stream=True)),
        (3, OuterConfig(tau=4, outer_lr=0.8, outer_momentum=0.5, sync=False, stream=True, lag=2)),
        (2, OuterConfig(tau=2, outer_momentum=0.3, sync=False, stream=True, lag=2)),
    ],
    ids=["2-tau4", "3-tau3-momentum", "3-tau1-nesterov", "2-tau5-clip", "3-tau4-lag2", "2-tau2-lag2"],
)
@pytest.mark.parametrize("segments", [None, [(0, 11), (11, 35), (35, 66)]], ids=["one-segment", "three-segments"])
def test_replicas_end_identical_and_match_the_simulator(n: int, cfg: OuterConfig, segments: list[tuple[int, int]] | None) -> None:
    steps = 13
    finals, results, avgs = _run(cfg, steps, n, segments)
    for f in finals[1:]:
        assert torch.equal(f, finals[0])                  # bitwise: finalize loads the same vector everywhere
    ref = _reference(cfg, steps, n, segments)
    assert torch.allclose(finals[0], ref[0], atol=1e-6, rtol=0)
    for res in results:
        # every boundary from the lag-th on applies the round launched lag steps before, of fragment
        # (step - lag) mod tau
        applied = [r for r in res[:-1] if r.anchor is not None]
        assert len(applied) == steps - 1 - cfg.lag
        for r in applied:
            assert r.fragment == (r.boundary - cfg.lag) % cfg.tau
            assert r.consumed_round is not None and r.launched_round == r.consumed_round + cfg.lag
        assert res[-1].reason == ""                       # every final fragment round completed
    for a in avgs:
        assert a.stats.rounds == (steps - 1) + len(a.fragments) and a.stats.skipped == 0


def test_one_replica_loses_no_progress() -> None:
    """Alone, with outer lr 1 and no momentum, averaging is the identity: plain local training."""
    cfg = OuterConfig(tau=4, sync=False, stream=True)
    finals, _, _ = _run(cfg, 11, 1)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    for s in range(11):
        _local_step(model, opt, 0, s)
    assert torch.allclose(finals[0], _flat(model), atol=1e-6, rtol=0)


@pytest.mark.parametrize("how", ["closed", "silent"])
def test_peer_dies_mid_run_survivors_drop_it_and_go_on(how: str) -> None:
    cfg = OuterConfig(tau=3, outer_momentum=0.3, sync=False, stream=True)
    peers = PEERS[:3]
    steps = 14
    finals: dict[str, torch.Tensor] = {}
    results: dict[str, list[BoundaryResult]] = {}
    alive: dict[str, tuple[str, ...]] = {}

    async def replica(mesh: Mesh, i: int, p: str) -> None:
        acfg = AveragerConfig(outer=cfg, job="j", stage=0, round_timeout=0.5)
        async with open_replica_averager(acfg, peers=peers, me=p, channels=mesh.ch[p], initial=list(_model().parameters())) as avg:
            if p == "r2":   # trains 5 steps with the others, then dies mid-run
                model = _model()
                opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
                for s in range(5):
                    _local_step(model, opt, i, s)
                    await trio.lowlevel.checkpoint()
                    res = await avg.round_boundary(list(model.parameters()), lr=LR)
                    if res.anchor is not None:
                        load_anchor_(list(model.parameters()), res.anchor, res.ranges)
                if how == "closed":
                    await mesh.kill(p)
                else:   # hangs without answering: only the deadlines save the others
                    await trio.sleep_forever()
                return
            m, res = await _train(avg, i, steps)
            finals[p], results[p], alive[p] = _flat(m), res, avg.alive

    async def main() -> None:
        mesh = Mesh(peers)
        with trio.fail_after(120):   # mock time: a real hang makes the clock jump here and fail
            async with trio.open_nursery() as victim:
                victim.start_soon(replica, mesh, 2, "r2")
                async with trio.open_nursery() as survivors:
                    for i, p in enumerate(peers[:2]):
                        survivors.start_soon(replica, mesh, i, p)
                victim.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert set(finals) == {"r0", "r1"}
    assert alive["r0"] == alive["r1"] == ("r0", "r1")
    for res in results.values():
        assert any(r.anchor is None and r.consumed_round is not None for r in res)   # a round was skipped ...
        assert res[-2].anchor is not None                                          # ... averaging resumed
        assert res[-1].reason == ""                                                # ... and finalize completed
    assert torch.equal(finals["r0"], finals["r1"])
    assert bool(torch.isfinite(finals["r0"]).all())


def _sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.dtype, int | None]]:
    """Record (phase, dtype, base) of every averaging part put on a channel."""
    from fusionp2p.train import averager as averager_mod

    sent: list[tuple[str, torch.dtype, int | None]] = []
    real = averager_mod.to_message

    def spy(job: str, stage: int, msg):  # type: ignore[no-untyped-def]
        sent.append((msg.phase, msg.data.dtype, msg.base))
        return real(job, stage, msg)

    monkeypatch.setattr(averager_mod, "to_message", spy)
    return sent


@pytest.mark.parametrize("n", [2, 3])
def test_bf16_wire_sends_differences_and_every_replica_loads_the_same_bits(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """CO2.wire "bf16": after each fragment's first round (fp32: no common base yet) every part is a bf16
    difference from the last average, half the bytes; the replicas still load identical vectors, and
    the result stays within bf16's rounding of the differences of the fp32 wire's."""
    cfg = OuterConfig(tau=3, outer_lr=0.8, outer_momentum=0.5, sync=False, stream=True)
    steps = 13
    sent = _sent(monkeypatch)
    finals, _, avgs = _run(cfg, steps, n, wire="bf16")
    for f in finals[1:]:
        assert torch.equal(f, finals[0])
    bases = [a._bases for a in avgs]                # every round's average: the same bits on every replica
    assert set(bases[0]) == set(range(3))
    for b in bases[1:]:
        assert b.keys() == bases[0].keys()
        assert all(b[k][0] == bases[0][k][0] and torch.equal(b[k][1], bases[0][k][1]) for k in b)
    first_rounds = 3 * n * (n - 1) * 2       # tau fragments, each replica to each other, scatter and gather
    assert all(d == torch.float32 and b is None for _, d, b in sent[:first_rounds])
    later = sent[first_rounds:]
    assert later and sum(d == torch.bfloat16 and b is not None for _, d, b in later) >= 0.75 * len(later)
    fp32, _, _ = _run(cfg, steps, n, wire="fp32")
    scale = fp32[0].abs().max()
    assert torch.allclose(finals[0], fp32[0], atol=2e-3 * float(scale), rtol=0)


def test_bf16_wire_on_no_link_is_the_fp32_wire_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """CO2.wire "bf16" where no link pays for it (fast links, jobs/build.averaging_bf16): every part goes in
    fp32, no base is kept, nothing is rounded, and the replicas end exactly where the fp32 wire does."""
    cfg = OuterConfig(tau=3, outer_lr=0.8, outer_momentum=0.5, sync=False, stream=True)
    sent = _sent(monkeypatch)
    none = dict.fromkeys(PEERS[:3], frozenset[str]())
    finals, _, avgs = _run(cfg, 10, 3, wire="bf16", bf16_peers=none)
    assert sent and all(d == torch.float32 and b is None for _, d, b in sent)
    assert all(not a._bases for a in avgs)
    fp32, _, _ = _run(cfg, 10, 3, wire="fp32")
    assert all(torch.equal(f, g) for f, g in zip(finals, fp32, strict=True))


def test_bf16_wire_on_one_link_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the r0-r1 link carries bf16 differences (a slow link; both ends priced it the same), r2's links
    fp32: the replicas still load identical vectors, and only that link's parts (a third of them) are bf16."""
    cfg = OuterConfig(tau=3, outer_lr=0.8, outer_momentum=0.5, sync=False, stream=True)
    sent = _sent(monkeypatch)
    links = {"r0": frozenset({"r1"}), "r1": frozenset({"r0"}), "r2": frozenset[str]()}
    finals, _, avgs = _run(cfg, 13, 3, wire="bf16", bf16_peers=links)
    for f in finals[1:]:
        assert torch.equal(f, finals[0])
    bf16 = sum(d == torch.bfloat16 for _, d, _ in sent)
    assert 0 < bf16 <= len(sent) // 3
    by = {a.me: a for a in avgs}   # avgs is in the order the replicas opened their averagers
    assert not by["r2"]._bases and by["r0"]._bases.keys() == by["r1"]._bases.keys() == set(range(3))
    fp32, _, _ = _run(cfg, 13, 3, wire="fp32")
    assert torch.allclose(finals[0], fp32[0], atol=2e-3 * float(fp32[0].abs().max()), rtol=0)


def test_a_replica_without_the_base_is_sent_fp32_and_the_wire_heals(monkeypatch: pytest.MonkeyPatch) -> None:
    """One replica loses its bases (as after a round only it saw fail) or holds a wrong one: its parts and
    the parts sent to it go in fp32, or a round is skipped; the replicas still end identical and the
    next rounds are bf16 again."""
    cfg = OuterConfig(tau=2, outer_lr=0.8, sync=False, stream=True)
    sent = _sent(monkeypatch)
    damaged: list[str] = []
    real_boundary = ReplicaAverager.round_boundary

    async def boundary(self: ReplicaAverager, params, *, lr=None):  # type: ignore[no-untyped-def]
        if self.me == PEERS[0] and self._boundary == 6:
            self._bases.clear()                          # lost them
            damaged.append("cleared")
        if self.me == PEERS[1] and self._boundary == 9 and 1 in self._bases:
            tag, vec = self._bases[1]
            self._bases[1] = (tag + 1000, vec)           # a base nobody else has
            damaged.append("wrong")
        return await real_boundary(self, params, lr=lr)

    monkeypatch.setattr(ReplicaAverager, "round_boundary", boundary)
    finals, results, avgs = _run(cfg, 16, 3, wire="bf16")
    assert damaged == ["cleared", "wrong"]
    for f in finals[1:]:
        assert torch.equal(f, finals[0])
    skipped = [r for res in results for r in res if r.reason and "mismatch" in r.reason]
    assert skipped                                         # the wrong base cost a round
    assert not any(r.reason and "lost" in r.reason for res in results for r in res)   # nobody was dropped
    assert all(len(a.alive) == 3 for a in avgs)
    assert sent[-20:] and any(d == torch.bfloat16 for _, d, _ in sent[-20:])   # healed: differences again


def test_with_lag_2_a_boundary_does_not_wait_for_the_round_of_the_step_before() -> None:
    """Replica r1 reaches its first boundary only after r0 has passed its second: with ``lag=2`` r0's
    second boundary applies nothing (round 0 is due a step later), so it does not wait for round 0,
    which cannot finish before r1 joins it (with lag 1 it would, and the run would never end). The end
    state is still the simulator's: the lag is fixed, so timing does not change the loss."""
    cfg = OuterConfig(tau=4, outer_lr=0.8, sync=False, stream=True, lag=2)
    peers, steps = PEERS[:2], 7
    finals: dict[str, torch.Tensor] = {}
    results: dict[str, list[BoundaryResult]] = {}
    r0_past_boundary_1 = trio.Event()

    async def hold(i: int, s: int) -> None:
        if i == 0 and s == 2:     # r0's boundary 1 has returned
            r0_past_boundary_1.set()
        elif i == 1 and s == 0:   # r1 holds its first boundary until then
            await r0_past_boundary_1.wait()

    async def replica(mesh: Mesh, i: int, p: str) -> None:
        acfg = AveragerConfig(outer=cfg, job="j", stage=1, round_timeout=5.0)
        async with open_replica_averager(acfg, peers=peers, me=p, channels=mesh.ch[p], initial=list(_model().parameters())) as avg:
            m, results[p] = await _train(avg, i, steps, before_boundary=functools.partial(hold, i))
        finals[p] = _flat(m)

    run_on_mesh(peers, replica, timeout=10.0)
    assert results["r0"][1].consumed_round is None
    assert torch.equal(finals["r0"], finals["r1"])
    assert torch.allclose(finals["r0"], _reference(cfg, steps, 2)[0], atol=1e-6, rtol=0)
