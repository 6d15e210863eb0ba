"""ReplicaAverager over in-memory tensor channels: n replicas in one trio.run.

The channel pair below is a tiny stand-in for fusionp2p.testing.channels (not present when this was
written): ordered, bounded, with an optional per-message delay, and a ``kill`` that makes the peer's
sends and receives raise PeerUnavailable the way a dead TCP connection does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import torch
import trio
import trio.lowlevel
import trio.testing

from fusionp2p.average.outer import OuterConfig, OuterOptimizer
from fusionp2p.average.shard import weighted_mean
from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.channel import TensorMessage
from fusionp2p.train.averager import (
    AveragerConfig,
    BoundaryResult,
    ReplicaAverager,
    load_flat_,
    open_replica_averager,
)

torch.set_num_threads(1)


class MemChannel:
    def __init__(self, local: str, remote: str, send: trio.MemorySendChannel[TensorMessage], recv: trio.MemoryReceiveChannel[TensorMessage], dead: set[str], delay: float = 0.0) -> None:
        self.local, self._remote, self._send, self._recv, self._dead = local, remote, send, recv, dead
        self.delay = delay            # seconds each message occupies the link (one at a time)
        self._link = trio.Lock()

    @property
    def remote_peer(self) -> str:
        return self._remote

    async def send(self, msg: TensorMessage) -> None:
        if self._remote in self._dead or self.local in self._dead:
            raise PeerUnavailable(self._remote, "dead")
        # a real channel serialises: the receiver never shares memory with the sender
        copy = TensorMessage(job=msg.job, kind=msg.kind, stage=msg.stage, step=msg.step, name=msg.name, meta=dict(msg.meta), tensors=tuple(t.clone() for t in msg.tensors))
        if self.delay:
            async with self._link:
                await trio.sleep(self.delay)
        try:
            await self._send.send(copy)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise PeerUnavailable(self._remote, "closed") from None

    async def receive(self) -> TensorMessage:
        try:
            return await self._recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise PeerUnavailable(self._remote, "closed") from None

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._recv.aclose()


class Mesh:
    """Full mesh of MemChannels among ``peers``."""

    def __init__(self, peers: list[str], window: int = 64, delay: float = 0.0) -> None:
        self.dead: set[str] = set()
        self.ch: dict[str, dict[str, MemChannel]] = {p: {} for p in peers}
        for i, a in enumerate(peers):
            for b in peers[i + 1 :]:
                s_ab, r_ab = trio.open_memory_channel[TensorMessage](window)
                s_ba, r_ba = trio.open_memory_channel[TensorMessage](window)
                self.ch[a][b] = MemChannel(a, b, s_ab, r_ba, self.dead, delay)
                self.ch[b][a] = MemChannel(b, a, s_ba, r_ab, self.dead, delay)

    async def kill(self, peer: str) -> None:
        """The peer dies: every channel touching it breaks."""
        self.dead.add(peer)
        for ch in self.ch[peer].values():
            await ch.aclose()


def run_on_mesh(peers: list[str], replica: Callable[[Mesh, int, str], Awaitable[None]], *, timeout: float = 30.0) -> None:
    """Run ``replica(mesh, i, peer)`` for every peer, on one fresh mesh, under a deadline."""

    async def main() -> None:
        mesh = Mesh(peers)
        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                for i, p in enumerate(peers):
                    nursery.start_soon(replica, mesh, i, p)

    trio.run(main)


PEERS = [f"r{i}" for i in range(4)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def _flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


async def _train(
    avg: ReplicaAverager, rank: int, steps: int, tau: int, *, on_boundary: Callable[[int, torch.nn.Module], Awaitable[None]] | None = None
) -> tuple[torch.nn.Module, list[BoundaryResult]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    out = []
    for s in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(_data(rank, s)[0]), _data(rank, s)[1]).backward()
        opt.step()
        await trio.lowlevel.checkpoint()  # the training loop yields between steps; averaging runs meanwhile
        if (s + 1) % tau == 0:
            res = await avg.round_boundary(list(model.parameters()), lr=0.05)
            out.append(res)
            if res.anchor is not None:
                load_flat_(model.parameters(), res.anchor)
            if on_boundary is not None:
                await on_boundary(s, model)
    return model, out


def _run_replicas(cfg: OuterConfig, steps: int, *, n: int = 4, timeout: float = 5.0, perturb: bool = False) -> tuple[list[torch.nn.Module], list[list[BoundaryResult]], list[ReplicaAverager]]:
    peers = PEERS[:n]
    models: list[torch.nn.Module] = [torch.nn.Module()] * n
    results: list[list[BoundaryResult]] = [[] for _ in range(n)]
    avgs: list[ReplicaAverager] = []

    async def replica(mesh: Mesh, i: int, p: str) -> None:
        acfg = AveragerConfig(outer=cfg, job="j", stage=1, round_timeout=timeout)
        async with open_replica_averager(acfg, peers=peers, me=p, channels=mesh.ch[p], initial=list(_model().parameters())) as avg:
            avgs.append(avg)

            async def scribble(_s: int, m: torch.nn.Module) -> None:
                # live params change while the round is in flight (it runs to completion meanwhile),
                # then change back before the next local step: the round must not notice
                rnd = avg._pending
                if perturb and rnd is not None:
                    saved = [q.detach().clone() for q in m.parameters()]
                    with torch.no_grad():
                        for q in m.parameters():
                            q.fill_(float("nan"))
                    await rnd.done.wait()
                    with torch.no_grad():
                        for q, v in zip(m.parameters(), saved):
                            q.copy_(v)

            m, res = await _train(avg, i, steps, cfg.tau, on_boundary=scribble)
            fin = await avg.finalize()
            if fin is not None:
                res.append(fin)
            models[i], results[i] = m, res

    run_on_mesh(peers, replica)
    return models, results, avgs


def _reference(cfg: OuterConfig, steps: int, n: int = 4) -> list[torch.Tensor]:
    """Single-process simulator of n replicas (unsharded outer state): the anchors each boundary returns."""
    models = [_model() for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5) for m in models]
    outer = OuterOptimizer(cfg, _flat(models[0]))
    pending: torch.Tensor | None = None
    anchors = []
    for s in range(steps):
        for i, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(_data(i, s)[0]), _data(i, s)[1]).backward()
            o.step()
        if (s + 1) % cfg.tau == 0:
            mean = weighted_mean([_flat(m) for m in models], [1.0] * n)
            if cfg.sync:
                new = outer.step(mean, lr=0.05).anchor
            elif pending is None:
                new = outer.hold(lr=0.05).anchor.clone()
            else:
                new = outer.step(pending, lr=0.05).anchor
            pending = mean
            anchors.append(new.clone())
            for m in models:
                load_flat_(m.parameters(), new)
    if not cfg.sync and pending is not None:
        anchors.append(outer.step(pending, lr=0.05).anchor.clone())
    return anchors


@pytest.mark.parametrize(
    "cfg",
    [
        OuterConfig(tau=2, outer_lr=0.8, outer_momentum=0.5),
        OuterConfig(tau=2, outer_lr=1.0, outer_momentum=0.5, sync=False, clip="elementwise", clip_threshold=0.05),
        OuterConfig(tau=3, outer_lr=0.9, outer_momentum=0.3, sync=False, penalty="elementwise", nesterov=True),
    ],
    ids=["sync-slowmo", "async-clip", "async-elementwise-nesterov"],
)
def test_replicas_match_single_process_simulator(cfg: OuterConfig) -> None:
    steps = 12
    _, results, _ = _run_replicas(cfg, steps)
    ref = _reference(cfg, steps)
    for res in results:
        anchors = [r.anchor for r in res]
        assert len(anchors) == len(ref)
        for t, (a, b) in enumerate(zip(anchors, ref)):
            assert a is not None
            assert torch.allclose(a, b, atol=1e-6, rtol=0), t
        for t, r in enumerate(res[: len(ref) - (0 if cfg.sync else 1)]):
            # sync consumes this round's average; async the previous round's (t−1), none at t = 0
            assert r.consumed_round == (t if cfg.sync else (t - 1 if t else None))
    for t in range(len(ref)):  # bitwise-identical anchors on every replica
        first = results[0][t].anchor
        assert first is not None
        assert all(torch.equal(first, res[t].anchor) for res in results)  # type: ignore[arg-type]


def test_live_params_changed_in_flight_do_not_matter() -> None:
    cfg = OuterConfig(tau=2, outer_lr=1.0, outer_momentum=0.5, sync=False)
    _, clean, _ = _run_replicas(cfg, 8)
    _, dirty, _ = _run_replicas(cfg, 8, perturb=True)
    for rc, rd in zip(clean, dirty):
        for a, b in zip(rc, rd):
            assert a.anchor is not None
            assert b.anchor is not None
            assert torch.equal(a.anchor, b.anchor)


def test_sharded_averager_equals_unsharded_with_odd_replica_counts() -> None:
    for n in (1, 3):
        cfg = OuterConfig(tau=1, outer_lr=0.7, outer_momentum=0.4)
        _, results, avgs = _run_replicas(cfg, 4, n=n)
        ref = _reference(cfg, 4, n=n)
        for res in results:
            for a, b in zip(res, ref):
                assert a.anchor is not None
                assert torch.allclose(a.anchor, b, atol=1e-6, rtol=0)
        assert sum(a._opt.anchor.numel() for a in avgs) == ref[0].numel()  # each owns only its shard


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("how", ["closed", "silent"])
def test_replica_killed_mid_round_others_continue(sync: bool, how: str) -> None:
    """r3 dies after its second boundary: the others skip (or finish) and keep averaging, no hang."""
    cfg = OuterConfig(tau=2, outer_lr=1.0, outer_momentum=0.5, sync=sync)
    peers = PEERS
    results: dict[str, list[BoundaryResult]] = {}
    anchors_after: dict[str, list[torch.Tensor | None]] = {}

    async def replica(mesh: Mesh, i: int, p: str, victim_dead: trio.Event) -> None:
        acfg = AveragerConfig(outer=cfg, job="j", stage=0, round_timeout=0.5)
        async with open_replica_averager(acfg, peers=peers, me=p, channels=mesh.ch[p], initial=list(_model().parameters())) as avg:
            model = _model()
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            res = []
            for s in range(16):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(_data(i, s)[0]), _data(i, s)[1]).backward()
                opt.step()
                await trio.lowlevel.checkpoint()
                if (s + 1) % cfg.tau == 0:
                    if p == "r3" and s == 3:
                        if how == "closed":
                            await mesh.kill(p)
                        victim_dead.set()
                        if how == "silent":   # hangs forever without answering: only deadlines save us
                            await trio.sleep_forever()
                        return
                    r = await avg.round_boundary(list(model.parameters()))
                    res.append(r)
                    if r.anchor is not None:
                        load_flat_(model.parameters(), r.anchor)
            results[p] = res
            anchors_after[p] = [r.anchor for r in res]
            assert avg.alive == ("r0", "r1", "r2")

    async def main() -> None:
        mesh = Mesh(peers)
        dead = trio.Event()
        with trio.fail_after(60):  # mock time: a real hang makes the clock jump here and fail
            async with trio.open_nursery() as victim:
                victim.start_soon(replica, mesh, 3, "r3", dead)
                async with trio.open_nursery() as survivors:
                    for i, p in enumerate(peers[:3]):
                        survivors.start_soon(replica, mesh, i, p, dead)
                victim.cancel_scope.cancel()

    # autojump: the clock only moves when every task is blocked, i.e. exactly when a deadline is needed
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert set(results) == {"r0", "r1", "r2"}
    for res in results.values():
        assert len(res) == 8
        assert any(r.anchor is None for r in res)            # at least one round was skipped ...
        assert res[-1].anchor is not None                     # ... and averaging resumed afterwards
    for t in range(8):  # whenever survivors load an anchor after the loss, they agree bitwise
        got = [anchors_after[p][t] for p in ("r0", "r1", "r2")]
        if t >= 4 and all(g is not None for g in got):
            assert all(torch.equal(got[0], g) for g in got)  # type: ignore[arg-type]


def _timed_run(cfg: OuterConfig, delay: float, *, t_step: float = 1.0, steps: int = 8, n: int = 4) -> tuple[float, list[list[BoundaryResult]]]:
    """Mock-clock run: compute is ``sleep(t_step)`` per step, each message occupies its link for *delay*.

    Returns the virtual time at which the last training step ended (finalize excluded).
    """
    peers = PEERS[:n]
    ends: list[float] = []
    results: list[list[BoundaryResult]] = [[] for _ in range(n)]

    async def replica(mesh: Mesh, i: int, p: str) -> None:
        x = torch.full((10,), float(i))
        acfg = AveragerConfig(outer=cfg, job="j", round_timeout=100.0)
        async with open_replica_averager(acfg, peers=peers, me=p, channels=mesh.ch[p], initial=torch.zeros(10)) as avg:
            for s in range(steps):
                await trio.sleep(t_step)          # the local step
                x += 0.1 * (i + 1)
                if (s + 1) % cfg.tau == 0:
                    r = await avg.round_boundary(x)
                    results[i].append(r)
                    if r.anchor is not None:
                        x = r.anchor.clone()
            ends.append(trio.current_time())
            await avg.finalize()

    async def main() -> None:
        with trio.fail_after(1000):
            async with trio.open_nursery() as nursery:
                mesh = Mesh(peers, delay=delay)
                for i, p in enumerate(peers):
                    nursery.start_soon(replica, mesh, i, p)

    clock = trio.testing.MockClock(autojump_threshold=0)
    trio.run(main, clock=clock)
    return max(ends), results


def test_overlap_hides_communication_up_to_tau_steps() -> None:
    """ALGORITHMS.md §2.5-9: a round costs 2·delay (scatter hop + gather hop)."""
    co2 = OuterConfig(tau=2, outer_momentum=0.5, sync=False)
    base, _ = _timed_run(co2, 0.0)
    assert base == pytest.approx(8.0)
    hidden, _ = _timed_run(co2, 0.9)                # 1.8 <= tau·t_step = 2: fully hidden
    assert hidden == pytest.approx(base)
    late, _ = _timed_run(co2, 1.5)                  # 3.0 > 2: boundaries 2..4 each wait 1.0
    assert late == pytest.approx(base + 3 * (2 * 1.5 - 2.0))
    sync, _ = _timed_run(OuterConfig(tau=2, outer_momentum=0.5), 0.9)   # sync pays every round
    assert sync == pytest.approx(base + 4 * 1.8)


def test_bounded_staleness_skips_then_applies_late_average() -> None:
    cfg = OuterConfig(tau=1, sync=False, max_staleness=2)
    _, results = _timed_run(cfg, 0.75, steps=6)    # a round takes 1.5 > tau·t_step = 1
    for res in results:
        late = [r for r in res if r.reason == "average late"]
        assert late                                 # some boundaries did not wait ...
        applied = [r for r in res if r.anchor is not None and r.consumed_round is not None]
        assert applied                              # ... and the late averages were applied later
        for r in applied:
            assert r.launched_round is None or r.consumed_round == r.launched_round - 1
    strict, _ = _timed_run(OuterConfig(tau=1, sync=False), 0.75, steps=6)
    assert strict > _timed_run(cfg, 0.75, steps=6)[0]  # strict CO2 waits; bounded staleness does not


def test_wire_roundtrip_and_routing_over_testing_channels() -> None:
    channels = pytest.importorskip("fusionp2p.testing.channels")
    others: list[tuple[str, str]] = []

    async def on_other(peer: str, tm: TensorMessage) -> None:
        others.append((peer, tm.kind))

    async def main() -> None:
        a, b = channels.memory_channel_pair("a", "b")
        cfg = AveragerConfig(outer=OuterConfig(), job="j")
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                out: dict[str, torch.Tensor | None] = {}

                async def replica(me: str, ch: object, val: float) -> None:
                    async with open_replica_averager(cfg, peers=["a", "b"], me=me, channels={"b" if me == "a" else "a": ch}, initial=torch.zeros(7), on_other=on_other) as avg:  # type: ignore[dict-item]
                        if me == "a":
                            await ch.send(TensorMessage(job="j", kind="act", tensors=(torch.ones(2),)))  # type: ignore[attr-defined]
                        out[me] = (await avg.round_boundary(torch.full((7,), val))).anchor

                nursery.start_soon(replica, "a", a, 1.0)
                nursery.start_soon(replica, "b", b, 3.0)
        assert out["a"] is not None
        assert torch.equal(out["a"], torch.full((7,), 2.0))
        assert out["b"] is not None
        assert torch.equal(out["a"], out["b"])

    trio.run(main)
    assert others == [("a", "act")]


def test_round_buffers_are_freed_without_the_cyclic_gc() -> None:
    """A finished round must not sit in a reference cycle: its buffers are model-sized."""
    import gc

    from fusionp2p.average.allreduce import AllReduceRound

    gc.collect()
    gc.disable()
    try:
        _timed_run(OuterConfig(tau=1, sync=False), 0.0, steps=4, n=3)
        alive = [o for o in gc.get_objects() if isinstance(o, AllReduceRound)]
    finally:
        gc.enable()
    assert alive == []


def test_round_vectors_are_recycled_only_once_nothing_holds_them() -> None:
    """Whole-vector rounds take their snapshot and gathered vector from a pool (a fresh model-sized one
    faults in every page): a result the caller still holds is never written again, and once the caller
    lets results go their vectors are handed out again."""
    n, rounds = 300_000, 6   # above the pool's 1 MiB floor
    held: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {p: [] for p in PEERS}
    reused: dict[str, int] = {}

    async def replica(mesh: Mesh, i: int, p: str) -> None:
        acfg = AveragerConfig(outer=OuterConfig(), job="j", round_timeout=10.0)
        x = torch.full((n,), float(i))
        async with open_replica_averager(acfg, peers=PEERS, me=p, channels=mesh.ch[p], initial=x) as avg:
            for r in range(rounds):
                x.add_(1.0)
                res = await avg.round_boundary(x)
                assert res.anchor is not None
                if r < 2:   # kept, with a copy of what it said
                    held[p].append((res.anchor, res.anchor.clone()))
                del res
            reused[p] = avg._vectors.reused

    run_on_mesh(PEERS, replica)
    for p in PEERS:
        assert all(torch.equal(kept, said) for kept, said in held[p])
        assert reused[p] >= 4
