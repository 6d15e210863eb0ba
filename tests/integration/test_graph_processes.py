"""Three real processes run three stages of GPT-2 over loopback TCP and reproduce single-process gradients.

The test process traces and partitions the model, writes each encoded StageProgram and the
micro-batches to files, and starts ``python -m tests.integration.test_graph_processes WORKDIR STAGE``
three times. A worker decodes only its own program (never any code), listens on 127.0.0.1, learns the
other workers' ports on stdin, dials every lower-numbered stage, and then moves boundary tensors as
length-prefixed frames (wire.framing + wire.msg + wire.tensor). At the end it writes its parameters'
gradients (safetensors) for the test to compare.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fusionp2p.graph import DATA, Inbox, StageExecutor, coarsen, partition, stages_from_fences, trace
from fusionp2p.models import GPT2, GPT2Config
from fusionp2p.wire import FrameDecoder, decode_tensor, encode_frame, encode_tensor, packb, unpackb
from fusionp2p.wire.dag import decode_stage, encode_stage

ROOT = Path(__file__).resolve().parents[2]
MAX_FRAME = 64 << 20
N_MICRO = 3


def _encode_msg(grad: bool, micro: int, name: str, src: int, t: torch.Tensor) -> bytes:
    header, raw = encode_tensor(t)
    head = packb({"g": grad, "mu": micro, "n": name, "s": src, "t": header})
    return encode_frame(len(head).to_bytes(4, "big") + head + bytes(raw), max_frame=MAX_FRAME)


def _decode_msg(frame: bytes) -> tuple[bool, int, str, int, torch.Tensor]:
    n = int.from_bytes(frame[:4], "big")
    head = unpackb(frame[4:4 + n])
    return head["g"], head["mu"], head["n"], head["s"], decode_tensor(head["t"], frame[4 + n:])


async def _worker(workdir: Path, stage: int) -> None:
    import trio
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(1)
    prog = decode_stage((workdir / f"stage{stage}.bin").read_bytes())
    ex, box = StageExecutor(prog), Inbox(prog)
    batches = load_file(str(workdir / "data.safetensors"))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    ports = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
    streams: dict[int, trio.abc.Stream] = {}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for peer in range(stage):   # dial lower stages; higher stages dial us
                dialed = await trio.open_tcp_stream("127.0.0.1", ports[peer])
                await dialed.send_all(stage.to_bytes(1, "big"))
                streams[peer] = dialed
            while len(streams) < prog.num_stages - 1:
                accepted = await listeners[0].accept()
                peer = (await accepted.receive_some(1))[0]
                streams[peer] = accepted
            send_q, recv_q = trio.open_memory_channel[tuple[bool, int, str, int, torch.Tensor]](1000)

            async def reader(s: trio.abc.Stream) -> None:
                dec = FrameDecoder(max_frame=MAX_FRAME)
                while data := await s.receive_some(1 << 16):
                    for f in dec.feed(data):
                        await send_q.send(_decode_msg(f))

            for s in streams.values():
                nursery.start_soon(reader, s)
            for mu in range(N_MICRO):
                for r in prog.recv:
                    if r.src == DATA:
                        await send_q.send((False, mu, r.name, DATA, batches[f"{mu}.{r.name}"]))
            done = 0
            while done < N_MICRO:
                grad, mu, name, src, t = await recv_q.receive()
                if not grad:
                    ready = box.put_activation(mu, name, t)
                    if ready is None:
                        continue
                    outs = await trio.to_thread.run_sync(ex.forward, mu, ready)
                    for o in prog.send:
                        for d in o.dsts:
                            await streams[d].send_all(_encode_msg(False, mu, o.name, stage, outs[o.name]))
                    if box.grads_needed():
                        continue
                    grads: dict[str, torch.Tensor] = {}
                else:
                    got = box.put_grad(mu, name, src, t)
                    if got is None:
                        continue
                    grads = got
                back = await trio.to_thread.run_sync(functools.partial(ex.backward, mu, grads, loss_scale=1 / N_MICRO))
                src_of = {r.name: r.src for r in prog.recv}
                for n, g in back.items():
                    await streams[src_of[n]].send_all(_encode_msg(True, mu, n, stage, g))
                done += 1
            save_file({k: p.grad.contiguous() for k, p in ex.parameters().items() if p.grad is not None},
                      str(workdir / f"grads{stage}.safetensors"))
            # wait until every peer has finished (closed its side), then close ours
            for stream in streams.values():
                assert isinstance(stream, trio.SocketStream)
                await stream.send_eof()
            nursery.cancel_scope.deadline = trio.current_time() + 10


def test_three_processes_reproduce_single_process_gradients(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    torch.set_num_threads(1)
    m = GPT2(GPT2Config.tiny(n_layer=4, n_embd=32))
    micro = [(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))) for _ in range(N_MICRO)]
    dag = trace(m, micro[0], count_flops=False)
    coarse = coarsen(dag)
    programs = partition(coarse, stages_from_fences(len(coarse.units), [2, 4]))
    assert len(programs) == 3
    for prog in programs:
        (tmp_path / f"stage{prog.stage}.bin").write_bytes(encode_stage(prog))
    save_file({f"{mu}.{name}": t for mu, mb in enumerate(micro) for name, t in zip(dag.data_inputs, mb)},
              str(tmp_path / "data.safetensors"))
    m.zero_grad()
    for idx, tgt in micro:
        out = m(idx, tgt)
        assert isinstance(out, tuple)
        (out[1] / N_MICRO).backward()

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.integration.test_graph_processes", str(tmp_path), str(s)],
                              cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=(tmp_path / f"err{s}.txt").open("w"), text=True) for s in range(3)]
    try:
        ports = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                p.wait(timeout=30)
                pytest.fail(f"worker died: {(tmp_path / f'err{procs.index(p)}.txt').read_text()[-2000:]}")
            ports.append(int(line))
        for p in procs:   # every worker must learn the ports before any of them can finish
            assert p.stdin is not None
            p.stdin.write(json.dumps(ports) + "\n")
            p.stdin.close()
        errors: list[Any] = []
        for i, p in enumerate(procs):
            if p.wait(timeout=120) != 0:
                errors.append((tmp_path / f"err{i}.txt").read_text()[-3000:])
        assert not errors, errors
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    got: dict[str, torch.Tensor] = {}
    for s in range(3):
        got.update(load_file(str(tmp_path / f"grads{s}.safetensors")))
    ref = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert set(got) == set(ref)
    for k, r in ref.items():
        assert (got[k] - r).abs().max().item() <= 1e-6 * r.abs().max().item(), k


if __name__ == "__main__":
    import trio

    trio.run(_worker, Path(sys.argv[1]), int(sys.argv[2]))
