"""Publishing from a safetensors file with the model on ``meta`` (issue 37, ``jobs/publish_file.py``): the same
manifest, byte for byte, as publishing the module that holds those values; bad files refused with what to do;
trained to the same losses as single-process training of the same weights; and the publisher's peak memory
far under the weights' size (measured in a fresh process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

from fusionp2p import empty_parameters
from fusionp2p.data import BuiltinCorpus, Examples
from fusionp2p.data.stream import ExampleOrder, OrderConfig
from fusionp2p.errors import ConfigError
from fusionp2p.jobs.build import BuiltJob, build_job
from fusionp2p.jobs.events import PlanChanged
from fusionp2p.net.identity import Identity
from fusionp2p.sdk import Swarm
from fusionp2p.train.config import TrainConfig

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

V, SEQ, N = 256, 16, 96


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)   # type: ignore[no-any-return]


def _gpt2() -> nn.Module:   # lm_head tied to wte: saved once in the file
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)   # type: ignore[no-any-return]


def _data() -> Examples:
    return Examples.causal_lm(BuiltinCorpus(seq_len=SEQ).tokens()[: N * SEQ].astype(np.int64), SEQ, holdout=16)


CFG = TrainConfig(steps=3, micro_batch=4, micro_batches=2, optimizer="sgd", lr=0.3, momentum=0.9, replicas=1,
                  averaging="none", seed=0)


ME = Identity.generate()


def _build(model: nn.Module, **kw: Any) -> BuiltJob:
    return build_job(model, None, _data(), CFG, publisher=ME.peer_id, sign=ME.sign, now=1.0, nonce=b"n" * 16,
                     piece_bytes=4096, **kw)


@pytest.mark.parametrize("make", [_llama, _gpt2])
def test_file_publishes_the_same_manifest_as_the_module(make: Callable[[], nn.Module], tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = make()
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_model(model, str(path))   # a tied weight is saved once, under one of its names
    with empty_parameters():
        lazy = make()
    assert all(p.device.type == "meta" for p in lazy.parameters())
    assert all(b.device.type == "cpu" for b in lazy.buffers())
    ours, theirs = _build(model), _build(lazy, weights=path)
    assert theirs.spec.weights_hash == ours.spec.weights_hash   # every piece's hash, byte for byte
    assert theirs.spec.model_hash == ours.spec.model_hash
    for h, blob in theirs.blobs.items():
        assert bytes(blob) == bytes(ours.blobs[h])


def test_bad_weights_are_refused_with_what_to_do(tmp_path: Path) -> None:
    torch.manual_seed(0)
    with empty_parameters():
        lazy = _llama()
    with pytest.raises(ConfigError, match="on the meta device: pass weights="):
        _build(lazy)
    state = _llama().state_dict()
    safetensors.torch.save_file(state, str(tmp_path / "full.safetensors"))
    short = tmp_path / "short.safetensors"
    safetensors.torch.save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(short))
    with pytest.raises(ConfigError, match=r"lacks 1 tensors .*lm_head\.weight"):
        _build(lazy, weights=short)
    half = tmp_path / "half.safetensors"
    safetensors.torch.save_file({k: v.half() for k, v in state.items()}, str(half))
    with pytest.raises(ConfigError, match=r"torch\.float16 .* torch\.float32 .* file.s configuration and dtype"):
        _build(lazy, weights=half)
    with torch.device("meta"):   # buffers on meta too: Llama's rotary inv_freq is in no state_dict file
        all_meta = _llama()
    with pytest.raises(ConfigError, match=r"lacks 2 tensors .*inv_freq.*empty_parameters"):
        _build(all_meta, weights=short.with_name("full.safetensors"))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match="not a safetensors file"):
        _build(lazy, weights=junk)


def test_meta_model_from_file_trains_to_the_single_process_losses(tmp_path: Path) -> None:
    """Two stages train the weights of the file, the model on meta, to the losses single-process training of
    the same weights has (the in-memory path's own test: test_models_hf.py)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    ref = _gpt2()
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_model(ref, str(path))
    data = _data()
    opt = torch.optim.SGD(ref.parameters(), lr=CFG.lr, momentum=CFG.momentum)
    order = ExampleOrder(data.shards()[0], OrderConfig(micro_batch=CFG.micro_batch, micro_batches=CFG.micro_batches,
                                                       seed=CFG.seed), ((0, CFG.micro_batches),))
    ref_losses = []
    for step in range(CFG.steps):
        opt.zero_grad()
        total = 0.0
        for mu in range(CFG.micro_batches):
            batch = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in data.batch(order.indices(step, mu)).items()}
            loss = ref(**batch).loss
            (loss / CFG.micro_batches).backward()
            total += loss.item()
        ref_losses.append(total / CFG.micro_batches)
        opt.step()
    with empty_parameters():
        lazy = _gpt2()
    with Swarm.local(n_nodes=2, home=tmp_path / "swarm") as swarm:
        job = swarm.publish(model=lazy, dataset=data, config=CFG, name="from-file", weights=path)
        events = list(job.events(timeout=300))
        job.wait(timeout=1)
        state = job.state_dict()
    assert next(e for e in events if isinstance(e, PlanChanged)).stage_sizes == (1, 1)
    assert [job.losses[s] for s in range(CFG.steps)] == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=k)


_PUBLISHER = textwrap.dedent("""
    import resource, sys, torch, transformers
    from fusionp2p import empty_parameters
    from fusionp2p.data import BuiltinCorpus, Examples
    from fusionp2p.jobs.build import build_job
    from fusionp2p.net.identity import Identity
    from fusionp2p.train.config import TrainConfig

    def status(key):
        line = next(ln for ln in open("/proc/self/status") if ln.startswith(key))
        return int(line.split()[1]) * 1024

    def build(vocab, weights):
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
        with empty_parameters():
            model = transformers.LlamaForCausalLM(cfg)
        return build_job(model, None, data, TrainConfig(steps=1, micro_batch=2, micro_batches=2),
                         publisher=me.peer_id, sign=me.sign, now=1.0, nonce=b"n" * 16, weights=weights)

    me = Identity.generate()
    data = Examples.causal_lm(BuiltinCorpus(seq_len=16).tokens()[:96 * 16].astype("int64"), 16, holdout=16)
    build(256, sys.argv[2])   # torch.export's own code and caches load once (about 50 MiB, whatever the model)
    open("/proc/self/clear_refs", "w").write("5")   # the peak from here on (Linux)
    before = status("VmRSS")
    built = build(32000, sys.argv[1])
    print(status("VmHWM") - before, sum(len(b) for b in built.blobs.values()))
""")


@pytest.mark.slow
def test_publisher_peak_is_far_under_the_weights(tmp_path: Path) -> None:
    """A Llama of 140 MB of weights published from its file, the model on meta: the publisher's resident set
    rises by a small part of the weights (the trace's activations, the manifest, one read buffer; measured in a
    fresh process, VmHWM reset just before, after a first small publish loaded torch.export). In memory the
    module alone is the weights' size."""
    def cfg(vocab: int) -> Any:
        return transformers.LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)

    path, small = tmp_path / "model.safetensors", tmp_path / "small.safetensors"
    model = transformers.LlamaForCausalLM(cfg(32000))
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    safetensors.torch.save_model(model, str(path))
    del model
    safetensors.torch.save_model(transformers.LlamaForCausalLM(cfg(256)), str(small))
    got = subprocess.run([sys.executable, "-c", _PUBLISHER, str(path), str(small)], capture_output=True, text=True,
                         timeout=300, check=True)
    rise, served = (int(x) for x in got.stdout.split())
    assert served >= weights > 100 << 20
    assert rise < 0.15 * weights, f"the publisher's peak rose {rise >> 20} MiB for {weights >> 20} MiB of weights"
