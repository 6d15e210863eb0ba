"""Hostile DAGs (issue 15, items 2 and 3): validating a peer's DAG is shape inference only, bounded.

A DAG is a few hundred bytes that names operators and shapes; validating it used to *run* them:
``aten.zeros([2**28])`` without a device allocated 1 GiB, an ``mm`` of two 4096x4096 ``ones``
computed for seconds, and ``split(x, 1)`` on a 4M-element input built 4M tensors (17 s, 2.8 GiB)
before the declared-output check refused it. The bombs run in a child process, which reports its
peak resident memory (``VmHWM``) and CPU time around the decode: the bounds below are generous
(validation costs milliseconds and no memory now) and every bomb broke them before the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fusionp2p.errors import RemoteProtocolError
from fusionp2p.graph.dag import InputSpec, OpDAG, OpNode, Ref, TensorMeta
from fusionp2p.wire.dag import decode_dag, encode_dag
from fusionp2p.wire.limits import GiB, Limits, MiB
from tests.unit.fuzz import peak_rss, reset_peak_rss

F32 = torch.float32
X = InputSpec(name="x", kind="input", meta=TensorMeta(shape=(1,), dtype=F32))


def _node(name: str, op: str, args: tuple, shape: tuple[int, ...]) -> OpNode:  # type: ignore[type-arg]
    return OpNode(name=name, op=op, args=args, out=(TensorMeta(shape=shape, dtype=F32),))


_CHILD = textwrap.dedent("""
    import json, resource, sys, torch
    from fusionp2p.errors import RemoteProtocolError
    from fusionp2p.graph.dag import InputSpec, OpDAG, OpNode, Ref, TensorMeta
    from fusionp2p.wire.dag import decode_dag, encode_dag
    F32 = torch.float32

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def meta(*shape):
        return TensorMeta(shape=shape, dtype=F32)

    x1 = InputSpec(name="x", kind="input", meta=meta(1))
    n, m = 2**28, 4096
    big = InputSpec(name="x", kind="input", meta=meta(2**22))
    bombs = {
        # factories without a device argument used to allocate for real
        "zeros": OpDAG(inputs=(x1,), nodes=(OpNode(name="z", op="aten.zeros.default", args=([n],), out=(meta(n),)),),
                       outputs=("z",)),
        "full": OpDAG(inputs=(x1,), nodes=(OpNode(name="z", op="aten.full.default", args=([n], 1.5), out=(meta(n),)),),
                      outputs=("z",)),
        # ... and whatever read them computed for real
        "mm": OpDAG(inputs=(x1,), nodes=(
            OpNode(name="o", op="aten.ones.default", args=([m, m],), out=(meta(m, m),)),
            OpNode(name="p", op="aten.mm.default", args=(Ref("o"), Ref("o")), out=(meta(m, m),)),
            OpNode(name="q", op="aten.mm.default", args=(Ref("p"), Ref("o")), out=(meta(m, m),))), outputs=("q",)),
        # 4M outputs were built before the count was compared with the 1000 declared
        "split": OpDAG(inputs=(big,), nodes=(OpNode(name="s", op="aten.split.Tensor", args=(Ref("x"), 1), multi=True,
                                                    out=tuple(meta(1) for _ in range(1000))),), outputs=()),
        "unbind": OpDAG(inputs=(big,), nodes=(OpNode(name="s", op="aten.unbind.int", args=(Ref("x"),), multi=True,
                                                     out=tuple(meta() for _ in range(1000))),), outputs=()),
    }
    blobs = {k: encode_dag(v) for k, v in bombs.items()}
    small = OpDAG(inputs=(x1,), nodes=(OpNode(name="z", op="aten.zeros.default", args=([1],), out=(meta(1),)),),
                  outputs=("z",))
    decode_dag(encode_dag(small))       # warm up the import and dispatch paths
    out = {"sizes": {k: len(b) for k, b in blobs.items()}, "results": {}}
    for name in sys.argv[1:]:
        rss0, cpu0 = status("VmRSS"), cpu()
        try:
            decode_dag(blobs[name], memory_bytes=1 << 40)
            result = "accepted"
        except RemoteProtocolError as exc:
            result = "refused: " + str(exc)[:120]
        out["results"][name] = {"result": result, "peak_growth": status("VmHWM") - rss0, "cpu_s": cpu() - cpu0}
    print(json.dumps(out))
""")


@pytest.mark.parametrize("bombs", [("zeros", "full", "mm"), ("split", "unbind")])
def test_validation_allocates_and_computes_nothing(bombs: tuple[str, ...]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, *bombs], capture_output=True, text=True, timeout=300,
                          env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(size < 16_000 for size in report["sizes"].values())   # small messages, large effects
    for name in bombs:
        r = report["results"][name]
        # before: zeros +1 GiB, full +1 GiB, mm 2 x 137 GFLOP (seconds), split 17 s and 2.8 GiB
        assert r["peak_growth"] < 128 * MiB, (name, r)
        assert r["cpu_s"] < 1.5, (name, r)
        if name in ("split", "unbind"):
            assert "would produce 4194304 outputs" in r["result"], r
        else:
            assert r["result"] == "accepted", r   # a declared 1 GiB output is legal; the budget decides


def test_the_whole_dag_is_checked_against_the_node_memory_first() -> None:
    # eight 1 GiB values: fine for a node with 16 GiB, refused on a 4 GiB node before anything runs
    n = 2**28
    nodes = tuple(_node(f"z{i}", "aten.zeros.default", ([n],), (n,)) for i in range(8))
    blob = encode_dag(OpDAG(inputs=(X,), nodes=nodes, outputs=("z7",)))
    assert len(blob) < 1000
    decode_dag(blob, memory_bytes=16 * GiB)
    with pytest.raises(RemoteProtocolError, match="more than this node's budget"):
        decode_dag(blob, memory_bytes=4 * GiB)


def test_every_input_and_output_shape_is_bounded() -> None:
    # 2**39 elements per dim were accepted before, and a product that overflows int64 raised RuntimeError
    huge = InputSpec(name="x", kind="input", meta=TensorMeta(shape=(2**39, 2**39), dtype=F32))
    with pytest.raises(RemoteProtocolError, match="too large"):
        decode_dag(encode_dag(OpDAG(inputs=(huge,), nodes=(), outputs=())))
    # no bytes at all, but torch cannot build it either ("Stride calculation overflowed", a RuntimeError before)
    empty = InputSpec(name="x", kind="input", meta=TensorMeta(shape=(0, 2**39, 2**39, 2**39, 2**39), dtype=F32))
    with pytest.raises(RemoteProtocolError, match="too large"):
        decode_dag(encode_dag(OpDAG(inputs=(empty,), nodes=(), outputs=())))
    lim = Limits(max_tensor_bytes=1 * MiB)
    x = InputSpec(name="x", kind="input", meta=TensorMeta(shape=(2**18 + 1,), dtype=F32))
    with pytest.raises(RemoteProtocolError, match="tensor limit"):
        decode_dag(encode_dag(OpDAG(inputs=(x,), nodes=(), outputs=())), limits=lim)
    nodes = (_node("z", "aten.zeros.default", ([2**18 + 1],), (2**18 + 1,)),)
    with pytest.raises(RemoteProtocolError, match="declares an output over"):
        decode_dag(encode_dag(OpDAG(inputs=(X,), nodes=nodes, outputs=("z",))), limits=lim)


def test_the_count_of_values_is_bounded() -> None:
    lim = Limits(max_dag_values=100)
    x = InputSpec(name="x", kind="input", meta=TensorMeta(shape=(101,), dtype=F32))
    split = OpNode(name="s", op="aten.split.Tensor", args=(Ref("x"), 1), multi=True,
                   out=tuple(TensorMeta(shape=(1,), dtype=F32) for _ in range(101)))
    blob = encode_dag(OpDAG(inputs=(x,), nodes=(split,), outputs=()))
    decode_dag(blob)   # 101 values are fine by default
    with pytest.raises(RemoteProtocolError, match="declare 101 values"):
        decode_dag(blob, limits=lim)


def test_the_header_is_bounded() -> None:
    lim = Limits(max_dag_header=1024)
    nodes = tuple(_node(f"z{i}", "aten.zeros.default", ([1],), (1,)) for i in range(50))
    with pytest.raises(RemoteProtocolError, match="graph header of"):
        decode_dag(encode_dag(OpDAG(inputs=(X,), nodes=nodes, outputs=("z0",))), limits=lim)


def test_honest_list_operators_still_validate() -> None:
    # chunk(x, 4) on 3 rows gives 3 pieces: the bound must not refuse it; split_with_sizes counts its list
    x = InputSpec(name="x", kind="input", meta=TensorMeta(shape=(3, 2), dtype=F32))
    row = TensorMeta(shape=(1, 2), dtype=F32)
    nodes = (OpNode(name="c", op="aten.chunk.default", args=(Ref("x"), 4), multi=True, out=(row, row, row)),
             OpNode(name="w", op="aten.split_with_sizes.default", args=(Ref("x"), [1, 2]), multi=True,
                    out=(row, TensorMeta(shape=(2, 2), dtype=F32))),
             OpNode(name="u", op="aten.unbind.int", args=(Ref("x"), 1), multi=True,
                    out=(TensorMeta(shape=(3,), dtype=F32),) * 2))
    dag = decode_dag(encode_dag(OpDAG(inputs=(x,), nodes=nodes, outputs=())))
    assert [len(n.out) for n in dag.nodes] == [3, 2, 2]


def test_an_explicit_real_device_is_still_inferred_on_meta() -> None:
    n = 2**26   # 256 MiB if it ran for real
    node = OpNode(name="z", op="aten.zeros.default", args=([n],), kwargs=(("device", torch.device("cpu")),),
                  out=(TensorMeta(shape=(n,), dtype=F32),))
    small = OpNode(name="z", op="aten.zeros.default", args=([4],), kwargs=(("device", torch.device("cpu")),),
                   out=(TensorMeta(shape=(4,), dtype=F32),))
    decode_dag(encode_dag(OpDAG(inputs=(X,), nodes=(small,), outputs=("z",))))   # torch's first call costs ~70 MiB
    rss0 = reset_peak_rss()
    decode_dag(encode_dag(OpDAG(inputs=(X,), nodes=(node,), outputs=("z",))))
    if rss0 is not None:   # measured where a tensor would live (tracemalloc does not see torch's allocations)
        assert peak_rss() - rss0 < 32 << 20
