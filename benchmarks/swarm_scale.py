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

Not measured yet: emulated link rates, planning a job on 8 nodes, estimated against measured links.
"""

from __future__ import annotations

import functools
import gc
import time
from typing import Any

import trio
import trio.testing

from benchmarks._common import headline, parser, write
from fusionp2p.net.identity import verify
from fusionp2p.net.memory import MemoryTransport, memory_network
from fusionp2p.net.transport import GossipMessage
from fusionp2p.swarm import node as swarm_mod
from fusionp2p.swarm.node import SwarmConfig, SwarmNode
from fusionp2p.swarm.probe import ProbeServer
from fusionp2p.testing.swarm import TEST_PROFILE
from fusionp2p.wire.protocols import PROBE, TOPIC_MEMBERS
from fusionp2p.wire.records import NodeRecord, Record, decode_signed, encode_bundle, encode_signed

STEADY = 30.0   # simulated seconds of steady state measured


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
    ap.add_argument("--one-node", type=int, default=0, metavar="N",
                    help="only the cross-check: the collector of one node with a view of N members (one_node)")
    args = ap.parse_args()
    if args.one_node:
        print(one_node(args.one_node))
        return
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else ([50, 150] if args.quick else [100, 300, 1000])

    decoder = Decoder()
    swarm_mod.decode_signed = decoder   # type: ignore[assignment]
    rows = []
    print(f"{'N':>5} {'join s':>7} {'cpu/node':>9} {'gc':>5} {'verify':>6} {'pings/s':>8} {'probe set':>9} {'period s':>9} "
          f"{'detect s':>9}")
    for n in sizes:
        r = run_one(n, decoder)
        rows.append(r)
        print(f"{n:>5} {r['join_s']:>7.1f} {r['cpu_per_node']:>9.5f} {r['gc_share']:>5.0%} {r['verify_share']:>6.0%} "
              f"{r['pings_per_node_s']:>8.2f} "
              f"{r['probe_set_max']:>9} {r['period_s']:>9.1f} {r['detect_s']:>9.2f}", flush=True)
    ratio = rows[-1]["cpu_per_node"] / rows[0]["cpu_per_node"]
    ex_gc = rows[-1]["cpu_per_node_ex_gc"] / rows[0]["cpu_per_node_ex_gc"]
    own = [r["cpu_per_node"] * (1 - r["gc_share"] - r["verify_share"]) for r in (rows[0], rows[-1])]
    write("swarm_scale", args.out, rows,
          headline(f"per-node CPU at {rows[-1]['n']} simulated nodes over that at {rows[0]['n']}", ratio, "x", 1.5, "lower",
                   f"dead-peer detection at {rows[-1]['n']}: {rows[-1]['detect_s']:.2f} s (target 30 s); the CPU "
                   f"outside Python's collector {ex_gc:.2f}x, outside it and verifying records {own[1] / own[0]:.2f}x"),
          quick=args.quick)


if __name__ == "__main__":
    main()
