"""Publishing, accepting, planning and running a job: the pieces shared by every swarm flavour.

* :func:`build_job` (publisher): trace + coarsen the model, encode the OP-DAG and the initial weights,
  prepare the dataset, sign the :class:`JobSpec`. Returns the envelope and the content blobs.
* :class:`NodeJobs` (every node): verify a signed envelope, fetch the DAG, weights and data by hash
  through :class:`ContentService` (every blob checked against its hash), decide whether the node fits.
* :func:`choose_plan`: the deterministic plan of a job for a member set (same on every node, so the
  election is a comparison of hashes); ``TrainConfig.replicas`` pins ``R`` replicas per stage.
* :func:`run_local_job`: all members in this trio.run, wired with in-memory TensorChannel pairs; each
  stage replica runs :class:`~fusionp2p.train.worker.StageWorker`. Progress is aggregated per step
  (mean loss of the ``R`` pipelines, summed tokens/s) and handed to ``emit``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import trio
from safetensors.torch import load as load_safetensors_bytes  # safetensors: no pickle, bounded header
from torch import nn

from fusionp2p.data import (
    BatchSampler,
    BuiltinCorpus,
    SamplerConfig,
    ShardedTokens,
    ShardManifest,
    TokenFile,
    corpus_tokens,
)
from fusionp2p.data.corpus import corpus_hash
from fusionp2p.errors import ConfigError, JobError, PeerUnavailable, PlanError, RemoteProtocolError
from fusionp2p.graph import OpDAG, StageExecutor, coarsen, partition, stages_from_fences, to_workload, trace
from fusionp2p.graph.program import StageProgram
from fusionp2p.jobs.checkpoint import StageCheckpointMeta, save_stage
from fusionp2p.jobs.content import ContentService, sha256_hex
from fusionp2p.jobs.events import CheckpointSaved, PlanChanged, ProgressEvent, StepProgress
from fusionp2p.jobs.spec import (
    JobSpec,
    Resources,
    decode_signed,
    new_job_id,
    prepare_dataset,
    sign_spec,
)
from fusionp2p.net.channel import TensorChannel
from fusionp2p.plan import Link, Plan, PlannerConfig, Snapshot, make_plan, plan_even_flops
from fusionp2p.testing.channels import memory_channel_pair
from fusionp2p.train.config import TrainConfig
from fusionp2p.train.worker import StageContext, StageReport, StageWorker
from fusionp2p.types import DeviceProfile
from fusionp2p.wire.dag import decode_dag, encode_dag

log = logging.getLogger(__name__)

Dataset = BuiltinCorpus | TokenFile
LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class BuiltJob:
    """The publisher's result: the signed envelope, the blobs to serve, and the traced DAG."""

    spec: JobSpec
    envelope: bytes
    blobs: dict[str, bytes]
    dag: OpDAG


def _example(dataset: Dataset, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of the real data (the DAG is traced for the micro-batch shape)."""
    tokens = dataset.tokens()
    sampler = BatchSampler(SamplerConfig(num_tokens=len(tokens), seq_len=dataset.seq_len, micro_batch=cfg.micro_batch,
                                         micro_batches=cfg.micro_batches, seed=cfg.seed))
    x = torch.from_numpy(sampler.inputs(tokens, 0, 0))
    y = torch.from_numpy(sampler.targets(tokens, 0, 0))
    return x, y


def trace_job(model: nn.Module, loss: LossFn | None, dataset: Dataset, cfg: TrainConfig) -> OpDAG:
    """Trace *model* for the job: ``model(x, y)`` returning the loss, or ``loss(model(x), y)``."""
    x, y = _example(dataset, cfg)
    if loss is None:
        return trace(model, (x, y))
    return trace(model, (x,), loss, loss_inputs=(y,))


def build_job(model: nn.Module, loss: LossFn | None, dataset: Dataset, cfg: TrainConfig, *, publisher: str,
              sign: Callable[[bytes], bytes], now: float, nonce: bytes, resources: Resources | None = None,
              name: str = "") -> BuiltJob:
    """Trace, encode and sign a job (the publisher's side). ConfigError on a model that cannot be traced."""
    dag = trace_job(model, loss, dataset, cfg)
    if dag.loss is None:
        raise ConfigError("the model returns no loss: return (output, loss) or pass loss=fn(output, target)")
    dag_blob = encode_dag(dag)
    weights = safetensors.torch.save({k: v.detach().contiguous().clone() for k, v in dag.tensors.items()})
    ref, _manifest, data_blobs = prepare_dataset(dataset)
    blobs = {sha256_hex(dag_blob): dag_blob, sha256_hex(weights): weights, **data_blobs}
    spec = JobSpec(job_id=new_job_id(publisher, now, nonce), publisher=publisher, created=now,
                   model_hash=sha256_hex(dag_blob), weights_hash=sha256_hex(weights), dataset=ref, config=cfg,
                   resources=resources or Resources(), name=name)
    return BuiltJob(spec=spec, envelope=sign_spec(spec, sign), blobs=blobs, dag=dag)


@dataclass(kw_only=True)
class AcceptedJob:
    """What a node holds after verifying a job: the spec, the DAG with the published weights, the data."""

    spec: JobSpec
    dag: OpDAG
    tokens: Any       # np.ndarray or ShardedTokens


class NodeJobs:
    """A node's job intake: verify, fetch by hash, check fit. Raises on anything wrong (never hangs)."""

    def __init__(self, content: ContentService, profile: DeviceProfile) -> None:
        self.content = content
        self.profile = profile
        self.max_blob = 2 << 30
        self.fetched: list[str] = []     # hashes fetched from the given peers and not yet provided

    async def accept(self, envelope: bytes, *, peers: Sequence[str] = ()) -> AcceptedJob:
        spec = decode_signed(envelope)    # IntegrityError on a forged/tampered spec
        if not spec.resources.fits(memory_bytes=self.profile.memory_bytes, device_kind=self.profile.kind):
            raise JobError(f"job {spec.job_id}: needs {spec.resources}, this node has {self.profile.kind} "
                           f"with {self.profile.memory_bytes} bytes")
        dag_blob = await self._fetch(spec.model_hash, peers)
        dag = decode_dag(dag_blob)        # RemoteProtocolError on a non-whitelisted operator
        weights = load_safetensors_bytes(await self._fetch(spec.weights_hash, peers))
        if set(weights) != set(dag.tensors):
            raise JobError(f"job {spec.job_id}: the weights do not match the model's tensors")
        dag = dataclasses.replace(dag, tensors={**dag.tensors, **weights})
        ref = spec.dataset
        tokens: Any
        if ref.kind == "builtin":
            if corpus_hash(ref.name) != ref.content_hash:
                raise JobError(f"job {spec.job_id}: this node's built-in corpus {ref.name!r} differs from the publisher's")
            tokens = corpus_tokens(ref.name)
        else:
            manifest = ShardManifest.decode(await self._fetch(ref.content_hash, peers), expected_hash=ref.content_hash)
            tokens = ShardedTokens(manifest)
            for i, h in enumerate(manifest.shards):
                tokens.add(i, await self._fetch(h, peers))
        return AcceptedJob(spec=spec, dag=dag, tokens=tokens)

    async def _fetch(self, h: str, peers: Sequence[str]) -> bytes:
        """From *peers* first (verified, stored; announcing it on the DHT is left to the caller, see
        ``fetched``, because a DHT provide can take seconds), then from the DHT's providers."""
        store = self.content.store
        if store.has(h):
            return store.get(h)
        for peer in peers:
            try:
                blob = await self.content.fetch_from(peer, h, max_size=self.max_blob)
            except (PeerUnavailable, RemoteProtocolError, trio.TooSlowError) as exc:
                log.info("fetch of %s from %s failed: %s", h[:16], peer[:12], exc)
                continue
            store.put(blob)
            self.fetched.append(h)
            return blob
        return await self.content.fetch(h, max_size=self.max_blob)


def choose_plan(spec: JobSpec, dag: OpDAG, members: Mapping[str, DeviceProfile], *,
                links: Mapping[tuple[str, str], Link] | None = None, epoch: int = 0) -> Plan:
    """The job's plan for *members*: a pure function, identical on every node.

    With ``config.replicas = R``: ``len(members) // R`` stages balanced by OP-Fence's compute model over the
    first peers, and ``R`` replicas each (peers in sorted order, stage-major). Otherwise OP-Fence
    decides stages and replicas; replica counts are then trimmed to the smallest one, because a
    replica of one stage talks to exactly one replica of each other stage (pipeline ``r``).
    """
    cfg = spec.config
    peers = sorted(members)
    wl = to_workload(coarsen(dag), micro_batch=cfg.micro_batch)
    pcfg = PlannerConfig(micro_batches=cfg.micro_batches, compression=cfg.adatopk is not None)
    fast = Link(bandwidth_bps=1e9, latency_s=1e-4)
    all_links = dict(links) if links is not None else {(a, b): fast for i, a in enumerate(peers) for b in peers[i + 1:]}
    if cfg.replicas is not None:
        r = cfg.replicas
        s = len(peers) // r
        if s < 1:
            raise PlanError(f"job {spec.job_id}: {r} replicas need at least {r} nodes, {len(peers)} accepted")
        s = min(s, len(wl.units))
        heads = peers[:s]
        snap = Snapshot(job=spec.job_id, epoch=epoch, members={p: members[p] for p in heads},
                        links={k: v for k, v in all_links.items() if k[0] in heads and k[1] in heads})
        base = plan_even_flops(wl, snap, pcfg, seed=cfg.seed) if s > 1 else make_plan(
            wl, snap, dataclasses.replace(pcfg, replicas=False), seed=cfg.seed)
        stages = tuple(dataclasses.replace(st, replicas=tuple(peers[k * r:(k + 1) * r]))
                       for k, st in enumerate(base.stages))
        return dataclasses.replace(base, stages=stages)
    snap = Snapshot(job=spec.job_id, epoch=epoch, members=dict(members), links=all_links)
    plan = make_plan(wl, snap, pcfg, seed=cfg.seed)
    r = min(len(st.replicas) for st in plan.stages)
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, replicas=st.replicas[:r]) for st in plan.stages))


def plan_for_snapshot(spec: JobSpec, dag: OpDAG, snap: Snapshot) -> Plan:
    """:func:`choose_plan` over a swarm snapshot, stamped with that snapshot's hash (for the election)."""
    if snap.job != spec.job_id:
        raise PlanError(f"snapshot of job {snap.job}, not {spec.job_id}")
    plan = choose_plan(spec, dag, snap.members, links=snap.links, epoch=snap.epoch)
    return dataclasses.replace(plan, job=spec.job_id, epoch=snap.epoch, snapshot_hash=snap.snapshot_hash())


def stage_programs(dag: OpDAG, plan: Plan) -> list[StageProgram]:
    """Cut the DAG at the plan's fences."""
    c = coarsen(dag)
    return partition(c, stages_from_fences(len(c.units), [f.unit for f in plan.fences]))


def data_fn(job: AcceptedJob) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """(global step, micro) -> the DAG's data inputs: the first is the token ids, the last the targets."""
    cfg, ref = job.spec.config, job.spec.dataset
    sampler = BatchSampler(SamplerConfig(num_tokens=ref.num_tokens, seq_len=ref.seq_len, micro_batch=cfg.micro_batch,
                                         micro_batches=cfg.micro_batches, seed=cfg.seed))
    names = job.dag.data_inputs
    if len(names) != 2:
        raise ConfigError(f"the model takes data inputs {names}; a job feeds exactly (tokens, targets)")

    def fn(step: int, micro: int) -> dict[str, torch.Tensor]:
        return {names[0]: torch.from_numpy(np.asarray(sampler.inputs(job.tokens, step, micro))),
                names[1]: torch.from_numpy(np.asarray(sampler.targets(job.tokens, step, micro)))}
    return fn


Emit = Callable[[ProgressEvent], Awaitable[None]]


async def run_local_job(jobs: Mapping[str, AcceptedJob], plan: Plan, *, ckpt_root: str | os.PathLike[str],
                        emit: Emit, epoch: int = 0) -> float | None:
    """Run *plan* with every member in this trio.run (in-memory channels). Returns the final eval loss."""
    any_job = next(iter(jobs.values()))
    spec = any_job.spec
    cfg = spec.config
    job_id = spec.job_id
    n_st = len(plan.stages)
    r_count = len(plan.stages[0].replicas)
    programs = stage_programs(any_job.dag, plan)
    await emit(PlanChanged(job=job_id, epoch=epoch, plan_hash=plan.plan_hash(),
                           stage_sizes=tuple(len(s.replicas) for s in plan.stages),
                           members=tuple(p for s in plan.stages for p in s.replicas), at=time.time()))
    compress = cfg.adatopk is not None
    # channels: pipeline r, stages a < b that exchange tensors; replicas of a stage: all pairs
    links: dict[tuple[int, int], dict[int, TensorChannel]] = {(s, r): {} for s in range(n_st) for r in range(r_count)}
    for r in range(r_count):
        for p in programs:
            for src in sorted({x.src for x in p.recv if x.src >= 0}):
                a, b = memory_channel_pair(plan.stages[src].replicas[r], plan.stages[p.stage].replicas[r], window=16)
                links[(src, r)][p.stage] = a
                links[(p.stage, r)][src] = b
    peers: dict[tuple[int, int], list[TensorChannel]] = {k: [] for k in links}
    for s in range(n_st):
        for i in range(r_count):
            for j in range(i + 1, r_count):
                a, b = memory_channel_pair(plan.stages[s].replicas[i], plan.stages[s].replicas[j], window=4)
                peers[(s, i)].append(a)
                peers[(s, j)].append(b)
    reports: dict[int, list[StageReport]] = {}
    final: list[float] = []
    t_start = time.perf_counter()

    async def report(rep: StageReport) -> None:
        if rep.loss is None:
            return
        if rep.eval:
            final.append(rep.loss)
            if len(final) == r_count:
                await emit(StepProgress(job=job_id, step=rep.step, epoch=epoch, stage=n_st - 1, loss=sum(final) / r_count,
                                        tokens_per_s=0.0, at=time.time()))
            return
        got = reports.setdefault(rep.step, [])
        got.append(rep)
        if len(got) == r_count:
            del reports[rep.step]
            toks = sum(x.tokens for x in got)
            wall = max(x.wall_s for x in got)
            await emit(StepProgress(job=job_id, step=rep.step, epoch=epoch, stage=n_st - 1,
                                    loss=sum(x.loss for x in got if x.loss is not None) / r_count,
                                    tokens_per_s=toks / wall if wall > 0 else 0.0,
                                    compute_util=min(1.0, max(x.compute_s / x.wall_s for x in got if x.wall_s > 0)),
                                    at=time.time()))

    def ckpt(stage: int) -> Callable[[int, dict[str, torch.Tensor]], Awaitable[None]]:
        async def save(step: int, state: dict[str, torch.Tensor]) -> None:
            meta = StageCheckpointMeta(job=job_id, stage=stage, num_stages=n_st, step=step, plan_hash=plan.plan_hash())
            await trio.to_thread.run_sync(lambda: save_stage(ckpt_root, meta, state))
            await emit(CheckpointSaved(job=job_id, step=step, stage=stage, peer=plan.stages[stage].replicas[0], at=time.time()))
        return save

    tokens_per_micro = cfg.micro_batch * spec.dataset.seq_len
    async with trio.open_nursery() as nursery:
        for s, prog in enumerate(programs):
            for r in range(r_count):
                peer = plan.stages[s].replicas[r]
                job = jobs[peer]
                rho_out: dict[int, float] = {}
                if compress:
                    if s + 1 < n_st:
                        rho_out[s + 1] = plan.fences[s].rho
                    if s > 0:
                        rho_out[-1 - (s - 1)] = plan.fences[s - 1].rho
                ctx = StageContext(job=job_id, executor=StageExecutor(prog.__class__(**{
                    f.name: getattr(prog, f.name) for f in dataclasses.fields(prog)})), config=cfg, replica=r,
                    replicas=r_count, links=links[(s, r)], peers=peers[(s, r)], data=data_fn(job),
                    tokens_per_micro=tokens_per_micro, rho_out=rho_out, report=report,
                    checkpoint=ckpt(s) if r == 0 else None)
                nursery.start_soon(StageWorker(ctx).run)
    log.info("job %s finished in %.1fs", job_id, time.perf_counter() - t_start)
    return sum(final) / len(final) if final else None


def module_state(dag: OpDAG, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DAG-named tensors -> the traced module's state_dict names (tied weights under every alias)."""
    out: dict[str, torch.Tensor] = {}
    for name, v in values.items():
        for target in dag.module_names.get(name, ()):
            out[target.removeprefix("model.")] = v.detach().contiguous().clone()
    return out


def save_module_state(path: Path, state: Mapping[str, torch.Tensor]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(dict(state), str(path))
    return path


__all__ = ["AcceptedJob", "BuiltJob", "NodeJobs", "build_job", "choose_plan", "data_fn", "module_state",
           "plan_for_snapshot", "run_local_job", "save_module_state", "stage_programs", "trace_job"]
