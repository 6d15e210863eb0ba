"""``fusionp2p status``: the swarm's members and bandwidth matrix, once (a table or JSON) or live.

Both ask one member for its VIEW (``swarm/node.py``: every signed record it holds, verified here).
``--watch`` keeps the connection and redraws a rich ``Live`` view every ``--interval`` seconds:
members with their devices and liveness, the bandwidth matrix as a coloured grid, and the jobs'
progress (step, loss and a loss sparkline) heard on the jobs gossip topic. To hear that gossip the
watcher also dials a few live nodes (the bootstrap does not relay the jobs topic unless it serves
``--http``). A member that stops answering shows as an error line; the next refresh tries again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from typing import Any

import trio
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from fusionp2p.errors import PeerUnavailable, RemoteProtocolError
from fusionp2p.ops.curves import LossCurves
from fusionp2p.types import short_peer

SPARK = "▁▂▃▄▅▆▇█"
MAX_MATRIX = 16   # nodes shown in the terminal's bandwidth grid
DIAL_NODES = 3    # live nodes the watcher dials to hear the jobs gossip


def view_summary(view: dict[str, Any]) -> dict[str, Any]:
    """The JSON of ``fusionp2p status --json`` from a verified VIEW."""
    from fusionp2p.swarm.membership import BandwidthTable
    from fusionp2p.wire.records import BandwidthReport, NodeRecord

    alive = set(view["alive"])
    recs = {r.peer: r for r in view["records"] if isinstance(r, NodeRecord)}
    table = BandwidthTable()
    for r in view["bw"]:
        if isinstance(r, BandwidthReport):
            table.on_report(r)
    nodes = sorted(p for p, r in recs.items() if r.role == "node" and p in alive)
    return {
        "members": [
            {"peer": p, "role": r.role, "alive": p in alive, "addrs": list(r.addrs), "data": list(r.data),
             "reach": r.reach, "profile": r.profile.to_wire() if r.profile else None, "speed": r.speed or None}
            for p, r in sorted(recs.items()) if not r.leaving
        ],
        "dead": view["dead"],
        "bandwidth": [
            {"src": a, "dst": b, "bytes_per_s": e.bandwidth, "rtt_s": e.rtt, "measured": e.measured}
            for (a, b), e in sorted(table.matrix(nodes).items())
        ],
    }


def cli_status(args: argparse.Namespace) -> int:
    from fusionp2p.net.libp2p_host import parse_peer_addr

    for b in args.bootstrap:
        parse_peer_addr(b)
    if args.watch:
        if args.interval <= 0:
            from fusionp2p.errors import ConfigError

            raise ConfigError("--interval must be positive")
        with contextlib.suppress(KeyboardInterrupt):
            trio.run(_watch, args)
        return 0

    async def once() -> dict[str, Any]:
        # one deadline over everything, the transport's start and teardown included
        with trio.fail_after(args.timeout + 10):
            async with _client() as t:
                _, view = await _first_view(t, args)
                return view_summary(view)

    try:
        out = trio.run(once)
    except trio.TooSlowError:
        raise PeerUnavailable(args.bootstrap[0].rsplit("/p2p/", 1)[-1], f"no answer within {args.timeout + 10:.0f} s") from None
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        c = Console()
        c.print(members_table(out))
        c.print(bandwidth_table(out))
    return 0


def _client() -> Any:
    from fusionp2p.net.identity import Identity
    from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport

    return open_libp2p_transport(Identity.generate(), Libp2pConfig(listen=("/ip4/127.0.0.1/tcp/0",)))


async def _first_view(t: Any, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(peer, view) from the first bootstrap address that answers."""
    from fusionp2p.swarm.node import fetch_view

    last: Exception | None = None
    for addr in args.bootstrap:
        try:
            peer = await t.connect(addr)
            return peer, await fetch_view(t, peer, timeout=args.timeout)
        except (PeerUnavailable, RemoteProtocolError, trio.TooSlowError) as exc:
            last = exc
    why = last.reason if isinstance(last, PeerUnavailable) and last.reason else str(last)
    raise PeerUnavailable(args.bootstrap[0].rsplit("/p2p/", 1)[-1], f"no bootstrap answered: {why}")


async def _watch(args: argparse.Namespace) -> None:
    from rich.live import Live

    from fusionp2p.swarm.node import fetch_view
    from fusionp2p.wire.protocols import TOPIC_JOBS

    console = Console()
    book = LossCurves(max_jobs=16, max_points=256)
    async with _client() as t, trio.open_nursery() as nursery:
        gossip = await t.subscribe(TOPIC_JOBS)

        async def listen() -> None:
            async for msg in gossip:
                book.on_gossip(msg, now=trio.current_time())

        nursery.start_soon(listen)
        peer: str | None = None
        summary: dict[str, Any] = {"members": [], "dead": [], "bandwidth": []}
        dialed: set[str] = set()
        n = 0
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                n += 1
                error = ""
                try:
                    with trio.fail_after(args.timeout + 10):
                        if peer is None:
                            peer, view = await _first_view(t, args)
                        else:
                            view = await fetch_view(t, peer, timeout=args.timeout)
                    summary = view_summary(view)
                    _dial_nodes(nursery, t, summary, dialed)
                except (PeerUnavailable, RemoteProtocolError, trio.TooSlowError) as exc:
                    peer, error = None, f"no answer: {exc}" if str(exc) else "no answer in time"
                live.update(watch_view(summary, book, n=n, error=error, source=args.bootstrap[0]), refresh=True)
                if args.refreshes and n >= args.refreshes:
                    break
                await trio.sleep(args.interval)
        nursery.cancel_scope.cancel()


def _dial_nodes(nursery: trio.Nursery, t: Any, summary: dict[str, Any], dialed: set[str]) -> None:
    """Connect (in the background, once each) to a few live nodes: they relay the jobs gossip to us."""
    for m in summary["members"]:
        if len(dialed) >= DIAL_NODES:
            return
        if m["role"] == "node" and m["alive"] and m["peer"] not in dialed and m["addrs"]:
            dialed.add(m["peer"])

            async def dial(addr: str = f"{m['addrs'][0]}/p2p/{m['peer']}") -> None:
                with trio.move_on_after(10):
                    with contextlib.suppress(PeerUnavailable):
                        await t.connect(addr)

            nursery.start_soon(dial)


# ---------------------------------------------------------------------------------------- rendering
_short = short_peer   # the same short form as the nodes' logs and str(event): the id's last 8 characters


def members_table(out: dict[str, Any]) -> Table:
    t = Table(title="members", title_justify="left",
              caption="peer: last 8 characters of its id, as in logs. start-up GFLOP/s: fp32 matmul benchmark. "
                      "trains at: the speed it trained at in its last job of a model, over what that benchmark "
                      "predicted (2.00x: twice as fast; -: no job yet). reach: public, or behind a NAT (relayed)",
              caption_justify="left")
    for col in ("peer", "role", "alive", "device", "start-up GFLOP/s", "trains at", "memory GiB", "data plane", "reach"):
        t.add_column(col)
    for m in out["members"]:
        p = m["profile"] or {}
        t.add_row(_short(m["peer"]), m["role"], Text("yes", style="green") if m["alive"] else Text("DEAD", style="bold red"),
                  p.get("name", "-"), f"{p['flops_fp32'] / 1e9:.1f}" if p else "-",
                  f"{m['speed']:.2f}x benchmark" if m.get("speed") else "-", f"{p['memory_bytes'] / 2**30:.1f}" if p else "-", " ".join(m.get("data") or ["-"]),
                  m.get("reach", "unknown"))
    return t


def bandwidth_table(out: dict[str, Any]) -> Table:
    bw = Table(title="bandwidth between members (MB/s of the data-plane path, round-trip ms; est.: not probed yet)",
               title_justify="left")
    for col in ("src", "dst", "MB/s", "rtt ms", "measured"):
        bw.add_column(col)
    for e in out["bandwidth"]:
        bw.add_row(_short(e["src"]), _short(e["dst"]), f"{e['bytes_per_s'] / 1e6:.1f}", f"{e['rtt_s'] * 1e3:.2f}",
                   "yes" if e["measured"] else "est.")
    return bw


def bandwidth_grid(out: dict[str, Any]) -> Table:
    """The matrix as a grid (rows send, columns receive), cells coloured by log bandwidth."""
    cells = {(e["src"], e["dst"]): e for e in out["bandwidth"]}
    nodes = sorted({p for pair in cells for p in pair})[:MAX_MATRIX]
    vals = [math.log10(e["bytes_per_s"]) for e in cells.values() if e["bytes_per_s"] > 0]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    g = Table(title="bandwidth matrix, MB/s (row sends to column; * estimated)", title_justify="left")
    g.add_column("")
    for p in nodes:
        g.add_column(_short(p), justify="right")
    palette = ["red", "dark_orange", "yellow", "green_yellow", "green"]
    for a in nodes:
        row: list[RenderableType] = [Text(_short(a), style="bold")]
        for b in nodes:
            e = cells.get((a, b))
            if a == b or e is None:
                row.append(Text("·" if a == b else "?", style="dim"))
                continue
            x = (math.log10(e["bytes_per_s"]) - lo) / (hi - lo) if hi > lo and e["bytes_per_s"] > 0 else 1.0
            row.append(Text(f"{e['bytes_per_s'] / 1e6:.0f}" + ("" if e["measured"] else "*"),
                            style=palette[min(len(palette) - 1, int(x * len(palette)))]))
        g.add_row(*row)
    return g


def sparkline(values: list[float], width: int = 32) -> str:
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return ""
    if len(vals) > width:   # evenly spaced samples of the whole curve
        vals = [vals[round(i * (len(vals) - 1) / (width - 1))] for i in range(width)]
    lo, hi = min(vals), max(vals)
    span = hi - lo or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in vals)


def jobs_table(book: LossCurves, now: float) -> Table:
    t = Table(title="jobs (from gossip)", title_justify="left")
    for col in ("job", "step", "loss", "tokens/s", "loss curve", "heard"):
        t.add_column(col)
    for c in sorted(book.jobs.values(), key=lambda c: -c.updated):
        t.add_row(c.job[:16], str(c.step), f"{c.loss:.3f}" if c.loss is not None else "-", f"{c.tokens_per_s:,.0f}",
                  sparkline([v for _, v in c.points]), f"{now - c.updated:.0f} s ago")
    return t


def watch_view(out: dict[str, Any], book: LossCurves, *, n: int, error: str, source: str) -> Group:
    alive = sum(1 for m in out["members"] if m["alive"] and m["role"] == "node")
    head = Text.assemble(("fusionp2p swarm ", "bold cyan"), f"via {_short(source.rsplit('/p2p/', 1)[-1])} · ",
                         (f"{alive} nodes alive", "green"), f" · {len(out['dead'])} dead · refresh {n}")
    parts: list[RenderableType] = [head]
    if error:
        parts.append(Text(error, style="bold red"))
    parts += [members_table(out), bandwidth_grid(out)]
    if book.jobs:
        parts.append(jobs_table(book, trio.current_time()))
    return Group(*parts)


__all__ = ["cli_status", "view_summary", "watch_view"]
