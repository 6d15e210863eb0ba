"""End to end on the embedded local swarm: publish -> verify/fetch/plan -> pipeline + CO2 -> download."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fusionp2p.data import BatchSampler, BuiltinCorpus, SamplerConfig, corpus_tokens
from fusionp2p.errors import ConfigError, JobError
from fusionp2p.jobs.build import build_job
from fusionp2p.jobs.run import JobRun
from fusionp2p.jobs.spec import Resources
from fusionp2p.models.gpt2 import GPT2, GPT2Config
from fusionp2p.net.channel import TensorChannel, TensorMessage
from fusionp2p.sdk import Swarm
from fusionp2p.train.config import CO2, TrainConfig
from fusionp2p.wire.msg import packb, unpackb

SEQ = 32
TIMEOUT = 240


def _model(seed: int = 0) -> GPT2:
    torch.manual_seed(seed)
    return GPT2(GPT2Config.tiny(block_size=SEQ))


def _sampler(cfg: TrainConfig) -> tuple[BatchSampler, np.ndarray]:
    tokens = corpus_tokens("pydoc")
    return BatchSampler(SamplerConfig(num_tokens=len(tokens), seq_len=SEQ, micro_batch=cfg.micro_batch,
                                      micro_batches=cfg.micro_batches, seed=cfg.seed)), tokens


def _batch(s: BatchSampler, tokens: np.ndarray, step: int, mu: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(s.inputs(tokens, step, mu)), torch.from_numpy(s.targets(tokens, step, mu))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Swarm:
    torch.set_num_threads(1)
    sw = Swarm.local(n_nodes=4, home=tmp_path_factory.mktemp("swarm"))
    yield sw  # type: ignore[misc]
    sw.close()


def test_one_replica_matches_single_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(steps=20, micro_batch=4, micro_batches=3, lr=2e-3, replicas=1, averaging="none",
                      compression="none", schedule="1f1b", seed=3)
    with Swarm.local(n_nodes=2, home=tmp_path) as sw:
        job = sw.publish(model=_model(), dataset=BuiltinCorpus(seq_len=SEQ), config=cfg)
        job.wait(timeout=TIMEOUT)
    ref_model = _model()
    opt = torch.optim.AdamW(ref_model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=0.0)
    s, tokens = _sampler(cfg)
    ref: list[float] = []
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        losses = []
        for mu in range(cfg.micro_batches):
            _, loss = ref_model(*_batch(s, tokens, step, mu))
            (loss / cfg.micro_batches).backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
        ref.append(sum(losses) / len(losses))
    got = [job.losses[i] for i in range(cfg.steps)]
    assert np.max(np.abs(np.array(got) - np.array(ref))) < 1e-4


class _AuditedChannel:
    """A TensorChannel that remembers every tensor it sent, as it was when ``send`` returned."""

    def __init__(self, inner: TensorChannel, sent: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        self.inner, self.sent = inner, sent

    @property
    def remote_peer(self) -> str:
        return self.inner.remote_peer

    async def send(self, msg: TensorMessage) -> None:
        await self.inner.send(msg)
        self.sent.extend((msg.kind, t, t.detach().clone()) for t in msg.tensors)

    async def receive(self) -> TensorMessage:
        return await self.inner.receive()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _audit_sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Every tensor the jobs' channels send from now on: (kind, the tensor, a copy taken at send)."""
    sent: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    open_links = JobRun._open_links

    async def audited(self: JobRun, *args: Any, **kwargs: Any) -> tuple[dict[int, TensorChannel], list[TensorChannel]]:
        links, peers = await open_links(self, *args, **kwargs)
        return ({s: _AuditedChannel(c, sent) for s, c in links.items()}, [_AuditedChannel(c, sent) for c in peers])

    monkeypatch.setattr(JobRun, "_open_links", audited)
    return sent


@pytest.mark.parametrize("averaging", [
    CO2(tau=2, outer_momentum=0.5, penalty="elementwise"),   # streaming CO2: fragment snapshots and anchor shards
    CO2(tau=2, outer_momentum=0.5, stream=False),            # whole-vector one-round-stale CO2
    CO2(tau=2, sync=True),
    "none",                                                  # replicas all-reduce gradients every step
])
def test_sent_tensors_are_never_modified_after_send(swarm: Swarm, monkeypatch: pytest.MonkeyPatch,
                                                    averaging: CO2 | str) -> None:
    """The job system's data-plane channels keep sent tensors by reference for retransmission
    (``NodeJobConfig.channels``: ``copy_on_send=False``). That is only sound while nothing the stage
    worker or the replica averager sends is changed in place afterwards: check every sent tensor at
    the end of a job against its value when ``send`` returned."""
    sent = _audit_sent(monkeypatch)
    cfg = TrainConfig(steps=5, micro_batch=2, micro_batches=2, lr=3e-3, replicas=2, averaging=averaging,
                      compression="adatopk", seed=5)
    job = swarm.publish(model=_model(), dataset=BuiltinCorpus(seq_len=SEQ), config=cfg)
    job.wait(timeout=TIMEOUT)
    kinds = {k for k, _, _ in sent}
    assert {"act", "grad", "grad-avg" if averaging == "none" else "avg"} <= kinds, kinds
    changed = [(k, i) for i, (k, t, was) in enumerate(sent) if not torch.equal(t, was)]
    assert changed == [], f"{len(changed)} of {len(sent)} sent tensors were modified after send: {changed[:5]}"


def test_a_bf16_job_trains_with_bf16_on_the_wire(swarm: Swarm, monkeypatch: pytest.MonkeyPatch) -> None:
    """``TrainConfig(precision="bf16")`` end to end (issue 39): planned, trained through compressed fences
    and CO2 to the end; activations and gradients cross the fences in bf16, the averaging in fp32 and bf16
    differences (CO2.wire), and the downloaded weights are fp32 (master weights)."""
    sent = _audit_sent(monkeypatch)
    cfg = TrainConfig(steps=5, micro_batch=2, micro_batches=2, lr=3e-3, replicas=2, averaging="co2",
                      compression="adatopk", seed=5, precision="bf16")
    job = swarm.publish(model=_model(), dataset=BuiltinCorpus(seq_len=SEQ), config=cfg)
    job.wait(timeout=TIMEOUT)
    assert len(job.losses) == cfg.steps and all(np.isfinite(v) for v in job.losses.values())
    fence = {t.dtype for k, t, _ in sent if k in ("act", "grad") and t.is_floating_point()}
    assert fence == {torch.bfloat16}, fence
    assert all(t.dtype == torch.float32 for t in job.state_dict().values() if t.is_floating_point())


def test_tampered_spec_is_refused(swarm: Swarm) -> None:
    cfg = TrainConfig(steps=2, micro_batch=2, micro_batches=1)
    built = build_job(_model(), None, BuiltinCorpus(seq_len=SEQ), cfg, publisher=swarm.publisher_id, sign=swarm.sign,
                      now=1.0, nonce=b"n" * 16)
    # the publisher's signature over a spec whose training config was changed afterwards
    env = unpackb(built.envelope, max_size=1 << 20)
    forged = dataclasses.replace(built.spec, config=dataclasses.replace(cfg, steps=3))
    bad = packb({**env, "spec": forged.encode()})
    job = swarm.publish_built(dataclasses.replace(built, envelope=bad))
    with pytest.raises(JobError, match=r"no node accepted the job .*signature does not verify against publisher"):
        job.wait(timeout=TIMEOUT)


def test_hash_mismatch_is_refused(swarm: Swarm) -> None:
    cfg = TrainConfig(steps=2, micro_batch=2, micro_batches=1)
    built = build_job(_model(seed=77), None, BuiltinCorpus(seq_len=SEQ), cfg, publisher=swarm.publisher_id,
                      sign=swarm.sign, now=2.0, nonce=b"m" * 16)
    # the publisher serves weights that are not the ones the signed spec names
    other = build_job(_model(seed=5), None, BuiltinCorpus(seq_len=SEQ), cfg, publisher=swarm.publisher_id,
                      sign=swarm.sign, now=2.0, nonce=b"m" * 16)
    blobs = {h: b for h, b in built.blobs.items() if h != built.spec.weights_hash}
    blobs.update({other.spec.weights_hash: other.blobs[other.spec.weights_hash]})
    job = swarm.publish_built(dataclasses.replace(built, blobs=blobs))
    with pytest.raises(JobError, match="no node accepted"):
        job.wait(timeout=TIMEOUT)


def test_job_no_node_fits_fails_fast(swarm: Swarm) -> None:
    cfg = TrainConfig(steps=2, micro_batch=2, micro_batches=1)
    job = swarm.publish(model=_model(), dataset=BuiltinCorpus(seq_len=SEQ), config=cfg,
                        resources=Resources(min_memory_bytes=1 << 50))
    with pytest.raises(JobError, match="needs"):
        job.wait(timeout=TIMEOUT)


class _Weird(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.fft.rfft(self.emb(x).float(), dim=-1).abs()
        return F.cross_entropy(h.reshape(-1, h.shape[-1]).repeat(1, 52)[:, :256], y.reshape(-1))


def test_non_whitelisted_operator_is_refused(swarm: Swarm) -> None:
    with pytest.raises(ConfigError, match="whitelist"):
        swarm.publish(model=_Weird(), dataset=BuiltinCorpus(seq_len=SEQ), config=TrainConfig(steps=1, micro_batch=2,
                                                                                            micro_batches=1))
