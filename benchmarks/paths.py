"""Throughput of the data plane's paths (issue 21): direct TCP (our AEAD) against the libp2p fallback
and the fallback through a circuit relay.

Two processes on loopback, each a real libp2p transport (Noise + yamux) with a data plane. The
receiver announces either its real data-plane port (the **direct** path: ``BulkChannel``, TCP lanes,
AES-GCM/ChaCha20-Poly1305 in threads) or a port that refuses connections, as a node behind a NAT
looks to its peers (the **libp2p** path: ``StreamChannel``, the tensors on a yamux stream of the
Noise connection the peers share). The **relay** path adds a third process, a circuit relay
(``net/relay.py``, its rate limit lifted so that the path's own capacity is measured): the receiver
reserves a slot on it and the sender knows only its circuit address, as for two nodes behind
different NATs; the tensors take the libp2p fallback on that relayed connection. The sender pushes
``total`` MiB of float32 messages through ``DataPlane.connect`` exactly as a job does and waits for
the receiver's final acknowledgement.

    python -m benchmarks.paths [--quick]

Headline: libp2p-path throughput / direct-path throughput, both measured in this run. Loopback
figures on a shared 2-core machine: read the ratio, not the absolute numbers. The same comparison
on shaped links is a matter of the link: below ~1 Gbit/s both paths fill it (docs/networking.md).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from typing import Any

import torch
import trio

from benchmarks._common import headline, parser, write
from fusionp2p.errors import FusionError
from fusionp2p.net.bulk import open_data_plane
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.identity import Identity
from fusionp2p.net.libp2p_host import Libp2pConfig, open_libp2p_transport
from fusionp2p.net.relay import RelayLimits

MiB = 1024 * 1024


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def hop() -> None:
    """The relay: print our multiaddr, relay until killed (no rate cap: the path's capacity is measured)."""
    cfg = Libp2pConfig(relay=RelayLimits(rate=1e12, circuit_bytes=1 << 40))
    async with open_libp2p_transport(Identity.generate(), cfg) as t:
        print(t.listen_addrs()[0], flush=True)
        await trio.sleep_forever()


async def child(mode: str, relay: str = "") -> None:
    """Receiver: print our multiaddr (on the relay path: our circuit address), take one channel, count
    bytes until a message named 'end'."""
    extra: dict[str, Any] = {"advertise_port": _closed_port()} if mode in ("libp2p", "relay") else {}
    async with open_libp2p_transport(Identity.generate()) as t, \
            open_data_plane(t, listen_host="127.0.0.1", **extra) as dp:
        if mode == "relay":
            rid = await t.connect(relay)
            await t.reserve(rid)
            print(t.circuit_addrs()[0], flush=True)
        else:
            print(t.listen_addrs()[0], flush=True)
        ch = await dp.incoming.receive()
        got = 0
        while True:
            msg = await ch.receive()
            if msg.name == "end":
                break
            got += sum(x.numel() * x.element_size() for x in msg.tensors)
        await ch.send(TensorMessage(job="b", kind="ack", name=ch.path, meta={"bytes": got}))
        with trio.move_on_after(10), contextlib.suppress(trio.EndOfChannel, FusionError):
            await ch.receive()   # the sender's close


async def send(addr: str, size: int, total: int) -> dict[str, Any]:
    async with open_libp2p_transport(Identity.generate()) as t, open_data_plane(t, listen_host="127.0.0.1") as dp:
        peer = await t.connect(addr)
        t0 = time.perf_counter()
        ch = await dp.connect(peer)
        setup = time.perf_counter() - t0
        relayed = t.is_relayed(peer)
        x = torch.randn(size // 4)
        n = max(1, total // size)
        t0 = time.perf_counter()
        for i in range(n):
            await ch.send(TensorMessage(job="b", kind="act", step=i, tensors=(x,)))
        await ch.send(TensorMessage(job="b", kind="act", name="end"))
        ack = await ch.receive()
        dt = time.perf_counter() - t0
        assert ack.meta["bytes"] == n * size, ack.meta
        await ch.aclose()
        return {"path": "relay" if relayed and ch.path == "libp2p" else ch.path, "relayed": relayed, "peer_path": ack.name, "message_mib": size / MiB, "total_mib": n * size / MiB,
                "seconds": dt, "mb_per_s": n * size / dt / 1e6, "setup_ms": setup * 1e3}


def _spawn(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.paths", *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def run_path(mode: str, size: int, total: int) -> dict[str, Any]:
    procs = []
    try:
        relay = ""
        if mode == "relay":
            proc, relay = _spawn("--child", "hop")
            procs.append(proc)
        proc, addr = _spawn("--child", mode, *(["--relay", relay] if relay else []))
        procs.append(proc)
        res = trio.run(send, addr, size, total)
        proc.wait(30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert res["path"] == mode and res["peer_path"] == ("libp2p" if mode == "relay" else mode), res
    return res


def main() -> None:
    p = parser("paths", __doc__)
    p.add_argument("--child", choices=["direct", "libp2p", "relay", "hop"], help=argparse_hidden())
    p.add_argument("--relay", default="", help=argparse_hidden())
    args = p.parse_args()
    if args.child == "hop":
        trio.run(hop)
        return
    if args.child:
        trio.run(child, args.child, args.relay)
        return
    torch.set_num_threads(1)
    sizes = [1 * MiB, 8 * MiB] if args.quick else [1 * MiB, 8 * MiB, 32 * MiB]
    total = (256 if args.quick else 1024) * MiB
    reps = 1 if args.quick else 3
    rows: list[dict[str, Any]] = []
    for size in sizes:
        for mode in ("direct", "libp2p", "relay"):
            best: dict[str, Any] | None = None
            for _ in range(reps):
                r = run_path(mode, size, {"direct": total, "libp2p": total // 4, "relay": total // 16}[mode])
                if best is None or r["mb_per_s"] > best["mb_per_s"]:
                    best = r
            assert best is not None
            rows.append(best)
            print(f"{mode:>7}  {size // MiB:>3} MiB messages  {best['total_mib']:>6.0f} MiB  "
                  f"{best['mb_per_s']:>8.1f} MB/s  set-up {best['setup_ms']:.1f} ms")
    direct = sorted(r["mb_per_s"] for r in rows if r["path"] == "direct")
    fallback = sorted(r["mb_per_s"] for r in rows if r["path"] == "libp2p")
    relayed = sorted(r["mb_per_s"] for r in rows if r["path"] == "relay")
    ratio = fallback[len(fallback) // 2] / direct[len(direct) // 2]
    print(f"relay path / direct path (median): {relayed[len(relayed) // 2] / direct[len(direct) // 2]:.4f}")
    write("paths", args.out, {"rows": rows, "reps": reps,
                              "relay_over_direct": relayed[len(relayed) // 2] / direct[len(direct) // 2],
                              "relay_over_libp2p": relayed[len(relayed) // 2] / fallback[len(fallback) // 2]}, headline(
        "libp2p fallback path / direct path throughput (median over message sizes, loopback)", ratio, "ratio", 0.1,
        "higher", "direct path (TCP + our AEAD) measured in the same run"), quick=args.quick)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
