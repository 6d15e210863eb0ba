"""Per-node cost and dead-peer detection of simulated swarms of 100, 300 and 1,000 nodes (issue 40).

Real ``SwarmNode``s (membership, heartbeats, watchers) and a bootstrap in one process on the in-memory
transport, heartbeat 1 s as a real node's, under trio's autojump clock: the figures are per simulated
second. Probing is off (a node's probe set is reported from its prober's own choice; the transfers of
1,000 nodes do not fit in one process).

Per size: time to join (simulated), the process's CPU per node per simulated second in steady state,
gossip deliveries and watch pings per node per second, the largest probe set, the heartbeat period, and
the simulated time until every node saw a killed one dead. Headlines: per-node CPU at the largest size
over that at the smallest (target at most 1.5) and dead-peer detection at the largest (target 30 s).

What one node is charged for in the steady state, and how (a real node pays each of these on its own CPU):

* its own code and trio's, as measured (process CPU / N);
* decoding and verifying every signed record it receives: each node decodes its own copy, as a real node
  does (while joining, every distinct record is decoded once for all nodes: N² verifications would not
  fit in the run; the steady state's share is reported as ``verify_share``);
* Python's collector, at a real node's pace. One process allocates for all N nodes, so at the default
  threshold it would collect N times as often per simulated second as any one node, and promote to the
  old generation the objects that live about a heartbeat (sleeping tasks' frames, the records in hand),
  which a node collecting at its own pace mostly frees young: the collector's share then grew with N
  (21/42/62% at 100/300/1,000, 2026-11-29) although the number of function calls per node per second
  did not (2,418 at 100, 2,491 at 1,000). So the young-generation threshold is N times the default: the
  process collects as often per simulated second as one node would, and each collection walks the young
  objects of all N nodes, N nodes' collections in one. The simulation's shared heap as it stands after
  joining (every node's view: N² records in one process) is frozen out of the collector, as each node's
  old generation holds its own view only; a full collection's cost amortizes over what is promoted
  (it runs when a quarter of the old generation is new), so its cost per second does not depend on the
  view's size. The collector's share is reported (``gc_share``).

**Links** (``run_links``, sizes ``--link-sizes``, default 100,300): a second swarm of N nodes with probing
on, each node given an access link (``LinkEmulator.set_access``: every stream of a node shares its uplink
and downlink, chunks arrive the two nodes' latencies later) drawn from ``LINK_MIX``: half home (downlink
20-300 Mbit/s, uplink 5-40, 8-25 ms one way), 30% office (symmetric 100-1,000 Mbit/s, 2-8 ms), 20%
datacenter (symmetric 1-10 Gbit/s, 0.5-2 ms), each rate log-uniform in its range. Once a reference node
has a capacity report from every node (or ``CAPACITY_WAIT`` simulated seconds), ``pairs`` node pairs that
no report measured (random perfect matchings, so no node is in two at once) are estimated by the source
node's ``BandwidthTable.estimate`` (from the nodes' announced capacities, checked against what others
measured) and then measured by the real probe from the source (``swarm.probe.probe``, its transfer sized
from the estimate, the swarm's own probing going on). Figures: the median and 90th percentile relative
error |estimate - measured| / measured, the same against the emulated rate (min of the source's uplink
and the destination's downlink), and the probe's own error (measured against emulated, and the directly
measured pairs of the reports against their emulated rate).

**Job** (``run_job``, sizes ``--job-sizes``, default 100,300; --quick: 30): plan and start a job on 8 of N
nodes. ``Swarm.local`` (real node and job services, in-memory transport, the TCP data plane on loopback:
wall-clock time, not simulated), the nodes' compute log-uniform over 0.5-2x, probing off (so the
candidates are chosen by compute: no link is measured); once the bootstrap sees every node, a tiny GPT-2
job (2 steps) is published with ``DriverConfig(candidates=8)`` (jobs/candidates.py). Figures: seconds from
publish to PLANNED and to RUNNING, the process's CPU-s over that span, the plan's members, and how many of
the N nodes ever held the job (an offer reached them): the candidates only. ``sw.publish``'s two halves are
timed apart: the build (``build_s``, ``build_cpu_s`` of this thread: the trace, while the swarm's thread runs
on) and the rest (discover, offers, plan, start, on the swarm's thread), to PLANNED and RUNNING. The first
trace in a process imports ``torch.export``'s tracer (1.2-1.6 CPU-s): ``Swarm.local`` imports it before the
swarm's thread starts (``graph.trace.preload``), so since 2026-11-30 it counts in ``swarm_start_s``, not in
publish to RUNNING (before, in ``build_s``: 2-6x its CPU in wall time at 30 and 100 nodes under load). ``--job-only``'s headline
compares publish to RUNNING with 30 s, the demo's end-to-end budget (the issue sets no target for it).

One command for all three phases: ``python -m benchmarks.swarm_scale`` (about 3 GiB at 1,000 nodes; the
links phase at 300 took 185 CPU-s and 0.6 GiB).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import os
import random
import statistics
import time
from typing import Any

import trio
import trio.testing

from benchmarks._common import headline, parser, write
from fusionp2p.errors import PeerUnavailable
from fusionp2p.net.identity import verify
from fusionp2p.net.memory import MemoryTransport, memory_network
from fusionp2p.net.shaping import Access, LinkEmulator
from fusionp2p.net.transport import GossipMessage
from fusionp2p.swarm import node as swarm_mod
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.probe import MEASURE_BYTES, ProbeBusy, ProbeServer, probe, probe_size
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.wire.protocols import PROBE, TOPIC_MEMBERS
from fusionp2p.wire.records import NodeRecord, Record, decode_signed, encode_bundle, encode_signed

STEADY = 30.0   # simulated seconds of steady state measured
MBIT = 1e6 / 8  # bytes/s
# (kind, share of the nodes, downlink range, uplink range (None: = downlink, symmetric), one-way latency range)
LINK_MIX: tuple[tuple[str, float, tuple[float, float], tuple[float, float] | None, tuple[float, float]], ...] = (
    ("home", 0.5, (20 * MBIT, 300 * MBIT), (5 * MBIT, 40 * MBIT), (0.008, 0.025)),
    ("office", 0.3, (100 * MBIT, 1000 * MBIT), None, (0.002, 0.008)),
    ("datacenter", 0.2, (1000 * MBIT, 10000 * MBIT), None, (0.0005, 0.002)),
)
CAPACITY_WAIT = 300.0   # simulated seconds after joining for every node's capacity report to reach the reference


class Decoder:
    """``decode_signed`` for the simulated nodes: shared while they join (each distinct record decoded and
    verified once for all of them), each node's own afterwards, its CPU counted."""

    def __init__(self) -> None:
        self.shared = True
        self.cpu = 0.0     # CPU-s in decoding and verifying, while not shared
        self.count = 0

    @functools.cache   # noqa: B019 (one Decoder per run of the benchmark)
    def _once(self, raw: bytes) -> Record:
        return decode_signed(raw, verify)

    def __call__(self, raw: bytes, _verify: Any) -> Record:
        if self.shared:
            return self._once(raw)
        t = time.process_time()
        try:
            return decode_signed(raw, verify)
        finally:
            self.cpu += time.process_time() - t
            self.count += 1


def run_one(n: int, decoder: Decoder) -> dict[str, Any]:
    clock = trio.testing.MockClock(autojump_threshold=0)
    cfg = SwarmConfig(heartbeat=1.0, dead_timeout=5.0, probing=False)   # watch_timeout as a real node's (SwarmConfig)
    out: dict[str, Any] = {"n": n}

    async def main() -> None:
        async with memory_network(gossip_buffer=4 * n) as net:
            hosts = [net.add_host() for _ in range(n + 1)]
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=5.0), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:]]
            async with trio.open_nursery() as nursery:
                t0, w0 = trio.current_time(), time.monotonic()
                await nursery.start(boot.run, [])
                for node in nodes:
                    await nursery.start(node.run, [hosts[0].listen_addrs()[0]])
                ids = sorted(x.peer_id for x in nodes)
                for node in nodes:
                    await node.wait_until(lambda node=node: node.members() == ids, 600)
                out["join_s"] = trio.current_time() - t0
                out["join_wall_s"] = time.monotonic() - w0
                await trio.sleep(10.0)   # past the joining beats and the watchers' first pings
                # Collections at one node's pace, the shared heap of N views frozen (the module's docstring),
                # each node decoding and verifying the records it receives itself
                gc.collect()
                gc.freeze()
                gc.set_threshold(threshold[0] * n, *threshold[1:])
                gc_s[0] = 0.0
                decoder.shared, decoder.cpu, decoder.count = False, 0.0, 0
                seen0 = sum(len(x.view.records) for x in nodes)
                pings0 = sum(x.watcher.pings for x in nodes)
                rx0 = [x.view.rejected for x in nodes]
                c0, s0 = time.process_time(), trio.current_time()
                await trio.sleep(STEADY)
                cpu, sim = time.process_time() - c0, trio.current_time() - s0
                out["gc_share"] = gc_s[0] / cpu
                out["verify_share"] = decoder.cpu / cpu
                out["verified_per_node_s"] = decoder.count / sim / n
                out["cpu_per_node_ex_gc"] = (cpu - gc_s[0]) / sim / n   # the nodes' own code and trio's
                out["cpu_per_node"] = cpu / sim / n
                out["pings_per_node_s"] = (sum(x.watcher.pings for x in nodes) - pings0) / sim / n
                out["replays_per_node_s"] = (sum(x.view.rejected for x in nodes) - sum(rx0)) / sim / n
                out["records_held"] = sum(len(x.view.records) for x in nodes) - seen0
                out["probe_set_max"] = max(len(x.prober.chosen()[1]) for x in nodes)
                out["watched_max"] = max(len(x.watcher.chosen()) for x in nodes)
                out["period_s"] = max(x.period() for x in nodes)
                victim = nodes[n // 2]
                t1 = trio.current_time()
                net.kill(victim.peer_id)
                for node in nodes:
                    if node is not victim:
                        await node.wait_until(lambda node=node: victim.peer_id in node.view.dead, 600)
                out["detect_s"] = trio.current_time() - t1
                nursery.cancel_scope.cancel()

    gc_s = [0.0, 0.0]   # CPU-s in the collector since the steady state began; when the current run began

    def timed(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            gc_s[1] = time.process_time()
        else:
            gc_s[0] += time.process_time() - gc_s[1]

    threshold = gc.get_threshold()
    gc.callbacks.append(timed)
    try:
        trio.run(main, clock=clock)
    finally:
        gc.callbacks.remove(timed)
        gc.set_threshold(*threshold)
        decoder.shared = True
        gc.unfreeze()
        gc.collect()
    return out


def draw_access(rng: random.Random) -> tuple[str, Access]:
    """One node's access link from ``LINK_MIX`` (rates log-uniform in their ranges)."""
    kind, _, down_r, up_r, lat_r = rng.choices(LINK_MIX, weights=[m[1] for m in LINK_MIX])[0]

    def log_uniform(lo: float, hi: float) -> float:
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))

    down = log_uniform(*down_r)
    up = log_uniform(*up_r) if up_r is not None else down
    return kind, Access(up=up, down=down, latency=rng.uniform(*lat_r))


def _errors(pairs: list[tuple[float, float]]) -> dict[str, float | None]:
    """Median and 90th percentile of |got - want| / want over (got, want) pairs."""
    errs = sorted(abs(g - w) / w for g, w in pairs if w > 0)
    if not errs:
        return {"median": None, "p90": None}
    return {"median": statistics.median(errs), "p90": errs[min(len(errs) - 1, int(0.9 * len(errs)))]}


def run_links(n: int, pairs: int, seed: int = 40) -> dict[str, Any]:
    """The links phase (module docstring): estimated against measured links under emulated access links."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    rng = random.Random(seed)
    cfg = SwarmConfig(heartbeat=1.0, dead_timeout=5.0)   # probing on, ProbeConfig as a real node's
    out: dict[str, Any] = {"n": n}

    async def main() -> None:
        async with memory_network(gossip_buffer=4 * n) as net:
            emu = net.emulator = LinkEmulator()
            hosts = [net.add_host() for _ in range(n + 1)]
            emu.set_access(hosts[0].peer_id, Access(up=1000 * MBIT, down=1000 * MBIT, latency=0.001))
            kinds: dict[str, int] = {}
            for h in hosts[1:]:
                kind, acc = draw_access(rng)
                kinds[kind] = kinds.get(kind, 0) + 1
                emu.set_access(h.peer_id, acc)
            out["kinds"] = kinds
            boot = SwarmNode(hosts[0], SwarmConfig(role="bootstrap", heartbeat=1.0, dead_timeout=5.0), None)
            nodes = [SwarmNode(h, cfg, TEST_PROFILE) for h in hosts[1:]]
            by_id = {x.peer_id: x for x in nodes}
            async with trio.open_nursery() as nursery:
                t0 = trio.current_time()
                await nursery.start(boot.run, [])
                for node in nodes:
                    await nursery.start(node.run, [hosts[0].listen_addrs()[0]])
                ids = sorted(by_id)
                for node in nodes:
                    await node.wait_until(lambda node=node: node.members() == ids, 600)   # type: ignore[misc]
                out["join_s"] = trio.current_time() - t0
                ref, t1 = nodes[0], trio.current_time()

                def known() -> bool:
                    return all(min(ref.bandwidth.capacity(p)[:2]) > 0 for p in ids if p != ref.peer_id)

                with trio.move_on_after(CAPACITY_WAIT):
                    await ref.wait_until(known, CAPACITY_WAIT + 1)
                out["capacities_s"] = trio.current_time() - t1
                out["capacities_known"] = sum(min(ref.bandwidth.capacity(p)[:2]) > 0 for p in ids) / n
                # the directly measured pairs of the reports, against their emulated rate (the probe's accuracy)
                direct = [(m.bandwidth, emu.path_rate(r.peer, m.dst) or 0.0) for r in ref.bandwidth.reports.values()
                          for m in r.measurements if m.samples > 0]
                out["measured_pairs"] = len(direct)
                out["direct_vs_emulated"] = _errors(direct)
                # unmeasured pairs: random matchings, each pair estimated by its source, then probed from it
                chosen: list[tuple[str, str]] = []
                for _ in range(20):
                    order = rng.sample(ids, len(ids))
                    chosen += [(a, b) for a, b in zip(order[::2], order[1::2], strict=False)
                               if by_id[a].bandwidth.direct(a, b) is None]
                    if len(chosen) >= pairs:
                        break
                rows: list[dict[str, Any]] = []
                rounds = [chosen[i : i + n // 2] for i in range(0, min(len(chosen), pairs), n // 2)]
                for batch in rounds:
                    async with trio.open_nursery() as inner:
                        for a, b in batch[: pairs - len(rows)]:
                            inner.start_soon(_estimate_and_probe, by_id[a], b, emu, rows)
                out["pairs"] = len(rows)
                out["unmeasured"] = sum(r["measured"] is None for r in rows)
                ok = [r for r in rows if r["measured"] is not None and r["estimate"] is not None]
                out["no_estimate"] = sum(r["estimate"] is None for r in rows)
                out["estimate_vs_measured"] = _errors([(r["estimate"], r["measured"]) for r in ok])
                out["estimate_vs_emulated"] = _errors([(r["estimate"], r["emulated"]) for r in ok])
                out["measured_vs_emulated"] = _errors([(r["measured"], r["emulated"]) for r in ok])
                out["rows"] = rows
                nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    return out


async def _estimate_and_probe(node: SwarmNode, peer: str, emu: LinkEmulator, rows: list[dict[str, Any]]) -> None:
    """Estimate the link *node* -> *peer* from *node*'s table, then measure it with the probe (a busy peer is
    asked again, at most 10 times a second apart)."""
    est = node.bandwidth.estimate(node.peer_id, peer)
    row: dict[str, Any] = {"src": node.peer_id, "dst": peer, "estimate": est.bandwidth if est else None,
                           "emulated": emu.path_rate(node.peer_id, peer), "measured": None}
    rows.append(row)
    size = probe_size(est.bandwidth if est else None, lo=256 * 1024)
    for _ in range(10):
        try:
            res = await probe(node.transport, peer, nbytes=size, max_bytes=MEASURE_BYTES, timeout=20.0)
        except ProbeBusy:
            await trio.sleep(1.0)
            continue
        except PeerUnavailable:
            return
        if res.measured:
            row["measured"] = res.bandwidth
            return
        size = probe_size(res.bandwidth, lo=256 * 1024)


def run_job(n: int, candidates: int = 8, timeout: float = 900.0, seed: int = 40) -> dict[str, Any]:
    """The job phase (module docstring): publish to PLANNED and RUNNING on *candidates* of *n* embedded nodes."""
    import tempfile

    import torch

    from fusionp2p.data import BuiltinCorpus
    from fusionp2p.jobs.build import build_job
    from fusionp2p.jobs.embedded import EmbeddedConfig
    from fusionp2p.jobs.events import JobStateChanged, PlanChanged
    from fusionp2p.jobs.publisher import DriverConfig
    from fusionp2p.models.gpt2 import GPT2, GPT2Config
    from fusionp2p.sdk import LOCAL_PROFILE, Swarm
    from fusionp2p.train.config import TrainConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = random.Random(seed)
    profiles = [dataclasses.replace(LOCAL_PROFILE, flops_fp32=LOCAL_PROFILE.flops_fp32 * 2 ** rng.uniform(-1, 1))
                for _ in range(n)]
    model = GPT2(GPT2Config.tiny(block_size=32, n_layer=2, n_head=2, n_embd=32))
    out: dict[str, Any] = {"n": n, "candidates": candidates}
    w0 = time.monotonic()
    with tempfile.TemporaryDirectory() as home, \
            Swarm.local(n_nodes=n, profiles=profiles, home=home, config=EmbeddedConfig(heartbeat=1.0, join_timeout=timeout)) as sw:
        out["swarm_start_s"] = time.monotonic() - w0
        assert sw._publisher is not None and sw.embedded is not None
        sw._publisher.config = DriverConfig(candidates=candidates)   # the benchmark's setting, not the default 64
        cfg = TrainConfig(steps=2, micro_batch=4, micro_batches=2, lr=2e-3, averaging=None)
        t0, c0 = time.monotonic(), time.process_time()
        # sw.publish's two halves, timed apart: the trace (this thread; the embedded swarm's runs meanwhile)
        # and the swarm's part (discover, offers, plan, start: on the swarm's thread)
        tc = time.thread_time()
        built = build_job(model, None, BuiltinCorpus(seq_len=32), cfg, publisher=sw.publisher_id,
                          sign=sw._identity.sign, now=time.time(), nonce=os.urandom(16))
        out["build_s"], out["build_cpu_s"] = time.monotonic() - t0, time.thread_time() - tc
        job = sw.publish_built(built)
        for ev in job.events(timeout=timeout):
            if isinstance(ev, PlanChanged) and "plan_members" not in out:
                out["plan_members"] = len(ev.members)
            if isinstance(ev, JobStateChanged):
                out[f"{ev.state}_s"] = time.monotonic() - t0
                if ev.state == "running":
                    out["cpu_to_running_s"] = time.process_time() - c0
                if ev.state in ("running", "failed", "cancelled"):
                    out["reason"] = ev.reason
                    break
        out["held_job"] = sum(job.id in node.jobs.jobs for node in sw.embedded.nodes)
        job.cancel()
    return out


def one_node(n: int, steady: float = 120.0) -> dict[str, Any]:
    """The collector of one real node with a view of *n* members, at its own pace (the cross-check of
    ``run_one``'s threshold): one ``SwarmNode`` at default collector settings; *n* - 1 passive peers (a probe
    server each, to answer its watcher) announce themselves once, then send the swarm's heartbeats,
    ``gossip_rate`` a second (signed beforehand), as a swarm of *n* would. Nothing is frozen: the node's view
    is on the heap its full collections walk, with the passive peers' objects beside it in place of a real
    process's imports. ``process_ms_per_s`` is then the node's own CPU (and the passive peers' answers to its
    watcher's pings). Not counted: the pings of the node's own watchers (about 8 every 10 s)."""
    cfg = SwarmConfig(heartbeat=1.0, dead_timeout=5.0, probing=False)
    period = n / cfg.gossip_rate
    out: dict[str, Any] = {"n": n}

    async def main() -> None:
        async with memory_network(gossip_buffer=4 * n) as net:
            me = SwarmNode(net.add_host(), cfg, TEST_PROFILE)
            peers = [net.add_host() for _ in range(n - 1)]
            for h in peers:
                h.set_stream_handler(PROBE, ProbeServer())

            def beat(h: MemoryTransport, seq: int) -> bytes:
                rec = NodeRecord(peer=h.peer_id, role="node", addrs=(f"/memory/{h.peer_id}",), profile=TEST_PROFILE,
                                 started=0.0, seq=seq, period=period)
                return encode_bundle([encode_signed(rec, h.sign)])

            async with trio.open_nursery() as nursery:
                await nursery.start(me.run, [])
                for h in peers:
                    await h.publish(TOPIC_MEMBERS, beat(h, 1))
                await me.wait_until(lambda: len(me.members()) == n, 600)
                beats = [(peers[i % len(peers)], beat(peers[i % len(peers)], 2 + i // len(peers)))
                         for i in range(int(steady * cfg.gossip_rate))]
                await trio.sleep(10.0)
                gc.collect()
                gc_s[0], counts[:] = 0.0, [0, 0, 0]
                c0, s0 = time.process_time(), trio.current_time()
                inbox = me.transport._subs[TOPIC_MEMBERS]   # type: ignore[attr-defined]
                for h, raw in beats:
                    # delivered as MemoryTransport.publish does, without its pass over every host of the
                    # network for subscribers (the simulation's work, linear in N, not the node's)
                    for ch in inbox:
                        ch.send_nowait(GossipMessage(TOPIC_MEMBERS, h.peer_id, raw))
                    await trio.sleep(1 / cfg.gossip_rate)
                cpu, sim = time.process_time() - c0, trio.current_time() - s0
                out["members"] = len(me.members())
                out["gc_ms_per_s"] = gc_s[0] / sim * 1e3
                out["process_ms_per_s"] = cpu / sim * 1e3
                out["collections_per_s"] = [c / sim for c in counts]
                nursery.cancel_scope.cancel()

    gc_s, counts = [0.0, 0.0], [0, 0, 0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_s[1] = time.process_time()
        else:
            gc_s[0] += time.process_time() - gc_s[1]
            counts[info["generation"]] += 1

    gc.callbacks.append(timed)
    try:
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        gc.callbacks.remove(timed)
    return out


def main() -> None:
    ap = parser("swarm_scale", __doc__)
    ap.add_argument("--sizes", default=None, help="comma-separated N (default 100,300,1000; --quick: 50,150)")
    ap.add_argument("--link-sizes", default=None,
                    help="comma-separated N of the links phase (default 100,300; --quick: 50; 0: skip)")
    ap.add_argument("--job-sizes", default=None,
                    help="comma-separated N of the job phase (default 100,300; --quick: 30; 0: skip)")
    ap.add_argument("--job-only", action="store_true",
                    help="only the job phase (written to swarm_scale_job.json; headline: publish to RUNNING)")
    ap.add_argument("--links-only", action="store_true",
                    help="only the links phase (written to swarm_scale_links.json; headline: the estimate's error)")
    ap.add_argument("--pairs", type=int, default=100, help="unmeasured pairs estimated and probed per size")
    ap.add_argument("--one-node", type=int, default=0, metavar="N",
                    help="only the cross-check: the collector of one node with a view of N members (one_node)")
    args = ap.parse_args()
    if args.one_node:
        print(one_node(args.one_node))
        return
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else ([50, 150] if args.quick else [100, 300, 1000])
    link_sizes = ([int(x) for x in args.link_sizes.split(",") if int(x)] if args.link_sizes is not None
                  else ([50] if args.quick else [100, 300]))
    job_sizes = ([int(x) for x in args.job_sizes.split(",") if int(x)] if args.job_sizes is not None
                 else ([30] if args.quick else [100, 300]))
    pairs = min(args.pairs, 40) if args.quick else args.pairs
    if args.links_only:
        sizes, job_sizes = [], []
    if args.job_only:
        sizes, link_sizes = [], []

    decoder = Decoder()
    swarm_mod.decode_signed = decoder   # type: ignore[assignment]
    rows: list[dict[str, Any]] = []
    if sizes:
        print(f"{'N':>5} {'join s':>7} {'cpu/node':>9} {'gc':>5} {'verify':>6} {'pings/s':>8} {'probe set':>9} "
              f"{'period s':>9} {'detect s':>9}")
    for n in sizes:
        r = run_one(n, decoder)
        rows.append({"phase": "swarm", **r})
        print(f"{n:>5} {r['join_s']:>7.1f} {r['cpu_per_node']:>9.5f} {r['gc_share']:>5.0%} {r['verify_share']:>6.0%} "
              f"{r['pings_per_node_s']:>8.2f} "
              f"{r['probe_set_max']:>9} {r['period_s']:>9.1f} {r['detect_s']:>9.2f}", flush=True)
    links: list[dict[str, Any]] = []
    if link_sizes:
        print(f"{'N':>5} {'caps s':>7} {'known':>6} {'pairs':>6} {'est/meas med':>12} {'p90':>6} {'est/emu med':>11} "
              f"{'meas/emu med':>12} {'direct/emu':>10} {'cpu s':>7}")
    for n in link_sizes:
        c0 = time.process_time()
        r = run_links(n, pairs)
        r["cpu_s"] = time.process_time() - c0
        links.append({"phase": "links", **r})

        def pct(x: float | None) -> str:
            return "-" if x is None else f"{x:.1%}"

        print(f"{n:>5} {r['capacities_s']:>7.1f} {r['capacities_known']:>6.0%} {r['pairs'] - r['unmeasured']:>6} "
              f"{pct(r['estimate_vs_measured']['median']):>12} {pct(r['estimate_vs_measured']['p90']):>6} "
              f"{pct(r['estimate_vs_emulated']['median']):>11} {pct(r['measured_vs_emulated']['median']):>12} "
              f"{pct(r['direct_vs_emulated']['median']):>10} {r['cpu_s']:>7.1f}", flush=True)
    jobs: list[dict[str, Any]] = []
    if job_sizes:
        print(f"{'N':>5} {'offered':>7} {'members':>7} {'held':>5} {'build s':>7} {'b cpu s':>7} {'planned s':>9} "
              f"{'running s':>9} {'cpu s':>7}")
    for n in job_sizes:
        r = run_job(n)
        jobs.append({"phase": "job", **r})
        print(f"{n:>5} {r['candidates']:>7} {r.get('plan_members', 0):>7} {r['held_job']:>5} "
              f"{r['build_s']:>7.2f} {r['build_cpu_s']:>7.2f} {r.get('planned_s', math.nan):>9.2f} {r.get('running_s', math.nan):>9.2f} "
              f"{r.get('cpu_to_running_s', math.nan):>7.1f} {r.get('reason', '')}", flush=True)
    est = "; ".join(f"estimated links' median error at {r['n']}: {r['estimate_vs_measured']['median']:.1%} of the "
                    f"measured rate ({r['pairs'] - r['unmeasured']} pairs)" for r in links
                    if r["estimate_vs_measured"]["median"] is not None)
    job = "; ".join(f"a job on {r['candidates']} of {r['n']}: publish to RUNNING {r.get('running_s', math.nan):.1f} s "
                    f"(wall), held by {r['held_job']} nodes" for r in jobs)
    more = "; ".join(x for x in (est, job) if x)
    if not rows and links:
        write("swarm_scale_links", args.out.with_name(args.out.stem + "_links.json"), links + jobs,
              headline(f"median relative error of estimated links at {links[-1]['n']} nodes",
                       links[-1]["estimate_vs_measured"]["median"] or math.inf, "ratio", 0.25, "lower", more),
              quick=args.quick)
        return
    if not rows:
        write("swarm_scale_job", args.out.with_name(args.out.stem + "_job.json"), jobs,
              headline(f"publish to RUNNING of a job on 8 of {jobs[-1]['n']} nodes (wall)",
                       jobs[-1].get("running_s", math.inf), "s", 30.0, "lower", more),
              quick=args.quick)
        return
    ratio = rows[-1]["cpu_per_node"] / rows[0]["cpu_per_node"]
    ex_gc = rows[-1]["cpu_per_node_ex_gc"] / rows[0]["cpu_per_node_ex_gc"]
    own = [r["cpu_per_node"] * (1 - r["gc_share"] - r["verify_share"]) for r in (rows[0], rows[-1])]
    write("swarm_scale", args.out, rows + links + jobs,
          headline(f"per-node CPU at {rows[-1]['n']} simulated nodes over that at {rows[0]['n']}", ratio, "x", 1.5, "lower",
                   f"dead-peer detection at {rows[-1]['n']}: {rows[-1]['detect_s']:.2f} s (target 30 s); the CPU "
                   f"outside Python's collector {ex_gc:.2f}x, outside it and verifying records {own[1] / own[0]:.2f}x"
                   + (f"; {more}" if more else "")),
          quick=args.quick)

if __name__ == "__main__":
    main()
