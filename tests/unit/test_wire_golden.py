"""Golden bytes of every wire format (STYLE.md 4; issue 16): fixed example values and the exact bytes
they encode to, committed here. Written before the formats moved to the generic codec (wire/codec.py),
so that the migration provably changed no byte; a change to any layout must change this table on
purpose (and the protocol version with it).

Ed25519 signatures are deterministic, so the signed envelopes are golden too. Each example also
decodes back to its value (where the format has a decoder).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fusionp2p.net.identity import Identity

ALICE = Identity(bytes(range(32)))
BOB = Identity(bytes(range(1, 33)))


def _profile():  # type: ignore[no-untyped-def]
    from fusionp2p.types import DeviceProfile
    return DeviceProfile(device="cpu", kind="cpu", name="x86_64 (2 threads)", flops_fp32=1.5e10, flops_bf16=0.0,
                         memory_bytes=16 << 30, threads=2, versions=(("python", "3.11.7"), ("torch", "2.13.0")))


def _snapshot():  # type: ignore[no-untyped-def]
    from fusionp2p.plan.snapshot import Link, Snapshot
    return Snapshot(job="job1", epoch=2, members={ALICE.peer_id: _profile(), BOB.peer_id: _profile()},
                    links={(ALICE.peer_id, BOB.peer_id): Link(bandwidth_bps=1.25e8, latency_s=0.01)})


def _plan():  # type: ignore[no-untyped-def]
    from fusionp2p.plan.plan import Fence, Plan, Stage
    return Plan(job="job1", epoch=2, snapshot_hash="c" * 64, algorithm="op-fence", seed=7, n_units=4, micro_batches=2,
                stages=(Stage(start=0, end=2, replicas=(ALICE.peer_id,), compute_s=0.5, memory_bytes=1e6),
                        Stage(start=2, end=4, replicas=(BOB.peer_id,), compute_s=0.25, memory_bytes=2e6)),
                fences=(Fence(index=0, unit=2, dense_bytes=4096.0, rho=0.25, time_s=0.1, dense_time_s=0.4),),
                bottleneck_s=0.5, step_time_s=1.5)


def _spec():  # type: ignore[no-untyped-def]
    from fusionp2p.data.corpus import corpus_hash
    from fusionp2p.jobs.spec import CO2, AdaTopK, DatasetRef, JobSpec, Resources, TrainConfig
    return JobSpec(job_id="0123456789abcdef", publisher=ALICE.peer_id, created=1.7e9, model_hash="a" * 64,
                   weights_hash="b" * 64,
                   dataset=DatasetRef(kind="builtin", name="pydoc", content_hash=corpus_hash("pydoc"), seq_len=64,
                                      vocab_size=256, num_tokens=400_000),
                   config=TrainConfig(steps=100, optimizer="adamw", lr=3e-4, averaging=CO2(tau=4), compression=AdaTopK(rho_min=0.01),
                                      lr_schedule="cosine"),
                   resources=Resources(min_memory_bytes=1 << 30, device_kinds=("cpu",)), name="demo")


def examples() -> dict[str, tuple[Callable[[], bytes], Callable[[bytes], Any] | None, Any]]:
    from fusionp2p.data.shards import ShardManifest
    from fusionp2p.jobs import events as ev
    from fusionp2p.jobs.election import Vote
    from fusionp2p.jobs.replan import Halted, Resume, Source
    from fusionp2p.jobs.spec import JobSpec, decode_signed, sign_spec
    from fusionp2p.net.channel import TensorMessage
    from fusionp2p.net.identity import verify
    from fusionp2p.net.resilient import Hello, hello_message, parse_hello, parse_welcome, welcome_message
    from fusionp2p.plan.plan import Plan
    from fusionp2p.plan.snapshot import Snapshot
    from fusionp2p.train.config import TrainConfig
    from fusionp2p.wire import jobrecords as jr
    from fusionp2p.wire import records as rec
    from fusionp2p.wire import tensor_frame as tf
    from fusionp2p.wire.framing import encode_frame
    from fusionp2p.wire.msg import packb, unpackb
    from fusionp2p.wire.records import decode_profile

    node = rec.NodeRecord(peer=ALICE.peer_id, role="node", addrs=("/ip4/127.0.0.1/tcp/4001",), profile=_profile(),
                          started=1.7e9, seq=3, period=1.0)
    bw = rec.BandwidthReport(peer=ALICE.peer_id, seq=2, uplink=1e8, downlink=2e8,
                             measurements=(rec.Measurement(src=ALICE.peer_id, dst=BOB.peer_id, bandwidth=1e8, rtt=0.01,
                                                           samples=3),))
    status = jr.JobStatus(job="job1", peer=ALICE.peer_id, publisher=BOB.peer_id, state="running", epoch=1, step=10,
                          steps=100, members=(ALICE.peer_id,), stage_sizes=(1,), losses=((1, 3.5),), checkpoint_step=5,
                          checkpoint=(jr.StageFile(stage=0, hash="a" * 64, holders=(ALICE.peer_id,)),), final_loss=None,
                          reason="", at=1.7e9)
    index = jr.JobIndex(peer=BOB.peer_id, jobs=(("job1", "demo", 1.7e9),))
    vote = Vote.make(job="job1", epoch=2, plan_hash="d" * 64, snapshot_hash="c" * 64, peer=ALICE.peer_id, sign=ALICE.sign,
                     plan=b"")
    hello = Hello(name="act:0>1", session="0123456789abcdef0123456789abcdef", fresh=True, received=3, delivered=2, window=64)
    msg = TensorMessage(job="job1", kind="act", stage=1, step=7, micro=2, name="e0", meta={"codec": "id"},
                        tensors=(torch.arange(4, dtype=torch.float32), torch.tensor([True, False])))
    halted = Halted(peer=ALICE.peer_id, epoch=1, stage=0, replica=0, step=10, state="a" * 64, start=0, end=2)
    resume = Resume(step=10, sources=(Source(start=0, end=2, step=10, state="a" * 64, holders=(ALICE.peer_id,)),),
                    lost_steps=1)
    manifest = ShardManifest(dtype="u16", num_tokens=1000, shard_tokens=600, vocab_size=256, shards=("e" * 64, "f" * 64))
    spec = _spec()
    baseline = TrainConfig(steps=100, replicas=2, planner="even_layers")
    evs = {
        "step": ev.StepProgress(job="job1", step=3, epoch=1, stage=1, peer=ALICE.peer_id, loss=2.5, tokens_per_s=1000.0,
                                compute_util=0.5, link_util=None, at=1.7e9),
        "plan": ev.PlanChanged(job="job1", epoch=1, plan_hash="d" * 64, stage_sizes=(1, 1), members=(ALICE.peer_id, BOB.peer_id),
                               at=1.7e9),
        "members": ev.MembersChanged(job="job1", epoch=2, joined=(BOB.peer_id,), left=(), at=1.7e9),
        "state": ev.JobStateChanged(job="job1", state="running", reason="", at=1.7e9),
        "checkpoint": ev.CheckpointSaved(job="job1", step=5, stage=0, peer=ALICE.peer_id, at=1.7e9, hash="a" * 64, start=0, end=2),
        "skipped": ev.StepSkipped(job="job1", step=4, stage=1, peer=ALICE.peer_id, reason="non-finite gradients", at=1.7e9),
    }
    out = {
        "profile": (lambda: packb(_profile().to_wire()), lambda b: decode_profile(unpackb(b)), _profile()),
        "node_record": (lambda: rec.encode_signed(node, ALICE.sign), lambda b: rec.decode_signed(b, verify), node),
        "bandwidth_report": (lambda: rec.encode_signed(bw, ALICE.sign), lambda b: rec.decode_signed(b, verify), bw),
        "record_bundle": (lambda: rec.encode_bundle([rec.encode_signed(node, ALICE.sign), rec.encode_signed(bw, ALICE.sign)]),
                          lambda b: [rec.decode_signed(p, verify) for p in rec.split_bundle(b)], [node, bw]),
        "job_status": (lambda: jr.encode_record(status, ALICE.sign), lambda b: jr.decode_record(b, verify), status),
        "job_index": (lambda: jr.encode_record(index, BOB.sign), lambda b: jr.decode_record(b, verify), index),
        "snapshot": (lambda: _snapshot().to_wire(), Snapshot.from_wire, _snapshot()),
        "plan": (lambda: _plan().to_wire(), Plan.from_wire, _plan()),
        "vote": (vote.encode, Vote.decode, vote),
        "train_config": (lambda: packb(spec.config.to_wire()), lambda b: TrainConfig.from_wire(unpackb(b)), spec.config),
        # a baseline planner (benchmarks/wan.py): the field appears only away from its default
        "train_config_planner": (lambda: packb(baseline.to_wire()), lambda b: TrainConfig.from_wire(unpackb(b)), baseline),
        "job_spec": (spec.encode, lambda b: JobSpec.from_wire(unpackb(b)), spec),
        "job_spec_envelope": (lambda: sign_spec(spec, ALICE.sign), decode_signed, spec),
        "halted": (lambda: packb(halted.to_wire()), lambda b: Halted.from_wire(unpackb(b)), halted),
        "resume": (lambda: packb(resume.to_wire()), lambda b: Resume.from_wire(unpackb(b)), resume),
        "shard_manifest": (manifest.encode, ShardManifest.decode, manifest),
        "hello": (lambda: tf.message_bytes(hello_message(hello)), lambda b: parse_hello(TensorMessage(**tf.decode_message(b))), hello),
        "welcome": (lambda: tf.message_bytes(welcome_message(3, 2, 64)),
                    lambda b: parse_welcome(TensorMessage(**tf.decode_message(b))), None),
        "tensor_message": (lambda: tf.message_bytes(msg), None, None),
        "frame": (lambda: encode_frame(b"hello", max_frame=1024), None, None),
        "record_header": (lambda: tf.record_header(tf.MSG_END, 100), None, None),
        "msg_start": (lambda: tf.encode_start(1 << 20), tf.decode_start, 1 << 20),
        "stripe_start": (lambda: tf.encode_stripe_start(1 << 20, 1 << 18), None, None),
        "ack": (lambda: tf.encode_ack(7), tf.decode_ack, 7),
        "ticket_request": (lambda: tf.encode_ticket_request("aes-128-gcm", 2), tf.decode_ticket_request, ("aes-128-gcm", 2)),
        "ticket_reply": (lambda: tf.encode_ticket_reply(ticket=bytes(16), cipher="aes-128-gcm", k_dial=bytes(32),
                                                        k_listen=bytes(range(32)), host="127.0.0.1", port=40000, lanes=2),
                         None, None),
    }
    from fusionp2p.average.allreduce import RoundMsg
    from fusionp2p.graph import InputSpec, OpDAG, OpNode, Ref, TensorMeta
    from fusionp2p.train.averager import from_message, to_message
    from fusionp2p.wire.dag import decode_dag, encode_dag

    f32 = torch.float32
    dag = OpDAG(inputs=(InputSpec(name="x", kind="input", meta=TensorMeta(shape=(2, 3), dtype=f32)),
                        InputSpec(name="w", kind="param", meta=TensorMeta(shape=(3,), dtype=f32))),
                nodes=(OpNode(name="y", op="aten.mul.Tensor", args=(Ref("x"), Ref("w")), out=(TensorMeta(shape=(2, 3), dtype=f32),)),
                       OpNode(name="s", op="aten.sum.default", args=(Ref("y"),), out=(TensorMeta(shape=(), dtype=f32),))),
                outputs=("s",), loss="s", tensors={"w": torch.tensor([1.0, 2.0, 3.0])})
    part = RoundMsg(round_id=3, epoch="e1", phase="scatter", lo=0, hi=4, data=torch.ones(4), weight=1.0, scalar=0.5)
    out["dag"] = (lambda: encode_dag(dag), lambda b: decode_dag(b).nodes, dag.nodes)
    out["averaging_part"] = (lambda: tf.message_bytes(to_message("job1", 0, part)),
                             lambda b: from_message(TensorMessage(**tf.decode_message(b))).lo, 0)
    for k, e in evs.items():
        out[f"event_{k}"] = ((lambda e=e: ev.encode_event(e)), ev.decode_event, e)
    out.update(_examples_issue_18_20_21())
    return out


def _examples_issue_18_20_21() -> dict[str, tuple[Callable[[], bytes], Callable[[bytes], Any] | None, Any]]:
    """The formats the merges of issues 18 (example datasets, held-out loss, tied weights), 20 (the
    planner's per-fence choices) and 21 (reachability, the libp2p fallback of the data plane) added."""
    import dataclasses

    from fusionp2p.data.examples import ExampleManifest, FieldSpec
    from fusionp2p.jobs import events as ev
    from fusionp2p.net.channel import TensorMessage
    from fusionp2p.net.identity import verify
    from fusionp2p.plan.plan import Candidate, Fence, Plan
    from fusionp2p.train.worker import check_tied_message
    from fusionp2p.wire import reach as wr
    from fusionp2p.wire import records as rec
    from fusionp2p.wire import tensor_frame as tf

    node = rec.NodeRecord(peer=ALICE.peer_id, role="node", addrs=("/ip4/127.0.0.1/tcp/4001",), profile=_profile(),
                          started=1.7e9, seq=3, period=1.0, data=("/ip4/127.0.0.1/tcp/5001",), reach=rec.REACH_P2P)
    plan = dataclasses.replace(
        _plan(), fences=(Fence(index=0, unit=2, dense_bytes=4096.0, rho=0.25, time_s=0.1, dense_time_s=0.4,
                               bandwidth_bps=1.25e8, latency_s=0.01),),
        how="joint:1x2", considered=(Candidate(replicas=1, stages=2, how="joint:1x2", step_time_s=1.5),
                                     Candidate(replicas=2, stages=1, how="replicas", step_time_s=2.0)))
    manifest = ExampleManifest(fields=(FieldSpec(name="input_ids", dtype="i64", shape=(4,)),
                                       FieldSpec(name="labels", dtype="i32", shape=())),
                               num_examples=10, num_train=8, shard_examples=6, shards=("e" * 64, "f" * 64))
    evs = {
        "eval": ev.EvalProgress(job="job1", step=10, epoch=1, peer=ALICE.peer_id, loss=2.25, at=1.7e9),
        "links": ev.LinksUp(job="job1", epoch=1, stage=0, peer=ALICE.peer_id, links=(f"{BOB.peer_id}=libp2p",), at=1.7e9),
        "plan_fences": ev.PlanChanged(job="job1", epoch=1, plan_hash="d" * 64, stage_sizes=(1, 1),
                                      members=(ALICE.peer_id, BOB.peer_id), at=1.7e9, rho=(0.25,), link_bps=(1.25e8,),
                                      fence_s=(0.1,), dense_s=(0.4,), step_s=1.5, how="joint:1x2"),
    }
    from fusionp2p.wire.pieces import TensorPieces, WeightManifest

    weights = WeightManifest(piece_bytes=1024, tensors=(
        TensorPieces(name="wte", dtype="f32", shape=(2, 300), pieces=("a" * 64, "b" * 64, "c" * 64)),
        TensorPieces(name="ln.b", dtype="bf16", shape=(4,), pieces=("d" * 64,)),
        TensorPieces(name="empty", dtype="i64", shape=(0,), pieces=())))
    tied = TensorMessage(job="job1", kind="tied", stage=0, step=3, name="wte",
                         tensors=(torch.ones(2, 2), torch.tensor([1.0])))
    holders = {"wte": ((0, 1), (2, 2), torch.float32)}
    out: dict[str, tuple[Callable[[], bytes], Callable[[bytes], Any] | None, Any]] = {
        "node_record_reach": (lambda: rec.encode_signed(node, ALICE.sign), lambda b: rec.decode_signed(b, verify), node),
        # the speed a node trained at in its earlier jobs (issue 20: jobs/rebalance.py)
        "node_record_speed": (lambda: rec.encode_signed(dataclasses.replace(node, speed=0.5, speed_model="e" * 64),
                                                        ALICE.sign),
                              lambda b: rec.decode_signed(b, verify), dataclasses.replace(node, speed=0.5, speed_model="e" * 64)),
        "plan_rationale": (plan.to_wire, Plan.from_wire, plan),
        "example_manifest": (manifest.encode, ExampleManifest.decode, manifest),
        # a job's initial tensors as pieces (issue 37: wire/pieces.py)
        "weight_manifest": (weights.encode, WeightManifest.decode, weights),
        "reach_check": (lambda: wr.encode("check", p2p=["/ip4/203.0.113.7/tcp/4001"], data=["/ip4/0.0.0.0/tcp/5001"]),
                        wr.decode_request, ("check", {"p2p": ["/ip4/203.0.113.7/tcp/4001"], "data": ["/ip4/0.0.0.0/tcp/5001"]})),
        "reach_reverse": (lambda: wr.encode("reverse", target=BOB.peer_id), wr.decode_request,
                          ("reverse", {"target": BOB.peer_id})),
        "reach_dial": (lambda: wr.encode("dial", peer=ALICE.peer_id, addrs=["/ip4/203.0.113.7/tcp/4001"]), wr.decode_request,
                       ("dial", {"peer": ALICE.peer_id, "addrs": ["/ip4/203.0.113.7/tcp/4001"]})),
        "reach_check_reply": (lambda: wr.encode("reply", p2p=True, data=False, ip="203.0.113.7"), wr.decode_check_reply,
                              (True, False, "203.0.113.7", "")),
        "reach_ok_reply": (lambda: wr.encode("reply", ok=False, why="busy"), wr.decode_ok_reply, (False, "busy")),
        "stream_hello": (lambda: tf.record_header(tf.HELLO, 0), None, None),
        "tied_gradient": (lambda: tf.message_bytes(tied),
                          lambda b: [t.tolist() for t in check_tied_message(TensorMessage(**tf.decode_message(b)), src=1,
                                                                                 holders=holders)],
                          [[[1.0, 1.0], [1.0, 1.0]], [1.0]]),
    }
    for k, e in evs.items():
        out[f"event_{k}"] = ((lambda e=e: ev.encode_event(e)), ev.decode_event, e)
    return out


GOLDEN: dict[str, str] = {
    "profile": (
        "88a6646576696365a3637075a46b696e64a3637075a46e616d65b27838365f3634202832207468726561647329aa666c"
        "6f70735f66703332cb420bf08eb0000000aa666c6f70735f62663136cb0000000000000000ac6d656d6f72795f627974"
        "6573cf0000000400000000a77468726561647302a876657273696f6e739292a6707974686f6ea6332e31312e3792a574"
        "6f726368a6322e31332e30"
    ),
    "node_record": (
        "84a17601a174a46e6f6465a162c501478aa470656572d934313244334b6f6f574134586f70314a6154334d487877594d"
        "6b436570597376346950566f704d5877437a35694859644266655342a4726f6c65a46e6f6465a5616464727391b72f69"
        "70342f3132372e302e302e312f7463702f34303031a770726f66696c6588a6646576696365a3637075a46b696e64a363"
        "7075a46e616d65b27838365f3634202832207468726561647329aa666c6f70735f66703332cb420bf08eb0000000aa66"
        "6c6f70735f62663136cb0000000000000000ac6d656d6f72795f6279746573cf0000000400000000a774687265616473"
        "02a876657273696f6e739292a6707974686f6ea6332e31312e3792a5746f726368a6322e31332e30a773746172746564"
        "cb41d954fc40000000a373657103a76c656176696e67c2a26862cb3ff0000000000000a46461746190a57265616368a7"
        "756e6b6e6f776ea173c440219f7b9a495601e234ea1b99a0b621b69e7cd9f77fd4658c1b39b1e9083fc0e4d4ac0e236b"
        "9e8d87f411d9dd386734ee7f77111bc42e3c0af329cdc92f233905"
    ),
    "bandwidth_report": (
        "84a17601a174a26277a162c4a885a470656572d934313244334b6f6f574134586f70314a6154334d487877594d6b4365"
        "70597376346950566f704d5877437a35694859644266655342a373657102a27570cb4197d78400000000a4646f776ecb"
        "41a7d78400000000a16d9194d934313244334b6f6f574a315473696a48374835463734686641443558697368517a3373"
        "78726d41745659333747744e643943715966cb4197d78400000000cb3f847ae147ae147b03a173c440d9e623de40fdb7"
        "3a3cc02e7eab33573cf3a3cdf9236afff33b5c2f99953c6024caf1c5966c996a7468bd4156f59a7aa41e0f59763397e2"
        "3dff1856f01934c105"
    ),
    "record_bundle": (
        "92c5019b84a17601a174a46e6f6465a162c501478aa470656572d934313244334b6f6f574134586f70314a6154334d48"
        "7877594d6b436570597376346950566f704d5877437a35694859644266655342a4726f6c65a46e6f6465a56164647273"
        "91b72f6970342f3132372e302e302e312f7463702f34303031a770726f66696c6588a6646576696365a3637075a46b69"
        "6e64a3637075a46e616d65b27838365f3634202832207468726561647329aa666c6f70735f66703332cb420bf08eb000"
        "0000aa666c6f70735f62663136cb0000000000000000ac6d656d6f72795f6279746573cf0000000400000000a7746872"
        "6561647302a876657273696f6e739292a6707974686f6ea6332e31312e3792a5746f726368a6322e31332e30a7737461"
        "72746564cb41d954fc40000000a373657103a76c656176696e67c2a26862cb3ff0000000000000a46461746190a57265"
        "616368a7756e6b6e6f776ea173c440219f7b9a495601e234ea1b99a0b621b69e7cd9f77fd4658c1b39b1e9083fc0e4d4"
        "ac0e236b9e8d87f411d9dd386734ee7f77111bc42e3c0af329cdc92f233905c4f984a17601a174a26277a162c4a885a4"
        "70656572d934313244334b6f6f574134586f70314a6154334d487877594d6b436570597376346950566f704d5877437a"
        "35694859644266655342a373657102a27570cb4197d78400000000a4646f776ecb41a7d78400000000a16d9194d93431"
        "3244334b6f6f574a315473696a48374835463734686641443558697368517a337378726d41745659333747744e643943"
        "715966cb4197d78400000000cb3f847ae147ae147b03a173c440d9e623de40fdb73a3cc02e7eab33573cf3a3cdf9236a"
        "fff33b5c2f99953c6024caf1c5966c996a7468bd4156f59a7aa41e0f59763397e23dff1856f01934c105"
    ),
    "job_status": (
        "84a17601a174aa6a6f622d737461747573a162c501b6de0010a36a6f62a46a6f6231a470656572d934313244334b6f6f"
        "574134586f70314a6154334d487877594d6b436570597376346950566f704d5877437a35694859644266655342a97075"
        "626c6973686572d934313244334b6f6f574a315473696a48374835463734686641443558697368517a337378726d4174"
        "5659333747744e643943715966a57374617465a772756e6e696e67a565706f636801a4737465700aa5737465707364a7"
        "6d656d6265727391d934313244334b6f6f574134586f70314a6154334d487877594d6b436570597376346950566f704d"
        "5877437a35694859644266655342a573697a65739101a66c6f73736573919201cb400c000000000000a9636b70745f73"
        "74657005a4636b7074919300d94061616161616161616161616161616161616161616161616161616161616161616161"
        "61616161616161616161616161616161616161616161616161616161616191d934313244334b6f6f574134586f70314a"
        "6154334d487877594d6b436570597376346950566f704d5877437a35694859644266655342a566696e616c90aa66696e"
        "616c5f6c6f7373c0a6726561736f6ea0a26174cb41d954fc40000000a173c440ef7a72babaeac1b4504f6224b20f92a5"
        "ecdfa37dbe503258b2ea40308f2858f8186415eaf53a09fe2cb40be38be3b1277ceafe0ce7ede6b22804c54644abd902"
    ),
    "job_index": (
        "84a17601a174a96a6f622d696e646578a162c45682a470656572d934313244334b6f6f574a315473696a483748354637"
        "34686641443558697368517a337378726d41745659333747744e643943715966a46a6f62739193a46a6f6231a464656d"
        "6fcb41d954fc40000000a173c4401fb0c918b0977a3ba3db07a6b5f75ad400c571908997f10d3e976de18190fb5cbe84"
        "0fda5305e848a56ca7e86b7cf1cc7627f8304d64a514960372dd8b00b007"
    ),
    "snapshot": (
        "85a17601a36a6f62a46a6f6231a565706f636802a76d656d626572739292d934313244334b6f6f574134586f70314a61"
        "54334d487877594d6b436570597376346950566f704d5877437a3569485964426665534288a6646576696365a3637075"
        "a46b696e64a3637075a46e616d65b27838365f3634202832207468726561647329aa666c6f70735f66703332cb420bf0"
        "8eb0000000aa666c6f70735f62663136cb0000000000000000ac6d656d6f72795f6279746573cf0000000400000000a7"
        "7468726561647302a876657273696f6e739292a6707974686f6ea6332e31312e3792a5746f726368a6322e31332e3092"
        "d934313244334b6f6f574a315473696a48374835463734686641443558697368517a337378726d41745659333747744e"
        "64394371596688a6646576696365a3637075a46b696e64a3637075a46e616d65b27838365f3634202832207468726561"
        "647329aa666c6f70735f66703332cb420bf08eb0000000aa666c6f70735f62663136cb0000000000000000ac6d656d6f"
        "72795f6279746573cf0000000400000000a77468726561647302a876657273696f6e739292a6707974686f6ea6332e31"
        "312e3792a5746f726368a6322e31332e30a56c696e6b739194d934313244334b6f6f574134586f70314a6154334d4878"
        "77594d6b436570597376346950566f704d5877437a35694859644266655342d934313244334b6f6f574a315473696a48"
        "374835463734686641443558697368517a337378726d41745659333747744e643943715966cb419dcd6500000000cb3f"
        "847ae147ae147b"
    ),
    "plan": (
        "8ba17601a36a6f62a46a6f6231a565706f636802a8736e617073686f74d9406363636363636363636363636363636363"
        "6363636363636363636363636363636363636363636363636363636363636363636363636363636363636363636363a9"
        "616c676f726974686da86f702d66656e6365a47365656407a76e5f756e69747304ad6d6963726f5f6261746368657302"
        "a67374616765739293000291d934313244334b6f6f574134586f70314a6154334d487877594d6b436570597376346950"
        "566f704d5877437a3569485964426665534293020491d934313244334b6f6f574a315473696a48374835463734686641"
        "443558697368517a337378726d41745659333747744e643943715966a372686f91cd09c4a47072656486a57374616765"
        "9292cb3fe0000000000000cb412e84800000000092cb3fd0000000000000cb413e848000000000a566656e63659195cb"
        "40b0000000000000cb3fb999999999999acb3fd999999999999acb0000000000000000cb0000000000000000aa626f74"
        "746c656e65636bcb3fe0000000000000a473746570cb3ff8000000000000a3686f77a0aa636f6e7369646572656490"
    ),
    "vote": (
        "88a174a9706c616e2d766f7465a36a6f62a46a6f6231a565706f636802a4706c616ed940646464646464646464646464"
        "646464646464646464646464646464646464646464646464646464646464646464646464646464646464646464646464"
        "64646464a8736e617073686f74d940636363636363636363636363636363636363636363636363636363636363636363"
        "63636363636363636363636363636363636363636363636363636363636363a470656572d934313244334b6f6f574134"
        "586f70314a6154334d487877594d6b436570597376346950566f704d5877437a35694859644266655342a3736967c440"
        "1575d1eb6ac78916aeab23ff3d809f335fd82ecbd6c1e94f0df8dcce60a034e333d15c2e04b749243d7dc2d14d5eb3ae"
        "02b80e9febd0b9d42bf3b976c684c501a4626f6479c400"
    ),
    "train_config_planner": (
        "de0014a5737465707364ab6d6963726f5f626174636808ad6d6963726f5f6261746368657304a96f7074696d697a6572"
        "a56164616d77a26c72cb3f33a92a30553261ac7765696768745f6465636179cb0000000000000000a86d6f6d656e7475"
        "6dcb0000000000000000a5626574617392cb3feccccccccccccdcb3feff7ced916872ba3657073cb3e45798ee2308c3a"
        "a9677261645f636c6970c0ab6c725f7363686564756c65c0a9617665726167696e67c0ab636f6d7072657373696f6ec0"
        "a87363686564756c65a431663162b0636865636b706f696e745f657665727900a47365656400a87265706c6963617302"
        "ac6f6e5f6e6f6e66696e697465a46661696caa6576616c5f657665727900a7706c616e6e6572ab6576656e5f6c617965"
        "7273"
    ),
    "train_config": (
        "de0013a5737465707364ab6d6963726f5f626174636808ad6d6963726f5f6261746368657304a96f7074696d697a6572"
        "a56164616d77a26c72cb3f33a92a30553261ac7765696768745f6465636179cb0000000000000000a86d6f6d656e7475"
        "6dcb0000000000000000a5626574617392cb3feccccccccccccdcb3feff7ced916872ba3657073cb3e45798ee2308c3a"
        "a9677261645f636c6970c0ab6c725f7363686564756c6583a46b696e64a6636f73696e65ac7761726d75705f73746570"
        "7300ac6d696e5f6c725f726174696fcb3fb999999999999aa9617665726167696e6787a374617504a86f757465725f6c"
        "72cb3ff0000000000000ae6f757465725f6d6f6d656e74756dcb0000000000000000a4636c6970c0a770656e616c7479"
        "a46e6f6e65ad70656e616c74795f7363616c65cb3ff0000000000000a473796e63c2ab636f6d7072657373696f6e81a7"
        "72686f5f6d696ecb3f847ae147ae147ba87363686564756c65a431663162b0636865636b706f696e745f657665727900"
        "a47365656400a87265706c69636173c0ac6f6e5f6e6f6e66696e697465a46661696caa6576616c5f657665727900"
    ),
    "job_spec": (
        "89a66a6f625f6964b030313233343536373839616263646566a97075626c6973686572d934313244334b6f6f57413458"
        "6f70314a6154334d487877594d6b436570597376346950566f704d5877437a35694859644266655342a7637265617465"
        "64cb41d954fc40000000aa6d6f64656c5f68617368d94061616161616161616161616161616161616161616161616161"
        "616161616161616161616161616161616161616161616161616161616161616161616161616161ac776569676874735f"
        "68617368d940626262626262626262626262626262626262626262626262626262626262626262626262626262626262"
        "62626262626262626262626262626262626262626262a76461746173657486a46b696e64a76275696c74696eac636f6e"
        "74656e745f68617368d94063363137386632336239653062343036643334353032636461366539623063313232363133"
        "623864346435663565306161313236646566363739643230626236a77365715f6c656e40aa766f6361625f73697a65cd"
        "0100aa6e756d5f746f6b656e73ce00061a80a46e616d65a57079646f63a6636f6e666967de0013a5737465707364ab6d"
        "6963726f5f626174636808ad6d6963726f5f6261746368657304a96f7074696d697a6572a56164616d77a26c72cb3f33"
        "a92a30553261ac7765696768745f6465636179cb0000000000000000a86d6f6d656e74756dcb0000000000000000a562"
        "6574617392cb3feccccccccccccdcb3feff7ced916872ba3657073cb3e45798ee2308c3aa9677261645f636c6970c0ab"
        "6c725f7363686564756c6583a46b696e64a6636f73696e65ac7761726d75705f737465707300ac6d696e5f6c725f7261"
        "74696fcb3fb999999999999aa9617665726167696e6787a374617504a86f757465725f6c72cb3ff0000000000000ae6f"
        "757465725f6d6f6d656e74756dcb0000000000000000a4636c6970c0a770656e616c7479a46e6f6e65ad70656e616c74"
        "795f7363616c65cb3ff0000000000000a473796e63c2ab636f6d7072657373696f6e81a772686f5f6d696ecb3f847ae1"
        "47ae147ba87363686564756c65a431663162b0636865636b706f696e745f657665727900a47365656400a87265706c69"
        "636173c0ac6f6e5f6e6f6e66696e697465a46661696caa6576616c5f657665727900a97265736f757263657382b06d69"
        "6e5f6d656d6f72795f6279746573ce40000000ac6465766963655f6b696e647391a3637075a46e616d65a464656d6f"
    ),
    "job_spec_envelope": (
        "83a17601a473706563c5038f89a66a6f625f6964b030313233343536373839616263646566a97075626c6973686572d9"
        "34313244334b6f6f574134586f70314a6154334d487877594d6b436570597376346950566f704d5877437a3569485964"
        "4266655342a763726561746564cb41d954fc40000000aa6d6f64656c5f68617368d94061616161616161616161616161"
        "616161616161616161616161616161616161616161616161616161616161616161616161616161616161616161616161"
        "616161ac776569676874735f68617368d940626262626262626262626262626262626262626262626262626262626262"
        "62626262626262626262626262626262626262626262626262626262626262626262a76461746173657486a46b696e64"
        "a76275696c74696eac636f6e74656e745f68617368d94063363137386632336239653062343036643334353032636461"
        "366539623063313232363133623864346435663565306161313236646566363739643230626236a77365715f6c656e40"
        "aa766f6361625f73697a65cd0100aa6e756d5f746f6b656e73ce00061a80a46e616d65a57079646f63a6636f6e666967"
        "de0013a5737465707364ab6d6963726f5f626174636808ad6d6963726f5f6261746368657304a96f7074696d697a6572"
        "a56164616d77a26c72cb3f33a92a30553261ac7765696768745f6465636179cb0000000000000000a86d6f6d656e7475"
        "6dcb0000000000000000a5626574617392cb3feccccccccccccdcb3feff7ced916872ba3657073cb3e45798ee2308c3a"
        "a9677261645f636c6970c0ab6c725f7363686564756c6583a46b696e64a6636f73696e65ac7761726d75705f73746570"
        "7300ac6d696e5f6c725f726174696fcb3fb999999999999aa9617665726167696e6787a374617504a86f757465725f6c"
        "72cb3ff0000000000000ae6f757465725f6d6f6d656e74756dcb0000000000000000a4636c6970c0a770656e616c7479"
        "a46e6f6e65ad70656e616c74795f7363616c65cb3ff0000000000000a473796e63c2ab636f6d7072657373696f6e81a7"
        "72686f5f6d696ecb3f847ae147ae147ba87363686564756c65a431663162b0636865636b706f696e745f657665727900"
        "a47365656400a87265706c69636173c0ac6f6e5f6e6f6e66696e697465a46661696caa6576616c5f657665727900a972"
        "65736f757263657382b06d696e5f6d656d6f72795f6279746573ce40000000ac6465766963655f6b696e647391a36370"
        "75a46e616d65a464656d6fa3736967c44092595e6ddf1828c73b1a17c0e8dbb837aa36a2dc9c94d9b02ce21bd9ed71b3"
        "8d8301f859e2914696624aadbe390d81b8c8f481e740c1f3e47473caa710465f0b"
    ),
    "halted": (
        "87a470656572d934313244334b6f6f574134586f70314a6154334d487877594d6b436570597376346950566f704d5877"
        "437a35694859644266655342a565706f636801a5737461676500a77265706c69636100a4737465700aa57374617465d9"
        "406161616161616161616161616161616161616161616161616161616161616161616161616161616161616161616161"
        "6161616161616161616161616161616161a5756e697473920002"
    ),
    "resume": (
        "84a4737465700aa4636b7074c2a46c6f737401a7736f7572636573919500020ad9406161616161616161616161616161"
        "616161616161616161616161616161616161616161616161616161616161616161616161616161616161616161616161"
        "616191d934313244334b6f6f574134586f70314a6154334d487877594d6b436570597376346950566f704d5877437a35"
        "694859644266655342"
    ),
    "shard_manifest": (
        "85a56474797065a3753136aa6e756d5f746f6b656e73cd03e8ac73686172645f746f6b656e73cd0258aa766f6361625f"
        "73697a65cd0100a673686172647392d94065656565656565656565656565656565656565656565656565656565656565"
        "656565656565656565656565656565656565656565656565656565656565656565d94066666666666666666666666666"
        "666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666666"
        "666666"
    ),
    "hello": (
        "0000008d89a17601a36a6f62a0a46b696e64a35f7263a5737461676500a47374657000a56d6963726f00a46e616d65a0"
        "a46d65746181a35f726388a26f70a568656c6c6fa17601a46e616d65a76163743a303e31a773657373696f6ed9203031"
        "323334353637383961626364656630313233343536373839616263646566a56672657368c3a17203a16402a17740a174"
        "9000000000000000"
    ),
    "welcome": (
        "0000005189a17601a36a6f62a0a46b696e64a35f7263a5737461676500a47374657000a56d6963726f00a46e616d65a0"
        "a46d65746181a35f726385a26f70a777656c636f6d65a17601a17203a16402a17740a17490000000"
    ),
    "tensor_message": (
        "0000005389a17601a36a6f62a46a6f6231a46b696e64a3616374a5737461676501a47374657007a56d6963726f02a46e"
        "616d65a26530a46d65746181a5636f646563a26964a1749292a3663332910492a4626f6f6c910200000000000000803f"
        "00000040000040400100000000000000"
    ),
    "frame": "0000000568656c6c6f",
    "record_header": "0000006502",
    "msg_start": "0000000000100000",
    "stripe_start": "000000000010000000040000",
    "ack": "00000007",
    "ticket_request": "83a17601a6636970686572ab6165732d3132382d67636da56c616e657302",
    "ticket_reply": (
        "88a17601a67469636b6574c41000000000000000000000000000000000a6636970686572ab6165732d3132382d67636d"
        "a66b5f6469616cc4200000000000000000000000000000000000000000000000000000000000000000a86b5f6c697374"
        "656ec420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fa4686f7374a93132372e302e"
        "302e31a4706f7274cd9c40a56c616e657302"
    ),
    "dag": (
        "465044470101000000f788a6696e707574739294a178a5696e707574a366333292020394a177a5706172616da3663332"
        "9103a56e6f6465739288a16ea179a26f70af6174656e2e6d756c2e54656e736f72a1619281a172a17881a172a177a16b"
        "80a16f9192a3663332920203a16dc2a173a0a166cb000000000000000088a16ea173a26f70b06174656e2e73756d2e64"
        "656661756c74a1619181a172a179a16b80a16f9192a366333290a16dc2a173a0a166cb0000000000000000a76f757470"
        "75747391a173a46c6f7373a173a774656e736f72739192a1770cac6d6f64756c655f6e616d657380ab73636f70655f74"
        "7970657380aa62617463685f73697a65010000803f0000004000004040"
    ),
    "averaging_part": (
        "0000006e89a17601a36a6f62a46a6f6231a46b696e64a3617667a5737461676500a47374657003a56d6963726f00a46e"
        "616d65a773636174746572a46d65746185a565706f6368a26531a26c6f00a2686904a177cb3ff0000000000000a173cb"
        "3fe0000000000000a1749192a366333291040000000000000000803f0000803f0000803f0000803f"
    ),
    "event_step": (
        "8ba474797065a473746570a36a6f62a46a6f6231a47374657003a565706f636801a5737461676501a470656572d93431"
        "3244334b6f6f574134586f70314a6154334d487877594d6b436570597376346950566f704d5877437a35694859644266"
        "655342a46c6f7373cb4004000000000000ac746f6b656e735f7065725f73cb408f400000000000ac636f6d707574655f"
        "7574696ccb3fe0000000000000a96c696e6b5f7574696cc0a26174cb41d954fc40000000"
    ),
    "event_plan": (
        "8da474797065a4706c616ea36a6f62a46a6f6231a565706f636801a9706c616e5f68617368d940646464646464646464"
        "646464646464646464646464646464646464646464646464646464646464646464646464646464646464646464646464"
        "64646464646464ab73746167655f73697a6573920101a76d656d6265727392d934313244334b6f6f574134586f70314a"
        "6154334d487877594d6b436570597376346950566f704d5877437a35694859644266655342d934313244334b6f6f574a"
        "315473696a48374835463734686641443558697368517a337378726d41745659333747744e643943715966a26174cb41"
        "d954fc40000000a372686f90a86c696e6b5f62707390a766656e63655f7390a764656e73655f7390a6737465705f73cb"
        "0000000000000000a3686f77a0"
    ),
    "event_members": (
        "86a474797065a76d656d62657273a36a6f62a46a6f6231a565706f636802a66a6f696e656491d934313244334b6f6f57"
        "4a315473696a48374835463734686641443558697368517a337378726d41745659333747744e643943715966a46c6566"
        "7490a26174cb41d954fc40000000"
    ),
    "event_state": (
        "85a474797065a57374617465a36a6f62a46a6f6231a57374617465a772756e6e696e67a6726561736f6ea0a26174cb41"
        "d954fc40000000"
    ),
    "event_checkpoint": (
        "89a474797065aa636865636b706f696e74a36a6f62a46a6f6231a47374657005a5737461676500a470656572d9343132"
        "44334b6f6f574134586f70314a6154334d487877594d6b436570597376346950566f704d5877437a3569485964426665"
        "5342a26174cb41d954fc40000000a468617368d940616161616161616161616161616161616161616161616161616161"
        "61616161616161616161616161616161616161616161616161616161616161616161616161a5737461727400a3656e64"
        "02"
    ),
    "event_skipped": (
        "87a474797065a7736b6970706564a36a6f62a46a6f6231a47374657004a5737461676501a470656572d934313244334b"
        "6f6f574134586f70314a6154334d487877594d6b436570597376346950566f704d5877437a35694859644266655342a6"
        "726561736f6eb46e6f6e2d66696e697465206772616469656e7473a26174cb41d954fc40000000"
    ),
    # issues 18, 20, 21
    "node_record_speed": (
        "84a17601a174a46e6f6465a162c501b58ca470656572d934313244334b6f6f574134586f70314a6154334d487877594d"
        "6b436570597376346950566f704d5877437a35694859644266655342a4726f6c65a46e6f6465a5616464727391b72f69"
        "70342f3132372e302e302e312f7463702f34303031a770726f66696c6588a6646576696365a3637075a46b696e64a363"
        "7075a46e616d65b27838365f3634202832207468726561647329aa666c6f70735f66703332cb420bf08eb0000000aa66"
        "6c6f70735f62663136cb0000000000000000ac6d656d6f72795f6279746573cf0000000400000000a774687265616473"
        "02a876657273696f6e739292a6707974686f6ea6332e31312e3792a5746f726368a6322e31332e30a773746172746564"
        "cb41d954fc40000000a373657103a76c656176696e67c2a26862cb3ff0000000000000a46461746191b72f6970342f31"
        "32372e302e302e312f7463702f35303031a57265616368a3703270a57370656564cb3fe0000000000000a87370656564"
        "5f6f66d94065656565656565656565656565656565656565656565656565656565656565656565656565656565656565"
        "656565656565656565656565656565656565656565a173c440b867a81b6c13a794c14d830088636697d1c355560765fb"
        "da76dc43ccf78d624a3b136235a04bb9139a14b0584110dd8c898cf497f29b89d215bc522e6029790b"
    ),
    "node_record_reach": (
        "84a17601a174a46e6f6465a162c5015b8aa470656572d934313244334b6f6f574134586f70314a6154334d487877594d"
        "6b436570597376346950566f704d5877437a35694859644266655342a4726f6c65a46e6f6465a5616464727391b72f69"
        "70342f3132372e302e302e312f7463702f34303031a770726f66696c6588a6646576696365a3637075a46b696e64a363"
        "7075a46e616d65b27838365f3634202832207468726561647329aa666c6f70735f66703332cb420bf08eb0000000aa66"
        "6c6f70735f62663136cb0000000000000000ac6d656d6f72795f6279746573cf0000000400000000a774687265616473"
        "02a876657273696f6e739292a6707974686f6ea6332e31312e3792a5746f726368a6322e31332e30a773746172746564"
        "cb41d954fc40000000a373657103a76c656176696e67c2a26862cb3ff0000000000000a46461746191b72f6970342f31"
        "32372e302e302e312f7463702f35303031a57265616368a3703270a173c440ddadaa6eb6eb45adb7de3bdf5bd5efcb85"
        "c9b1d49891252e56ea69e69ddb5de9fee4f9494284c1da702edeeb4bf642979c8434154c77a7d4cfd17f83c2373f01"
    ),
    "plan_rationale": (
        "8ba17601a36a6f62a46a6f6231a565706f636802a8736e617073686f74d9406363636363636363636363636363636363"
        "6363636363636363636363636363636363636363636363636363636363636363636363636363636363636363636363a9"
        "616c676f726974686da86f702d66656e6365a47365656407a76e5f756e69747304ad6d6963726f5f6261746368657302"
        "a67374616765739293000291d934313244334b6f6f574134586f70314a6154334d487877594d6b436570597376346950"
        "566f704d5877437a3569485964426665534293020491d934313244334b6f6f574a315473696a48374835463734686641"
        "443558697368517a337378726d41745659333747744e643943715966a372686f91cd09c4a47072656486a57374616765"
        "9292cb3fe0000000000000cb412e84800000000092cb3fd0000000000000cb413e848000000000a566656e63659195cb"
        "40b0000000000000cb3fb999999999999acb3fd999999999999acb419dcd6500000000cb3f847ae147ae147baa626f74"
        "746c656e65636bcb3fe0000000000000a473746570cb3ff8000000000000a3686f77a96a6f696e743a317832aa636f6e"
        "7369646572656492940102a96a6f696e743a317832cb3ff8000000000000940201a87265706c69636173cb4000000000"
        "000000"
    ),
    "example_manifest": (
        "85a66669656c64739293a9696e7075745f696473a3693634910493a66c6162656c73a369333290ac6e756d5f6578616d"
        "706c65730aa96e756d5f747261696e08ae73686172645f6578616d706c657306a673686172647392d940656565656565"
        "656565656565656565656565656565656565656565656565656565656565656565656565656565656565656565656565"
        "65656565656565656565d940666666666666666666666666666666666666666666666666666666666666666666666666"
        "66666666666666666666666666666666666666666666666666666666"
    ),
    "weight_manifest": (
        "83a17601a57069656365cd0400a774656e736f72739394a3777465a36633329202cd012c93d940616161616161616161"
        "616161616161616161616161616161616161616161616161616161616161616161616161616161616161616161616161"
        "61616161616161d940626262626262626262626262626262626262626262626262626262626262626262626262626262"
        "62626262626262626262626262626262626262626262626262d940636363636363636363636363636363636363636363"
        "6363636363636363636363636363636363636363636363636363636363636363636363636363636363636394a46c6e2e"
        "62a462663136910491d94064646464646464646464646464646464646464646464646464646464646464646464646464"
        "64646464646464646464646464646464646464646464646464646494a5656d707479a3693634910090"
    ),
    "reach_check": (
        "84a17601a26f70a5636865636ba370327091b92f6970342f3230332e302e3131332e372f7463702f34303031a4646174"
        "6191b52f6970342f302e302e302e302f7463702f35303031"
    ),
    "reach_reverse": (
        "83a17601a26f70a772657665727365a6746172676574d934313244334b6f6f574a315473696a48374835463734686641"
        "443558697368517a337378726d41745659333747744e643943715966"
    ),
    "reach_dial": (
        "84a17601a26f70a46469616ca470656572d934313244334b6f6f574134586f70314a6154334d487877594d6b43657059"
        "7376346950566f704d5877437a35694859644266655342a5616464727391b92f6970342f3230332e302e3131332e372f"
        "7463702f34303031"
    ),
    "reach_check_reply": "85a17601a26f70a57265706c79a3703270c3a464617461c2a26970ab3230332e302e3131332e37",
    "reach_ok_reply": "84a17601a26f70a57265706c79a26f6bc2a3776879a462757379",
    "stream_hello": "0000000105",
    "tied_gradient": (
        "0000004c89a17601a36a6f62a46a6f6231a46b696e64a474696564a5737461676500a47374657003a56d6963726f00a4"
        "6e616d65a3777465a46d65746180a1749292a366333292020292a366333291010000803f0000803f0000803f0000803f"
        "0000803f00000000"
    ),
    "event_eval": (
        "87a474797065a46576616ca36a6f62a46a6f6231a4737465700aa565706f636801a470656572d934313244334b6f6f57"
        "4134586f70314a6154334d487877594d6b436570597376346950566f704d5877437a35694859644266655342a46c6f73"
        "73cb4002000000000000a26174cb41d954fc40000000"
    ),
    "event_links": (
        "87a474797065a56c696e6b73a36a6f62a46a6f6231a565706f636801a5737461676500a470656572d934313244334b6f"
        "6f574134586f70314a6154334d487877594d6b436570597376346950566f704d5877437a35694859644266655342a56c"
        "696e6b7391d93b313244334b6f6f574a315473696a48374835463734686641443558697368517a337378726d41745659"
        "333747744e6439437159663d6c6962703270a26174cb41d954fc40000000"
    ),
    "event_plan_fences": (
        "8da474797065a4706c616ea36a6f62a46a6f6231a565706f636801a9706c616e5f68617368d940646464646464646464"
        "646464646464646464646464646464646464646464646464646464646464646464646464646464646464646464646464"
        "64646464646464ab73746167655f73697a6573920101a76d656d6265727392d934313244334b6f6f574134586f70314a"
        "6154334d487877594d6b436570597376346950566f704d5877437a35694859644266655342d934313244334b6f6f574a"
        "315473696a48374835463734686641443558697368517a337378726d41745659333747744e643943715966a26174cb41"
        "d954fc40000000a372686f91cb3fd0000000000000a86c696e6b5f62707391cb419dcd6500000000a766656e63655f73"
        "91cb3fb999999999999aa764656e73655f7391cb3fd999999999999aa6737465705f73cb3ff8000000000000a3686f77"
        "a96a6f696e743a317832"
    ),
}


EXAMPLES = examples()


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name: str) -> None:
    encode, decode, value = EXAMPLES[name]
    data = encode()
    assert data.hex() == GOLDEN[name], f"the {name} layout changed"
    if decode is not None:
        back = decode(data)
        if value is not None:
            assert back == value


def test_every_example_has_golden_bytes() -> None:
    assert set(EXAMPLES) == set(GOLDEN)
