"""Every decoder that takes bytes from a peer, as ``name -> (decode(bytes), seeds)``, for the fuzz suite.

Each target wraps one decoder so that it takes one ``bytes`` argument, and builds its seeds from
valid encodings (so that mutations reach deep into the format). Signature checks are injected as
"always valid" where the decoder takes a verifier, so that a mutated body reaches the field checks
(a real verifier would refuse it at the signature, which is tested elsewhere); decoders that verify
with the real key (job specs) are reached through their parsing step before the signature.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from fusionp2p.wire.msg import packb, unpackb
from tests.unit.fuzz import HarnessSkip


@dataclass(frozen=True)
class Target:
    name: str
    decode: Callable[[bytes], object]
    seeds: tuple[bytes, ...]
    memory_bound: int = 64 << 20    # bytes one case may take: its tracemalloc peak, and its rise of peak RSS


def _verify_all(peer: str, data: bytes, sig: bytes) -> bool:
    return True


def _sign(data: bytes) -> bytes:
    return b"\x01" * 64


# ------------------------------------------------------------------------------------------ builders
def _profile():  # type: ignore[no-untyped-def]
    from fusionp2p.types import DeviceProfile

    return DeviceProfile(device="cpu", kind="cpu", name="x86_64 (2 threads)", flops_fp32=1e10, flops_bf16=0.0,
                         memory_bytes=16 << 30, threads=2, versions=(("python", "3.11"), ("torch", "2.13.0")))


def _snapshot():  # type: ignore[no-untyped-def]
    from fusionp2p.plan.snapshot import Link, Snapshot

    peers = ["peerA", "peerB", "peerC"]
    return Snapshot(job="job1", epoch=2, members={p: _profile() for p in peers},
                    links={("peerA", "peerB"): Link(bandwidth_bps=1.25e8, latency_s=0.01),
                           ("peerB", "peerC"): Link(bandwidth_bps=1e9, latency_s=0.0)})


def _plan():  # type: ignore[no-untyped-def]
    from fusionp2p.plan.opfence import make_plan
    from fusionp2p.types import Edge, Unit, WorkloadGraph

    units = tuple(Unit(name=f"u{i}", kind="block", fwd_flops=1e9, bwd_flops=2e9, param_bytes=1 << 20, act_bytes=1 << 20)
                  for i in range(4))
    edges = tuple(Edge(src=i, dst=i + 1, nbytes=1 << 20) for i in range(3))
    return make_plan(WorkloadGraph(units=units, edges=edges), _snapshot())


def _identity(i: int):  # type: ignore[no-untyped-def]
    from fusionp2p.net.identity import Identity

    return Identity(bytes(range(i, i + 32)))


# ------------------------------------------------------------------------------------------ targets
def _msgpack() -> Target:
    seeds = (packb({"a": 1, "b": [1.5, "x", b"y", None, True], "c": {"d": -1}}), packb([1, 2, 3]), packb("s"))
    return Target("wire.unpackb", lambda b: unpackb(b, max_size=1 << 20), seeds)


def _framing() -> Target:
    from fusionp2p.wire.framing import FrameDecoder, encode_frame

    def dec(b: bytes) -> object:
        d = FrameDecoder(max_frame=4096)
        out = d.feed(b)
        d.check_eof()
        return out

    return Target("wire.framing", dec, (encode_frame(b"hello", max_frame=4096) + encode_frame(b"", max_frame=4096),))


def _records() -> Target:
    from fusionp2p.wire.records import (
        BandwidthReport,
        Measurement,
        NodeRecord,
        decode_signed,
        encode_bundle,
        encode_signed,
        split_bundle,
    )

    node = NodeRecord(peer="peerA", role="node", addrs=("/ip4/127.0.0.1/tcp/4001",), profile=_profile(), started=1.7e9,
                      seq=3, period=1.0)
    bw = BandwidthReport(peer="peerA", seq=2, uplink=1e8, downlink=2e8,
                         measurements=(Measurement(src="peerA", dst="peerB", bandwidth=1e8, rtt=0.01, samples=3),))
    a, b = encode_signed(node, _sign), encode_signed(bw, _sign)

    def dec(data: bytes) -> object:
        return [decode_signed(p, _verify_all) for p in split_bundle(data)]

    return Target("wire.records", dec, (a, b, encode_bundle([a, b])))


def _jobrecords() -> Target:
    from fusionp2p.wire.jobrecords import JobIndex, JobStatus, StageFile, decode_record, encode_record

    st = JobStatus(job="job1", peer="peerA", publisher="pub", state="running", epoch=1, step=10, steps=100,
                   members=("peerA", "peerB"), stage_sizes=(1, 1), losses=((1, 3.5), (2, 3.25)), checkpoint_step=5,
                   checkpoint=(StageFile(stage=0, hash="a" * 64, holders=("peerA",)),), final=(), final_loss=2.5,
                   reason="", at=1.7e9)
    ix = JobIndex(peer="pub", jobs=(("job1", "demo", 1.7e9),))
    return Target("wire.jobrecords", lambda b: decode_record(b, _verify_all),
                  (encode_record(st, _sign), encode_record(ix, _sign)))


@cache
def _small_dag():  # type: ignore[no-untyped-def]
    from fusionp2p.graph import trace
    from fusionp2p.models import MLP, MLPConfig

    torch.manual_seed(0)
    return trace(MLP(MLPConfig(in_features=4, hidden=(3,), out_features=2)), (torch.randn(2, 4),))


def _dag() -> Target:
    from fusionp2p.wire.dag import decode_dag, encode_dag

    return Target("wire.dag", lambda b: decode_dag(b, memory_bytes=1 << 30), (encode_dag(_small_dag()),), 256 << 20)


def _dag_weightless() -> Target:
    from fusionp2p.wire.dag import decode_dag, encode_dag

    return Target("wire.dag.weightless", decode_dag, (encode_dag(_small_dag(), weights=False),), 256 << 20)


def _weight_manifest() -> Target:
    from fusionp2p.wire.pieces import WeightManifest, check_against, make_manifest

    dag = _small_dag()
    declared = {s.name: (s.meta.dtype, s.meta.shape) for s in dag.inputs if s.kind != "input"}

    def dec(b: bytes) -> object:
        man = WeightManifest.decode(b)
        check_against(man, declared)   # the manifest is held to the DAG before any piece is fetched
        return man

    return Target("wire.pieces.manifest", dec, (make_manifest(dag.tensors, 1024)[0].encode(),
                                                make_manifest(dag.tensors, 1 << 20)[0].encode()))


def _stage() -> Target:
    from fusionp2p.graph import single_stage
    from fusionp2p.wire.dag import decode_stage, encode_stage

    return Target("wire.stage", lambda b: decode_stage(b, memory_bytes=1 << 30), (encode_stage(single_stage(_small_dag())),),
                  256 << 20)


def _tensor_message_seed() -> bytes:
    from fusionp2p.net.channel import TensorMessage
    from fusionp2p.wire import tensor_frame as tf

    msg = TensorMessage(job="job1", kind="act", stage=1, step=7, micro=2, name="e0", meta={"codec": "id", "k": [1, 2]},
                        tensors=(torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([True, False]),
                                 torch.empty(0, 3)))
    return tf.message_bytes(msg)


def _tensor_message() -> Target:
    from fusionp2p.wire import tensor_frame as tf

    return Target("wire.tensor_frame.message", lambda b: tf.decode_message(b), (_tensor_message_seed(),))


def _tensor() -> Target:
    from fusionp2p.wire.tensor import decode_tensor

    # header and data in one msgpack array, so that both are mutated
    def dec(b: bytes) -> object:
        m = unpackb(b)
        if not isinstance(m, list) or len(m) != 2 or not isinstance(m[1], bytes):
            raise HarnessSkip("fuzz harness: not [header, data]")
        return decode_tensor(m[0], m[1])

    seeds = (packb([{"dtype": "f32", "shape": [2, 2]}, struct.pack("<4f", 1, 2, 3, 4)]),
             packb([{"dtype": "bool", "shape": [3]}, b"\x01\x00\x01"]), packb([{"dtype": "i64", "shape": []}, bytes(8)]))
    return Target("wire.tensor", dec, seeds)


def _dataplane_small() -> Target:
    from fusionp2p.wire import tensor_frame as tf

    def dec(b: bytes) -> object:
        # the small fixed layouts of the data plane: record header, MSG_START, STRIPE_START, ACK
        tag, body = b[:1], b[1:]
        if tag == b"h":
            return tf.parse_record_header(body[: tf.RECORD_HEADER].ljust(tf.RECORD_HEADER, b"\0"), max_body=1 << 20)
        if tag == b"s":
            return tf.decode_start(body)
        if tag == b"t":
            return tf.decode_stripe_start(body, max_slot=1 << 20)
        return tf.decode_ack(body)

    seeds = (b"h" + tf.record_header(tf.MSG_END, 100), b"s" + tf.encode_start(4096) + b"xyz",
             b"t" + tf.encode_stripe_start(1 << 20, 1 << 18), b"a" + tf.encode_ack(7))
    return Target("wire.tensor_frame.records", dec, seeds)


def _tickets() -> Target:
    from fusionp2p.wire import tensor_frame as tf

    def dec(b: bytes) -> object:
        m = unpackb(b)
        if isinstance(m, dict) and "ticket" in m:
            return tf.decode_ticket_reply(b)
        return tf.decode_ticket_request(b)

    seeds = (tf.encode_ticket_request("aes-128-gcm", 2),
             tf.encode_ticket_reply(ticket=bytes(16), cipher="aes-128-gcm", k_dial=bytes(32), k_listen=bytes(range(32)),
                                    host="127.0.0.1", port=40000, lanes=2))
    return Target("wire.tensor_frame.tickets", dec, seeds)


def _record_reader() -> Target:
    """The data plane's record reader, with the "none" cipher so that mutations reach the plaintext."""
    from fusionp2p.net.aead import Opener, Sealer
    from fusionp2p.net.channel import TensorMessage
    from fusionp2p.net.tensor_stream import RecordReader, RecordWriter
    from fusionp2p.wire import tensor_frame as tf

    key = bytes(32)
    w = RecordWriter(Sealer("none", key), chunk_size=1024)
    big = TensorMessage(job="j", kind="act", tensors=(torch.arange(600, dtype=torch.float32),))
    small = TensorMessage(job="j", kind="grad", meta={"codec": "id"}, tensors=(torch.ones(3),))
    stream = b"".join(bytes(w.seal(p)) for m in (small, big) for p in w.plan_message(m))
    stream += bytes(w.sealer.seal(w.sealer.next_nonce(), tf.ACK, [tf.encode_ack(2)]))
    stream += bytes(w.sealer.seal(w.sealer.next_nonce(), tf.CLOSE, []))

    def dec(b: bytes) -> object:
        r = RecordReader(Opener("none", key), chunk_size=1024, lanes=2)
        out = r.feed(b)
        r.check_eof()
        return out

    return Target("net.record_reader", dec, (stream,))


def _spec() -> Target:
    from fusionp2p.data.corpus import corpus_hash
    from fusionp2p.jobs.spec import CO2, DatasetRef, JobSpec, Resources, TrainConfig, decode_signed, sign_spec

    alice = _identity(0)
    spec = JobSpec(job_id="0123456789abcdef", publisher=alice.peer_id, created=1.7e9, model_hash="a" * 64,
                   weights_hash="b" * 64,
                   dataset=DatasetRef(kind="builtin", name="pydoc", content_hash=corpus_hash("pydoc"), seq_len=64,
                                      vocab_size=256, num_tokens=400_000),
                   config=TrainConfig(steps=100, optimizer="adamw", lr=3e-4, averaging=CO2(tau=4), compression="adatopk",
                                      lr_schedule="cosine"),
                   resources=Resources(min_memory_bytes=1 << 30, device_kinds=("cpu",)), name="demo")
    return Target("jobs.spec", decode_signed, (sign_spec(spec, alice.sign),))


def _events() -> Target:
    from fusionp2p.jobs.events import (
        CheckpointSaved,
        JobStateChanged,
        MembersChanged,
        PlanChanged,
        StepProgress,
        StepSkipped,
        decode_event,
        encode_event,
    )

    evs = (StepProgress(job="j", step=3, epoch=1, stage=1, peer="p", loss=2.5, tokens_per_s=1e3, compute_util=0.5, at=1.0),
           PlanChanged(job="j", epoch=1, plan_hash="h", stage_sizes=(1, 2), members=("a", "b", "c"), at=2.0),
           MembersChanged(job="j", epoch=2, joined=("a",), left=("b",)), JobStateChanged(job="j", state="running"),
           CheckpointSaved(job="j", step=5, stage=0, peer="p", hash="a" * 64, start=0, end=3),
           StepSkipped(job="j", step=4, stage=1, reason="nan"))
    return Target("jobs.events", decode_event, tuple(encode_event(e) for e in evs))


def _votes() -> Target:
    from fusionp2p.jobs.election import Vote

    plan = _plan()
    v = Vote.make(job="job1", epoch=2, plan_hash=plan.plan_hash(), snapshot_hash="c" * 64, peer="peerA", sign=_sign,
                  plan=plan.to_wire())
    return Target("jobs.election.vote", lambda b: Vote.decode(b), (v.encode(), packb({"t": "other"})))


def _plan_record() -> Target:
    from fusionp2p.jobs.election import Vote, _read_record

    plan = _plan()
    votes = [Vote.make(job="job1", epoch=2, plan_hash=plan.plan_hash(), snapshot_hash="c" * 64, peer=p, sign=_sign).encode()
             for p in ("peerA", "peerB")]
    rec = packb({"job": "job1", "epoch": 2, "members": ["peerA", "peerB", "peerC"], "plan": plan.to_wire(), "votes": votes})
    return Target("jobs.election.record", _read_record, (rec,))


def _plan_wire() -> Target:
    from fusionp2p.plan.plan import Plan

    return Target("plan.plan", lambda b: Plan.from_wire(b), (_plan().to_wire(),))


def _snapshot_wire() -> Target:
    from fusionp2p.plan.snapshot import Snapshot

    return Target("plan.snapshot", lambda b: Snapshot.from_wire(b), (_snapshot().to_wire(),))


def _replan() -> Target:
    from fusionp2p.jobs.replan import Halted, Resume, Source

    def dec(b: bytes) -> object:
        m = unpackb(b)
        if not isinstance(m, dict):
            raise HarnessSkip("fuzz harness: not a map")
        return Resume.from_wire(m) if "sources" in m else Halted.from_wire(m)

    h = Halted(peer="peerA", epoch=1, stage=0, replica=0, step=10, state="a" * 64, start=0, end=2)
    r = Resume(step=10, sources=(Source(start=0, end=2, step=10, state="a" * 64, holders=("peerA",)),), lost_steps=0)
    return Target("jobs.replan", dec, (packb(h.to_wire()), packb(r.to_wire())))


def _resilient() -> Target:
    from fusionp2p.net.channel import TensorMessage
    from fusionp2p.net.resilient import (
        RESERVED,
        Hello,
        hello_message,
        parse_hello,
        parse_welcome,
        welcome_message,
    )
    from fusionp2p.wire import tensor_frame as tf

    def dec(b: bytes) -> object:
        msg = TensorMessage(**tf.decode_message(b))
        rc = msg.meta.get(RESERVED)
        if isinstance(rc, dict) and rc.get("op") == "hello":
            return parse_hello(msg)
        return parse_welcome(msg)

    h = Hello(name="act:0>1", session="0123456789abcdef0123456789abcdef", fresh=True, received=3, delivered=2, window=64)
    return Target("net.resilient", dec, (tf.message_bytes(hello_message(h)), tf.message_bytes(welcome_message(3, 2, 64))))


def _shards() -> Target:
    import numpy as np

    from fusionp2p.data.shards import ShardManifest, make_shards

    man, _ = make_shards(np.arange(1000, dtype=np.int64) % 256, vocab_size=256, shard_tokens=300)
    return Target("data.shards", lambda b: ShardManifest.decode(b), (man.encode(),))


def _codec() -> Target:
    from fusionp2p.compress.codec import CastCodec, TopKCodec, decode
    from fusionp2p.net.channel import TensorMessage
    from fusionp2p.wire import tensor_frame as tf

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    seeds = []
    for codec in (TopKCodec(ratio=0.1), TopKCodec(ratio=0.6), TopKCodec(ratio=0.2, per_row=True), CastCodec(wire_dtype="bf16")):
        payload, meta = codec.encode(x)
        seeds.append(tf.message_bytes(TensorMessage(job="j", kind="act", meta=dict(meta), tensors=tuple(payload))))

    def dec(b: bytes) -> object:
        m = tf.decode_message(b)
        return decode(m["tensors"], m["meta"])

    return Target("compress.codec", dec, tuple(seeds))


def _averaging() -> Target:
    from fusionp2p.average.allreduce import RoundMsg
    from fusionp2p.net.channel import TensorMessage
    from fusionp2p.train.averager import from_message, to_message
    from fusionp2p.wire import tensor_frame as tf

    rm = RoundMsg(round_id=3, epoch="e1", phase="scatter", lo=0, hi=4, data=torch.ones(4), weight=1.0, scalar=0.5)
    # a re-dealing owner's anchor shard: its speed, whom it clipped, when the scatter parts reached it (issue 46)
    gm = RoundMsg(round_id=3, epoch="e1", phase="gather", lo=0, hi=4, data=torch.ones(4), speed=0.05, clipped=(1,),
                  arrived=((0, 0.0), (1, 0.25)))
    return Target("train.averager.part", lambda b: from_message(TensorMessage(**tf.decode_message(b))),
                  (tf.message_bytes(to_message("job1", 0, rm)), tf.message_bytes(to_message("job1", 0, gm))))


def _work_receipt() -> Target:
    """A finished job's publisher's signed work receipt, as a node shows it (jobs/reputation.py, issue 46)."""
    from fusionp2p.jobs.reputation import WorkReceipt, decode_receipt

    r = WorkReceipt(job="0123456789abcdef", member=_identity(0).peer_id, issuer=_identity(1).peer_id, steps=100,
                    work=800, at=1.7e9, signature=b"\x01" * 64)
    return Target("jobs.reputation.receipt", decode_receipt, (r.encode(),))


def _checkpoint_state() -> Target:
    from fusionp2p.jobs.checkpoint import StageCheckpointMeta, decode_state, encode_state
    from fusionp2p.train.state import StageState

    meta = StageCheckpointMeta(job="job1", stage=0, num_stages=2, step=5, plan_hash="p" * 16)
    st = StageState(step=5, tensors={"w": torch.ones(2, 2)}, optimizer={"w.exp_avg": torch.zeros(2, 2)},
                    momentum={"w": ((0, torch.zeros(2)),)})
    return Target("jobs.checkpoint.state", lambda b: decode_state(b, job="job1"), (encode_state(meta, st),))


def _spec_body() -> Target:
    """The spec map itself (TrainConfig, DatasetRef, Resources), without the envelope's canonical and
    signature checks in front of it."""
    from fusionp2p.jobs.spec import JobSpec

    env = unpackb(_spec().seeds[0])
    return Target("jobs.spec.body", lambda b: JobSpec.from_wire(unpackb(b)), (env["spec"],))


def _probe_ctrl() -> Target:
    from fusionp2p.swarm.probe import decode_ctrl

    seeds = (packb({"op": "ping", "i": 1}), packb({"op": "bulk", "n": 65536, "mark": 16384}),
             packb({"op": "ack", "n": 65536, "timed": 0.12, "rate": 1.2e8}))
    return Target("swarm.probe.ctrl", decode_ctrl, seeds)


def _content() -> Target:
    from fusionp2p.jobs.content import decode_request, decode_response_head

    def dec(b: bytes) -> object:
        m = unpackb(b)
        return decode_request(b) if isinstance(m, dict) and "op" in m else decode_response_head(b)

    seeds = (packb({"op": "get", "hash": "a" * 64, "max": 1 << 20}), packb({"ok": True, "size": 1234}),
             packb({"ok": False, "error": "not found"}))
    return Target("jobs.content", dec, seeds)


def _view() -> Target:
    from fusionp2p.swarm.node import decode_view

    rec = _records().seeds
    return Target("swarm.view", decode_view,
                  (packb({"records": [rec[0]], "bw": [rec[1]], "alive": ["peerA", "peerB"], "dead": ["peerC"]}),
                   packb({"records": [], "bw": [rec[1]], "alive": ["peerA"], "dead": [], "distrusted": ["peerA"]})))


def _job_message() -> Target:
    from fusionp2p.jobs.proto import decode_message

    seeds = (packb({"op": "start", "job": "job1", "snapshot": _snapshot().to_wire(), "resume": {"step": 0, "sources": [],
                                                                                              "ckpt": False, "lost": 0}}),
             packb({"op": "keep", "job": "job1", "hash": "a" * 64, "holder": "peerA", "units": [0, 2], "step": 3, "stage": 0}),
             packb({"ok": True, "halted": {"peer": "p", "epoch": 1, "stage": 0, "replica": 0, "step": 3, "state": "",
                                           "units": [-1, -1]}}))
    return Target("jobs.proto.message", decode_message, seeds)


def _dht_rankers() -> Target:
    """The DHT's record rankers run on every value a peer stores: they return a rank or None, never raise."""
    from fusionp2p.jobs.records import rank_index, rank_job_record, rank_plan

    def dec(b: bytes) -> object:
        return rank_job_record(b), rank_index(b), rank_plan(b)

    return Target("jobs.records.rankers", dec, (*_jobrecords().seeds, *_plan_record().seeds, *_spec().seeds))


# ------------------------------------------------------------ decoders added by the merges of issues 18, 20, 21
def _example_manifest() -> Target:
    import numpy as np

    from fusionp2p.data.examples import ExampleManifest, Examples

    ex = Examples({"input_ids": np.arange(40, dtype=np.int64).reshape(10, 4), "labels": np.arange(10, dtype=np.int32),
                   "mask": np.ones((10, 2, 2), dtype=bool)}, holdout=2)
    man, _ = ex.shards(shard_bytes=64)
    return Target("data.examples.manifest", lambda b: ExampleManifest.decode(b), (man.encode(),))


def _example_shards() -> Target:
    """A manifest and one shard in one msgpack array: the shard is checked against the (mutated) manifest."""
    import numpy as np

    from fusionp2p.data.examples import ExampleManifest, Examples, ShardedExamples

    ex = Examples({"x": np.arange(24, dtype=np.float32).reshape(6, 4), "y": np.arange(6, dtype=np.int64)}, holdout=1)
    man, blobs = ex.shards(shard_bytes=48)

    def dec(b: bytes) -> object:
        m = unpackb(b)
        if not isinstance(m, list) or len(m) != 3 or not isinstance(m[0], bytes) or not isinstance(m[1], int) \
                or not isinstance(m[2], bytes):
            raise HarnessSkip("fuzz harness: not [manifest, index, shard]")
        shards = ShardedExamples(ExampleManifest.decode(m[0]))
        if not 0 <= m[1] < len(shards.manifest.shards):
            raise HarnessSkip("fuzz harness: no such shard")   # the index is the node's, not the peer's
        shards.add(m[1], m[2])
        lo, hi = shards.manifest.shard_range(m[1])
        return shards.rows(np.arange(lo, hi))

    return Target("data.examples.shards", dec,
                  tuple(packb([man.encode(), i, blobs[h]]) for i, h in enumerate(man.shards)))


def _events_new() -> Target:
    from fusionp2p.jobs.events import (
        AveragingOutlier,
        EvalProgress,
        LinksUp,
        PlanChanged,
        StageConvicted,
        decode_event,
        encode_event,
    )

    evs = (EvalProgress(job="j", step=10, epoch=1, peer="p", loss=2.25, at=1.0),
           StageConvicted(job="j", step=7, stage=1, peer="p", suspect="q", evidence=b"\x84\xa1c" + bytes(40), at=3.0),
           AveragingOutlier(job="j", step=7, stage=1, peer="p", suspect="q", at=3.0),
           LinksUp(job="j", epoch=1, stage=0, peer="p", links=("peerB=direct", "peerC=libp2p"), at=2.0),
           PlanChanged(job="j", epoch=1, plan_hash="h", stage_sizes=(1, 2), members=("a", "b", "c"), at=2.0,
                       rho=(0.25,), link_bps=(1.25e8,), fence_s=(0.01,), dense_s=(0.04,), step_s=0.5, how="joint:1x2"))
    return Target("jobs.events.new", decode_event, tuple(encode_event(e) for e in evs))


def _plan_rationale() -> Target:
    """A plan with the planner's per-fence link numbers (5 per fence), ``how`` and its candidates."""
    import dataclasses

    from fusionp2p.plan.plan import Candidate, Plan

    plan = dataclasses.replace(_plan(), how="joint:1x3", considered=(
        Candidate(replicas=1, stages=3, how="joint:1x3", step_time_s=0.5),
        Candidate(replicas=3, stages=1, how="replicas", step_time_s=0.75)))
    return Target("plan.plan.rationale", lambda b: Plan.from_wire(b), (plan.to_wire(),))


def _reach() -> Target:
    """REACH requests (with the server's dial-back address check on a check request) and replies."""
    from fusionp2p.swarm.reach import _endpoint
    from fusionp2p.wire import reach as wr

    def dec(b: bytes) -> object:
        m = unpackb(b, max_size=wr.MAX_MESSAGE)
        if isinstance(m, dict) and "op" in m and m.get("op") != "reply":
            op, f = wr.decode_request(b)
            if op == "check":
                return [_endpoint(a, "10.0.0.7") for a in (*f["p2p"], *f["data"])]
            return op, f
        return wr.decode_check_reply(b) if isinstance(m, dict) and "p2p" in m else wr.decode_ok_reply(b)

    seeds = (wr.encode("check", p2p=["/ip4/10.0.0.7/tcp/4001", "/ip4/0.0.0.0/tcp/4002/p2p/x"], data=["/ip6/::1/tcp/5000"]),
             wr.encode("reverse", target="peerB"), wr.encode("dial", peer="peerA", addrs=["/ip4/1.2.3.4/tcp/4001"]),
             wr.encode("reply", p2p=True, data=False, ip="10.0.0.7"), wr.encode("reply", ok=False, why="busy"))
    return Target("wire.reach", dec, seeds)


class _BytesStream:
    """A libp2p stream whose peer sent *data* (in short reads) and then ended its side."""

    remote_peer = "peerB"

    def __init__(self, data: bytes) -> None:
        self._data, self._at = data, 0

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        n = min(max_bytes or 1 << 16, 997)   # short reads, as a Noise stream gives
        out = self._data[self._at : self._at + n]
        self._at += len(out)
        return out

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        pass

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def _stream_channel() -> Target:
    """The libp2p fallback of the data plane: the opening (``stream_welcome`` / ``stream_hello``, chosen
    by the first byte) and then the channel's record reader, on one stream of the peer's bytes."""
    import trio

    from fusionp2p.errors import PeerUnavailable
    from fusionp2p.net.admission import BufferBudget
    from fusionp2p.net.bulk_channel import DataPlaneConfig
    from fusionp2p.net.channel import TensorMessage
    from fusionp2p.net.stream_channel import StreamChannel, stream_hello, stream_welcome
    from fusionp2p.wire import tensor_frame as tf

    cfg = DataPlaneConfig(window=4)

    def dec(b: bytes) -> object:
        async def main() -> object:
            stream = _BytesStream(b[1:])
            try:
                if b[:1] == b"d":
                    await stream_hello(stream, "peerB", 5.0)
                elif not await stream_welcome(stream, 5.0):
                    return None
                ch = StreamChannel(stream, "peerB", cfg, BufferBudget(max_total=cfg.limits.max_frame * 2, max_peer=cfg.limits.max_frame))
                await ch._read_loop()
            except PeerUnavailable as exc:   # the stream ended early: the channel fails, as it should
                return str(exc)
            return None

        return trio.run(main)

    hello = tf.record_header(tf.HELLO, 0)
    msgs = [TensorMessage(job="j", kind="act", step=1, tensors=(torch.arange(6, dtype=torch.float32),)),
            TensorMessage(job="j", kind="tied", name="wte", tensors=(torch.ones(2, 2), torch.tensor([1.0])))]
    body = b"".join(tf.record_header(tf.MSG_END, len(p)) + p for p in (tf.message_bytes(m) for m in msgs))
    close = tf.record_header(tf.CLOSE, 0)
    return Target("net.stream_channel", dec, (b"w" + hello + body + close, b"d" + hello + body + close))


def _tied_gradient() -> Target:
    """A tied-weight gradient message (kind ``tied``) as the worker checks it (``_keep_tied`` then the shape,
    dtype and flag checks of ``_sum_tied``)."""
    from fusionp2p.net.channel import TensorMessage
    from fusionp2p.train.worker import check_tied_message
    from fusionp2p.wire import tensor_frame as tf

    holders = {"wte": ((0, 2), (16, 8), torch.float32)}

    def dec(b: bytes) -> object:
        g, flag = check_tied_message(TensorMessage(**tf.decode_message(b)), src=2, holders=holders)
        return g.sum(), flag.numel() == 1 and bool(flag.item() == 1.0)

    good = TensorMessage(job="j", kind="tied", stage=0, step=3, name="wte", tensors=(torch.ones(16, 8), torch.tensor([1.0])))
    return Target("train.worker.tied", dec, (tf.message_bytes(good),))


def _spec_examples() -> Target:
    """A spec body of an example dataset with the issue-18 train settings (held-out loss, non-finite policy,
    replicas hint): DatasetRef kind ``examples``, TrainConfig ``eval_every``, ``on_nonfinite``, ``replicas``."""
    from fusionp2p.jobs.spec import CO2, DatasetRef, JobSpec, Resources, TrainConfig

    spec = JobSpec(job_id="0123456789abcdef", publisher=_identity(0).peer_id, created=1.7e9, model_hash="a" * 64,
                   weights_hash="b" * 64,
                   dataset=DatasetRef(kind="examples", name="imdb", content_hash="c" * 64, seq_len=128, vocab_size=2,
                                      num_tokens=1000),
                   config=TrainConfig(steps=100, optimizer="adamw", lr=3e-4, averaging=CO2(tau=4), eval_every=10,
                                      on_nonfinite="skip", replicas=2),
                   resources=Resources(min_memory_bytes=1 << 30, device_kinds=("cpu",)), name="examples")
    return Target("jobs.spec.examples", lambda b: JobSpec.from_wire(unpackb(b)), (spec.encode(),))


def _node_record() -> Target:
    """A node record with its data-plane addresses and reachability (issue 21)."""
    from fusionp2p.wire.records import NodeRecord, decode_signed, encode_signed

    node = NodeRecord(peer="peerA", role="node", addrs=("/ip4/127.0.0.1/tcp/4001",), profile=_profile(), started=1.7e9,
                      seq=3, period=1.0, data=("/ip4/127.0.0.1/tcp/5001", "/ip4/10.0.0.2/tcp/5001"), reach="p2p")
    return Target("wire.records.node", lambda b: decode_signed(b, _verify_all), (encode_signed(node, _sign),))


def _spot_verdict() -> Target:
    from fusionp2p.net.identity import Identity
    from fusionp2p.train.receipts import Stamp
    from fusionp2p.train.verify import Claim, Verdict, decode_verdict, encode_verdict

    a, b = Identity(bytes([1]) * 32), Identity(bytes([2]) * 32)
    c = Claim(job="j", epoch=1, stage=0, replica=1, peer=a.peer_id, step=3, micro=1, params=bytes(32),
              transcript=(bytes(32),) * 5, signature=bytes(64))
    st = Stamp(job="j", epoch=1, kind="act", step=3, micro=1, name="x", dst=1, coded=False, digest=bytes(32),
               signer=a.peer_id, signature=bytes(64))
    seeds = (encode_verdict(Verdict(claim=c, checker=b.peer_id, reason="step 3 micro 1: output differs",
                                    signature=bytes(64))),
             encode_verdict(Verdict(claim=c, checker=b.peer_id, reason="r", stamp=st, signature=bytes(64))))
    return Target("train.verify.verdict", decode_verdict, seeds)


def _spot_lists() -> Target:
    from fusionp2p.train.spot_wire import decode_claims, encode_claims
    from fusionp2p.train.verify import Claim

    c = Claim(job="j", epoch=1, stage=0, replica=1, peer="peerA", step=3, micro=1, params=bytes(32),
              transcript=(bytes(32),) * 5, signature=bytes(64))

    return Target("train.spot_wire.claims", decode_claims, (encode_claims([c, c]), encode_claims([])))


def _spot_stamps() -> Target:
    from fusionp2p.train.receipts import Stamp
    from fusionp2p.train.spot_wire import decode_stamps, encode_stamps

    st = Stamp(job="j", epoch=1, kind="grad", step=3, micro=1, name="x", dst=0, coded=True, digest=bytes(32),
               signer="peerB", signature=bytes(64))
    return Target("train.spot_wire.stamps", decode_stamps, (encode_stamps([st, st]), encode_stamps([])))


def _spot_bundle() -> Target:
    from fusionp2p.train.spot_wire import decode_bundle, encode_bundle
    from fusionp2p.train.verify import Transcript

    t = Transcript(step=2, micro=1, inputs={"x": torch.ones(2, 3)}, outputs={"y": torch.zeros(2, 3)},
                   rng=torch.get_rng_state(), grad_outputs={"y": torch.ones(2, 3)},
                   grad_inputs={"x": torch.full((2, 3), 0.5)}, loss_scale=0.5)
    blob = encode_bundle(({"w": torch.arange(6, dtype=torch.float32), "b": torch.zeros(1, dtype=torch.int64)}, t))
    return Target("train.spot_wire.bundle", lambda b: decode_bundle(b, max_size=1 << 20), (blob,))


TARGETS: dict[str, Callable[[], Target]] = {
    f.__name__.lstrip("_"): f for f in (
        _msgpack, _framing, _records, _jobrecords, _dag, _stage, _tensor_message, _tensor, _dataplane_small, _tickets,
        _record_reader, _spec, _events, _votes, _plan_record, _plan_wire, _snapshot_wire, _replan, _resilient, _shards,
        _codec, _averaging, _checkpoint_state, _spec_body, _probe_ctrl, _content, _view, _job_message,
        _dht_rankers, _example_manifest, _example_shards, _events_new, _plan_rationale, _reach, _stream_channel,
        _tied_gradient, _node_record, _spec_examples, _dag_weightless, _weight_manifest, _spot_verdict, _spot_lists,
        _spot_stamps, _spot_bundle, _work_receipt,
    )
}
