"""Attacks on a node, for the hostile-peer tests (never imported by the product).

Each function does one thing a hostile peer can do with nothing but its own identity, and returns
what it built so that a test can look at the damage: a DAG that is tiny on the wire and huge to run,
a signed record or report with out-of-range values, a data-plane message announced and never
finished, a probe server that lies about its measurements.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import trio

from fusionp2p.graph.dag import InputSpec, OpDAG, OpNode, Ref, TensorMeta
from fusionp2p.net.bulk import DataPlane
from fusionp2p.net.bulk_channel import BulkChannel
from fusionp2p.net.channel import TensorMessage
from fusionp2p.net.identity import Identity
from fusionp2p.net.transport import Stream
from fusionp2p.wire import tensor_frame as tf
from fusionp2p.wire.dag import encode_dag
from fusionp2p.wire.framing import FrameDecoder, encode_frame
from fusionp2p.wire.msg import packb, unpackb

F32 = torch.float32


# ------------------------------------------------------------------------------------------- DAGs
def bomb_dags() -> dict[str, bytes]:
    """Encoded DAGs of a few hundred bytes each that used to allocate gigabytes or compute for seconds
    while being *validated* (issue 15, items 2 and 3)."""
    x1 = InputSpec(name="x", kind="input", meta=TensorMeta(shape=(1,), dtype=F32))
    big = InputSpec(name="x", kind="input", meta=TensorMeta(shape=(2**22,), dtype=F32))
    n, m = 2**28, 4096

    def meta(*shape: int) -> TensorMeta:
        return TensorMeta(shape=shape, dtype=F32)

    def zeros(k: int, size: int = n) -> OpDAG:   # k tensors of *size* floats, allocated while "validated" before
        return OpDAG(inputs=(x1,), nodes=tuple(OpNode(name=f"z{i}", op="aten.zeros.default", args=([size],),
                                                      out=(meta(size),)) for i in range(k)), outputs=(f"z{k - 1}",))

    dags = {
        "zeros8": zeros(8),                # 8 GiB: within a big node's memory, shape inference only, then accepted
        "zeros1T": zeros(256, 2**30),      # 1 TiB: over any node's budget, refused before anything runs
        "mm": OpDAG(inputs=(x1,), nodes=(OpNode(name="o", op="aten.ones.default", args=([m, m],), out=(meta(m, m),)),
                                         OpNode(name="p", op="aten.mm.default", args=(Ref("o"), Ref("o")), out=(meta(m, m),))),
                    outputs=("p",)),
        "split": OpDAG(inputs=(big,), nodes=(OpNode(name="s", op="aten.split.Tensor", args=(Ref("x"), 1), multi=True,
                                                    out=tuple(meta(1) for _ in range(100))),), outputs=()),
    }
    return {k: encode_dag(v) for k, v in dags.items()}


# ---------------------------------------------------------------------------------------- records
def signed_record(identity: Identity, t: str, body: dict[str, Any]) -> bytes:
    """A swarm record (wire/records.py envelope) with any body, correctly signed by *identity*."""
    b = packb(body)
    return packb({"v": 1, "t": t, "b": b, "s": identity.sign(t.encode() + b"\x00" + b)})


def inf_profile_record(identity: Identity) -> bytes:
    """The record that took down a node and then the bootstrap relaying it (issue 15): a self-signed
    heartbeat whose device profile claims infinite memory and FLOP/s."""
    profile = {"device": "cpu", "kind": "cpu", "name": "x", "flops_fp32": math.inf, "flops_bf16": 0.0,
               "memory_bytes": math.inf, "threads": 1, "versions": []}
    return signed_record(identity, "node", {"peer": identity.peer_id, "role": "node", "addrs": [], "profile": profile,
                                            "started": 0.0, "seq": 2**62, "leaving": False, "hb": 1.0})


# ------------------------------------------------------------------------------------- data plane
async def half_sent(dp: DataPlane, peer: str, *, announce: int, send: int) -> BulkChannel:
    """Open a channel to *peer* and send the first *send* bytes of a message of *announce* bytes, then
    nothing more (the dialing data plane should have a long keepalive, or its PINGs end the attack)."""
    ch = await dp.connect(peer)
    assert isinstance(ch, BulkChannel), "the attack needs the direct path (the peer's data port must be reachable)"
    payload = torch.empty(max(0, announce - 256), dtype=torch.uint8)   # never written: costs no memory here
    parts = tf.encode_message(TensorMessage(job="x", kind="act", tensors=(payload,)))
    sent = 0
    for plan in ch._writer.plan_parts(parts):
        if sent >= send or plan.kind == tf.MSG_END:
            break
        ch._send_raw_for_tests(bytes(ch._writer.seal(plan)))
        sent += plan.size
        await trio.lowlevel.checkpoint()
    return ch


# ------------------------------------------------------------------------------------------ probes
def lying_probe_server(rate: object = math.inf) -> Callable[[Stream], Awaitable[None]]:
    """A PROBE handler that answers every transfer with *rate* as its measurement (and never says busy)."""

    async def serve(stream: Stream) -> None:
        dec = FrameDecoder(max_frame=1 << 20)
        want: int | None = None
        got = 0
        while True:
            data = await stream.receive_some()
            if not data:
                return
            for fr in dec.feed(data):
                if want is None:
                    m = unpackb(fr)
                    if not isinstance(m, dict):
                        return
                    if m.get("op") == "ping":
                        await stream.send_all(encode_frame(packb({"op": "pong", "i": m.get("i", 0)}), max_frame=4096))
                    elif m.get("op") == "bulk" and isinstance(m.get("n"), int):
                        want, got = m["n"], 0
                        await stream.send_all(encode_frame(packb({"op": "go"}), max_frame=4096))
                    continue
                got += len(fr)
                if got >= want:
                    ack = {"op": "ack", "n": want, "timed": 1.0, "rate": rate}
                    await stream.send_all(encode_frame(packb(ack), max_frame=4096))
                    want = None
    return serve


__all__ = ["bomb_dags", "half_sent", "inf_profile_record", "lying_probe_server", "signed_record"]
