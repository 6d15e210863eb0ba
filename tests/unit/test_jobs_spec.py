"""JobSpec: validation with helpful messages, canonical encoding, signatures, rejection of bad specs."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionp2p.data import BuiltinCorpus, ShardManifest, TokenFile, corpus_hash
from fusionp2p.errors import ConfigError, IntegrityError, RemoteProtocolError
from fusionp2p.jobs.spec import (
    CO2,
    MAX_SPEC_BYTES,
    AdaTopK,
    DatasetRef,
    JobSpec,
    LRSchedule,
    Resources,
    TrainConfig,
    decode_signed,
    new_job_id,
    prepare_dataset,
    sign_spec,
)
from fusionp2p.net.identity import Identity
from fusionp2p.wire.msg import packb, unpackb

ALICE = Identity(bytes(range(32)))
MALLORY = Identity(bytes(range(1, 33)))


def spec(**over: object) -> JobSpec:
    kw: dict[str, object] = {
        "job_id": new_job_id(ALICE.peer_id, 1700000000.0, b"nonce"),
        "publisher": ALICE.peer_id,
        "created": 1700000000.0,
        "model_hash": "a" * 64,
        "weights_hash": "b" * 64,
        "dataset": DatasetRef(kind="builtin", name="pydoc", content_hash=corpus_hash("pydoc"), seq_len=64, vocab_size=256, num_tokens=400_000),
        "config": TrainConfig(steps=100, optimizer="adamw", lr=3e-4, averaging=CO2(tau=4), compression="adatopk", lr_schedule="cosine"),
        "resources": Resources(min_memory_bytes=1 << 30, device_kinds=("cuda", "cpu")),
        "name": "demo",
    }
    kw.update(over)
    return JobSpec(**kw)  # type: ignore[arg-type]


def test_round_trip_and_content_hash() -> None:
    s = spec()
    env = sign_spec(s, ALICE.sign)
    assert len(env) < 2048
    back = decode_signed(env)
    assert back == s
    assert back.content_hash == s.content_hash
    assert back.resources.device_kinds == ("cpu", "cuda")  # canonical order
    assert spec(name="other").content_hash != s.content_hash


def test_trainconfig_shorthands_and_defaults() -> None:
    c = TrainConfig(steps=10, averaging="co2", compression="none", lr=1)
    assert c.co2 == CO2()
    assert c.adatopk is None
    assert isinstance(c.lr, float)
    assert TrainConfig(steps=10, compression="AdaTopK").adatopk == AdaTopK()
    assert TrainConfig(steps=10, lr_schedule="constant").lr_sched is None
    assert TrainConfig.from_wire(c.to_wire()) == c
    assert c.samples_per_step == 32


def test_lr_schedule_warmup_and_decay() -> None:
    c = TrainConfig(steps=11, lr=1.0, lr_schedule=LRSchedule(kind="linear", warmup_steps=2, min_lr_ratio=0.0))
    assert [c.lr_at(i) for i in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert c.lr_at(10) == pytest.approx(0.0)
    assert TrainConfig(steps=5, lr=0.1).lr_at(3) == 0.1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, "steps must be an integer >= 1"),
        ({"optimizer": "lion"}, "optimizer must be one of sgd, adamw"),
        ({"lr": 0.0}, "lr must be > 0.0"),
        ({"lr": float("nan")}, "lr must be a finite number"),
        ({"momentum": 0.9}, "momentum applies to sgd only"),
        ({"betas": (0.9,)}, "betas must be a pair"),
        ({"averaging": "diloco"}, "averaging must be None, one of 'co2', 'none'"),
        ({"compression": 3}, "compression must be None"),
        ({"schedule": "zb-h1"}, "schedule must be one of 1f1b, gpipe"),
        ({"checkpoint_every": -1}, "checkpoint_every"),
        ({"replicas": 0}, "replicas"),
        ({"seed": -1}, "seed"),
        ({"micro_batch": True}, "micro_batch"),
    ],
)
def test_trainconfig_user_errors(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"steps": 10}
    base.update(kwargs)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as ei:
        TrainConfig(**base)  # type: ignore[arg-type]
    assert "\n" not in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_sub_config_errors() -> None:
    with pytest.raises(ConfigError, match="tau"):
        CO2(tau=0)
    with pytest.raises(ConfigError, match="penalty"):
        CO2(penalty="huge")
    with pytest.raises(ConfigError, match="rho_min"):
        AdaTopK(rho_min=0.0)
    with pytest.raises(ConfigError, match="dense_finish"):
        AdaTopK(dense_finish=1.5)
    with pytest.raises(ConfigError, match="device kinds"):
        Resources(device_kinds=("tpu",))
    with pytest.raises(ConfigError, match="job_id"):
        spec(job_id="../etc")
    with pytest.raises(ConfigError, match="publisher"):
        spec(publisher="not-a-peer")
    with pytest.raises(ConfigError, match="model_hash"):
        spec(model_hash="ABC")


def test_prepare_dataset(tmp_path: Path) -> None:
    ref, man, blobs = prepare_dataset(BuiltinCorpus("pydoc", seq_len=32))
    assert (ref.kind, ref.name, ref.content_hash, man, blobs) == ("builtin", "pydoc", corpus_hash("pydoc"), None, {})
    (tmp_path / "c.txt").write_bytes(b"some text " * 100)
    ref, man, blobs = prepare_dataset(TokenFile(tmp_path / "c.txt", seq_len=8), shard_tokens=300)
    assert man is not None
    assert ref.content_hash == man.content_hash
    assert (ref.kind, ref.num_tokens, ref.vocab_size) == ("text", 1000, 256)
    assert ShardManifest.decode(blobs[ref.content_hash], expected_hash=ref.content_hash) == man
    assert all(h in blobs for h in man.shards)
    assert len(blobs) == 1 + len(set(man.shards))


def test_resources_fit() -> None:
    r = Resources(min_memory_bytes=100, device_kinds=("cuda",))
    assert r.fits(memory_bytes=200, device_kind="cuda")
    assert not r.fits(memory_bytes=50, device_kind="cuda")
    assert not r.fits(memory_bytes=200, device_kind="cpu")
    assert Resources().fits(memory_bytes=0, device_kind="cpu")


def test_signing_with_the_wrong_key_is_refused_locally() -> None:
    with pytest.raises(ConfigError, match="not the publisher"):
        sign_spec(spec(), MALLORY.sign)


def test_unsigned_forged_and_tampered_specs_are_rejected() -> None:
    s = spec()
    body = s.encode()
    with pytest.raises(IntegrityError, match="unsigned"):
        decode_signed(packb({"v": 1, "spec": body, "sig": b""}))
    with pytest.raises(IntegrityError, match="unsigned"):
        decode_signed(packb({"v": 1, "spec": body}))
    # Mallory signs Alice's spec with her own key: it does not verify against Alice's peer id.
    forged = packb({"v": 1, "spec": body, "sig": MALLORY.sign(b"fusionp2p/jobspec/1\0" + body)})
    with pytest.raises(IntegrityError, match="does not verify"):
        decode_signed(forged)
    # A signature without the domain prefix does not verify either.
    with pytest.raises(IntegrityError):
        decode_signed(packb({"v": 1, "spec": body, "sig": ALICE.sign(body)}))
    # Tampering with a field keeps the old signature, which no longer matches.
    env = unpackb(sign_spec(s, ALICE.sign))
    tampered = s.to_wire()
    tampered["config"]["lr"] = 1.0
    env["spec"] = packb(tampered)
    with pytest.raises(IntegrityError):
        decode_signed(packb(env))


def test_malformed_and_oversized_specs_are_remote_errors() -> None:
    s = spec()
    sig = ALICE.sign(b"x")
    cases = [
        b"",
        b"\xc1",
        packb([1, 2, 3]),
        packb({"v": 2, "spec": s.encode(), "sig": sig}),
        packb({"v": 1, "spec": "text", "sig": sig}),
        packb({"v": 1, "spec": s.encode(), "sig": "text"}),
        packb({"v": 1, "spec": packb({"job_id": "x"}), "sig": sig}),
        packb({"v": 1, "spec": packb(s.to_wire() | {"extra": 1}), "sig": sig}),
        packb({"v": 1, "spec": packb(s.to_wire() | {"dataset": {"kind": "builtin"}}), "sig": sig}),
        packb({"v": 1, "spec": packb(s.to_wire() | {"config": s.config.to_wire() | {"steps": -5}}), "sig": sig}),
        packb({"v": 1, "spec": packb(s.to_wire() | {"config": s.config.to_wire() | {"lr": "0.1"}}), "sig": sig}),
        packb({"v": 1, "spec": packb(s.to_wire() | {"created": 1700000000}), "sig": sig}),  # int: not canonical
        b"\x00" * (MAX_SPEC_BYTES + 1),
    ]
    for data in cases:
        with pytest.raises(RemoteProtocolError):
            decode_signed(data)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_never_crashes(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode_signed(data)


@settings(max_examples=60, deadline=None)
@given(pos=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_any_bit_flip_is_rejected(pos: int, bit: int) -> None:
    env = bytearray(sign_spec(spec(), ALICE.sign))
    env[pos % len(env)] ^= 1 << bit
    with pytest.raises(RemoteProtocolError):  # IntegrityError is a RemoteProtocolError
        decode_signed(bytes(env))


def test_the_dense_finish_is_left_off_the_wire_at_its_default() -> None:
    # a spec at the defaults keeps its bytes and signature; a set value (none, too) round-trips
    assert AdaTopK().to_wire() == {"rho_min": 0.3}
    for f in (0.0, 0.25):
        wired = AdaTopK(dense_finish=f).to_wire()
        assert wired["dense_finish"] == f and AdaTopK.from_wire(wired) == AdaTopK(dense_finish=f)
    assert AdaTopK().dense_finish == 0.05
    assert (AdaTopK().dense_from(400), AdaTopK(dense_finish=0.1).dense_from(400), AdaTopK(dense_finish=0.0).dense_from(400)) \
        == (380, 360, 400)
