"""Publishing, accepting, planning and running a job: the pieces shared by every swarm flavour.

* :func:`build_job` (publisher): trace + coarsen the model, encode the OP-DAG and the initial weights,
  prepare the dataset, sign the :class:`JobSpec`. Returns the envelope and the content blobs.
* :class:`NodeJobs` (every node): verify a signed envelope, fetch the DAG, weights and data by hash
  through :class:`ContentService` (every blob checked against its hash), decide whether the node fits.
* :func:`choose_plan`: the deterministic plan of a job for a member set (same on every node, so the
  election is a comparison of hashes): stages, replicas and AdaTopK ratios chosen together from the
  links; ``TrainConfig.replicas`` is a hint and a bound for the replica count.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import trio
from torch import nn

from fusionp2p.data import (
    BatchSampler,
    BuiltinCorpus,
    ExampleManifest,
    Examples,
    SamplerConfig,
    ShardedExamples,
    ShardedTokens,
    ShardManifest,
    TokenFile,
    corpus_tokens,
)
from fusionp2p.data.corpus import corpus_hash
from fusionp2p.data.file_shards import FileRange
from fusionp2p.data.hf import HFTokens
from fusionp2p.data.shards import DEFAULT_SHARD_TOKENS
from fusionp2p.data.url import TokenURL, check_url
from fusionp2p.errors import ConfigError, JobError, PeerUnavailable, PlanError, RemoteProtocolError
from fusionp2p.graph import CoarseDAG, OpDAG, Ref, coarsen, partition, stages_from_fences, to_workload, trace
from fusionp2p.graph.program import StageProgram
from fusionp2p.graph.trace import with_flops
from fusionp2p.jobs.accepted import AcceptedJob
from fusionp2p.jobs.content import ContentService, sha256_hex
from fusionp2p.jobs.data_shards import StreamFeed, window_bytes
from fusionp2p.jobs.publish_file import file_manifest, stand_ins
from fusionp2p.jobs.spec import (
    JobSpec,
    Resources,
    decode_signed,
    new_job_id,
    prepare_dataset,
    sign_spec,
)
from fusionp2p.jobs.verified import SPOT_BOUNDARY_STEPS, SPOT_STATE_COPIES
from fusionp2p.plan import (
    InfeasiblePlanError,
    Link,
    Plan,
    PlannerConfig,
    Snapshot,
    plan_even_flops,
    plan_even_layers,
    plan_joint,
)
from fusionp2p.plan.estimator import CostModel, bf16_pays
from fusionp2p.train.config import TrainConfig
from fusionp2p.types import DeviceProfile, WorkloadGraph, short_peer
from fusionp2p.wire.dag import decode_dag, encode_dag
from fusionp2p.wire.limits import DEFAULT_LIMITS
from fusionp2p.wire.pieces import (
    DEFAULT_PIECE_BYTES,
    WeightManifest,
    check_against,
    make_manifest,
)
from fusionp2p.wire.pieces import (
    MAX_MANIFEST_BYTES as MAX_WEIGHT_MANIFEST_BYTES,
)

log = logging.getLogger(__name__)

Dataset = BuiltinCorpus | TokenFile | Examples | TokenURL
LossFn = Callable[..., torch.Tensor]


def as_dataset(dataset: Any) -> Dataset:
    """The dataset a user gave ``publish``: a dataset object, or a path to a ``.npz``/``.safetensors``
    file of named arrays (one row per example). ConfigError saying what to give otherwise."""
    if isinstance(dataset, BuiltinCorpus | TokenFile | Examples | TokenURL):
        return dataset
    if isinstance(dataset, HFTokens):   # streamed and tokenised into a token file, here, once (data/hf.py)
        return dataset.token_file()
    if isinstance(dataset, str | os.PathLike):
        p = Path(dataset)
        if p.suffix in (".npz", ".safetensors"):
            return Examples.load(p)
        raise ConfigError(f"dataset {str(dataset)!r}: a path must name a .npz or .safetensors file of named arrays; "
                          "for tokens give fusionp2p.data.TokenFile(path, seq_len=...), for text "
                          "TokenFile(path, seq_len=..., kind='text')")
    raise ConfigError(f"dataset must be BuiltinCorpus, TokenFile, TokenURL, HFTokens, Examples or a .npz/.safetensors path, "
                      f"not {type(dataset).__name__}")


def _loss_params(loss: LossFn) -> set[str]:
    """Names a loss function takes after the model output (what it receives by name from a batch)."""
    try:
        params = list(inspect.signature(loss).parameters.values())
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def split_fields(names: Sequence[str], loss: LossFn | None) -> tuple[list[str], list[str]]:
    """(fields for the model, fields for the loss function): the loss gets those its signature names."""
    if loss is None:
        return list(names), []
    wanted = _loss_params(loss)
    return [n for n in names if n not in wanted], [n for n in names if n in wanted]


@dataclass(frozen=True, slots=True, kw_only=True)
class BuiltJob:
    """The publisher's result: the signed envelope, the blobs to serve, and the traced DAG."""

    spec: JobSpec
    envelope: bytes
    # the weight pieces: views of the module's tensors (make_manifest); a token file's shards: ranges of the file
    blobs: dict[str, bytes | memoryview | FileRange]
    dag: OpDAG


def _example(dataset: BuiltinCorpus | TokenFile | TokenURL, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of the real data: its first windows (the DAG is traced for the micro-batch shape;
    a sampler's permutation of every window would take 16 bytes a window, 512 MiB for a 2 GiB text file)."""
    tokens, t = dataset.tokens(), dataset.seq_len
    starts = (np.arange(cfg.micro_batch) % ((len(tokens) - 1) // t)) * t
    x = torch.from_numpy(np.stack([np.asarray(tokens[s:s + t], dtype=np.int64) for s in starts]))
    y = torch.from_numpy(np.stack([np.asarray(tokens[s + 1:s + t + 1], dtype=np.int64) for s in starts]))
    return x, y


def trace_job(model: nn.Module, loss: LossFn | None, dataset: Dataset, cfg: TrainConfig) -> OpDAG:
    """Trace *model* for the job: ``model(x, y)`` returning the loss, or ``loss(model(x), y)``; for
    :class:`Examples`, ``model(**batch)`` returning the loss, or ``loss(model(**rest), **named)`` where
    *named* are the fields the loss function's signature names. The data's token ids are checked
    against the model's embeddings (:func:`check_vocab`) before the traced graph first runs."""
    if isinstance(dataset, Examples):
        if dataset.num_examples - dataset.num_holdout < cfg.micro_batch:
            raise ConfigError(f"the dataset has {dataset.num_examples - dataset.num_holdout} training examples, "
                              f"fewer than micro_batch={cfg.micro_batch}")
        batch = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in dataset.batch(range(cfg.micro_batch)).items()}
        to_model, to_loss = split_fields(list(batch), loss)
        if loss is None:
            dag = trace(model, batch, count_flops=False)
        elif not to_model:
            raise ConfigError(f"every field {sorted(batch)} goes to the loss function; the model gets none")
        else:
            dag = trace(model, {k: batch[k] for k in to_model}, loss, loss_inputs={k: batch[k] for k in to_loss},
                        count_flops=False)
        args = tuple(batch[k] for k in dag.data_inputs)
    else:
        x, y = _example(dataset, cfg)
        dag = trace(model, (x, y), count_flops=False) if loss is None else trace(
            model, (x,), loss, loss_inputs=(y,), count_flops=False)
        args = (x, y)
    check_vocab(dag, dataset)
    return with_flops(dag, args)


_PASS_THROUGH = frozenset({"aten.reshape.default", "aten.view.default", "aten.clone.default", "aten.contiguous.default",
                           "aten.alias.default", "aten.detach.default", "aten.unsqueeze.default", "aten.squeeze.dim",
                           "aten.flatten.using_ints", "aten.slice.Tensor", "aten.select.int", "aten.to.dtype",
                           "aten.to.dtype_layout", "aten.pad.default"})
_CLASS_LOSSES = frozenset({"aten.cross_entropy_loss.default", "aten.nll_loss.default"})


def _data_field(dag: OpDAG, by_name: Mapping[str, Any], arg: Any) -> str | None:
    """The data input an argument reads through reshapes, slices, casts and pads, or None."""
    while isinstance(arg, Ref) and arg.name in by_name and by_name[arg.name].op in _PASS_THROUGH:
        arg = by_name[arg.name].args[0]
    return arg.name if isinstance(arg, Ref) and arg.name in dag.data_inputs else None


def _id_range(dag: OpDAG, dataset: Dataset, name: str, ignore: int | None) -> tuple[int, int] | None:
    """(smallest, largest) id of data field *name*, *ignore* left out; None for a field that holds no
    integer ids (or only *ignore*). A token file is scanned a chunk at a time (never whole in memory)."""
    if isinstance(dataset, Examples):
        ids = dataset.arrays.get(name)
    elif name in dag.data_inputs[:2]:   # the inputs, or the targets: the same tokens, shifted
        if isinstance(dataset, TokenFile):
            lo, hi = dataset.id_range(ignore)
            return None if hi < lo else (lo, hi)
        ids = dataset.tokens()
    else:
        return None
    if ids is None or not ids.size or not np.issubdtype(ids.dtype, np.integer):
        return None
    kept = ids[ids != ignore] if ignore is not None else ids
    return (int(kept.min()), int(kept.max())) if kept.size else None


def check_vocab(dag: OpDAG, dataset: Dataset) -> None:
    """Refuse, before training, data the model cannot take: token ids an embedding cannot look up (an
    id outside ``[0, rows)`` of the table it feeds), and class labels outside ``[0, classes)`` of the
    loss they feed (``ignore_index`` aside). Said as what it is: the data and the model disagree."""
    by_name = {n.name: n for n in dag.nodes}
    for n in dag.nodes:
        if n.op == "aten.embedding.default" and len(n.args) >= 2:
            table, what = n.args[0], "embedding"
        elif n.op in _CLASS_LOSSES and len(n.args) >= 2:
            table, what = n.args[0], "loss"
        else:
            continue
        name = _data_field(dag, by_name, n.args[1])
        if not isinstance(table, Ref) or name is None:
            continue
        meta = dag.meta_of(table.name)
        if meta is None or not meta.shape:
            continue
        if what == "embedding":
            rows = meta.shape[0]
            found = _id_range(dag, dataset, name, None)
            if found is None:
                continue
            lo, hi = found
            if lo < 0 or hi >= rows:
                raise ConfigError(f"the dataset's {name} holds token ids in [{lo}, {hi}], but the model's embedding "
                                  f"{table.name} has {rows} rows: the data and the model disagree (tokenize with the "
                                  f"model's tokenizer, or give the model a vocabulary of at least {hi + 1})")
            continue
        classes = meta.shape[1] if len(meta.shape) >= 2 else meta.shape[0]
        ignore = dict(n.kwargs).get("ignore_index", n.args[4] if len(n.args) > 4 else -100)
        found = _id_range(dag, dataset, name, ignore if isinstance(ignore, int) else None)
        if found is not None and (found[0] < 0 or found[1] >= classes):
            raise ConfigError(f"the dataset's {name} holds labels in [{found[0]}, {found[1]}], but the "
                              f"model's loss takes {classes} classes: the data and the model disagree (set the "
                              f"model's number of labels, or mark ignored positions with {ignore})")


def build_job(model: nn.Module, loss: LossFn | None, dataset: Dataset | HFTokens | str | os.PathLike[str], cfg: TrainConfig, *, publisher: str,
              sign: Callable[[bytes], bytes], now: float, nonce: bytes, resources: Resources | None = None,
              name: str = "", piece_bytes: int = DEFAULT_PIECE_BYTES, shard_tokens: int = DEFAULT_SHARD_TOKENS,
              weights: str | os.PathLike[str] | None = None) -> BuiltJob:
    """Trace, encode and sign a job (the publisher's side). ConfigError on a model that cannot be traced.

    The DAG travels without its tensors; they travel as content-addressed pieces of at most
    *piece_bytes* (``wire/pieces.py``), named in the weight manifest whose hash the spec signs
    (``weights_hash``), so that each node fetches only the pieces of its own stage. With *weights* (a
    safetensors file), the tensors' values come from that file a piece at a time, and the model's
    parameters may be on the ``meta`` device (``jobs/publish_file.py``): weights larger than the publisher's
    memory."""
    dataset = as_dataset(dataset)
    if weights is None and any(p.device.type == "meta" for p in model.parameters()):
        raise ConfigError("the model's parameters are on the meta device: pass weights= the safetensors file they are in")
    with stand_ins(model) as placeholders:
        dag = trace_job(model, loss, dataset, cfg)
    if placeholders:   # the DAG declares them (meta); their values come from the file
        dag = dataclasses.replace(dag, tensors={n: t.to("meta") if t.numel() and t.data_ptr() in placeholders else t
                                                for n, t in dag.tensors.items()})
    if dag.loss is None:
        raise ConfigError("the model returns no loss: return (output, loss) or pass loss=fn(output, target)")
    dag_blob = encode_dag(dag, weights=False)
    pieces: Mapping[str, bytes | memoryview | FileRange]
    if weights is not None:
        manifest, pieces = file_manifest(dag, weights, piece_bytes)
    else:
        manifest, pieces = make_manifest(dag.tensors, piece_bytes, copy=False)   # no second copy of the weights
    man_blob = manifest.encode()
    ref, _manifest, data_blobs = prepare_dataset(dataset, shard_tokens=shard_tokens)
    blobs: dict[str, bytes | memoryview | FileRange] = {sha256_hex(dag_blob): dag_blob, manifest.content_hash: man_blob, **pieces,
                                            **data_blobs}
    spec = JobSpec(job_id=new_job_id(publisher, now, nonce), publisher=publisher, created=now,
                   model_hash=sha256_hex(dag_blob), weights_hash=manifest.content_hash, dataset=ref, config=cfg,
                   resources=resources or Resources(), name=name)
    return BuiltJob(spec=spec, envelope=sign_spec(spec, sign), blobs=blobs, dag=dag)


MAX_MANIFEST_BYTES = 16 << 20   # a ShardManifest of MAX_SHARDS (1e5) hashes is about 7 MB
EXAMPLE_MANIFEST_BYTES = 8 << 20


# a job's DAG travels without tensors: its header and the fixed head (wire/dag.py)
MAX_DAG_BLOB = DEFAULT_LIMITS.max_dag_header + 64


class NodeJobs:
    """A node's job intake: verify, fetch by hash, check fit. Raises on anything wrong (never hangs).

    Every fetch is bounded by what is known before it (issue 15, item 8: each blob could be up to
    2 GiB): the DAG (without tensors) by its header's limit, the weight manifest by its format, a dataset
    manifest by its format. No dataset shard (tokens or examples) is fetched here: the reading stages stream
    their replica's, each at its exact size (``jobs/data_shards.py``), and a node checks here that the window
    fits its memory. No weight piece is
    fetched here: the node fetches its stage's once the plan names it (``jobs/weights.py``), and its
    memory is held against that stage, not the whole model (issue 37).
    """

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
        memory = self.profile.memory_bytes
        dag_blob = await self._fetch(spec.model_hash, peers, max_size=MAX_DAG_BLOB)
        # RemoteProtocolError on a non-whitelisted operator or a graph over the structure limits; its memory
        # is checked per stage once the plan names one (jobs/weights.py: stage_fit).
        # In a worker thread: the first validation in a process imports torch's meta kernels (800 modules,
        # 1.6 CPU-s), which on the event loop held up the node's heartbeats and gossip long enough, on a
        # loaded machine, for it to declare every peer dead and be declared dead (a spurious re-plan)
        dag = await trio.to_thread.run_sync(lambda: decode_dag(dag_blob))
        if any(t.device.type != "meta" for t in dag.tensors.values()):
            raise RemoteProtocolError(f"job {spec.job_id}: its graph carries tensors; a job's travel as pieces")
        weights = WeightManifest.decode(await self._fetch(spec.weights_hash, peers, max_size=MAX_WEIGHT_MANIFEST_BYTES),
                                        expected_hash=spec.weights_hash)
        check_against(weights, {s.name: (s.meta.dtype, s.meta.shape) for s in dag.inputs if s.kind != "input"})
        ref = spec.dataset
        tokens: Any
        if ref.kind == "builtin":
            if corpus_hash(ref.name) != ref.content_hash:
                raise JobError(f"job {spec.job_id}: this node's built-in corpus {ref.name!r} differs from the publisher's")
            tokens = corpus_tokens(ref.name)
        elif ref.kind == "examples":
            eman = ExampleManifest.decode(await self._fetch(ref.content_hash, peers, max_size=EXAMPLE_MANIFEST_BYTES),
                                          expected_hash=ref.content_hash)
            # streamed (issue 38) as token datasets are: a reading stage's feed fetches its replica's shards
            window = window_bytes(eman, micro_batch=spec.config.micro_batch, micro_batches=spec.config.micro_batches)
            if eman.num_examples != ref.num_tokens or window > memory:
                raise JobError(f"job {spec.job_id}: the dataset's {eman.num_examples} examples do not match its "
                               f"reference ({ref.num_tokens}) or its window of {window} bytes does not fit this node's memory")
            missing = sorted(set(dag.data_inputs) - {f.name for f in eman.fields})
            if missing:
                raise JobError(f"job {spec.job_id}: the model reads {missing}, which the dataset does not hold")
            tokens = ShardedExamples(eman)
        else:
            if ref.kind == "url":
                try:
                    check_url(ref.name)
                except ConfigError as exc:
                    raise RemoteProtocolError(f"job {spec.job_id}: {exc}") from None
            manifest = ShardManifest.decode(await self._fetch(ref.content_hash, peers, max_size=MAX_MANIFEST_BYTES),
                                            expected_hash=ref.content_hash)
            # streamed (issue 38): no shard here; a reading stage's feed fetches its replica's, a window ahead
            window = window_bytes(manifest, micro_batch=spec.config.micro_batch, micro_batches=spec.config.micro_batches)
            if manifest.num_tokens != ref.num_tokens or window > memory:
                raise JobError(f"job {spec.job_id}: the dataset's {manifest.num_tokens} tokens do not match its "
                               f"reference ({ref.num_tokens}) or its window of {window} bytes does not fit this node's memory")
            tokens = ShardedTokens(manifest)
        return AcceptedJob(spec=spec, dag=dag, tokens=tokens, envelope=bytes(envelope), weights=weights)

    async def _fetch(self, h: str, peers: Sequence[str], *, max_size: int) -> bytes:
        """At most *max_size* bytes: from *peers* first (verified, stored; announcing it on the DHT is left
        to the caller, see ``fetched``, because a DHT provide can take seconds), then from the DHT's
        providers."""
        max_size = min(max_size, self.max_blob)
        store = self.content.store
        if store.has(h):
            return store.get(h)
        for peer in peers:
            try:
                blob = await self.content.fetch_from(peer, h, max_size=max_size)
            except (PeerUnavailable, RemoteProtocolError, trio.TooSlowError) as exc:
                log.info("fetch of %s from %s failed: %s", h[:16], short_peer(peer), exc)
                continue
            store.put(blob)
            self.fetched.append(h)
            return blob
        return await self.content.fetch(h, max_size=max_size)


MICRO_PERIOD = 8   # asynchronous CO2: replicas' micro-batches per step in eighths (Plan.micro_period)


def planner_config(cfg: TrainConfig, *, recompute: bool = False) -> PlannerConfig:
    """The planner's cost model for a job: its micro-batches, compression, AdaTopK floor and averaging period
    (per-step gradient all-reduce without CO2: one step), whether the averaging hides behind the
    compute (asynchronous CO2) or blocks the step (the all-reduce, synchronous CO2), and the bytes of a
    CO2 round (half with ``CO2.wire="bf16"``); with *recompute*, activation recomputation's memory and compute."""
    comp, co2 = cfg.adatopk, cfg.co2
    bf16 = co2 is not None and co2.wire == "bf16"
    spot = cfg.spot_rate > 0
    return PlannerConfig(micro_batches=cfg.micro_batches, compression=comp is not None, recompute=recompute,
                         schedule=cfg.schedule,   # the micro-batches in flight a stage's memory is priced with
                         rho_min=comp.rho_min if comp is not None else PlannerConfig().rho_min,
                         co2_tau=co2.tau if co2 is not None else 1,
                         overlap_averaging=co2 is not None and not co2.sync,
                         stream_averaging=co2 is not None and co2.stream and not co2.sync,
                         averaging_wire=0.5 if bf16 else 1.0, gradient_exchange=co2 is None,
                         # replicas of unequal speed: fractional micro-batches a step where no round blocks it
                         micro_period=MICRO_PERIOD if co2 is not None and not co2.sync else 1,
                         # the bf16 wire keeps the last average of every fragment: one more fp32 copy; the spot
                         # checks (jobs/verified.py) their state copies and transcripts on every checked replica
                         replica_memory_factor=PlannerConfig().replica_memory_factor + (1.0 if bf16 else 0.0)
                         + (SPOT_STATE_COPIES if spot else 0.0),
                         replica_boundary_steps=SPOT_BOUNDARY_STEPS if spot else 0,
                         # mixed precision: compute at the bf16 rate, activations in 2-byte values
                         half_precision=cfg.precision != "fp32", value_bytes=2 if cfg.precision != "fp32" else 4)


def job_cost_model(spec: JobSpec, dag: OpDAG, snap: Snapshot) -> tuple[CostModel, WorkloadGraph, Snapshot]:
    """The cost model of *spec* on *snap* as its plan was made (with no link measured, all fast), its
    workload and that snapshot."""
    cfg = spec.config
    wl = to_workload(coarsen(dag), micro_batch=cfg.micro_batch)
    judged = dataclasses.replace(snap, links=planned_links(snap.members, snap.links))
    return CostModel(wl, judged, planner_config(cfg)), wl, judged


def averaging_lag(spec: JobSpec, dag: OpDAG, plan: Plan, snap: Snapshot, stage: int) -> int:
    """``OuterConfig.lag`` of *stage*'s streaming CO2 rounds in *plan* (:meth:`CostModel.averaging_lag`):
    a pure function of the plan and its snapshot, so every replica of the stage applies each round at
    the same step and the loss does not depend on timing. 1 without CO2 or replicas (no cost model built)."""
    st = plan.stages[stage]
    if spec.config.co2 is None or len(st.replicas) < 2:
        return 1
    cm = job_cost_model(spec, dag, snap)[0]
    micro = [plan.micro[r] for r in range(len(st.replicas))] if plan.micro else None
    return cm.averaging_lag(st.start, st.end, [cm.index[p] for p in st.replicas], micro)


def averaging_bf16(spec: JobSpec, dag: OpDAG, plan: Plan, snap: Snapshot, stage: int, replica: int) -> frozenset[int] | None:
    """The replicas of *stage* (indices) to which replica *replica*'s CO2 rounds send bf16 differences
    (``AveragerConfig.bf16_peers``): with ``CO2.wire="bf16"``, those whose link to it is slow enough for
    the halved bytes to outweigh the bf16 wire's CPU (:func:`~fusionp2p.plan.estimator.bf16_pays`, on the
    links the plan was made with). A pure function of the plan and its snapshot, symmetric in the two ends
    of a link, so both sides of a link agree. None without the bf16 wire or replicas (the config's wire)."""
    st = plan.stages[stage]
    co2 = spec.config.co2
    if co2 is None or co2.wire != "bf16" or len(st.replicas) < 2:
        return None
    cm = job_cost_model(spec, dag, snap)[0]
    me = cm.index[st.replicas[replica]]
    return frozenset(k for k, p in enumerate(st.replicas) if k != replica and bf16_pays(float(cm.bw[me, cm.index[p]])))


def choose_plan(spec: JobSpec, dag: OpDAG, members: Mapping[str, DeviceProfile], *,
                links: Mapping[tuple[str, str], Link] | None = None, epoch: int = 0) -> Plan:
    """The job's plan for *members*: a pure function, identical on every node.

    Stages, replicas per stage and AdaTopK ratios are chosen together from the links
    (:func:`~fusionp2p.plan.joint.plan_joint`); ``config.replicas`` is the hint and the upper bound of
    the replica count, never an off switch for OP-Fence or compression. When no layout fits the members'
    memory, the plan is made again with activation recomputation (``config.recompute``, unless "never").
    ``config.planner`` may instead
    name a network-blind baseline (``plan/baselines.py``: exactly ``replicas`` per stage, dense fences),
    which is how benchmarks/wan.py runs its baselines on the product. Without any measured link (an
    embedded swarm without emulated links) every pair counts as 1 GB/s, 0.1 ms; once some are measured,
    a pair without a figure counts as ``PlannerConfig.missing_link`` (slow, so that it is avoided).
    """
    cfg = spec.config
    wl = to_workload(coarsen(dag), micro_batch=cfg.micro_batch)
    snap = Snapshot(job=spec.job_id, epoch=epoch, members=dict(members), links=planned_links(members, links))

    def plan(pc: PlannerConfig) -> Plan:
        if cfg.planner == "even_layers":
            return plan_even_layers(wl, snap, pc, seed=cfg.seed, replicas=cfg.replicas or 1)
        if cfg.planner == "even_flops":
            return plan_even_flops(wl, snap, pc, seed=cfg.seed, replicas=cfg.replicas or 1)
        return plan_joint(wl, snap, pc, replicas=cfg.replicas, stages=cfg.stages, seed=cfg.seed)

    if cfg.recompute == "always":
        return plan(planner_config(cfg, recompute=True))
    try:
        return plan(planner_config(cfg))
    except InfeasiblePlanError as exc:
        if cfg.recompute == "never":
            raise
        # activation recomputation only where nothing fits without it: the layout is then priced with it in
        # every stage, and each stage recomputes only if it is over its node's offer (jobs/weights.py)
        log.info("job %s: no layout fits the members' memory without activation recomputation; planning with it",
                 spec.job_id)
        try:
            return plan(planner_config(cfg, recompute=True))
        except InfeasiblePlanError:
            raise InfeasiblePlanError(f"{exc} (activation recomputation does not make it fit either)") from exc


def planned_links(members: Iterable[str], links: Mapping[tuple[str, str], Link] | None) -> dict[tuple[str, str], Link]:
    """The links a plan is made on: *links*, or with none measured at all 1 GB/s, 0.1 ms for every pair."""
    if links:
        return dict(links)
    peers = sorted(members)
    fast = Link(bandwidth_bps=1e9, latency_s=1e-4)
    return {(a, b): fast for i, a in enumerate(peers) for b in peers[i + 1:]}


def plan_for_snapshot(spec: JobSpec, dag: OpDAG, snap: Snapshot, *, previous: Plan | None = None) -> Plan:
    """:func:`choose_plan` over a swarm snapshot, stamped with that snapshot's hash (for the election).

    With *previous* (the plan of the epoch before a re-plan), members keep the stage they held where
    the plan's quality allows it (:func:`stabilize`), so that a re-plan moves as little state as it can.
    """
    if snap.job != spec.job_id:
        raise PlanError(f"snapshot of job {snap.job}, not {spec.job_id}")
    plan = choose_plan(spec, dag, snap.members, links=snap.links, epoch=snap.epoch)
    if previous is not None:
        plan = stabilize(plan, previous, snap.members)
    return dataclasses.replace(plan, job=spec.job_id, epoch=snap.epoch, snapshot_hash=snap.snapshot_hash())


def stabilize(plan: Plan, previous: Plan, profiles: Mapping[str, DeviceProfile]) -> Plan:
    """Swap members with identical device profiles so that as many as possible keep their old stage.

    Only equal devices change places, so the plan's cost model (compute, memory, links unless they
    differ) sees the same plan; the swap is deterministic (sorted ids), so every member computes it.
    """
    held = {p: k for k, st in enumerate(previous.stages) for p in st.replicas}
    slots = [(k, i) for k, st in enumerate(plan.stages) for i in range(len(st.replicas))]
    who = {(k, i): plan.stages[k].replicas[i] for k, i in slots}
    groups: dict[DeviceProfile, list[tuple[int, int]]] = {}
    for slot in slots:
        groups.setdefault(profiles[who[slot]], []).append(slot)
    for prof, gslots in groups.items():
        used = {who[s] for s in gslots}
        eligible = sorted(used | {p for p in held if p in profiles and profiles[p] == prof})
        chosen: dict[tuple[int, int], str] = {}
        for slot in gslots:     # first the members that held this very stage
            cand = [p for p in eligible if held.get(p) == slot[0] and p not in chosen.values()]
            if cand:
                chosen[slot] = cand[0]
        taken = set(chosen.values())
        rest = [p for p in eligible if p in held and p not in taken] + [p for p in eligible if p not in held and p not in taken]
        for slot in gslots:     # then members of the old plan, then newcomers
            if slot not in chosen:
                chosen[slot] = rest.pop(0)
        who.update(chosen)
    stages = tuple(dataclasses.replace(st, replicas=tuple(who[(k, i)] for i in range(len(st.replicas))))
                   for k, st in enumerate(plan.stages))
    return dataclasses.replace(plan, stages=stages)


def stage_programs(dag: OpDAG, plan: Plan) -> list[StageProgram]:
    """Cut the DAG at the plan's fences."""
    c = coarsen(dag)
    return partition(c, stages_from_fences(len(c.units), [f.unit for f in plan.fences]))


def unit_names(c: CoarseDAG, start: int, end: int) -> set[str]:
    """Parameters and buffers of the stage that holds coarse units [start, end) of *c*."""
    cuts = [u for u in (start, end) if 0 < u < len(c.units)]
    prog = partition(c, stages_from_fences(len(c.units), cuts))[1 if start > 0 else 0]
    return {spec.name for spec in prog.inputs if spec.kind != "input"}


def data_fn(job: AcceptedJob) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """(global step, micro) -> the DAG's data inputs for a dataset every node holds whole (the built-in corpus):
    the first is the token ids, the last the targets. A streamed dataset (a token file, examples) is read
    through the stage's feed (``jobs/data_shards.py``); a stage without one reads no data."""
    cfg, ref = job.spec.config, job.spec.dataset
    if isinstance(job.tokens, ShardedExamples | ShardedTokens):
        def unread(step: int, micro: int) -> dict[str, torch.Tensor]:
            raise AssertionError("a streamed dataset is read through the stage's feed")
        return unread
    sampler = BatchSampler(SamplerConfig(num_tokens=ref.num_tokens, seq_len=ref.seq_len, micro_batch=cfg.micro_batch,
                                         micro_batches=cfg.micro_batches, seed=cfg.seed))
    names = job.dag.data_inputs
    if len(names) != 2:
        raise ConfigError(f"the model takes data inputs {names}; a job feeds exactly (tokens, targets)")

    def fn(step: int, micro: int) -> dict[str, torch.Tensor]:
        return {names[0]: torch.from_numpy(np.asarray(sampler.inputs(job.tokens, step, micro))),
                names[1]: torch.from_numpy(np.asarray(sampler.targets(job.tokens, step, micro)))}
    return fn


def eval_data_fn(job: AcceptedJob, feed: StreamFeed | None = None) -> Callable[[int, int], dict[str, torch.Tensor]] | None:
    """The held-out micro-batches of the job's dataset (the reading stage's *feed* holds them), or None when it
    holds out nothing or the stage reads no data."""
    return feed.eval_data if feed is not None else None


def module_state(dag: OpDAG, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DAG-named tensors -> the traced module's ``state_dict`` keys: tied weights under every alias,
    non-persistent buffers left out, and a tensor *values* lacks taken from the DAG's own (published)
    value, so that the result holds exactly the keys of the module's ``state_dict()`` and loads with
    ``load_state_dict(strict=True)``."""
    out: dict[str, torch.Tensor] = {}
    for name in dag.module_names:
        v = values.get(name, dag.tensors.get(name))
        if v is None or v.device.type == "meta":   # a node's DAG holds declarations only (issue 37)
            continue
        for target in dag.module_names[name]:
            out[target] = v.detach().contiguous().clone()
    return out


def save_module_state(path: Path, state: Mapping[str, torch.Tensor]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(dict(state), str(path))
    return path


__all__ = ["AcceptedJob", "BuiltJob", "NodeJobs", "as_dataset", "build_job", "choose_plan", "data_fn", "eval_data_fn",
           "module_state", "plan_for_snapshot", "planner_config", "save_module_state", "stage_programs", "trace_job",
           "unit_names"]
