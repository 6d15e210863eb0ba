"""The device through a stage without a GPU (issue 39): stages run on the ``meta`` device, a stand-in for
CUDA that holds no data and, like CUDA, refuses to mix with host tensors in a kernel. Every boundary
goes through ``fusionp2p.device``; a host tensor that reached a device stage unchecked would raise here
the way it would on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fusionp2p import device as dev
from fusionp2p.compress.codec import TopKCodec, decode, kept_mask
from fusionp2p.compress.select import _select_torch, pack_bits, select_topk
from fusionp2p.errors import LocalProtocolError
from fusionp2p.graph import StageExecutor, coarsen, partition, stages_from_fences, trace
from fusionp2p.graph.executor import tied_sum
from fusionp2p.graph.program import StageProgram
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.train.averager import flatten
from fusionp2p.train.boundary import encode_boundary
from fusionp2p.wire.tensor import encode_tensor

META = torch.device("meta")


def _two_stages() -> tuple[list[StageProgram], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT2(GPT2Config.tiny(vocab_size=64, n_layer=1, n_embd=16, block_size=8))
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    dag = trace(model, example_inputs=(x, y))
    c = coarsen(dag)
    return partition(c, stages_from_fences(len(c.units), [len(c.units) // 2])), dict(zip(dag.data_inputs, (x, y)))


def test_the_helpers_move_check_and_copy_back() -> None:
    h = torch.arange(6.0).view(2, 3)
    m = dev.to_device(h, META)
    assert m.device == META and m.shape == h.shape
    assert dev.to_device(h, torch.device("cpu")) is h                    # nothing to do: the tensor itself
    assert dev.to_device(h, torch.device("cpu"), dtype=torch.bfloat16).dtype == torch.bfloat16
    assert dev.check(m, META, "x") is m
    with pytest.raises(dev.DeviceMismatch, match="a gradient is on cpu, but the stage computes on meta"):
        dev.check(h, META, "a gradient")
    back = dev.to_host([m, h])
    assert back[0].device.type == "cpu" and back[0].shape == (2, 3) and back[1].data_ptr() == h.data_ptr()   # no copy
    assert dev.same(torch.device("cuda"), torch.device("cuda:0")) and not dev.same(torch.device("cuda:1"), torch.device("cuda:0"))
    assert dev.resolve("cuda") == torch.device("cuda:0") or torch.cuda.is_available()
    dev.sync(META)   # no-op off CUDA
    with pytest.raises(LocalProtocolError, match="reached the wire encoder"):
        encode_tensor(m)   # never a blocking copy per tensor on the event loop


def test_a_stage_on_a_device_keeps_everything_there() -> None:
    (p0, p1), data = _two_stages()
    s0, s1 = StageExecutor(p0, device="meta"), StageExecutor(p1, device="meta")
    assert all(p.device == META for p in [*s0.parameters().values(), *s1.parameters().values()])
    # inputs arrive from the data loader and the wire as host tensors: the executor moves them
    out0 = s0.forward(0, {r.name: data[r.name] for r in p0.recv})
    assert out0 and all(t.device == META for t in out0.values())
    wire = dict(zip(out0, dev.to_host(list(out0.values()))))   # what stage 1 receives
    in1 = {r.name: wire[r.name] if r.name in wire else data[r.name] for r in p1.recv}
    out1 = s1.forward(0, in1)
    assert p1.loss is not None and out1[p1.loss].device == META
    g1 = s1.backward(0, {}, loss_scale=0.5)
    assert g1 and all(g.device == META for g in g1.values())
    g0 = s0.backward(0, dict(zip(g1, dev.to_host(list(g1.values())))))
    assert all(g.device == META for g in g0.values())
    for s in (s0, s1):   # the parameter gradients, which the optimizer, tied sums and all-reduce read
        assert all(p.grad is not None and p.grad.device == META for p in s.parameters().values() if p.requires_grad)
    opt = torch.optim.AdamW(list(s0.parameters().values()), lr=1e-3)
    opt.step()           # the optimizer state lives beside the parameters
    assert all(v.device == META for st in opt.state.values() for k, v in st.items() if k != "step")


def test_tied_sums_refuse_a_host_part_on_a_device() -> None:
    a, b = torch.ones(3, device="meta"), torch.ones(3, device="meta")
    assert tied_sum([a, None, b]).device == META   # type: ignore[union-attr]
    # torch itself lets an in-place add of a host tensor into a meta one through (CUDA would raise):
    # the sum checks its parts
    with pytest.raises(dev.DeviceMismatch):
        tied_sum([a, torch.ones(3)])


def test_topk_selects_on_the_tensors_device_and_packs_bits_like_numpy() -> None:
    vals, idx, bits = select_topk(torch.randn(1000, device="meta"), 100, approx=True,
                                  generator=torch.Generator(), index_dtype=torch.int16, bitmap=True)
    assert vals.device == META and vals.shape == (100,)
    assert idx is not None and idx.device == META and idx.dtype == torch.int16
    assert bits is not None and bits.device == META and bits.shape == (125,)
    # the torch path is the exact selection (checked on the host against the numpy one)
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(1))
    for k in (0, 1, 777, 10_001):
        tv, ti, tb = _select_torch(x, k, index_dtype=torch.int32, bitmap=True)
        nv, ni, nb = select_topk(x, k, approx=False, index_dtype=torch.int32, bitmap=True)
        assert torch.equal(tv, nv) and torch.equal(ti, ni) and torch.equal(tb, nb)   # type: ignore[arg-type]
    mask = torch.rand(13) > 0.5
    assert np.array_equal(pack_bits(mask).numpy(), np.packbits(mask.numpy(), bitorder="little"))


def test_a_compressed_message_leaves_a_device_stage_as_host_tensors() -> None:
    x = torch.randn(4, 64, device="meta")
    payload, _ = TopKCodec(ratio=0.1).encode(x)
    assert all(t.device == META for t in payload)        # compressed where it was computed
    meta, tensors = encode_boundary(x, 0.1)
    assert meta["codec"] == "topk" and all(t.device.type == "cpu" for t in tensors)
    assert decode(tensors, meta).shape == (4, 64)
    mask = kept_mask(tensors, meta)                      # the receiver's keep-mask, moved to its gradient
    g = torch.ones(4, 64, device="meta")
    assert mask is not None and (g * dev.to_device(mask, g.device)).device == META
    assert encode_boundary(x, 1.0)[1][0].device.type == "cpu"


def test_the_averaging_state_lives_on_the_host() -> None:
    params = [torch.ones(3, device="meta"), torch.ones(2, 2, device="meta")]
    flat = flatten(params)
    assert flat.device.type == "cpu" and flat.shape == (7,)


def test_the_node_job_config_takes_the_node_device() -> None:
    from fusionp2p.errors import ConfigError
    from fusionp2p.jobs.node import NodeJobConfig

    assert NodeJobConfig().device == "cpu" and NodeJobConfig(device="cuda:1").device == "cuda:1"
    for bad in ("tpu", "meta", "cuda:x"):
        with pytest.raises(ConfigError, match="device must be cpu or cuda:N"):
            NodeJobConfig(device=bad)
